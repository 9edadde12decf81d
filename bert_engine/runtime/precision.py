"""Numeric precisions: one table of what each name means, where it runs, what the CPU must support,
and how a model is prepared for it; plus the device choice and the CPU-capability probe.

Inference (Predictor, CLI --precision, BERT_ENGINE_PRECISION), training (--precision) and the
benchmarks all ask this module; adding a precision is one row of PRECISIONS. The kernels themselves
(packed oneDNN linears, int8 quantisation) live in fast.py.

"auto" is fp32 on the CPU (exact parity with the reference), bf16 on GPUs that support it, else fp16.
A CPU precision is allowed only where the CPU has it natively: bf16 needs AVX512-BF16 or AMX, fp16
needs AMX-FP16. Elsewhere the request is refused with PrecisionError naming what is missing, instead
of running emulated (slower than fp32) or failing inside oneDNN.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import settings
from ..model import BertModel
from . import fast, native

logger = logging.getLogger(__name__)


class PrecisionError(ValueError):
    """A precision that does not exist, or that this device or CPU cannot run."""


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: torch.dtype          # the parameters' dtype (int8 keeps fp32 outside its quantised linears)
    devices: tuple[str, ...]    # device types it runs on
    cpu_feature: str | None     # CpuCapability field that must be true on a CPU (None: any CPU)
    prepare: str                # "pack" (CPU: pre-packed oneDNN linears), "quantize" (dynamic int8) or "none"
    autocast: bool              # usable as a training autocast dtype


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", torch.float32, ("cpu", "cuda", "mps"), None, "pack", autocast=False),
    Precision("bf16", torch.bfloat16, ("cpu", "cuda"), "bf16", "pack", autocast=True),
    Precision("fp16", torch.float16, ("cpu", "cuda", "mps"), "fp16", "none", autocast=True),
    Precision("int8", torch.float32, ("cpu",), None, "quantize", autocast=False),
)}
NAMES = ("auto", *PRECISIONS)
TRAINING_NAMES = ("auto", *(name for name, p in PRECISIONS.items() if p.prepare != "quantize"))  # int8 is inference-only

CAPABILITY_ENV = "BERT_ENGINE_CPU_CAPABILITY"  # "avx2" or "default": behave as on a lesser CPU (tests, checks)


@dataclass(frozen=True)
class CpuCapability:
    """What this CPU offers, as the precision rules need it."""

    isa: str        # torch's dispatch level: "AVX512", "AVX2", "DEFAULT" (or another architecture's)
    bf16: bool      # native bf16 matmul: AVX512-BF16 or AMX, and oneDNN's bf16 path usable
    fp16: bool      # native fp16 matmul: AMX-FP16, and oneDNN's fp16 path usable
    amx: bool
    vnni: bool      # int8 dot products (AVX512-VNNI / AVX-VNNI)

    def describe(self) -> str:
        extras = [name for name, on in (("AVX512-BF16/AMX bf16", self.bf16), ("AMX-FP16", self.fp16),
                                        ("AMX", self.amx), ("VNNI", self.vnni)) if on]
        return self.isa + (" + " + ", ".join(extras) if extras else "")


@functools.lru_cache(maxsize=1)
def _probe_cpu() -> CpuCapability:
    cpu = torch.cpu
    flag = lambda name: bool(getattr(cpu, name, lambda: False)())  # noqa: E731 - private probes, absent on some builds
    mkldnn = torch.ops.mkldnn
    onednn_bf16 = bool(getattr(mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    onednn_fp16 = bool(getattr(mkldnn, "_is_mkldnn_fp16_supported", lambda: False)())
    amx = flag("_is_amx_tile_supported")
    return CpuCapability(
        isa=torch.backends.cpu.get_cpu_capability(),
        bf16=onednn_bf16 and (flag("_is_avx512_bf16_supported") or amx),
        fp16=onednn_fp16 and flag("_is_amx_fp16_supported"),
        amx=amx,
        vnni=flag("_is_vnni_supported"),
    )


def cpu_capability() -> CpuCapability:
    """This CPU's capability; BERT_ENGINE_CPU_CAPABILITY=avx2 (or default) makes it report less, never more."""
    real = _probe_cpu()
    try:
        pretend = native.capability_setting()  # the C kernels' reading of the same setting, one check for both
    except ValueError as err:
        raise PrecisionError(str(err)) from None
    if not pretend:
        return real
    isa = "AVX2" if pretend == "avx2" and real.isa in ("AVX2", "AVX512") else "DEFAULT"
    return CpuCapability(isa=isa, bf16=False, fp16=False, amx=False, vnni=False)


def pick_device(preference: str | torch.device | None = None) -> torch.device:
    """The given device, else BERT_ENGINE_DEVICE's, else CUDA, then Apple MPS, then CPU.

    Raises:
        ValueError: `preference` names no device, or one this machine (or this build of torch) does not have.
    """
    if preference is not None and preference != "":  # 0 is a device (cuda:0), not "pick one"
        return _present(preference)
    forced = settings.get("BERT_ENGINE_DEVICE")
    if forced:
        try:
            return _present(forced)
        except ValueError as err:
            raise ValueError(f"BERT_ENGINE_DEVICE: {err}") from None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def device_for(precision: str, preference: str | torch.device | None = None) -> torch.device:
    """pick_device, except that a precision that runs on the CPU alone (int8) picks the CPU when no device is
    named: `pipeline(task, precision="int8")` on a machine with a GPU runs int8 on its CPU, as asked."""
    spec = PRECISIONS.get(precision)
    if (preference is None or preference == "") and spec is not None and spec.devices == ("cpu",):
        return torch.device("cpu")
    return pick_device(preference)


def setting_precision() -> str:
    """BERT_ENGINE_PRECISION, checked on the device it would run on (BERT_ENGINE_DEVICE, else pick_device's): the
    app and the CLI commands that predict read it so, and a refusal names the variable.

    Raises:
        PrecisionError: a name that is not a precision, or one this machine cannot run, after the variable's name."""
    precision = settings.get("BERT_ENGINE_PRECISION")
    try:
        resolve(precision, device_for(precision, settings.get("BERT_ENGINE_DEVICE") or None))
    except PrecisionError as err:
        raise PrecisionError(f"BERT_ENGINE_PRECISION: {err}") from None
    return precision


def _present(preference: str | torch.device) -> torch.device:
    """`preference` as a device, checked to exist here (torch itself fails later with an AssertionError)."""
    if isinstance(preference, int) and not isinstance(preference, bool):
        preference = "cpu" if preference == -1 else f"cuda:{preference}"  # transformers' integers: -1 the CPU
    if not isinstance(preference, (str, torch.device)):
        raise ValueError(f"device must be a name such as 'cpu', 'cuda' or 'cuda:1', got {type(preference).__name__}")
    try:
        device = torch.device(preference)
    except RuntimeError:
        raise ValueError(f"device {str(preference)[:40]!r} is not a device name (cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(preference)!r}: {why}; use 'cpu' or leave the device out")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(preference)!r}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), numbered from 0")
    elif device.type == "mps" and not (getattr(torch.backends, "mps", None) is not None
                                       and torch.backends.mps.is_available()):
        raise ValueError(f"device {str(preference)!r}: Apple's MPS is not available here; use 'cpu'")
    elif device.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"device {str(preference)!r}: not a device the engine runs on (cpu, cuda, mps)")
    return device


def resolve(name: str, device: torch.device) -> Precision:
    """The concrete precision `name` means on `device` ("auto" decided here), after checking it can run.

    Raises:
        PrecisionError: an unknown name, a device it does not run on, or a CPU without the native support.
    """
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            name = "fp16" if device.type == "mps" else "fp32"
    precision = PRECISIONS.get(name)
    if precision is None:
        raise PrecisionError(f"precision {name!r} is not one of {', '.join(NAMES)}")
    if device.type not in precision.devices:
        where = ", ".join(precision.devices)
        raise PrecisionError(f"precision {name!r} runs on {where} only, not on {device}")
    if device.type == "cpu" and precision.cpu_feature and not getattr(cpu_capability(), precision.cpu_feature):
        needs = {"bf16": "AVX512-BF16 or AMX", "fp16": "AMX-FP16"}[precision.cpu_feature]
        raise PrecisionError(f"precision {name!r} needs a CPU with {needs}; this one has {cpu_capability().describe()} "
                             f"and would only emulate it, slower than fp32: use fp32 (or int8 for speed)")
    return precision


def parameter_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype a model's parameters take for precision `name` on `device` (checks it first)."""
    return resolve(name, device).dtype


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The training autocast dtype for precision `name` (None: plain fp32). "auto" autocasts on GPUs only."""
    if name not in TRAINING_NAMES:
        raise PrecisionError(f"training precision {name!r} is not one of {', '.join(TRAINING_NAMES)}")
    precision = resolve(name, device)
    return precision.dtype if precision.autocast else None


def kernel_cache() -> Path:
    """Where the kernel timings of `fast.choose_kernels` are kept (BERT_ENGINE_KERNEL_CACHE)."""
    return Path(settings.get("BERT_ENGINE_KERNEL_CACHE") or Path.home() / ".cache" / "bert_engine" / "kernels.json")


def check_kernel_setting() -> str:
    """BERT_ENGINE_KERNELS, after raising PrecisionError on a value that is not a kernel, or on "tiled" where
    bert_engine's AVX2 kernel cannot run (the app checks this at start-up; every load checks it again)."""
    kernels = settings.get("BERT_ENGINE_KERNELS")
    if kernels not in ("auto", *fast.KERNELS):
        raise PrecisionError(f"BERT_ENGINE_KERNELS={kernels!r} is not one of auto, {', '.join(fast.KERNELS)}")
    if kernels == "tiled" and native.library() is None:
        raise PrecisionError(f"BERT_ENGINE_KERNELS=tiled: bert_engine's AVX2 kernel cannot run here: "
                             f"{native.unavailable()}")
    return kernels


def _choose_kernels(model: nn.Module, names: tuple[str, ...]) -> None:
    """Swap the linear layers `names` (fast.KERNEL_CHOICES) for the kernel BERT_ENGINE_KERNELS says: "auto" the
    fastest of oneDNN (packed), MKL (plain) and bert_engine's AVX2 kernel (tiled, fp32) on this machine, timed
    once and cached; the choice is kept in model.kernel_choice (the provenance's "kernels")."""
    kernels = check_kernel_setting()  # Inductor fuses plain layers its own way: not with compile
    if kernels == "tiled" and next(model.parameters()).dtype != torch.float32:
        raise PrecisionError(f"BERT_ENGINE_KERNELS=tiled: bert_engine's AVX2 kernel is fp32 only, not "
                             f"{next(model.parameters()).dtype}")
    if kernels == "auto":
        # (with the encoder's projections, their attention: torch's or bert_engine's, whichever timed faster)
        wanted = (*names, fast.ATTENTION) if set(fast.PROJECTIONS) <= set(names) else names
        choice = {name: c for name, c in fast.choose_kernels(model, kernel_cache()).items() if name in wanted}
    else:
        choice = {name: {"chose": kernels} for name in names}
    model.kernel_choice = choice
    fast.use_kernels(model, {name: fast.choice_tiers(c) for name, c in choice.items() if name != fast.ATTENTION})
    fast.use_attention(model, choice.get(fast.ATTENTION, {}).get("chose"))


def prepare_for_inference(model: nn.Module, name: str = "auto", *, pack: bool = True,
                          compile: bool = False) -> nn.Module:
    """What the Predictor does to a loaded model: the precision's dtype, then its preparation (int8
    quantisation, or on the CPU pre-packed linear layers), then optionally torch.compile (of the encoder
    layers; with int8, of each projection's input quantiser, the int8 matmuls staying oneDNN's). The encoder
    runs padding-free (model.Unpadded): outputs at padding are zeros, real tokens' are unchanged."""
    device = next(model.parameters()).device
    precision = resolve(name, device)
    if compile and device.type == "cpu" and fast.cpp_compiler() is None:
        logger.warning("compile: torch.compile on the CPU builds its kernels with a C++ compiler and none was found "
                       "(install g++, or set torch._inductor.config.cpp.cxx); running without compile")
        compile = False
    model = model.to(dtype=precision.dtype).eval()
    model.compiled = compile
    for module in model.modules():
        if isinstance(module, BertModel):
            module.padding_free = True  # heads read real tokens only; the padding's share of the work is skipped
    if precision.prepare == "quantize":
        fast.quantize_int8(model)
        if pack and fast.mlm_heads(model):  # a masked-LM head's decoder stays fp32: packed where that is faster
            _choose_kernels(model, (fast.DECODER,))
    elif precision.prepare == "pack" and pack and not compile and device.type == "cpu":
        # the CPU's matmuls (BERT_ENGINE_KERNELS says nothing of a GPU's); Inductor cannot lower the packed ones
        _choose_kernels(model, fast.KERNEL_CHOICES if fast.mlm_heads(model) else fast.PROJECTIONS)
    if compile and precision.prepare == "quantize":
        # Inductor cannot lower oneDNN's int8 matmuls: it compiles what feeds them, each projection's quantiser
        if not fast.onednn_int8_available() or not fast.fuse_int8_quantisers(model):
            logger.warning("compile: this int8 model has no oneDNN int8 projections to fuse; running without compile")
            model.compiled = False
        else:  # what provenance() says: not the whole model, and not every input
            chunks = (f", and the feed-forward's {fast.FFN_CHUNK_ROWS}-row chunks,"
                      if fast.FFN_CHUNK_ROWS < fast.FUSED_MIN_ROWS else "")
            model.compiled = (f"int8 input quantisers, for batches of {fast.FUSED_MIN_ROWS:,}+ tokens "
                              f"(shorter ones{chunks} run them eagerly)")
    elif compile:
        fast.compile_encoder(model)
    return model
