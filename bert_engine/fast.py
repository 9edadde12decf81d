"""Faster CPU inference kernels: pre-packed oneDNN linear layers, dynamic int8 quantisation, torch.compile.

`pack_linear_layers` runs the encoder's linear layers through oneDNN with their weights re-laid out
once at load ("pre-packed") and the feed-forward GELU fused into its first matmul (outputs equal the
plain layers to ~1e-5); a packed model is for inference only. Which precision uses which kernel, and
what the CPU must support for it, is decided in precision.py.

`benchmarks/encoder.py` measures the speed of each and `benchmarks/workloads.py` the share of
predictions that stay identical to fp32; benchmarks/README.md lists the figures.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .model import gelu_tanh

logger = logging.getLogger(__name__)


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


class PackedLinear(nn.Module):
    """An inference-only nn.Linear on the CPU: oneDNN matmul over a weight packed once, with the
    bias (and optionally a GELU) fused into the same call instead of three passes over memory."""

    _GELU = {F.gelu: "none", gelu_tanh: "tanh"}

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
    """Packing applies to fp32 models, and bf16 ones where oneDNN has a bf16 path, on a CPU with oneDNN."""
    param = next(model.parameters())
    if param.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if param.dtype == torch.bfloat16:  # oneDNN's bf16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return param.dtype == torch.float32


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
