"""Faster CPU inference kernels: pre-packed oneDNN linear layers, dynamic int8 quantisation, torch.compile.

`pack_linear_layers` runs the encoder's linear layers through oneDNN with their weights re-laid out
once at load ("pre-packed") and the feed-forward GELU fused into its first matmul (outputs equal the
plain layers to ~1e-5); a packed model is for inference only. Which is faster, oneDNN's packed matmul
or MKL's sgemm behind plain nn.Linear, depends on the CPU (MKL runs its AVX2 code on AMD EPYCs, oneDNN
its AVX-512 one; on AVX2-only parts either may win): `choose_kernels` times both on the model's own
shapes once per machine and keeps the faster per projection (BERT_ENGINE_KERNELS). A third candidate is
bert_engine's own AVX2 matmul (`TiledLinear`, tiled_matmul.c built by native.py where a C compiler is
found; at AVX-512's width where the CPU has it): at the few rows of one request it reads each weight from
memory once, where oneDNN and MKL lose time. Short inputs (up to COLD_ROWS rows) and long ones are timed and
chosen apart (`RowSwitch` runs the kernels where they differ; on AVX-512 CPUs inputs run the tiled kernel in
front of both, each layer in one C call, as far as whole layers timed that way ran no slower, and a layer's four
projections run one kernel: `favour_fusion`). Which precision uses which kernel, and what the CPU must support for it,
is decided in precision.py.

`benchmarks/encoder.py` measures the speed of each and `benchmarks/workloads.py` the share of
predictions that stay identical to fp32; benchmarks/README.md lists the figures.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import platform
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import settings
from ..heads import MaskedLMHead
from ..model import encoder_of, gelu_tanh
from . import cpu_load, native

logger = logging.getLogger(__name__)


def onednn_int8_available() -> bool:
    """oneDNN's int8 matmul (torch.ops.onednn.qlinear_*) is in this torch build and usable on this CPU."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "onednn")
            and hasattr(torch.ops.onednn, "qlinear_prepack") and hasattr(torch.ops.onednn, "qlinear_pointwise"))


def fbgemm_int8_available() -> bool:
    """FBGEMM's dynamic int8 linear (torch.ops.quantized.linear_dynamic, pre-packed weights) is in this build."""
    return ("fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops, "quantized")
            and hasattr(torch.ops.quantized, "linear_dynamic") and hasattr(torch.ops.quantized, "linear_prepack"))


INT8_KERNELS = ("onednn", "fbgemm", "tiled")


def tiled_int8_available() -> bool:
    """bert_engine's own AVX2 int8 matmul (int8_matmul.c) builds and runs here (native.py)."""
    return native.library() is not None


def int8_kernel() -> str | None:
    """Which int8 matmul Int8Linear runs (BERT_ENGINE_INT8_KERNEL): "onednn", "fbgemm", "tiled" (bert_engine's
    own, int8_matmul.c), or None where none runs. auto: on an AVX2 CPU without VNNI or AVX-512, the tiled
    kernel where it builds (it runs the FBGEMM path's scheme, and a whole layer in one C call, fused_layer:
    `python -m benchmarks.encoder --precisions int8` on the real AVX2 EPYC, benchmarks/README.md); else FBGEMM
    where the CPU has no VNNI, oneDNN where it has. Measured on a real
    AVX2-only EPYC (benchmarks/README.md, "Real AVX2, end to end and short rows"): oneDNN's u8 x s8 matmul
    there is its generic jit gemm, which re-packs the whole weight on every call; with FBGEMM's pre-packed
    AVX2 kernels MiniLM's int8 forward ran 1.11-1.56x faster at 1-128 tokens and 0.87x on a 32x128 batch
    (`python -m benchmarks.int8_kernels`). With VNNI, oneDNN's int8 kept level with ONNX Runtime's (AVX-512
    EPYC); FBGEMM was not timed there. Where the tiled kernel sums with AVX-512 VNNI (native.int8_isa() == 512)
    and the CPU has no AMX, it comes first there too: on the Cascade Lake Xeon MiniLM's int8 forward ran 3.3-5x oneDNN's at 12-128 tokens
    and 1.2x on a 32x128 batch, 0.99-1.18x ONNX Runtime's int8 (`python -m benchmarks.int8_kernels`,
    benchmarks/README.md). A rule, not a timing at load as for the fp32 kernels: the kernels quantise
    differently, and a machine's int8 answers should not hang on a noisy first timing."""
    choice = settings.get("BERT_ENGINE_INT8_KERNEL").strip().lower()
    if choice not in ("auto", *INT8_KERNELS):
        raise ValueError(f"BERT_ENGINE_INT8_KERNEL={choice!r}: choose auto, {', '.join(INT8_KERNELS)}")
    available = {"onednn": onednn_int8_available, "fbgemm": fbgemm_int8_available, "tiled": tiled_int8_available}
    if choice != "auto":
        if not available[choice]():
            where = (f"bert_engine's AVX2 kernel cannot run here: {native.unavailable()}" if choice == "tiled"
                     else f"this torch build has no {choice} int8 matmul")
            raise ValueError(f"BERT_ENGINE_INT8_KERNEL={choice}: {where}")
        return choice
    amx = cpu_isa().endswith("+AMX")  # oneDNN's int8 there runs AMX's tiles, far past VNNI's (not timed here)
    if int8_weight_limit() == 127 and not amx and available["tiled"]() and native.int8_isa() == 512:
        preferred: tuple[str, ...] = ("tiled", "onednn", "fbgemm")
    elif int8_weight_limit() == 127:
        preferred = ("onednn", "fbgemm", "tiled")
    elif _avx2_only():
        preferred = ("tiled", "fbgemm", "onednn")
    else:
        preferred = ("fbgemm", "onednn", "tiled")
    return next((kernel for kernel in preferred if available[kernel]()), None)


def _avx2_only() -> bool:
    """The CPU runs AVX2 and not AVX-512 (torch's own reading, or BERT_ENGINE_CPU_CAPABILITY's)."""
    capability = (settings.get("BERT_ENGINE_CPU_CAPABILITY") or "").strip().lower()
    if capability in ("avx2", "default"):
        return capability == "avx2"
    return torch.backends.cpu.get_cpu_capability().upper() == "AVX2"


_BELOW_VNNI = {"SSE41", "AVX", "AVX2", "AVX512_CORE"}  # ONEDNN_MAX_CPU_ISA values without u8 x s8 dot products


def int8_weight_limit() -> int:
    """The largest |weight| level of Int8Linear: 127 where the CPU has VNNI (int32 dot products of
    u8 x s8), 63 elsewhere: AVX2's vpmaddubsw adds pairs of u8 x s8 products in int16, which
    saturates for 8-bit weights (2 x 255 x 127 > 32767) and fits for 7-bit ones (2 x 255 x 63)."""
    limited = (os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _BELOW_VNNI
               or settings.get("BERT_ENGINE_CPU_CAPABILITY").lower() in ("avx2", "default"))
    vnni = bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())
    return 127 if vnni and not limited else 63


def quantize_weight(weight: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """A weight's int8 codes in [-levels, levels] and its scale per output channel (symmetric): the
    rounding Int8Linear multiplies with; codes * scale[:, None] is the weight it computes with."""
    scale = (weight.abs().amax(dim=1) / levels).clamp_min(1e-12)
    return torch.clamp(torch.round(weight / scale[:, None]), -levels, levels).to(torch.int8), scale


class Int8Linear(nn.Module):
    """An inference-only nn.Linear in int8 on the CPU, through oneDNN (`kernel`; FBGEMM's and bert_engine's own
    "tiled" one, int8_matmul.c, quantise as `_fbgemm_forward` says, 8-bit weights and 7-bit row codes, and the
    tiled one runs inside fused_layer.c too): the weight quantised once per
    output channel (symmetric; 8 bits with VNNI, 7 without, see int8_weight_limit) and pre-packed;
    each call quantises its input per token (each row scaled by its own largest |value|, so one
    token with large activations, such as [SEP], does not coarsen every other token's steps) to
    int8, multiplies in int8 and returns fp32 with each row's scale, the bias and optionally a GELU
    applied after.

    oneDNN's int8 linear in torch takes one input scale per call; per-token scales go through it
    exactly because a matmul is linear in each row: W (x / s) = (W x) / s. A one-sided input (FFN
    down's: a GELU's output) is quantised over each row's own [min, max] instead (one_sided_input).
    An input rotation (input_rotation, quantize_int8's default) spreads wide channels first. On the
    starter models (benchmarks.int8_sensitivity, 872-1,000 items each), rotated, this keeps 99.7 % of
    sentiment, 99.8 % of NER and 98.4 % of QA predictions identical to fp32 with VNNI (8-bit weights;
    unrotated 99.5 / 99.4 / 95.8 %), 99.8 / 99.7 / 97.5 % held to AVX2 (7-bit weights; benchmarks/README.md)."""

    _GELU = {F.gelu: "none", gelu_tanh: "tanh"}

    def __init__(self, linear: nn.Linear, activation=None, *, one_sided_input: bool = False,
                 input_divisor: Tensor | None = None, input_rotation: Tensor | None = None,
                 kernel: str = "onednn") -> None:
        super().__init__()
        if kernel not in INT8_KERNELS:
            raise ValueError(f"kernel {kernel!r}: choose one of {INT8_KERNELS}")
        self.kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        self.register_buffer("input_rotation", None if input_rotation is None else input_rotation.detach().float(),
                             persistent=False)
        # Smoothing (SmoothQuant): W x = (W diag(d)) (x / d) for any positive per-channel d; a d large where
        # the input's channel is wide and the weight's column narrow moves range from the activations,
        # quantised per token, into the weights, quantised per output channel (smoothing_divisors).
        self.register_buffer("input_multiplier", None if input_divisor is None else
                             input_divisor.detach().float().reciprocal(), persistent=False)
        if input_divisor is not None:
            weight = weight * input_divisor.detach().float()[None, :]
        # Rotation (QuaRot-style): W x = (W R)(R^T x) for an orthogonal R, here block-diagonal Hadamard blocks
        # (see hadamard): one wide input channel's range is spread over its block, in the input quantised per
        # token and in the weight's columns quantised per output channel alike. x R runs as one small matmul.
        if input_rotation is not None:
            block = input_rotation.shape[0]
            if self.in_features % block:
                raise ValueError(f"input_rotation of size {block} does not divide in_features {self.in_features}")
            weight = (weight.view(self.out_features, -1, block) @ input_rotation).view_as(weight)
        # FBGEMM keeps 8-bit weights everywhere and, without VNNI, halves the activations' range instead
        # (reduce_range: 7-bit activation codes), which keeps AVX2's int16 pair sums from saturating as well;
        # the tiled kernel always does (int8_matmul.c)
        self.reduce_range = kernel == "fbgemm" and int8_weight_limit() < 127
        self.levels = 127 if kernel in ("fbgemm", "tiled") else int8_weight_limit()
        quantised, scale = quantize_weight(weight, self.levels)
        # An input far from symmetric about 0 (a GELU's output: >= -0.17, up to several units) would use
        # about half the 255 codes with steps symmetric about 0; each row's own [min, max] in 255 steps
        # uses them all. The offset's share of the output, midpoint x (row sums of W), is added back.
        self.one_sided_input = one_sided_input
        self.register_buffer("weight_row_sum", (quantised.float() * scale[:, None]).sum(dim=1)
                             if one_sided_input or kernel != "onednn" else None, persistent=False)
        # the tiled kernel rotates blocks of 16 itself, on the way to its codes; other blocks, and smoothing, here
        self.rotates_inside = (kernel == "tiled" and input_divisor is None and input_rotation is not None
                               and input_rotation.shape[0] == 16)
        self._fbgemm = None
        self.register_buffer("packed", None, persistent=False)
        if kernel == "tiled":
            lib = native.library()
            if lib is None:
                raise RuntimeError(f"the AVX2 int8 kernel cannot run here: {native.unavailable()}")
            if self.in_features > TILED_INT8_MAX_FEATURES:
                raise ValueError(f"the AVX2 int8 kernel takes at most {TILED_INT8_MAX_FEATURES} input features, "
                                 f"not {self.in_features}")
            panels = torch.empty(-(-self.out_features // 16) * -(-self.in_features // 4) * 64, dtype=torch.int8)
            codes = quantised.contiguous()
            lib.int8_pack(codes.data_ptr(), self.out_features, self.in_features, panels.data_ptr())
            self.register_buffer("packed", panels, persistent=False)
        elif kernel == "fbgemm":
            with warnings.catch_warnings():  # torch marks its quantised tensors deprecated; FBGEMM's prepack takes one
                warnings.simplefilter("ignore", (UserWarning, DeprecationWarning, FutureWarning))
                codes = torch._make_per_channel_quantized_tensor(quantised, scale.double(), torch.zeros(
                    self.out_features, dtype=torch.long), 0)
                self._fbgemm = torch.ops.quantized.linear_prepack(codes, None)  # bias added after the row scales
        else:
            self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(quantised, None), persistent=False)
        self.register_buffer("weight_scale", scale.float().contiguous(), persistent=False)
        self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.long), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.post_op, self.algorithm = ("gelu", self._GELU[activation]) if activation is not None else ("none", "")
        self.fused_quantiser = None  # fuse_int8_quantisers sets a torch.compile'd one

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).float()
        if self._fbgemm is not None:
            return self._fbgemm_forward(x).reshape(*shape[:-1], self.out_features)
        if self.kernel == "tiled":
            return self._tiled_forward(x).reshape(*shape[:-1], self.out_features)
        if self.fused_quantiser is not None and x.shape[0] >= FUSED_MIN_ROWS:  # compiled: one pass to uint8 codes
            qx, row_scale, mid = self.fused_quantiser(x, self.input_multiplier, self.input_rotation)
            input_scale = 1.0 if self.one_sided_input else 1.0 / 127
        else:
            x = _prepared_rows(x, self.input_multiplier, self.input_rotation)
            qx, input_scale, row_scale, mid = self._one_sided_codes(x) if self.one_sided_input else self._codes(x)
            # the codes are int8; shifted by 128 into uint8: oneDNN's fast kernels take u8 activations only (an
            # int8 input runs a reference path thousands of times slower). Float to int8 is vectorised where
            # float to uint8 is not, and the shift is a wrapping uint8 add on the same bytes.
            qx = qx.view(torch.uint8).add_(128)
        out = torch.ops.onednn.qlinear_pointwise(qx, input_scale, 128, self.packed, self.weight_scale,
                                                 self.weight_zero_point, None, 1.0, 0, torch.float32,
                                                 "none", [], "")
        # the row scales and the bias in one pass, in place (these outputs are large: each pass costs)
        out = out.mul_(row_scale) if self.bias is None else torch.addcmul(self.bias, out, row_scale, out=out)
        if mid is not None:
            out = out.addr_(mid.squeeze(1), self.weight_row_sum)
        if self.post_op == "gelu":
            out = torch.ops.aten.gelu_(out, approximate=self.algorithm)
        return out.reshape(*shape[:-1], self.out_features)

    def _fbgemm_forward(self, x: Tensor) -> Tensor:
        """FBGEMM quantises its whole input with one [min, max]. Each row is first mapped from its own
        [min, max] onto [0, 1] (per-token asymmetric steps, as the oneDNN path's one-sided inputs), so
        every token gets the whole code range, and since every row then holds an exact 0 and an exact
        1, the tensor's range is [0, 1] whatever else is in the batch: a row's codes, and its output, do
        not depend on the rows beside it (a text alone, in a batch, or in the feed-forward's chunks)."""
        x = _prepared_rows(x, self.input_multiplier, self.input_rotation)
        low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        step = (high - low).clamp_min_(1e-12)
        out = torch.ops.quantized.linear_dynamic((x - low).div_(step), self._fbgemm, self.reduce_range)
        # W x = step * (W x') + low * (W 1), x' = (x - low) / step
        out = out.mul_(step).addr_(low.squeeze(1), self.weight_row_sum)
        if self.bias is not None:
            out = out.add_(self.bias)
        if self.post_op == "gelu":
            out = torch.ops.aten.gelu_(out, approximate=self.algorithm)
        return out

    def _tiled_forward(self, x: Tensor) -> Tensor:
        """int8_matmul.c: the FBGEMM path's scheme (each row's [min, max] onto 7-bit codes, 8-bit weights)
        in one call, rotation included where it is in blocks of 16."""
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("the tiled int8 kernel is for inference: it has no backward")
        if not self.rotates_inside:
            x = _prepared_rows(x, self.input_multiplier, self.input_rotation)
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            codes = torch.empty(rows * -(-self.in_features // 4) * 4, dtype=torch.uint8)
            row_steps = torch.empty(2 * rows, dtype=torch.float32)
            status = native.library().int8_matmul(
                x.data_ptr(), rows, self.in_features, int(self.rotates_inside), self.packed.data_ptr(),
                -(-self.out_features // 16), self.weight_scale.data_ptr(), self.weight_row_sum.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), self.out_features,
                codes.data_ptr(), row_steps.data_ptr(), torch.get_num_threads())
            if status != 0:
                raise RuntimeError(f"int8_matmul.c refused {self.in_features} input features")
        if self.post_op == "gelu":
            out = torch.ops.aten.gelu_(out, approximate=self.algorithm)
        return out

    @staticmethod
    def _codes(x: Tensor) -> tuple[Tensor, float, Tensor, None]:
        """Each row to int8 codes in [-127, 127] by its own largest |value| s (made by hand: torch's
        quantised tensors are deprecated); one input scale (1/127) per call, the output times s."""
        # amax and amin: aminmax along a dimension is many times slower
        row_scale = torch.maximum(x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True).neg_()).clamp_min_(1e-12)
        return (x * (127.0 / row_scale)).round_().to(torch.int8), 1.0 / 127, row_scale, None

    @staticmethod
    def _one_sided_codes(x: Tensor) -> tuple[Tensor, float, Tensor, Tensor]:
        """Each row x ~ mid + step * c, c = int8 codes in [-128, 127] over the row's [min, max], so
        W x = step * (W c) + mid * (W 1): the output times step, plus mid times W's row sums."""
        low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        step = (high - low).div_(255.0).clamp_min_(1e-12)
        inverse = step.reciprocal()
        mid = low.add_(step * 128.0)  # low + 128 steps: codes 0..255 become c = -128..127
        # (x - mid) / step in one pass
        codes = torch.addcmul(mid.mul(inverse).neg_(), x, inverse).round_().clamp_(-128, 127).to(torch.int8)
        return codes, 1.0, step, mid

    def extra_repr(self) -> str:
        inputs = ("per-token [min, max] input steps" if self.one_sided_input or self.kernel != "onednn"
                  else "per-token input scales")
        smoothed = ", smoothed" if self.input_multiplier is not None else ""
        rotated = "" if self.input_rotation is None else f", inputs rotated in blocks of {self.input_rotation.shape[0]}"
        fused = "" if self.fused_quantiser is None else ", fused quantiser"
        kernel = "FBGEMM, 7-bit activation codes" if self.reduce_range else (
            "FBGEMM" if self.kernel == "fbgemm" else "bert_engine's AVX2 kernel, 7-bit activation codes"
            if self.kernel == "tiled" else "oneDNN")
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 {kernel} "
                f"(weights +-{self.levels}), "
                f"activation={self.post_op}, {inputs}{smoothed}{rotated}{fused}")


# Rows (tokens) an int8 encoder layer's feed-forward block runs at a time (model.FeedForward.chunk_rows): its
# intermediate is then 512 x I floats (3 MB in MiniLM, 6 MB in bert-base), which the quantiser's passes find in
# cache. Measured on the 2-core AVX-512 EPYC, 32 x 128 tokens, in turn with unchunked (benchmarks/README.md,
# "int8 in chunks"): MiniLM 1.41x, bert-base 1.31x; in fp32 and bf16 (one fused pass) it bought nothing, so
# only int8 sets it.
FFN_CHUNK_ROWS = 512


# Below this many rows (tokens) a projection quantises its input eagerly even where a fused quantiser is set.
# MiniLM int8 timed in turn (2-core AVX-512 EPYC): with compiled quantisers on every call, 32x128 read 1.08x
# and 8x128 (1,024 rows) / 1x128 0.95x / 0.94x in one run. With this floor, `python -m benchmarks.int8_fused`
# read 1.00x / 0.99x / 1.00x in another (benchmarks/README.md, "int8 with fused quantisers").
# The first input this long compiles (about 2 s).
FUSED_MIN_ROWS = 2048


def _prepared_rows(x: Tensor, multiplier: Tensor | None, rotation: Tensor | None) -> Tensor:
    """An int8 projection's input rows smoothed (times `multiplier`) and rotated in Hadamard blocks, as set."""
    if multiplier is not None:
        x = x * multiplier
    if rotation is not None:
        x = (x.reshape(-1, rotation.shape[0]) @ rotation).view(x.shape)
    return x


def symmetric_codes(x: Tensor, multiplier: Tensor | None, rotation: Tensor | None
                    ) -> tuple[Tensor, Tensor, None]:
    """Int8Linear's per-token input quantisation written for torch.compile to fuse into one pass: the
    same codes as Int8Linear._codes + the uint8 shift (round(x * 127 / s) + 128), (codes, s, None)."""
    x = _prepared_rows(x, multiplier, rotation)
    row_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    return (torch.round(x * (127.0 / row_scale)) + 128.0).to(torch.uint8), row_scale, None


def one_sided_codes(x: Tensor, multiplier: Tensor | None, rotation: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Int8Linear._one_sided_codes + the uint8 shift written for torch.compile: (codes, step, mid)."""
    x = _prepared_rows(x, multiplier, rotation)
    low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    step = ((high - low) / 255.0).clamp_min(1e-12)
    inverse = step.reciprocal()
    mid = low + step * 128.0
    codes = (torch.round(x * inverse - mid * inverse).clamp(-128, 127) + 128.0).to(torch.uint8)
    return codes, step, mid


def fuse_int8_quantisers(model: nn.Module) -> int:
    """Give each Int8Linear of the model a torch.compile'd quantiser (rotation, row scales, round and the
    convert to uint8 in one generated loop instead of five passes over the input; Inductor needs a C++
    compiler, see cpp_compiler). The codes equal the eager ones but where a fused multiply-add rounds a
    tie the other way (one step, rarely). Returns how many were given one."""
    compiled = {False: torch.compile(symmetric_codes, dynamic=True),
                True: torch.compile(one_sided_codes, dynamic=True)}
    count = 0
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.kernel == "onednn":  # FBGEMM quantises inside its own op
            module.fused_quantiser = compiled[module.one_sided_input]
            count += 1
    return count


LINEAR_NAMES = ("attention.qkv", "attention.out", "ffn.up", "ffn.down")  # each encoder layer's projections


# SmoothQuant's migration strength when smoothing is asked for: divisors d = r^alpha / w^(1 - alpha) (r the
# input channel's reach, w its weight column's largest |value|). Off by default, by measurement: on the QA
# starter it bought +1.3 points on SQuAD dev questions 0-999 and lost 1.0 on 1,000-1,499, and NER lost
# 0.3-0.6 (benchmarks/README.md).
SMOOTHING_ALPHA = 0.5
# The Hadamard block size of the rotation every int8 projection's input gets (quantize_int8(rotation=); None or
# 1 for none). Measured on the QA starter, first 1,000 SQuAD dev questions, answers identical to fp32: none
# 95.8 %, blocks of 16 98.4 % (benchmarks.int8_sensitivity); a draft that rotated attention.out's input in
# blocks of the head size read 97.3 / 98.1 / 98.6 / 98.9 / 97.7 / 97.8 / 98.1 % at 2 / 4 / 8 / 16 / 32 / 64 / 128
# (benchmarks/README.md). Small blocks are also the cheapest (the rotation is one more pass over each input).
ROTATION_BLOCK = 16
# A LayerNorm's output channel j is gamma_j * z + beta_j with z normalised: |z| rarely passes 4
_NORMALISED_REACH = 4.0


def _feeding_norms(encoder: nn.Module, index: int, name: str) -> list[nn.LayerNorm] | None:
    """The LayerNorms whose outputs are the input of layer `index`'s projection `name` (post-LN
    layers: qkv reads the previous layer's ffn_norm, or the embeddings' norm first; FFN up reads
    attention_norm), over every place the layer runs (ALBERT shares layers); None where another
    module feeds it (ALBERT's embedding projection) or the projection reads no norm."""
    if name == "ffn.up":
        return [encoder.layers[index].attention_norm]
    if name != "attention.qkv":
        return None
    schedule = list(getattr(encoder, "schedule", range(len(encoder.layers))))
    norms = []
    for position, layer in enumerate(schedule):
        if layer != index:
            continue
        if position == 0:
            if getattr(encoder, "embedding_projection", None) is not None:
                return None
            norms.append(encoder.embeddings.layer_norm)
        else:
            norms.append(encoder.layers[schedule[position - 1]].ffn_norm)
    return norms or None


def smoothing_divisors(linear: nn.Linear, norms: list[nn.LayerNorm], alpha: float = SMOOTHING_ALPHA) -> Tensor:
    """Per-input-channel divisors for a projection that reads LayerNorm outputs, without data: the
    channel's reach r = 4 |gamma| + |beta| (over every norm feeding it, the widest), then
    d = r^alpha / w^(1 - alpha), w the weight column's largest |value|, divided by their geometric
    mean (a common factor changes no code: both sides are scaled per token / per output channel)."""
    reach = torch.stack([_NORMALISED_REACH * n.weight.detach().float().abs() + n.bias.detach().float().abs()
                         for n in norms]).amax(dim=0).clamp_min(1e-5)
    columns = linear.weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    divisors = reach.pow(alpha) / columns.pow(1.0 - alpha)
    return divisors / divisors.log().mean().exp()


def hadamard(size: int) -> Tensor:
    """The orthonormal Hadamard matrix of a power-of-two size (Sylvester's construction, divided by
    sqrt(size)): symmetric, its own inverse, and every entry +-1/sqrt(size), so it spreads any one
    channel's value evenly over all `size` outputs."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Hadamard matrix here needs a power-of-two size, got {size}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / size ** 0.5


def rotation_block(features: int, block: int) -> int:
    """The largest power of two that is at most `block` and divides `features` (1: no rotation)."""
    size = 1
    while size * 2 <= block and features % (size * 2) == 0:
        size *= 2
    return size


def rotate_value_heads(attention: nn.Module, block: int) -> None:
    """Rotate each head's value features by Hadamard blocks R (of at most `block`, inside each head),
    in place and exactly: V's rows
    become R^T W_v (and R^T b_v), so each head's context comes out times R, and the output
    projection's columns of that head become W_o R, which undoes it. No cost at run time; the
    output projection's int8 input (the context) has its wide channels spread over the head."""
    qkv, out = attention.qkv, attention.out
    hidden = out.in_features
    heads = attention.num_heads
    size = rotation_block(hidden // heads, block)
    if size < 2:
        return
    rotation = hadamard(size)
    with torch.no_grad():
        values = qkv.weight[2 * hidden:]  # (H, in): rows grouped (head, feature)
        values.copy_((rotation.T @ values.reshape(-1, size, values.shape[1])).reshape_as(values))
        if qkv.bias is not None:
            bias = qkv.bias[2 * hidden:]
            bias.copy_((bias.reshape(-1, size) @ rotation).reshape_as(bias))
        out.weight.copy_((out.weight.reshape(out.out_features, -1, size) @ rotation).reshape_as(out.weight))


def quantize_int8(model: nn.Module, keep_fp32: tuple[str, ...] | None = None,
                  smoothing: float | None = None, rotation: int | None = ROTATION_BLOCK) -> nn.Module:
    """Replace the encoder layers' projections by int8 ones, in place: Int8Linear with the int8 matmuls
    `int8_kernel()` picks (oneDNN's or FBGEMM's), else, where this torch has neither, torch.ao's dynamic
    quantisation.

    `keep_fp32` names projections to leave in fp32 (packed), as "LAYER.NAME" ("5.ffn.down") or a bare
    NAME for every layer ("ffn.down"); default KEEP_FP32 (see there). `rotation`: the Hadamard block
    size (a power of two; ROTATION_BLOCK by default, None for none) each projection's input is rotated
    by, the weight taking the inverse: a channel far wider than the rest (LayerNorm outputs and FFN
    activations have a few) no longer sets every other channel's step; attention.out's input through
    V's weights at no cost (rotate_value_heads), the others as one small matmul per call. `smoothing`: the migration
    strength alpha (e.g. SMOOTHING_ALPHA) for the projections that read a LayerNorm (qkv, FFN up;
    `smoothing_divisors`); None, the default, for none (see SMOOTHING_ALPHA for why).
    """
    if smoothing is not None and not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"smoothing must lie in [0, 1] (or be None), got {smoothing!r}")
    keep = set(KEEP_FP32 if keep_fp32 is None else keep_fp32)
    known = set(LINEAR_NAMES)
    unknown = sorted(k for k in keep if k.split(".", 1)[-1] not in known and k not in known)
    if unknown:
        raise ValueError(f"keep_fp32: {unknown} name no encoder projection; use NAME or LAYER.NAME with NAME one "
                         f"of {LINEAR_NAMES}")
    encoder = encoder_of(model)
    kernel = int8_kernel()
    if kernel is None:
        with warnings.catch_warnings():
            # torch marks its quantised-tensor API as deprecated in favour of torchao; it still works.
            warnings.simplefilter("ignore", (UserWarning, DeprecationWarning, FutureWarning))
            for layer in encoder.layers:
                torch.ao.quantization.quantize_dynamic(layer, {nn.Linear}, dtype=torch.qint8, inplace=True)
        logger.info("quantised %d encoder layers to dynamic int8 (torch.ao; no oneDNN or FBGEMM int8 here)",
                    len(encoder.layers))
        return model
    quantised = 0
    for index, layer in enumerate(encoder.layers):
        if rotation and isinstance(layer.attention.out, nn.Linear) and isinstance(layer.attention.qkv, nn.Linear):
            rotate_value_heads(layer.attention, rotation)  # exact in fp32, so whichever of the two stays fp32
        for name in LINEAR_NAMES:
            owner_name, attr = name.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            if not isinstance(linear, nn.Linear):  # already packed or quantised
                continue
            fused_gelu = name == "ffn.up" and owner.act in Int8Linear._GELU
            kept = name in keep or f"{index}.{name}" in keep
            if kept:
                replacement = PackedLinear(linear, owner.act if fused_gelu else None) if can_pack(model) else linear
            else:
                # FFN down's input is a GELU's (fused into up: act is then _identity) or a ReLU's
                # output, or SiLU's: one-sided (see Int8Linear)
                one_sided = name == "ffn.down" and owner.act in (*Int8Linear._GELU, _identity, F.relu, F.silu)
                norms = _feeding_norms(encoder, index, name) if smoothing is not None else None
                divisors = smoothing_divisors(linear, norms, smoothing) if norms else None
                # attention.out's input, the heads' context, is rotated through V's weights (rotate_value_heads)
                size = rotation_block(linear.in_features, rotation) if rotation and name != "attention.out" else 1
                replacement = Int8Linear(linear, owner.act if fused_gelu else None,
                                         one_sided_input=one_sided and size == 1, input_divisor=divisors,
                                         input_rotation=hadamard(size) if size > 1 else None,
                                         kernel=_int8_kernel_for(kernel, linear))
                quantised += 1
            if fused_gelu and replacement is not linear:
                owner.act = _identity
            setattr(owner, attr, replacement)
        if isinstance(layer.ffn.up, Int8Linear) or isinstance(layer.ffn.down, Int8Linear):
            layer.ffn.chunk_rows = FFN_CHUNK_ROWS
        if all(_fusable_int8(module) for module, _ in _projections(layer).values()):
            layer.fused = fused_layer  # the whole layer in one C call (fused_layer.c), the int8 matmuls in it
            encoder.embeddings.fused = fused_embeddings
            encoder.fused_stack = fused_stack
    model.int8_kernel = kernel
    logger.info("quantised %d of %d encoder projections to int8 (%s; smoothing %s), kept %s in fp32", quantised,
                len(encoder.layers) * len(LINEAR_NAMES), kernel, smoothing, sorted(keep) or "none")
    return model


TILED_INT8_MAX_FEATURES = 16384  # int8_matmul.c's QMAX_K: the longest input rows its quantiser holds


def _int8_kernel_for(kernel: str, linear: nn.Linear) -> str:
    """`kernel`, or for the tiled one a projection wider than it takes, FBGEMM's (else oneDNN's)."""
    if kernel != "tiled" or linear.in_features <= TILED_INT8_MAX_FEATURES:
        return kernel
    return "fbgemm" if fbgemm_int8_available() else "onednn"


# Empty by measurement: kept alone in fp32, the projection that bought most on 150 probe questions
# bought about one point on the 1,000 scored ones, two together none (benchmarks/int8_sensitivity.py;
# benchmarks/README.md).
KEEP_FP32: tuple[str, ...] = ()


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


class TiledLinear(nn.Module):
    """An inference-only fp32 nn.Linear on the CPU through bert_engine's own AVX2 kernel (native.py,
    tiled_matmul.c; at AVX-512's width where the CPU has it, the same bits): the weight laid out once in panels of 16 output columns, each read from memory once per
    call. Faster than oneDNN's and MKL's at the few rows of one request on the AVX2 EPYC it was written on;
    `choose_kernels` times it beside them. Each row's outputs are summed in a fixed order, whatever else is in
    the batch and however many threads run: a text's outputs do not depend on its batch."""

    def __init__(self, linear: nn.Linear, activation=None) -> None:
        super().__init__()
        lib = native.library()
        if lib is None:
            raise RuntimeError(f"the AVX2 kernel cannot run here: {native.unavailable()}")
        if linear.weight.dtype != torch.float32:
            raise ValueError(f"the AVX2 kernel is fp32 only, not {linear.weight.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        panels = -(-self.out_features // 16)
        padded = weight.new_zeros(panels * 16, self.in_features)
        padded[: self.out_features] = weight
        self.register_buffer("panels", padded.view(panels, 16, self.in_features).transpose(1, 2).contiguous(),
                             persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().contiguous(),
                                                                  requires_grad=False)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(f"TiledLinear takes fp32 CPU inputs of {self.in_features} features, not "
                             f"{x.dtype} {x.device.type} {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("TiledLinear is for inference: it has no backward (explain.py uses a plain copy)")
        x = x.contiguous()
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.float32)
        rows = x.numel() // self.in_features
        if rows:
            native.tiled_matmul()(x.data_ptr(), rows, self.in_features, self.panels.data_ptr(), self.panels.shape[0],
                      None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), self.out_features,
                      torch.get_num_threads())
        return out if self.activation is None else self.activation(out)

    def extra_repr(self) -> str:
        act = "none" if self.activation is None else getattr(self.activation, "__name__", "activation")
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={act}"


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


PROJECTIONS = ("qkv", "out", "up", "down")  # an encoder layer's projections, as kernel choices name them
# ... and a masked-LM head's decoder (hidden -> vocabulary: 30,522 x 384 in MiniLM), read at a few masks per
# text: MKL's sgemm took 4.5 ms for one row and 15 ms for three where oneDNN's packed matmul took 1.4 / 2.5 ms
# (2-core AVX-512 EPYC), so it is timed and chosen like the projections, on the rows it sees (DECODER_ROWS).
DECODER = "decoder"
KERNEL_CHOICES = (*PROJECTIONS, DECODER)


def mlm_heads(model: nn.Module) -> list[nn.Module]:
    """The model's masked-LM heads whose decoder is still a plain nn.Linear."""
    return [m for m in model.modules() if isinstance(m, MaskedLMHead) and isinstance(m.decoder, nn.Linear)]


class RowSwitch(nn.Module):
    """One projection through two kernels: `short` for inputs of up to `rows` rows, `long` past them (where
    `choose_kernels` found a different kernel faster). Each holds its own copy of the weight."""

    def __init__(self, short: nn.Module, long: nn.Module, rows: int, in_features: int) -> None:
        super().__init__()
        self.short, self.long, self.rows, self.in_features = short, long, rows, in_features

    def kernel_at(self, rows: int) -> nn.Module:
        """The kernel an input of `rows` rows runs through."""
        return self.short if rows <= self.rows else self.long

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel_at(x.numel() // self.in_features)(x)

    def extra_repr(self) -> str:
        return f"up to {self.rows} rows: short, past them: long"


def kernel_tiers(kernels: tuple) -> tuple:
    """A projection's kernels as (kernel, rows, kernel, rows, ..., kernel): the first up to the rows after it,
    the next from there, and so on. `kernels` is that already, or (short, long): short up to COLD_ROWS rows."""
    if len(kernels) == 2:
        short, long = kernels
        return (short,) if short == long else (short, COLD_ROWS, long)
    return tuple(kernels)


def _fuses(kernel: str, activation) -> bool:
    """Whether `kernel` (KERNELS) applies `activation` itself: oneDNN's a GELU, the tiled kernel any."""
    return kernel == "tiled" or (kernel == "packed" and activation in PackedLinear._GELU)


def _kernel_module(kernel: str, linear: nn.Linear, activation) -> nn.Module:
    """`linear` (then `activation`, which the kernel fuses; None: none) through `kernel` (KERNELS)."""
    if kernel == "tiled":
        return TiledLinear(linear, activation)
    return PackedLinear(linear, activation) if kernel == "packed" else linear


def use_kernels(model: nn.Module, choice: dict[str, tuple]) -> nn.Module:
    """Run each projection named in `choice` (KERNEL_CHOICES: PROJECTIONS, and "decoder" for a masked-LM
    head's) through its kernels (short rows, long rows: KERNELS; or tiers, see `kernel_tiers` and
    `choose_kernels`), in place. Kernels
    this model or machine cannot run are left out (packed: fp32 or oneDNN bf16 on a CPU; tiled: fp32 where
    native.py builds it), as is a projection already swapped or quantised. The feed-forward's activation
    moves into its first projection where every kernel of it fuses it (oneDNN a GELU, the tiled kernel any);
    else it stays after it. A swapped decoder is a copy: the word embeddings it was tied to stay."""
    choice = {name: kernel_tiers(kernels) for name, kernels in choice.items()}
    wanted = {k for kernels in choice.values() for k in kernels[::2]}  # the tiled kernel is built only if asked for
    runs = {"plain": True, "packed": "packed" in wanted and can_pack(model),
            "tiled": "tiled" in wanted and next(model.parameters()).dtype == torch.float32
            and native.library() is not None}
    kept = {name: kernels for name, kernels in choice.items() if all(runs[k] for k in kernels[::2])
            and kernels != ("plain",)}
    for head in mlm_heads(model):
        head.decoder = _swapped(head.decoder, kept.get(DECODER)) or head.decoder
    for layer in encoder_of(model).layers:
        if _swap_layer(layer, kept):
            encoder_of(model).embeddings.fused = fused_embeddings
            encoder_of(model).fused_stack = fused_stack
    model.eval()
    return model


def _swapped(linear: nn.Module, tiers: tuple | None, activation=None) -> nn.Module | None:
    """`linear` (then `activation`) through the kernels `tiers` (kernel_tiers'), or None: no tiers, or not an
    nn.Linear (already swapped or quantised). The activation stays after it unless every kernel fuses it."""
    if tiers is None or not isinstance(linear, nn.Linear):
        return None
    if activation is not None and not all(_fuses(kernel, activation) for kernel in tiers[::2]):
        return _swapped(linear, tiers)  # the activation stays after it
    module = _kernel_module(tiers[-1], linear, activation)
    for at in range(len(tiers) - 3, -1, -2):  # from the last boundary back: short up to it, the rest past it
        module = RowSwitch(_kernel_module(tiers[at], linear, activation), module, tiers[at + 1], linear.in_features)
    return module


def _swap_layer(layer: nn.Module, kept: dict[str, tuple]) -> bool:
    """An encoder layer's projections through their tiers in `kept` (use_kernels'), in place; True where the
    layer runs in one C call (fused_layer) at some number of rows: all four take the tiled kernel there."""
    attention, ffn = layer.attention, layer.ffn
    attention.qkv = _swapped(attention.qkv, kept.get("qkv")) or attention.qkv
    attention.out = _swapped(attention.out, kept.get("out")) or attention.out
    up = _swapped(ffn.up, kept.get("up"), ffn.act)
    if up is not None:
        fused = all(_fuses(kernel, ffn.act) for kernel in kept["up"][::2])
        ffn.up, ffn.act = up, (_identity if fused else ffn.act)
    ffn.down = _swapped(ffn.down, kept.get("down")) or ffn.down
    if all("tiled" in kept.get(name, ())[::2] for name in PROJECTIONS):
        layer.fused = fused_layer
        return True
    return False


FUSED_ACTIVATIONS = {F.gelu: 0, gelu_tanh: 1, F.relu: 2}  # fused_layer.c's codes
# fused_layer.c takes a batch's sequences in groups of whole sequences of up to this many rows (one longer sequence
# alone): the same values, with each group's intermediates in cache and in a scratch buffer the pool keeps.
FUSED_GROUP_ROWS = 512


def _fusable_int8(module: nn.Module) -> bool:
    """An Int8Linear fused_layer.c can run: the tiled kernel's, its input rotated there or not at all."""
    return (isinstance(module, Int8Linear) and module.kernel == "tiled" and module.input_multiplier is None
            and (module.input_rotation is None or module.rotates_inside))


def _tiled_at(module: nn.Module, rows: int) -> TiledLinear | Int8Linear | None:
    """The TiledLinear `module` runs `rows` rows through, if it is one (or a RowSwitch choosing one), or the
    module itself where it is an Int8Linear fused_layer.c can run."""
    while isinstance(module, RowSwitch):
        module = module.kernel_at(rows)
    return module if isinstance(module, TiledLinear) or _fusable_int8(module) else None


def _activation_of(module: TiledLinear | Int8Linear):
    """The activation a projection applies to its own output (None: none)."""
    if isinstance(module, TiledLinear):
        return module.activation
    return {"none": F.gelu, "tanh": gelu_tanh}[module.algorithm] if module.post_op == "gelu" else None


def _projection(module: TiledLinear | Int8Linear) -> native.Projection:
    """fused_layer.c's record of one projection (its tensors stay alive: the module holds them)."""
    if isinstance(module, TiledLinear):
        return native.Projection(module.panels.data_ptr(), module.bias.data_ptr(), None, None, 0, 0)
    return native.Projection(module.packed.data_ptr(), module.bias.data_ptr(), module.weight_scale.data_ptr(),
                             module.weight_row_sum.data_ptr(), 1, int(module.rotates_inside))


_WHOLE_ROWS: dict[tuple[int, int], Tensor] = {}  # offsets of (batch, tokens) unpadded rows: the C code only reads them


def _sequence_offsets(x: Tensor, mask: Tensor | None, unpadded: Any) -> Tensor | None:
    """Where each sequence's rows start in `x` laid out flat, and where the last ends ((S + 1,) int64), for
    fused_layer.c; None where the rows are not whole sequences end to end (padding left in: `mask` without
    `unpadded`, or a padding mask with holes)."""
    if unpadded is None:
        if mask is not None or x.dim() != 3:
            return None
        shape = (x.shape[0], x.shape[1])
        offsets = _WHOLE_ROWS.get(shape)
        if offsets is None:  # made once per shape (each layer of each request asked for it anew: 5-20 us)
            if len(_WHOLE_ROWS) >= 256:
                _WHOLE_ROWS.clear()
            offsets = _WHOLE_ROWS[shape] = torch.arange(0, shape[0] * shape[1] + 1, shape[1], dtype=torch.int64)
        return offsets
    offsets = getattr(unpadded, "sequence_offsets", False)
    if offsets is False:  # worked out once per forward, by the first layer
        index, tokens = unpadded.index, unpadded.tokens
        sequence = torch.div(index, tokens, rounding_mode="floor")
        steps, same = index[1:] - index[:-1], sequence[1:] == sequence[:-1]
        offsets = None
        if bool((steps[same] == 1).all()):  # each sequence's real tokens next to each other
            counts = torch.bincount(sequence, minlength=unpadded.batch)
            offsets = torch.cat([counts.new_zeros(1), counts[counts > 0].cumsum(0)])
        unpadded.sequence_offsets = offsets
    return offsets


class ScratchPool:
    """Working memory for fused_layer.c, kept between calls. A fresh tensor of a few hundred KB per layer
    comes from mmap and goes back on free, with page faults on every call: on the 2-core EPYC VMs the
    Python side of a 12-row layer took 0.2-0.6 ms beside its 0.3-0.4 ms C call until this pool and the bias
    check's fix (by hand, medians of 300 calls). At most `keep` buffers of up to `largest` bytes each are
    kept (32 MB at most); bigger ones (long batches) are allocated per call."""

    def __init__(self, keep: int = 2, largest: int = 16 << 20) -> None:
        self.keep, self.largest = keep, largest
        self._free: list[Tensor] = []
        self._lock = threading.Lock()

    def take(self, floats: int) -> Tensor:
        with self._lock:
            best = None
            for i, buffer in enumerate(self._free):  # the smallest that fits
                size = buffer.numel()
                if size >= floats and (best is None or size < self._free[best].numel()):
                    best = i
            if best is not None:
                return self._free.pop(best)
        return torch.empty(floats, dtype=torch.float32)

    def give(self, buffer: Tensor) -> None:
        if buffer.numel() * 4 > self.largest:
            return
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.keep:  # the smallest goes
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


SCRATCH = ScratchPool()


class _FusedPlan:
    """What fused_layer.c needs of one layer with one set of projection modules, worked out once per layer and
    set (a RowSwitch gives short and long inputs their own): the activation's code, the projection records, the
    norms' pointers, and the tensors those point into, kept here and checked at each call to still be the
    modules' own (a module given new tensors gets a new plan, not a pointer into freed memory)."""

    def __init__(self, layer: nn.Module, modules: tuple, hidden: int) -> None:
        qkv, out, up, down = modules
        ffn = layer.ffn
        norms = (layer.attention_norm, layer.ffn_norm)
        own = _activation_of(up)
        activation = own if ffn.act is _identity else (ffn.act if own is None else None)
        self.code = FUSED_ACTIVATIONS.get(activation)
        self.hidden, self.act = hidden, ffn.act
        supported = (self.code is not None and all(m.bias is not None for m in modules)
                     and all(type(n) is nn.LayerNorm and n.weight is not None and n.bias is not None
                             and n.normalized_shape == (hidden,) for n in norms))
        # (the owners' own parameter and buffer dicts: read through nn.Module's __getattr__, 12 tensors took 25 us)
        self.tensors: list[tuple[dict, str, Tensor]] = []
        if not supported:
            self.code = None
            return
        for module in modules:
            names = ("panels", "bias") if isinstance(module, TiledLinear) else ("packed", "bias", "weight_scale",
                                                                                 "weight_row_sum")
            self.tensors += [(_holder(module, name), name, getattr(module, name)) for name in names]
        self.tensors += [(_holder(n, name), name, getattr(n, name)) for n in norms for name in ("weight", "bias")]
        self.projections = (native.Projection * 4)(*(_projection(m) for m in modules))
        self.norms = [(n.weight.data_ptr(), n.bias.data_ptr(), n.eps) for n in norms]
        self.inner, self.heads = up.out_features, layer.attention.num_heads
        # an int8 projection's codes (the widest input's bytes) and row steps, per row of scratch
        self.int8_room = -(-max(hidden, self.inner) // 4) + 3 if any(isinstance(m, Int8Linear) for m in modules) else 0

    def current(self, act: Any, hidden: int) -> bool:
        return hidden == self.hidden and act is self.act and _still_held(self.tensors)


def _still_held(tensors: list[tuple[dict, str, Tensor]]) -> bool:
    """Whether each (holder, name, tensor) of a plan is still its module's own (else the plan is made anew)."""
    for holder, name, tensor in tensors:  # (a loop: all() over a generator took twice as long)
        if holder.get(name) is not tensor:
            return False
    return True


def _holder(module: nn.Module, name: str) -> dict:
    """The dict of `module` that holds its tensor `name`: its parameters' or its buffers'."""
    return module._parameters if name in module._parameters else module._buffers


def _plan(layer: nn.Module, rows: int, hidden: int) -> _FusedPlan | None:
    children = layer._modules  # (nn.Module's __getattr__ costs about a microsecond a name)
    attention, ffn = children["attention"]._modules, children["ffn"]
    key = (_tiled_at(attention["qkv"], rows), _tiled_at(attention["out"], rows), _tiled_at(ffn._modules["up"], rows),
           _tiled_at(ffn._modules["down"], rows), children["attention_norm"], children["ffn_norm"])
    if None in key:
        return None
    modules = key[:4]
    plans = layer.__dict__.setdefault("_fused_plans", {})  # (not a registered attribute of the module)
    plan = plans.get(key)
    if plan is None or not plan.current(ffn.__dict__.get("act", ffn._modules.get("act")), hidden):
        if len(plans) >= 4:  # a short and a long set at most in use: older ones would hold old tensors alive
            plans.clear()
        plan = plans[key] = _FusedPlan(layer, modules, hidden)
    return plan if plan.code is not None else None


class _EmbeddingPlan:
    """What fused_embeddings needs of one BertEmbeddings, worked out once: whether the C code applies, the
    tables' and the norm's pointers and sizes, and the tensors those point into, checked at each call to still
    be the modules' own (as _FusedPlan's)."""

    def __init__(self, embeddings: nn.Module) -> None:
        # (attributes, not _modules: a table built as None, DistilBERT's token types, is a plain attribute)
        word, positions, segments, norm = (embeddings.word_embeddings, embeddings.position_embeddings,
                                           embeddings.token_type_embeddings, embeddings.layer_norm)
        tables = [word, positions] + ([segments] if segments is not None else [])
        E = word.weight.shape[1]
        self.supported = (E % 8 == 0 and embeddings.roberta_padding is None
                          and all(t.max_norm is None and t.weight.dtype == torch.float32 and t.weight.is_cpu
                                  and t.weight.shape[1] == E for t in tables)
                          and type(norm) is nn.LayerNorm and norm.weight is not None and norm.bias is not None
                          and norm.normalized_shape == (E,))
        self.tables_of, self.max_norms = tables, tuple(t.max_norm for t in tables)
        self.tensors = [(t._parameters, "weight", t.weight) for t in tables]
        if norm.weight is not None and norm.bias is not None:
            self.tensors += [(norm._parameters, "weight", norm.weight), (norm._parameters, "bias", norm.bias)]
        self.E, self.segments = E, segments is not None
        self.tables = (word.weight.data_ptr(), word.weight.shape[0],
                       segments.weight.data_ptr() if segments is not None else None,
                       segments.weight.shape[0] if segments is not None else 0,
                       positions.weight.data_ptr(), positions.weight.shape[0])
        self.norm = (norm.weight.data_ptr(), norm.bias.data_ptr(), norm.eps) if self.supported else None

    def current(self) -> bool:
        return _still_held(self.tensors) and tuple(t.max_norm for t in self.tables_of) == self.max_norms


def fused_embeddings(embeddings: nn.Module, input_ids: Tensor, token_type_ids: Tensor | None,
                     position_ids: Tensor | None) -> Tensor | None:
    """`embeddings`' output (model.BertEmbeddings, in inference: (B, T, E)) from one call of fused_layer.c's
    fused_embeddings, or None where that does not apply and the torch modules must run: not fp32 on the CPU,
    gradients wanted, an embedding that renormalises (max_norm), a norm that is not a LayerNorm with weight and
    bias, E not a multiple of 8, RoBERTa's positions counted from the padding, an id outside its table (the
    modules then name it), BERT_ENGINE_FUSED_LAYERS off. The sums are torch's, in its order; the LayerNorm is the
    fused layers' (within 1e-6 of torch's; tested). About 35 us for a request's 24 tokens (8 of them the C call),
    where the modules' seven torch operators took 0.15-0.4 ms on the AVX2 EPYC."""
    if input_ids.dtype != torch.int64 or not input_ids.is_cpu or input_ids.dim() != 2 or not input_ids.numel():
        return None
    if not settings.get("BERT_ENGINE_FUSED_LAYERS"):
        return None
    plan = embeddings.__dict__.get("_fused_plan")
    if plan is None or not plan.current():
        plan = embeddings.__dict__["_fused_plan"] = _EmbeddingPlan(embeddings)
    if not plan.supported or (torch.is_grad_enabled() and plan.tensors[0][2].requires_grad):
        return None
    B, T = input_ids.shape
    types = None
    if plan.segments:
        if token_type_ids is None or token_type_ids.dtype != torch.int64 or token_type_ids.shape != (B, T):
            return None
        types = token_type_ids.contiguous()
    positions = None
    if position_ids is not None:
        if position_ids.dtype != torch.int64 or position_ids.dim() > 2 or position_ids.shape[-1] != T:
            return None
        positions = position_ids.expand(B, T).contiguous()
    ids = input_ids.contiguous()
    out = torch.empty(B, T, plan.E, dtype=torch.float32)
    status = native.library().fused_embeddings(
        ids.data_ptr(), None if types is None else types.data_ptr(), None if positions is None else positions.data_ptr(),
        B * T, T, plan.E, *plan.tables, *plan.norm, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def _group_rows(rows: int, offsets: Tensor) -> int:
    """The most rows fused_layer.c works on at once (its scratch holds that many): a group of whole sequences of up
    to FUSED_GROUP_ROWS rows, or one longer sequence alone."""
    if rows <= FUSED_GROUP_ROWS:
        return rows
    return min(rows, max(FUSED_GROUP_ROWS, int((offsets[1:] - offsets[:-1]).max())))


def _first_rows_out(offsets: Tensor, unpadded: Any, hidden: int) -> Tensor | bool:
    """Where a last layer computes each sequence's first row alone: the (S, 1, hidden) tensor fused_layer.c
    writes them to, or False where the rows are not whole sequences each starting at its position 0."""
    if unpadded is not None:  # (rows without padding are whole sequences, each starting at its position 0)
        starts, batch = unpadded.index[offsets[:-1]], unpadded.batch
        if offsets.numel() - 1 != batch or not bool((starts == torch.arange(batch) * unpadded.tokens).all()):
            return False
    return torch.empty(offsets.numel() - 1, 1, hidden, dtype=torch.float32)


def fused_layer(layer: nn.Module, x: Tensor, mask: Tensor | None, unpadded: Any,
                first_only: bool = False) -> Tensor | None:
    """`layer`'s output (model.BertLayer, in inference) from one call of fused_layer.c, or None where that does
    not apply and the torch modules must run: a projection at this many rows is not a TiledLinear (a RowSwitch
    past COLD_ROWS may run packed) or an int8 one the C code runs, an activation or norm the C code lacks,
    padding left in the rows, gradients wanted, BERT_ENGINE_FUSED_LAYERS off. The projections are the same
    kernels', so the layer differs from the modules only in the attention's, LayerNorms' and GELU's last bits
    (3e-6; tested). `first_only` (BertLayer's): only each sequence's first row, (B, 1, H), the same bits as the
    whole layer's first row; every sequence must start at its row's position 0."""
    if x.dtype != torch.float32 or not x.is_cpu or (x.requires_grad and torch.is_grad_enabled()):
        return None
    if not settings.get("BERT_ENGINE_FUSED_LAYERS"):
        return None
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    plan = _plan(layer, rows, hidden) if rows else None
    if plan is None:
        return None
    offsets = _sequence_offsets(x, mask, unpadded)
    first = _first_rows_out(offsets, unpadded, hidden) if first_only and offsets is not None else None
    if offsets is None or first is False:
        return None
    y = x.clone(memory_format=torch.contiguous_format)  # (x's shape: the C code reads it as rows x hidden)
    # fused_layer.c's working rows: a group of whole sequences at a time (FUSED_GROUP_ROWS, or the longest)
    scratch = SCRATCH.take(_group_rows(rows, offsets) * (5 * hidden + plan.inner + plan.int8_room))
    (w1, b1, eps1), (w2, b2, eps2) = plan.norms
    try:
        status = native.library().fused_layer(
            y.data_ptr(), rows, offsets.data_ptr(), offsets.numel() - 1, hidden, plan.heads, plan.inner,
            plan.projections, w1, b1, eps1, plan.code, w2, b2, eps2, scratch.data_ptr(), torch.get_num_threads(),
            None if first is None else first.data_ptr(), FUSED_GROUP_ROWS)
    finally:
        SCRATCH.give(scratch)
    if status != 0:
        return None
    return first if first is not None else y


class _StackPlan:
    """fused_stack's arguments for one run of layers' plans (their _FusedPlans, in the order the layers apply):
    the projection records, norm pointers, epsilons and activation codes laid end to end, kept with the plans
    they were read from (a plan made anew, its layer's tensors replaced, makes a new stack plan)."""

    def __init__(self, plans: list[_FusedPlan]) -> None:
        self.plans = plans
        n = len(plans)
        self.projections = (native.Projection * (4 * n))(*(record for plan in plans for record in plan.projections))
        self.norms = (ctypes.c_void_p * (4 * n))(*(pointer for plan in plans for (w, b, _) in plan.norms
                                                  for pointer in (w, b)))
        self.eps = (ctypes.c_float * (2 * n))(*(eps for plan in plans for (_, _, eps) in plan.norms))
        self.acts = (ctypes.c_int * n)(*(plan.code for plan in plans))
        self.heads, self.inner = plans[0].heads, plans[0].inner
        self.int8_room = max(plan.int8_room for plan in plans)
        self.same_shape = all((plan.heads, plan.inner) == (self.heads, self.inner) for plan in plans)

    def current(self, plans: list[_FusedPlan]) -> bool:
        return len(plans) == len(self.plans) and all(a is b for a, b in zip(plans, self.plans))


def fused_stack(encoder: nn.Module, layers: list[nn.Module], x: Tensor, mask: Tensor | None, unpadded: Any,
                first_only: bool = False) -> Tensor | None:
    """The output of `layers` (model.BertLayer, in the order they apply, in inference) from one C call for them
    all (fused_layer.c's fused_stack), or None where that does not apply and each layer runs on its own: any
    layer whose own fused_layer would answer None at these rows (past the fused layers' reach, say). The same
    bits as fused_layer called once a layer (tested), without the 0.1-0.3 ms of Python around each layer's call
    (a visitor's sentence ran 1.17-1.25x faster on the Cascade Lake Xeon; benchmarks/README.md, session 47);
    `first_only` as there, for the last layer. The model calls it only where nothing runs between its layers
    (model.BETWEEN_LAYERS: a long row handing its turn back)."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    if (not rows or x.dtype != torch.float32 or not x.is_cpu
            or (x.requires_grad and torch.is_grad_enabled()) or not settings.get("BERT_ENGINE_FUSED_LAYERS")):
        return None
    plans = []
    for layer in layers:
        plan = _plan(layer, rows, hidden) if layer.fused is fused_layer else None
        if plan is None:
            return None
        plans.append(plan)
    stack = encoder.__dict__.get("_stack_plan")
    if stack is None or not stack.current(plans):
        stack = encoder.__dict__["_stack_plan"] = _StackPlan(plans)
    if not stack.same_shape:
        return None
    offsets = _sequence_offsets(x, mask, unpadded)
    first = _first_rows_out(offsets, unpadded, hidden) if first_only and offsets is not None else None
    if offsets is None or first is False:
        return None
    y = x.clone(memory_format=torch.contiguous_format)
    scratch = SCRATCH.take(_group_rows(rows, offsets) * (5 * hidden + stack.inner + stack.int8_room))
    try:
        status = native.library().fused_stack(
            y.data_ptr(), rows, offsets.data_ptr(), offsets.numel() - 1, hidden, stack.heads, stack.inner,
            len(plans), stack.projections, stack.norms, stack.eps, stack.acts, scratch.data_ptr(),
            torch.get_num_threads(), None if first is None else first.data_ptr(), FUSED_GROUP_ROWS)
    finally:
        SCRATCH.give(scratch)
    if status != 0:
        return None
    return first if first is not None else y


def native_attention(attention: nn.Module, qkv: Tensor, mask: Tensor | None, unpadded: Any) -> Tensor | None:
    """model.SelfAttention's context, (B, T, H) or (R, H) as `qkv` (B, T, 3H) or (R, 3H), from fused_layer.c's
    attention (each sequence and head over its own tokens: no padding computed), or None where it does not apply
    and the attention backend runs: not fp32 on the CPU, gradients wanted, padding left in the rows (`mask`
    without `unpadded`, or a mask with holes), a head width the C code does not take, a single sequence (in
    whole QA requests of one question it ran 0.93x torch's, benchmarks.attention_ab, though a head timed alone
    ran faster). Its values differ from torch's in the last bits (the sums' order: 3e-7 here; tested)."""
    if qkv.dtype != torch.float32 or not qkv.is_cpu or (qkv.requires_grad and torch.is_grad_enabled()):
        return None
    offsets = _sequence_offsets(qkv, mask, unpadded)
    if offsets is None or offsets.numel() <= 2:  # one sequence: torch's (a request of one question ran 0.93x with
        return None                               # this one in its layers, though one head alone times faster)
    qkv = qkv.contiguous()
    hidden = qkv.shape[-1] // 3
    rows = qkv.numel() // (3 * hidden)
    context = torch.empty(*qkv.shape[:-1], hidden, dtype=torch.float32)
    status = native.library().fused_attention(qkv.data_ptr(), rows, offsets.data_ptr(), offsets.numel() - 1, hidden,
                                              attention.num_heads, context.data_ptr(), torch.get_num_threads())
    return context if status == 0 else None


def use_attention(model: nn.Module, kernel: str | None) -> None:
    """The encoder layers' attention through `kernel` (ATTENTION's choice): "native" (native_attention) or torch's
    backend ("sdpa", None), in place."""
    wanted = native_attention if kernel == "native" and native.library() is not None else None
    for layer in encoder_of(model).layers:
        layer.attention.native = wanted


def time_attention(hidden: int, heads: int, shapes: Iterable[tuple[int, int]] | None = None,
                   repeats: int = 7) -> dict[str, dict[str, float]]:
    """Milliseconds of each (sequences, tokens) of `shapes` through a layer's attention: "sdpa", torch's
    scaled_dot_product_attention as model.SelfAttention runs it (without a padding mask, which only adds to
    its time), and "native", fused_layer.c's (native_attention); the two take turns, each keeping the fastest
    of `repeats` rounds. Keyed by the shape's tokens in all."""
    timed: dict[str, dict[str, float]] = {}
    for sequences, tokens in ATTENTION_SHAPES if shapes is None else shapes:
        best = _attention_best(hidden, heads, sequences, tokens, repeats)
        timed[str(sequences * tokens)] = {name: round(1000 * seconds, 4) for name, seconds in best.items()}
    return timed


def _attention_best(hidden: int, heads: int, sequences: int, tokens: int, repeats: int) -> dict[str, float]:
    """time_attention's seconds for one shape: the fastest of `repeats` rounds each, taking turns."""
    lib, width = native.library(), hidden // heads
    qkv = torch.randn(sequences * tokens, 3 * hidden, generator=torch.Generator().manual_seed(tokens))
    offsets = torch.arange(0, sequences * tokens + 1, tokens, dtype=torch.int64)
    context = torch.empty(sequences * tokens, hidden)

    def sdpa() -> None:
        q, k, v = qkv.view(sequences, tokens, 3, heads, width).permute(2, 0, 3, 1, 4)
        F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(sequences * tokens, hidden)

    def own() -> None:
        lib.fused_attention(qkv.data_ptr(), sequences * tokens, offsets.data_ptr(), sequences, hidden, heads,
                            context.data_ptr(), torch.get_num_threads())

    best = {"sdpa": math.inf, "native": math.inf}
    with torch.inference_mode():
        sdpa(), own()  # warm-up
        for _ in range(repeats):
            for name, run in (("sdpa", sdpa), ("native", own)):
                began = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - began)
    return best


def pick_attention(rows: dict[str, dict[str, float]]) -> str:
    """"native" where it is PLAIN_MARGIN faster than torch's over the timed shapes (the geometric mean of its
    times over sdpa's: each shape counts alike), else "sdpa"."""
    if not rows:
        return "sdpa"
    ratio = math.prod(t["native"] / t["sdpa"] for t in rows.values()) ** (1 / len(rows))
    return "native" if ratio < PLAIN_MARGIN else "sdpa"


def pack_linear_layers(model: nn.Module, only: Iterable[str] = PROJECTIONS, kernel: str = "packed") -> nn.Module:
    """Run the projections named in `only` through one kernel (`use_kernels`): oneDNN's packed matmul by
    default (see the module docstring), or "tiled"."""
    return use_kernels(model, {name: (kernel, kernel) for name in only})


# The layers' attention as a kernel choice (choose_kernels): torch's scaled_dot_product_attention ("sdpa") or
# bert_engine's (fused_layer.c: "native") for batches of several sequences (one sequence runs torch's: see
# native_attention), timed at batches of short texts, of 128-token texts and of whole 384-token windows
# (sequences, tokens)
ATTENTION = "attention"
ATTENTION_SHAPES = ((8, 32), (8, 128), (4, 384))
KERNEL_ROWS = (24, 128, 2048)  # rows a kernel is timed on: a visitor's sentence, a long text, a batch of 16 x 128
DECODER_ROWS = (1, 32)  # ... and a decoder: a visitor's mask, a batch of texts' masks
PLAIN_MARGIN = 0.9  # another kernel replaces the incumbent only when at least 10 % faster: not on timing noise
KERNELS = ("packed", "plain", "tiled")
# In a forward pass each projection's weight comes from memory (a model's 24 weight matrices outgrow the
# caches: MiniLM's are 42 MB); timed alone and repeated, it would come from cache. Runs of up to COLD_ROWS
# rows, where that trip is much of the cost, are timed after reading EVICT_BYTES of other memory.
COLD_ROWS = 256
EVICT_BYTES = 64 << 20


def _projections(layer: nn.Module) -> dict[str, tuple[nn.Linear, Any]]:
    return {"qkv": (layer.attention.qkv, None), "out": (layer.attention.out, None),
            "up": (layer.ffn.up, layer.ffn.act), "down": (layer.ffn.down, None)}


def time_kernels(linear: nn.Linear, activation: Any = None, rows: Iterable[int] = KERNEL_ROWS,
                 repeats: int = 5, short_repeats: int = 11) -> dict[str, dict[int, float]]:
    """Seconds (the fastest of `repeats` rounds) for each number of `rows`, of one projection (and its
    activation) as oneDNN's packed matmul with the activation fused ("packed"), as nn.Linear then the
    activation ("plain": MKL's sgemm through addmm) and, for fp32 where it builds and runs (native.py), as
    bert_engine's own AVX2 kernel ("tiled"). The candidates take turns within each round, and each keeps its
    fastest time: a burst of other work on the machine slows a round, not one candidate (timed one after
    the other, a busy moment once made the packed path look twice as slow as it is, and the choice was kept).
    Short runs (COLD_ROWS) start with the weight out of cache, as in a forward pass, and take `short_repeats`
    rounds: at a fraction of a millisecond each, one busy moment of the machine can cover all of five."""
    packed = PackedLinear(linear, activation if activation in PackedLinear._GELU else None)
    after = _identity if activation is None or activation in PackedLinear._GELU else activation
    candidates = {"packed": lambda x: after(packed(x)),
                  "plain": lambda x: (activation or _identity)(F.linear(x, linear.weight, linear.bias))}
    if linear.weight.dtype == torch.float32 and native.library() is not None:
        candidates["tiled"] = TiledLinear(linear, activation)
    times: dict[str, dict[int, float]] = {name: {} for name in candidates}
    other = None
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, linear.in_features, dtype=linear.weight.dtype, generator=torch.Generator().manual_seed(n))
            if n <= COLD_ROWS and other is None:
                other = torch.ones(EVICT_BYTES // 4)
            best = dict.fromkeys(candidates, float("inf"))
            for run in candidates.values():
                run(x)  # warm-up: packing caches, first-touch of the output
            for _ in range(short_repeats if n <= COLD_ROWS else repeats):
                for name, run in candidates.items():
                    if n <= COLD_ROWS:
                        other.sum()
                    start = time.perf_counter()
                    run(x)
                    best[name] = min(best[name], time.perf_counter() - start)
            for name in candidates:
                times[name][n] = best[name]
    return times


def pick_kernel(timings: dict[str, Any], incumbent: str = "packed") -> str | None:
    """The kernel `choose_kernels` keeps from a projection's timings: `incumbent`, unless the fastest other
    one is at least 10 % faster (PLAIN_MARGIN). With times per number of rows ("rows": {"24": {"packed": ms,
    ...}}), each number of rows counts alike (the geometric mean of each kernel's time over the incumbent's):
    a visitor's sentence as much as a batch. Else by the totals ("packed_ms", ...). None for no rows at all."""
    by_rows = timings.get("rows")
    if by_rows is not None and not by_rows:
        return None
    if by_rows:
        kernels = [k for k in KERNELS if all(k in row for row in by_rows.values())]
        incumbent = incumbent if incumbent in kernels else "packed"
        score = {k: math.prod(row[k] / row[incumbent] for row in by_rows.values()) ** (1 / len(by_rows))
                 for k in kernels}
    else:
        incumbent = incumbent if f"{incumbent}_ms" in timings else "packed"
        score = {k: timings[f"{k}_ms"] / timings[f"{incumbent}_ms"] for k in KERNELS if f"{k}_ms" in timings}
    others = {k: v for k, v in score.items() if k != incumbent}
    fastest = min(others, key=others.get, default=None)
    return fastest if fastest is not None and others[fastest] < PLAIN_MARGIN else incumbent


def short_rows_incumbent() -> str:
    """The kernel short inputs keep unless another is 10 % faster: the tiled one on AVX2-only CPUs, where a
    whole MiniLM forward ran 1.08-1.60x faster with it than with oneDNN's at 12-128 tokens in two runs
    (benchmarks/results/avx2/fp32_kernels.json and benchmarks/README.md; a projection timed alone shows less
    of that, and noisily), else oneDNN's packed one."""
    return "tiled" if cpu_isa() == "AVX2" else "packed"


def short_and_long(choice: dict[str, Any]) -> tuple[str | None, str | None]:
    """A projection's choice (choose_kernels') as its kernels for the shortest inputs and for the longest."""
    return choice.get("chose"), choice["past_rows"][-1] if "past_rows" in choice else choice.get("chose")


def choice_tiers(choice: dict[str, Any]) -> tuple:
    """A projection's choice (choose_kernels') as `kernel_tiers`: "chose", then "past_rows" (rows, kernel, ...)."""
    return (choice.get("chose"), *choice.get("past_rows", ()))


def kernel_label(choice: dict[str, Any]) -> str:
    """How a projection's choice reads in the provenance: "tiled", or "tiled up to 256 rows, then packed"
    (or "tiled up to 64 rows, then packed up to 256 rows, then plain")."""
    tiers = choice_tiers(choice)
    return str(tiers[0]) + "".join(f" up to {rows} rows, then {kernel}" for rows, kernel in zip(tiers[1::2], tiers[2::2]))


def _kernel_at(tiers: tuple, rows: int) -> str | None:
    """The kernel `tiers` (kernel_tiers') run an input of `rows` rows through."""
    kernel = tiers[0]
    for bound, after in zip(tiers[1::2], tiers[2::2]):
        if rows > bound:
            kernel = after
    return kernel


def fused_ranges(choice: dict[str, dict[str, Any]]) -> list[tuple[int, float]]:
    """The ranges of rows (low, high]: inputs of low + 1 to high rows, high possibly math.inf) where all four
    projections run the tiled kernel under `choice`, so each layer in one C call."""
    tiers = [choice_tiers(choice.get(name, {})) for name in PROJECTIONS]
    bounds = sorted({0, math.inf, *(bound for t in tiers for bound in t[1::2])})
    ranges: list[tuple[int, float]] = []
    for low, high in zip(bounds, bounds[1:]):
        if all(_kernel_at(t, low + 1) == "tiled" for t in tiers):
            if ranges and ranges[-1][1] == low:
                ranges[-1] = (ranges[-1][0], high)
            else:
                ranges.append((low, high))
    return ranges


FUSION_MARGIN = 1.10  # the matmul time short inputs may give up for their layers to run fused (favour_fusion)
# ... and long ones (batches past COLD_ROWS rows), where the layer's work outside its matmuls is a smaller share: run
# fused with the tiled kernel in groups of sequences, MiniLM's 32x128 fp32 forward took 0.86-0.93x the packed
# modules' time with the tiled matmuls timed at 1.02x the packed ones (AVX2 EPYC, session 37, benchmarks/README.md)
FUSION_MARGIN_LONG = 1.05
# Where the tiled kernel runs at AVX-512's width (native.isa() == 512) and oneDNN's packed kernel stays short inputs'
# incumbent, a layer's four projections run one kernel in each range of rows: up to SHORT_ROWS_WIDE (a visitor's
# sentence, judged on the timings at 24 rows), up to COLD_ROWS (judged at 128), past it; and in front of those the
# tiled kernel, each layer in one C call, as far as whole layers timed that way ran no slower. Whole layers, not
# their matmuls (the Cascade Lake Xeon): a first load on a busy machine timed the four tiled matmuls 1.65x oneDNN's
# at 24 rows where whole forwards ran 1.2-1.8x faster fused (session 41's fresh-clone check), and another timed them
# 1.12x at 128 rows where fused forwards ran 1.09-1.13x faster at 128-160 tokens (sessions 41-42): a matmul timed
# alone cannot show what the one C call saves, and its timings move with the machine's load. So choose_kernels
# times a stack of up to LAYER_STACK of the model's layers (their weights come from memory in turn, as in a forward)
# fused and not, taking turns, at each of LAYER_ROWS rows (time_layers), and fused_reach reads how far fusion pays.
SHORT_ROWS_WIDE = 64
LAYER_ROWS = (16, 32, 64, 96, 128, 160, 192, 256)
LAYER_STACK = 6
LAYER_MARGIN = 1.03  # a loss this small at fewer rows is timing noise, not the end of fusion's reach
LAYER_RETIMES = 2  # times time_layers may time again the row counts whose timings contradict each other
BUSY_SHARE = 0.25  # timings taken while other work used this share of the CPUs or more are taken again ...
BUSY_TRIES = 3  # ... at the next loads, up to this many timings in all; the least busy is kept
KERNEL_CACHE_BYTES = 4 << 20  # a kernel cache file larger than this is not read (one model's entries: ~5 KB)


def cpu_busy_meter(stat: str = "/proc/stat",
                   own: Callable[[], float] = time.process_time) -> Callable[[], float | None]:
    """Starts measuring; the function returned gives the share of CPU time on the CPUs this process may run on
    (os.sched_getaffinity: a container's cpuset, a taskset), since the start, that went to anything but this
    process (`own`: the CPU seconds counted as its own work, by default its own threads'; a benchmark adds the
    peers it starts): other processes, and a virtual machine's steal (the host running other guests on its cores). None
    where `stat` (Linux's per-CPU counters) cannot be read. In a container held to a CPU quota rather than a
    cpuset, the CPUs are all the host's, and so is the work counted. Timings taken beside other work are not the
    machine's: a first load beside a test run once put the fused layers' reach at 32 rows where quiet loads found
    160-192 (session 42), and a busy spell once made the packed path look twice as slow as it is."""
    cpus = cpu_load.affinity_cpus()

    def busy_ticks() -> int | None:
        return cpu_load.busy_ticks(stat, cpus)

    start, cpu, wall = busy_ticks(), own(), time.monotonic()

    def share() -> float | None:
        end = busy_ticks()
        seconds = time.monotonic() - wall
        if start is None or end is None or seconds <= 0:
            return None
        others = (end - start) / os.sysconf("SC_CLK_TCK") - (own() - cpu)
        return min(1.0, max(0.0, others / (seconds * (len(cpus) if cpus else os.cpu_count() or 1))))

    return share


def _unsettled(found: dict) -> bool:
    """Whether kept timings were taken while other work used BUSY_SHARE of the CPUs or more, and fewer than
    BUSY_TRIES loads have timed them: the next load times them again."""
    busy = found.get("busy")  # (an entry _kept_timings passed: a share in [0, 1] or None, a count in 1 .. BUSY_TRIES)
    return busy is not None and busy >= BUSY_SHARE and found.get("tries", 1) < BUSY_TRIES


def _timed(timing: Callable[[], dict], before: dict | None) -> dict:
    """The cache entry `timing()` makes, with the share of the CPUs other work used meanwhile ("busy") and how
    many loads have timed it ("tries"). `before`: the entry it times again (`_unsettled`), kept instead where it
    was the less busy of the two."""
    share = cpu_busy_meter()
    entry = timing()
    busy = share()
    tries = before.get("tries", 1) + 1 if before is not None else 1
    if before is not None and busy is not None and before["busy"] <= busy:
        entry = dict(before)
    else:
        entry["busy"] = None if busy is None else round(busy, 3)
    entry["tries"] = tries
    return entry


def _say_busy(timed: list[tuple[str, dict]], cache: Path | None) -> None:
    """One log line for the entries timed at this load while other work used BUSY_SHARE of the CPUs or more: to be
    timed again at the next load (INFO), or, after BUSY_TRIES such timings, kept as they are (a WARNING: deleting
    the cache file times them again)."""
    for last in (False, True):
        busy = [(what, e) for what, e in timed if e["busy"] is not None and e["busy"] >= BUSY_SHARE
                and (e["tries"] >= BUSY_TRIES) == last]
        if not busy:
            continue
        low, high = min(round(100 * e["busy"]) for _, e in busy), max(round(100 * e["busy"]) for _, e in busy)
        share = f"{low} %" if low == high else f"{low}-{high} %"
        names = ", ".join(what for what, _ in busy)
        if last:
            logger.warning("kernel timings (%s) taken while other work used %s of the CPUs at %d loads: kept as they "
                           "are; delete %s to time them again on a quiet machine", names, share, BUSY_TRIES,
                           cache or "the kernel cache")
        else:
            logger.info("kernel timings (%s) taken while other work used %s of the CPUs: timed again at the next "
                        "load (%d of %d)", names, share, min(e["tries"] for _, e in busy) + 1, BUSY_TRIES)


def favour_fusion(choice: dict[str, dict[str, Any]]) -> None:
    """Kernels chosen projection by projection (choose_kernels) cannot see that a layer whose four projections
    all run the tiled kernel runs in one C call: 25 % faster than the modules around the same matmuls at 24
    tokens, AVX2 EPYC (benchmarks/README.md, session 36), 7-14 % on a 32x128 batch (session 37). So where the
    tiled kernel is short inputs' incumbent (AVX2-only CPUs) and was timed for all four, and all four on it
    would cost the layer's matmuls at most FUSION_MARGIN over the choices for short inputs (summed over the
    projections, each number of rows alike; and where it was kept for some of them), or FUSION_MARGIN_LONG for
    long ones, all four take it for those inputs: one noisy timing at first load no longer turns fusion off
    for good. Where the tiled kernel runs at AVX-512's width instead, inputs take it in front of the choices as far
    as whole layers timed fused ran no slower (choose_kernels' "layer_rows"), and at every length a layer's four
    projections run one kernel (`_favour_fusion_wide`). Elsewhere nothing changes."""
    if not settings.get("BERT_ENGINE_FUSED_LAYERS"):
        return
    if any(name not in choice or "rows" not in choice[name] for name in PROJECTIONS):
        return
    if short_rows_incumbent() != "tiled":
        _favour_fusion_wide(choice)
        return
    kernels = {name: short_and_long(choice[name]) for name in PROJECTIONS}
    short = [kernels[name][0] for name in PROJECTIONS]
    if "tiled" in short and not all(kernel == "tiled" for kernel in short) and _fusing_costs_little(
            choice, short, lambda n: n <= COLD_ROWS, FUSION_MARGIN):
        short = ["tiled"] * len(PROJECTIONS)
    long = [kernels[name][1] for name in PROJECTIONS]
    if short == ["tiled"] * len(PROJECTIONS) and not all(kernel == "tiled" for kernel in long) and _fusing_costs_little(
            choice, long, lambda n: n > COLD_ROWS, FUSION_MARGIN_LONG):
        long = ["tiled"] * len(PROJECTIONS)
    for name, short_kernel, long_kernel in zip(PROJECTIONS, short, long):
        entry = choice[name]
        entry.pop("past_rows", None)
        entry["chose"] = short_kernel
        if long_kernel != short_kernel:
            entry["past_rows"] = [COLD_ROWS, long_kernel]


def _favour_fusion_wide(choice: dict[str, dict[str, Any]]) -> None:
    """favour_fusion where the tiled kernel is AVX-512 wide. There a layer's four projections run one kernel in
    each range of rows (_unfused_wide_tiers: the one all four pick, else packed): a layer of mixed kernels lost to
    the all-packed one in whole forwards although each projection, timed alone, chose its own as faster (on the
    Cascade Lake Xeon, session 41, benchmarks/README.md: out and down tiled, 0.91-0.93x at 96-160 tokens; out on
    MKL's, 0.92-0.95x). In front of them the tiled kernel runs, each layer in one C call, up to the most rows at
    which whole layers timed that way ran no slower (choose_kernels' "layer_rows", time_layers; fused_reach).
    Without such timings (layers choose_kernels could not time), nothing runs fused."""
    if not _wide(choice):
        return
    unfused = _unfused_wide_tiers(choice)
    if unfused:
        _set_tiers(choice, _with_fusion(fused_reach(choice[PROJECTIONS[0]].get("layer_rows") or {}), unfused))


def _wide(choice: dict[str, dict[str, Any]]) -> bool:
    """Whether favour_fusion's AVX-512 rule applies: fused layers on, packed short inputs' incumbent, and the tiled
    kernel at AVX-512's width, timed for all four projections at every number of rows."""
    if not settings.get("BERT_ENGINE_FUSED_LAYERS") or short_rows_incumbent() == "tiled":
        return False
    timed = all(name in choice and "rows" in choice[name] and choice[name]["rows"] for name in PROJECTIONS) and all(
        "tiled" in row for name in PROJECTIONS for row in choice[name]["rows"].values())
    return timed and native.isa() == 512  # (timed: the library is loaded, so asking its width builds nothing)


def _set_tiers(choice: dict[str, dict[str, Any]], tiers: list) -> None:
    for name in PROJECTIONS:
        choice[name]["chose"] = tiers[0]
        choice[name].pop("past_rows", None)
        if len(tiers) > 1:
            choice[name]["past_rows"] = tiers[1:]


def _unfused_wide_tiers(choice: dict[str, dict[str, Any]]) -> list:
    """The tiers a layer's four projections take where it does not run fused (AVX-512): in each range of rows (up
    to SHORT_ROWS_WIDE, up to COLD_ROWS, past it) the kernel all four pick from their timings there (pick_kernel;
    up to COLD_ROWS between packed and plain, as four tiled ones would run fused), else packed. [] untimed."""
    ranges = ((0, lambda n: n <= SHORT_ROWS_WIDE), (SHORT_ROWS_WIDE, lambda n: SHORT_ROWS_WIDE < n <= COLD_ROWS),
              (COLD_ROWS, lambda n: n > COLD_ROWS))
    tiers: list = []
    for low, judged in ranges:
        rows = [{n: {k: ms for k, ms in t.items() if k != "tiled" or low == COLD_ROWS}
                 for n, t in choice[name]["rows"].items() if judged(int(n))} for name in PROJECTIONS]
        if not all(rows):  # no row count timed for this range: the next range's kernel reaches down
            continue
        agreed = {pick_kernel({"rows": r}) for r in rows}
        kernel = agreed.pop() if len(agreed) == 1 else "packed"
        if not tiers or tiers[-1] != kernel:
            tiers += [low, kernel] if tiers else [kernel]
    return tiers


def fused_reach(layer_rows: dict[str, dict[str, float]]) -> int:
    """Up to how many rows layers run fused, from whole-layer timings (time_layers'): the most rows timed at which
    the fused stack ran no slower than the other, with none at fewer rows more than LAYER_MARGIN slower. 0: none."""
    reach = 0
    for n in sorted(layer_rows, key=int):
        ratio = layer_rows[n]["fused"] / layer_rows[n]["unfused"]
        if ratio > LAYER_MARGIN:
            break
        if ratio <= 1.0:
            reach = int(n)
    return reach


def _with_fusion(reach: int, unfused: list) -> list:
    """Tiers: the tiled kernel (so each layer in one C call) up to `reach` rows, then `unfused`'s kernels past it."""
    if reach <= 0:
        return list(unfused)
    tiers = ["tiled"]
    bounds = [0, *unfused[1::2], math.inf]
    for low, high, kernel in zip(bounds, bounds[1:], unfused[::2]):
        if high > reach and tiers[-1] != kernel:
            tiers += [max(low, reach), kernel]
    return tiers


def time_layers(layers: Iterable[nn.Module], unfused: Iterable, rows: Iterable[int] = LAYER_ROWS,
                repeats: int = 5, short_repeats: int = 15) -> dict[str, dict[str, float]]:
    """Milliseconds of one sequence of each number of `rows` through a stack of copies of up to LAYER_STACK of
    `layers`: "fused", all four projections on the tiled kernel and the layers in one C call (fused_stack, as a
    forward runs them: timed one call a layer, the Python between the calls hid the fused layers' gain at a
    visitor's lengths), and "unfused", on the
    kernels of the tiers `unfused`. The two take turns in each round; each stack's weights come from memory after
    the other's, as in a forward. Each keeps the fastest of `repeats` rounds, or of `short_repeats` up to
    SHORT_ROWS_WIDE rows, where a round takes a few milliseconds and one busy spell could cover all five (a first
    load beside a test run once put the reach at 32 rows, where quiet ones found 160-192: the fresh-clone check,
    session 42). Row counts whose timings contradict each other (`_contradicted`) take `short_repeats` rounds more,
    up to LAYER_RETIMES times. {} where the layers cannot run fused (an activation or norm fused_layer.c lacks)."""
    import copy  # noqa: PLC0415 - only a first load on a machine times layers

    rows = tuple(rows)
    stacks: dict[str, list[nn.Module]] = {}
    for variant, tiers in (("fused", ("tiled",)), ("unfused", tuple(unfused))):
        stacks[variant] = []
        for layer in list(layers)[:LAYER_STACK]:
            twin = copy.deepcopy(layer).eval()
            _swap_layer(twin, dict.fromkeys(PROJECTIONS, tiers))
            stacks[variant].append(twin)
    hidden = stacks["fused"][0].attention_norm.normalized_shape[0]
    if not rows or any(_plan(layer, rows[0], hidden) is None for layer in stacks["fused"]):
        return {}
    best = {n: dict.fromkeys(stacks, math.inf) for n in rows}
    dtype = next(stacks["fused"][0].parameters()).dtype

    holder = types.SimpleNamespace()  # (where fused_stack keeps its plan of the fused twins)

    def forward(stack: list[nn.Module], x: Tensor) -> None:
        if stack is stacks["fused"] and fused_stack(holder, stack, x, None, None) is not None:
            return
        for layer in stack:
            x = layer(x, None)[0]

    def rounds(n: int, count: int) -> None:
        x = torch.randn(1, n, hidden, dtype=dtype, generator=torch.Generator().manual_seed(n))
        for stack in stacks.values():
            forward(stack, x)  # warm-up: first-touch of the outputs and the scratch pool
        for _ in range(count):
            for variant, stack in stacks.items():
                start = time.perf_counter()
                forward(stack, x)
                best[n][variant] = min(best[n][variant], time.perf_counter() - start)

    with torch.inference_mode():
        for n in rows:
            rounds(n, short_repeats if n <= SHORT_ROWS_WIDE else repeats)
        for retime in range(1, LAYER_RETIMES + 2):
            again = _contradicted(best)
            if not again:
                break
            if retime > LAYER_RETIMES:
                logger.info("whole layers: the timings at %s rows still contradict each other after %d more timings; "
                            "kept as they are", ", ".join(map(str, again)), LAYER_RETIMES)
                break
            logger.info("whole layers: the timings at %s rows contradict each other; timed again (%d of %d)",
                        ", ".join(map(str, again)), retime, LAYER_RETIMES)
            for n in again:
                rounds(n, short_repeats)
    return {str(n): {variant: round(1000 * seconds, 4) for variant, seconds in best[n].items()} for n in rows}


def _contradicted(best: dict[int, dict[str, float]]) -> list[int]:
    """The row counts whose whole-layer timings (time_layers' `best`) contradict each other: the first where the
    fused stack lost by more than LAYER_MARGIN, which would end fusion's reach there, and those past it where it
    won. Its lead shrinks as rows grow, so a loss between wins is more likely a busy moment than the end of the
    reach (a quiet first load on the Cascade Lake Xeon lost by 13 % at 96 rows, then won by 0-10 % at 128-256,
    and put the reach at 64 where other loads found 160-192: session 43); time_layers times them again. []: none."""
    ratios = [(n, best[n]["fused"] / best[n]["unfused"]) for n in sorted(best)]
    for i, (n, ratio) in enumerate(ratios):
        if ratio > LAYER_MARGIN:
            won = [m for m, later in ratios[i + 1:] if later <= 1.0]
            return [n, *won] if won else []
    return []


def _fusing_costs_little(choice: dict[str, dict[str, Any]], chosen: list[str], counts_taken, margin: float) -> bool:
    """Whether all four projections on the tiled kernel cost their matmuls at most `margin` times the `chosen`
    kernels, at the timed row counts `counts_taken` accepts (a geometric mean over them)."""
    rows = [{n: t for n, t in choice[name]["rows"].items() if counts_taken(int(n))} for name in PROJECTIONS]
    counts = set.intersection(*(set(r) for r in rows))
    if not counts or not all("tiled" in r[n] and kernel in r[n] for r in rows for n in counts for kernel in chosen):
        return False

    def layer(kernels: list[str]) -> float:
        return math.prod(sum(r[n][k] for r, k in zip(rows, kernels)) for n in counts) ** (1 / len(counts))

    return layer(["tiled"] * len(PROJECTIONS)) <= margin * layer(chosen)


# How the fused layers run, in the words of fused_label (`bert-engine info --kernels`, the provenance): every layer
# in C, all of them in one call (fused_stack) unless something between them is asked for.
FUSED_WORDS = "the layers in one C call (one call per layer where hidden states, attentions or a hook between layers are asked for)"


def fused_label(choice: dict[str, dict[str, Any]]) -> str:
    """Where the fused layer (fused_layer.c) runs under `choice` (choose_kernels' answer), in words: it needs
    all four projections on the tiled kernel at the input's number of rows."""
    if not settings.get("BERT_ENGINE_FUSED_LAYERS"):
        return "off (BERT_ENGINE_FUSED_LAYERS=0)"
    ranges = fused_ranges(choice)
    if not ranges:
        never = [name for name in PROJECTIONS if "tiled" not in choice_tiers(choice.get(name, {}))[::2]]
        if never:
            return f"not used: {', '.join(never)} {'does' if len(never) == 1 else 'do'} not run the tiled kernel"
        return "not used: the four projections never run the tiled kernel at the same number of rows"
    words = ["every input" if (low, high) == (0, math.inf) else f"inputs of up to {high} rows" if low == 0
             else f"inputs past {low} rows" if high == math.inf else f"inputs of {low + 1} to {high} rows"
             for low, high in ranges]
    return f"{' and '.join(words)}: {FUSED_WORDS}"


def int8_fused_label(model: nn.Module | None = None, kernel: str | None = None) -> str:
    """Where an int8 model's layers run as one C call (fused_layer.c with int8_matmul.c), in words: of `model` as
    quantised, or, without one, of a model `--precision int8` would quantise with the int8 `kernel`
    (`bert-engine info --kernels`: every layer fuses where the kernel is tiled)."""
    if not settings.get("BERT_ENGINE_FUSED_LAYERS"):
        return "off (BERT_ENGINE_FUSED_LAYERS=0)"
    if model is not None:
        layers = encoder_of(model).layers
        fused = len(layers) > 0 and all(getattr(layer, "fused", None) is fused_layer for layer in layers)
        kernel = getattr(model, "int8_kernel", None)
    else:
        fused = kernel == "tiled"
    if fused:
        return f"every input: {FUSED_WORDS}"
    return f"not used: the int8 matmuls are {kernel}'s" if kernel != "tiled" else "not used: a projection stays fp32"


def _kept_timings(found: Any, columns: tuple[str, ...], empty: bool = False) -> bool:
    """Whether a kernel cache entry holds usable timings: {"rows": {"<rows>": {column: ms > 0, ...}, ...}, ...}
    with every one of `columns` (`empty`: no rows at all is an answer too), and its other figures what they say:
    milliseconds ("..._ms") finite and positive, "busy" a share in [0, 1], "tries" a count up to BUSY_TRIES. A file
    edited by hand, or written by another version, is timed again rather than read into a crash (or into a NaN
    that `info --kernels` refuses to print)."""
    rows = found.get("rows") if isinstance(found, dict) else None
    if not isinstance(rows, dict) or not (rows or empty):
        return False

    def number(v: Any, low: float, high: float) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high

    def ms(v: Any) -> bool:  # a time: finite and positive
        return number(v, 0, math.inf) and 0 < v < math.inf

    if not all(ms(v) for k, v in found.items() if k.endswith("_ms")):
        return False
    if found.get("busy") is not None and not number(found["busy"], 0, 1):  # (how busy the machine was: a share)
        return False
    if "tries" in found and not (isinstance(found["tries"], int) and number(found["tries"], 1, BUSY_TRIES)):
        return False
    return all(isinstance(n, str) and n.isdigit() and isinstance(t, dict) and all(
        ms(t.get(c)) for c in columns) for n, t in rows.items())


def _kernel_entry(linear: nn.Linear, activation: Any, rows: tuple[int, ...], tiled: str | None) -> dict:
    """A projection's kernel cache entry: each kernel's milliseconds per number of rows (time_kernels), summed,
    and the tiled kernel's build."""
    timed = time_kernels(linear, activation, rows)
    entry: dict[str, Any] = {f"{kernel}_ms": round(1000 * sum(by_rows.values()), 3) for kernel, by_rows in timed.items()}
    entry["rows"] = {str(n): {kernel: round(1000 * timed[kernel][n], 4) for kernel in timed} for n in rows}
    return entry | ({"tiled_build": tiled} if tiled else {})


def timing_threads() -> int:
    """The threads the kernels are timed on: torch's, but no more than the container's CPU limit (its cgroup quota,
    rounded: cpu_load.FREE_CPUS.limit). On more threads than the quota pays for, a timing of a few hundred
    milliseconds spends most periods throttled, waiting out the rest of the period, and would pick kernels by
    that: 16 threads under a 2-CPU limit run about 12 ms of each 100. torch's where BERT_ENGINE_SHARE_CPUS is off
    (the forwards then run on every thread too)."""
    threads = torch.get_num_threads()
    limit = cpu_load.FREE_CPUS.limit
    if limit is None or not settings.get("BERT_ENGINE_SHARE_CPUS"):
        return threads
    return max(1, min(threads, limit))


def choose_kernels(model: nn.Module, cache: Path | None = None) -> dict[str, dict[str, Any]]:
    """The kernels of `model`'s projections on this machine (_choose_kernels), timed on timing_threads(): within
    the container's CPU limit, whatever torch's own thread count."""
    before, threads = torch.get_num_threads(), timing_threads()
    if threads == before:
        return _choose_kernels(model, cache)
    logger.info("kernels timed on %d thread(s), the container's CPU limit, not torch's %d", threads, before)
    torch.set_num_threads(threads)
    try:
        return _choose_kernels(model, cache)
    finally:
        torch.set_num_threads(before)


def _choose_kernels(model: nn.Module, cache: Path | None = None) -> dict[str, dict[str, Any]]:
    """For each projection of the encoder's layers (all layers share the shapes), with the timings: the
    kernel for inputs of up to COLD_ROWS rows ("chose") and, where another, for longer ones ("past_rows"),
    among the packed oneDNN, the plain MKL and (fp32, where it runs) the tiled AVX2 kernel on this machine:
    the incumbent (short_rows_incumbent for short inputs, packed for long ones) unless another is
    PLAIN_MARGIN faster (pick_kernel); where the tiled kernel is AVX-512 wide, whole layers too (time_layers:
    fused, and on the kernels they would run unfused), which set how far the layers run fused (favour_fusion).
    Timed once per CPU, torch version, threads, dtype and shape, and kept in `cache` (a JSON file; None: not
    kept)."""
    encoder = encoder_of(model)
    if not can_pack(model) or not len(encoder.layers):
        return {}
    stored: dict[str, Any] = {}
    if cache is not None and cache.is_file():
        try:
            if cache.stat().st_size <= KERNEL_CACHE_BYTES:  # (larger: not ours, or edited past use; started afresh)
                stored = json.loads(cache.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # (RecursionError: JSON nested past the parser's depth)
            stored = {}
    if not isinstance(stored, dict):  # (a JSON list, say: nothing of ours)
        stored = {}
    machine = f"{cpu_name()}|{cpu_isa()}|torch {torch.__version__}|{torch.get_num_threads()} threads"
    choice, changed, timed = {}, False, []
    candidates = {name: (linear, activation, KERNEL_ROWS) for name, (linear, activation)
                  in _projections(encoder.layers[0]).items()}
    heads = mlm_heads(model)
    if heads:
        candidates[DECODER] = (heads[0].decoder, DECODER, DECODER_ROWS)
    for name, (linear, activation, rows) in candidates.items():
        if not isinstance(linear, nn.Linear):
            continue
        act = activation if isinstance(activation, str) else (
            getattr(activation, "__name__", type(activation).__name__) if activation is not None else "none")
        key = f"{machine}|{linear.weight.dtype}|{linear.in_features}x{linear.out_features}|{act}"
        tiled = native.build() if linear.weight.dtype == torch.float32 else None
        found = stored.get(key, {})
        columns = ("packed", "plain", "tiled") if tiled else ("packed", "plain")
        kept = _kept_timings(found, columns) and not (tiled and found.get("tiled_build") != tiled)  # another build's
        if not kept or _unsettled(found):
            timing = partial(_kernel_entry, linear, None if isinstance(activation, str) else activation, rows, tiled)
            found = stored[key] = _timed(timing, found if kept else None)
            timed.append((name, found))
            changed = True
        if not tiled:  # timed where the kernel ran, read where it does not (a shared cache, CC unset)
            found = {k: v for k, v in found.items() if k not in ("tiled_ms", "tiled_build")}
            found["rows"] = {n: {k: ms for k, ms in row.items() if k != "tiled"} for n, row in found["rows"].items()}
        short = pick_kernel({"rows": {n: t for n, t in found["rows"].items() if int(n) <= COLD_ROWS}},
                            short_rows_incumbent())
        long = pick_kernel({"rows": {n: t for n, t in found["rows"].items() if int(n) > COLD_ROWS}}) or short
        choice[name] = {**found, "chose": short, **({"past_rows": [COLD_ROWS, long]} if long != short else {})}
    if _wide(choice) and all(isinstance(linear, nn.Linear) for linear, _ in _projections(encoder.layers[0]).values()):
        layer = encoder.layers[0]
        unfused = _unfused_wide_tiers(choice)
        key = (f"{machine}|{layer.ffn.up.weight.dtype}|{min(len(encoder.layers), LAYER_STACK)} layers|"
               f"{layer.ffn.up.in_features}x{layer.ffn.up.out_features}|{layer.attention.num_heads} heads|"
               f"{getattr(layer.ffn.act, '__name__', type(layer.ffn.act).__name__)}")
        found = stored.get(key, {})
        kept = (_kept_timings(found, ("fused", "unfused"), empty=True) and found.get("tiled_build") == native.build()
                and found.get("unfused") == unfused)
        if not kept or _unsettled(found):
            def timing() -> dict:
                return {"rows": time_layers(encoder.layers, unfused), "unfused": unfused, "tiled_build": native.build()}

            found = stored[key] = _timed(timing, found if kept else None)
            timed.append(("whole layers", found))
            changed = True
        for name in PROJECTIONS:
            choice[name]["layer_rows"] = found["rows"]
            choice[name]["layer_timed"] = {k: found.get(k) for k in ("busy", "tries")}
    favour_fusion(choice)
    layer = encoder.layers[0]
    if native.build() is not None and layer.attention_norm.weight.dtype == torch.float32:
        hidden, heads = layer.attention_norm.normalized_shape[0], layer.attention.num_heads
        key = f"{machine}|attention|{hidden} wide|{heads} heads"
        found = stored.get(key, {})
        kept = _kept_timings(found, ("sdpa", "native")) and found.get("tiled_build") == native.build()
        if not kept or _unsettled(found):
            def timing() -> dict:
                return {"rows": time_attention(hidden, heads), "tiled_build": native.build()}

            found = stored[key] = _timed(timing, found if kept else None)
            timed.append(("attention", found))
            changed = True
        choice[ATTENTION] = {**found, "chose": pick_attention(found["rows"])}
    _say_busy(timed, cache)
    if changed and cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            written = cache.with_suffix(f".{os.getpid()}.partial")
            written.write_text(json.dumps(stored, indent=1), encoding="utf-8")
            os.replace(written, cache)
        except OSError as err:  # a read-only home: the choice holds for this process
            logger.info("kernel timings not kept in %s: %s", cache, err)
    return choice


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere platform's answer)."""
    cpuinfo = Path("/proc/cpuinfo")
    try:
        lines = cpuinfo.read_text(encoding="utf-8").splitlines() if cpuinfo.is_file() else []
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The instruction sets the kernels can use: torch's dispatch level and AMX ("AVX512+AMX", "AVX2"). A
    model name alone does not tell them apart (a VM's "AMD EPYC" is an AVX2 Zen 2/3 or an AVX-512 Zen 4)."""
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return torch.backends.cpu.get_cpu_capability() + ("+AMX" if amx else "")


def _identity(x: Tensor) -> Tensor:
    return x


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (Inductor) would build its kernels with, or None
    where it finds none (it looks for g++ unless torch._inductor.config.cpp.cxx names another)."""
    try:
        from torch._inductor import cpp_builder  # noqa: PLC0415 - loads Inductor, only when compile is asked for

        return cpp_builder.get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - InvalidCxxCompiler, or an Inductor that cannot load here
        logger.debug("no C++ compiler for torch.compile: %s", err)
        return None


def compile_encoder(model: nn.Module) -> nn.Module:
    """torch.compile each encoder layer (dynamic shapes); the first calls of each shape are slow."""
    encoder = encoder_of(model)
    for i, layer in enumerate(encoder.layers):
        encoder.layers[i] = torch.compile(layer, dynamic=True)
    return model
