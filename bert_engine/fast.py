"""Inference precisions a user can choose, and their trade-offs.

- "auto": fp32 on CPU (exact parity with the reference), bf16 on GPUs that support it, else fp16.
- "fp32", "bf16", "fp16": the whole model in that dtype (heads cast their logits to fp32 before
  softmax or decoding). bf16 pays off on CPUs with AVX512-BF16/AMX and on GPUs.
- "int8": dynamic int8 quantisation of the encoder's linear layers (weights int8 per tensor,
  activations quantised per batch); CPU only. The embeddings, LayerNorms, attention and the task
  head stay fp32.

On the CPU, `pack_linear_layers` also runs the encoder's linear layers through oneDNN with their
weights re-laid out once at load ("pre-packed") and the feed-forward GELU fused into its first
matmul; the Predictor does this by default for fp32/bf16 on CPU (outputs equal the plain layers to
~1e-5). A packed model is for inference only.

`benchmarks/encoder.py` measures the speed of each and `benchmarks/workloads.py` the share of
predictions that stay identical to fp32; benchmarks/README.md lists the figures.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .model import _gelu_tanh

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The parameter dtype that `precision` means on `device` ("int8" keeps fp32 outside the linears)."""
    check_precision(precision, device)
    if precision == "auto":
        from .inference import pick_dtype

        return pick_dtype(device)
    return _DTYPES.get(precision, torch.float32)


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "int8" and device.type != "cpu":
        raise ValueError(f"precision 'int8' (dynamic quantisation) runs on the CPU only, not on {device}")


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace the encoder layers' nn.Linear modules by dynamically quantised int8 ones, in place."""
    encoder = getattr(model, "encoder", model)
    with warnings.catch_warnings():
        # torch marks its quantised-tensor API as deprecated in favour of torchao; it still works.
        warnings.simplefilter("ignore", (UserWarning, DeprecationWarning, FutureWarning))
        for layer in encoder.layers:
            torch.ao.quantization.quantize_dynamic(layer, {nn.Linear}, dtype=torch.qint8, inplace=True)
    logger.info("quantised %d encoder layers to dynamic int8", len(encoder.layers))
    return model


def prepare_for_inference(model: nn.Module, precision: str = "auto", *, pack: bool = True,
                          compile: bool = False) -> nn.Module:
    """What the Predictor does to a loaded model: the precision's dtype, then int8 quantisation or
    (CPU) packed linear layers, then optionally torch.compile."""
    device = next(model.parameters()).device
    model = model.to(dtype=precision_dtype(precision, device)).eval()
    if precision == "int8":
        quantize_int8(model)
    elif pack:
        pack_linear_layers(model)
    if compile:
        compile_encoder(model)
    return model


class PackedLinear(nn.Module):
    """An inference-only nn.Linear on the CPU: oneDNN matmul over a weight packed once, with the
    bias (and optionally a GELU) fused into the same call instead of three passes over memory."""

    _GELU = {F.gelu: "none", _gelu_tanh: "tanh"}

    def __init__(self, linear: nn.Linear, activation=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # The batch-size hint only tunes the layout; any number of rows works.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 128), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.attr, self.algorithm = ("gelu", self._GELU[activation]) if activation is not None else ("none", "")

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.attr, [], self.algorithm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused={self.attr}"


def can_pack(model: nn.Module) -> bool:
    """Packing applies to fp32/bf16 models on a CPU whose torch build has oneDNN."""
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linear_layers(model: nn.Module) -> nn.Module:
    """Swap the encoder layers' projections for PackedLinear, in place (see the module docstring)."""
    if not can_pack(model):
        return model
    encoder = getattr(model, "encoder", model)
    for layer in encoder.layers:
        attention, ffn = layer.attention, layer.ffn
        if not isinstance(attention.qkv, nn.Linear):  # already packed or quantised
            continue
        attention.qkv, attention.out = PackedLinear(attention.qkv), PackedLinear(attention.out)
        if ffn.act in PackedLinear._GELU:
            ffn.up, ffn.act = PackedLinear(ffn.up, ffn.act), _identity
        else:
            ffn.up = PackedLinear(ffn.up)
        ffn.down = PackedLinear(ffn.down)
    model.eval()
    return model


def _identity(x: Tensor) -> Tensor:
    return x


def compile_encoder(model: nn.Module) -> nn.Module:
    """torch.compile each encoder layer (dynamic shapes); the first calls of each shape are slow."""
    encoder = getattr(model, "encoder", model)
    for i, layer in enumerate(encoder.layers):
        encoder.layers[i] = torch.compile(layer, dynamic=True)
    return model
