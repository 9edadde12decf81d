"""bert_engine's own C kernels for AVX2 + FMA CPUs, built at first use: tiled_matmul.c (an fp32 matmul, run at
AVX-512's width where torch's own capability reading is AVX512: `isa()`),
int8_matmul.c (an int8 one for CPUs without VNNI: fast.Int8Linear's "tiled" kernel), fused_layer.c (a whole
encoder layer around either, for inference: fast.fused_layer) and crf_decode.c (the CRF's
n-best Viterbi and forward-backward for one row, which bert_engine/crf.py runs once the library has loaded).

`library()` compiles the sources with the system's C compiler once per sources, compiler and flags (about a
second), keeps the shared library under the kernel cache's folder (~/.cache/bert_engine/native, or beside
BERT_ENGINE_KERNEL_CACHE), loads it with ctypes and returns it; or returns None, logging the reason once,
where it cannot run: not Linux on x86-64, a CPU without AVX2 and FMA (or BERT_ENGINE_CPU_CAPABILITY below
AVX2), no C compiler (CC, else cc or gcc), or a failed build. Nothing else then changes: the kernel is one
candidate among those `fast.choose_kernels` times, and the others need no compiler.

The library is linked with -fopenmp and loaded after torch, so it uses torch's own OpenMP runtime (the
libgomp torch loaded has the same soname) and the thread count the caller passes: torch's setting.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .. import crf, settings

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("tiled_matmul.c", "int8_matmul.c", "fused_layer.c", "crf_decode.c"))
FLAGS = ("-O3", "-funroll-loops", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")  # unrolled: 2-9 % faster at 12-128 rows
LIBS = ("-lm",)
BUILD_TIMEOUT_S = 120
_lock = threading.Lock()
_state: dict[str, object] = {}  # "library": the loaded CDLL or None; "reason": why None


def cache_folder() -> Path:
    """Where built libraries are kept: a "native" folder beside the kernel timings' cache."""
    timings = settings.get("BERT_ENGINE_KERNEL_CACHE")
    base = Path(timings).parent if timings else Path.home() / ".cache" / "bert_engine"
    return base / "native"


def compiler() -> list[str] | None:
    """The C compiler command to build with: $CC (which may carry words: "ccache gcc"), else cc or gcc on the
    PATH (None: none found)."""
    named = shlex.split(os.environ.get("CC", ""))
    if named:
        found = shutil.which(named[0])
        return [found, *named[1:]] if found else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def capability_setting() -> str:
    """BERT_ENGINE_CPU_CAPABILITY, lower-cased: "", "avx2" or "default".

    Raises:
        ValueError: another value, naming it (precision.cpu_capability reads it here too, as a PrecisionError)."""
    value = settings.get("BERT_ENGINE_CPU_CAPABILITY").lower()
    if value not in ("", "avx2", "default"):
        raise ValueError(f"BERT_ENGINE_CPU_CAPABILITY={value!r} is not one of avx2, default")
    return value


def cpu_supported() -> str | None:
    """None when this CPU and platform can run the kernel, else why not.

    Raises:
        ValueError: BERT_ENGINE_CPU_CAPABILITY is not avx2, default or unset."""
    pretend = capability_setting()
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"built for Linux on x86-64, not {platform.system()} on {platform.machine()}"
    if pretend == "default":
        return "BERT_ENGINE_CPU_CAPABILITY=default"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU's capability is {capability}: the kernel needs AVX2 and FMA"
    flags = _cpu_flags()
    missing = [flag for flag in ("avx2", "fma") if flag not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _cpu_flags() -> list[str]:
    try:
        return next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), [])
    except OSError:
        return []


def wanted_isa() -> int:
    """The vector width for tiled_matmul here: 512 where torch reads the CPU as AVX512 (BERT_ENGINE_CPU_CAPABILITY=avx2
    holds it to 256) and the CPU lists avx512f, else 256. Both widths give the same bits."""
    if capability_setting() in ("avx2", "default"):
        return 256
    return 512 if torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512f" in _cpu_flags() else 256


def wanted_int8_isa() -> int:
    """int8_matmul's width here: 512 (vpdpbusd) where tiled_matmul runs at 512 and the CPU lists avx512_vnni."""
    return 512 if wanted_isa() == 512 and "avx512_vnni" in _cpu_flags() else 256


def int8_isa() -> int | None:
    """The width the loaded library's int8_matmul sums at (256: AVX2's vpmaddubsw; 512: AVX-512 VNNI), or None."""
    return _state.get("int8_isa") if library() is not None else None  # type: ignore[return-value]


def isa() -> int | None:
    """The vector width the loaded library's tiled_matmul runs at (256 or 512); None where it is not loaded."""
    return _state.get("isa") if library() is not None else None  # type: ignore[return-value]


def _build(cc: list[str]) -> Path:
    """The library built from SOURCES with `cc` (kept; rebuilt only when a source, the compiler or flags change)."""
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode()])).hexdigest()[:16]
    target = cache_folder() / f"tiled_matmul-{key}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        folder = target.parent
    except OSError:  # a read-only home: build for this process only
        folder = Path(tempfile.mkdtemp(prefix="bert_engine_native_"))
        target = folder / target.name
    partial = folder / f".{target.name}.{os.getpid()}.{threading.get_ident()}.partial"
    done = subprocess.run([*cc, *FLAGS, *map(str, SOURCES), "-o", str(partial), *LIBS], capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        said = (done.stderr + done.stdout).strip()
        first = next((line for line in said.splitlines() if "error" in line), said[:200]) or "it printed nothing"
        raise RuntimeError(f"{' '.join(cc)} failed (exit {done.returncode}): {first}")
    os.replace(partial, target)  # another process building the same file at once replaces it with the same
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.tiled_matmul.restype = None
    lib.tiled_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.tiled_matmul_version.restype = ctypes.c_int
    lib.tiled_matmul_set_isa.restype = ctypes.c_int
    lib.tiled_matmul_set_isa.argtypes = [ctypes.c_int]
    lib.int8_matmul_set_isa.restype = ctypes.c_int
    lib.int8_matmul_set_isa.argtypes = [ctypes.c_int]
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.fused_layer.restype = ctypes.c_int
    lib.fused_layer.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, f32, ctypes.c_int, ptr, ptr, f32,
                                ptr, ctypes.c_int, ptr, i64]
    lib.fused_stack.restype = ctypes.c_int
    lib.fused_stack.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64]
    lib.fused_attention.restype = ctypes.c_int
    lib.fused_attention.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.int8_pack.restype = None
    lib.int8_pack.argtypes = [ptr, i64, i64, ptr]
    lib.int8_matmul.restype = ctypes.c_int
    lib.int8_matmul.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.int8_matmul_version.restype = ctypes.c_int
    lib.fused_embeddings.restype = ctypes.c_int
    lib.fused_embeddings.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, f32, ptr,
                                     ctypes.c_int]
    lib.fused_activation.restype = None
    lib.fused_activation.argtypes = [ptr, i64, ctypes.c_int, ctypes.c_int]
    lib.crf_viterbi_nbest.restype = i64
    lib.crf_viterbi_nbest.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr]
    lib.crf_forward_backward.restype = ctypes.c_int
    lib.crf_forward_backward.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr]
    return lib


class Projection(ctypes.Structure):
    """fused_layer.c's `projection`: one of a layer's four matmuls, fp32 panels (TiledLinear) or int8 ones
    (fast.Int8Linear with the "tiled" kernel: its scales, row sums, and whether it rotates its input)."""
    _fields_ = [("panels", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("rowsum", ctypes.c_void_p), ("int8", ctypes.c_int64), ("rotate", ctypes.c_int64)]


def _load_or_rebuild(cc: list[str]) -> ctypes.CDLL:
    """The kept library, loaded; one that will not load (cut short by a full disk, say) is built again."""
    path = _build(cc)
    try:
        return _load(path)
    except OSError as err:
        logger.info("the kept kernel library %s does not load (%s); building it again", path, err)
        path.unlink(missing_ok=True)
        return _load(_build(cc))


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None where it cannot run here (see `unavailable`)."""
    with _lock:
        if "library" in _state:
            return _state["library"]  # type: ignore[return-value]
        reason = cpu_supported()
        lib = None
        if reason is None:
            cc = compiler()
            if cc is None:
                named = os.environ.get("CC", "").strip()
                reason = f"CC={named!r} is not a program found here" if named else "no C compiler (set CC, or install gcc)"
            else:
                try:
                    lib = _load_or_rebuild(cc)
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    reason = f"its build failed: {err}"
        if lib is None:
            logger.info("bert_engine's AVX2 kernel is not available: %s; the matmuls use oneDNN's and MKL's kernels "
                        "(int8: FBGEMM's or oneDNN's)", reason)
        _state.update(library=lib, reason=reason, isa=None if lib is None else lib.tiled_matmul_set_isa(wanted_isa()),
                      int8_isa=None if lib is None else lib.int8_matmul_set_isa(wanted_int8_isa()))
        crf.NATIVE = lib  # the CRF's recursions in C (crf_decode.c) from now on; None: numpy's
        return lib


def tiled_matmul():
    """The kernel's C function (a TiledLinear exists only once `library()` has loaded it)."""
    lib = _state.get("library")
    return (lib if lib is not None else library()).tiled_matmul  # type: ignore[union-attr]


def build() -> str | None:
    """Which build of the kernel `library()` loaded (its source, compiler and flags, hashed), or None: kernel
    timings taken with one build are not a choice for another (fast.choose_kernels times again)."""
    lib = library()
    if lib is None:
        return None
    stem = Path(lib._name).stem.removeprefix("tiled_matmul-")
    return stem if _state.get("isa") == 256 else f"{stem}-avx512"  # AVX2's builds keep the name they had


def unavailable() -> str | None:
    """None when `library()` loads, else the reason it does not (building it first if need be)."""
    library()
    return _state.get("reason")  # type: ignore[return-value]


def forget() -> None:
    """Drop what `library()` found, so the next call looks again (tests change the compiler or the CPU's flags)."""
    with _lock:
        _state.clear()
        crf.NATIVE = None
