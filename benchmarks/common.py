"""Shared pieces of the benchmarks: interleaved timing, the machine's matmul peak, the table printer.

Absolute times on a shared machine are noisy, so every comparison runs its contenders in turn
(A, B, A, B, ...) and reports medians; ratios taken that way survive a busy neighbour far better
than two back-to-back runs.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bert_engine.runtime.fast import BUSY_SHARE, cpu_busy_meter, cpu_name
from bert_engine.runtime.precision import cpu_capability


def own_cpu_seconds(proc: str = "/proc") -> float:
    """CPU seconds this process and the processes it started have run: its own threads, its children that have
    ended and been waited for, and those still running (read from `proc`, Linux's process table; the peers'
    servers that `benchmarks.peers` starts, an app under load). What a benchmark's run counts as its own work."""
    times = os.times()
    seconds = time.process_time() + times.children_user + times.children_system
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return seconds
    parents, ticks = {}, {}
    for pid in entries:
        try:
            with open(f"{proc}/{pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)": the name may hold spaces
            parents[int(pid)], ticks[int(pid)] = int(fields[1]), int(fields[11]) + int(fields[12])  # ppid; utime, stime
        except (OSError, ValueError, IndexError):
            continue
    ours, grew = {os.getpid()}, True
    while grew:  # children, their children, ...
        found = {pid for pid, parent in parents.items() if parent in ours and pid not in ours}
        ours |= found
        grew = bool(found)
    return seconds + sum(ticks[pid] for pid in ours - {os.getpid()}) / os.sysconf("SC_CLK_TCK")


# Other work on this machine while a benchmark runs: timed from the first import (a benchmark's start) to its
# write_json (its end), which records it in the machine's entry and says so where it is BUSY_SHARE or more.
_others_share = cpu_busy_meter(own=own_cpu_seconds)


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved(contenders: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2,
                device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Seconds per call of each contender, run in turn `repeats` times after `warmup` rounds."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(warmup + repeats):
        for name, fn in contenders.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def matmul_peak_gflops(dtype: torch.dtype = torch.float32, device: str = "cpu", size: int | None = None,
                       repeats: int = 10) -> float:
    """The machine's sustained matmul rate (GFLOP/s) on square `size` matrices: the roofline.
    Default size: 2048 on a CPU; 8192 on a GPU, whose 2048-sized products run far under its peak (an
    H200 gave 398-437 TFLOP/s at 2048, and 786 at 8192 in session 27's run).

    The best of torch.mm and (on CPU) oneDNN's matmul over a pre-packed weight, the two kernels the
    implementations under test use, so a fraction of this peak never exceeds 1 by kernel choice.
    """
    size = size or (8192 if torch.device(device).type == "cuda" else 2048)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    out = torch.empty(size, size, dtype=dtype, device=device)
    kernels = {"mm": lambda: torch.mm(a, b, out=out)}
    if device == "cpu" and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        kernels["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    times = interleaved(kernels, repeats, warmup=2, device=device)
    return 2 * size ** 3 / min(min(t) for t in times.values()) / 1e9


def cpu_class() -> str:
    """The class a CPU result holds for: avx2, avx512 or avx512-amx ("-emulated" when
    BERT_ENGINE_CPU_CAPABILITY makes the CPU report less than it has); gpu on a CUDA machine."""
    from bert_engine import settings

    if torch.cuda.is_available():
        return "gpu"
    capability = cpu_capability()
    name = "avx512-amx" if capability.isa == "AVX512" and capability.amx else (
        "avx512" if capability.isa == "AVX512" else "avx2")
    return name + ("-emulated" if settings.get("BERT_ENGINE_CPU_CAPABILITY") else "")


def task_names(parser, text: str, known) -> list[str]:
    """The comma-separated task names of a --tasks argument, each one of `known`, else the parser's usage error."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--tasks: {unknown[0]!r} is not one of {', '.join(known)}")
    return names


def others_cpu_share() -> float | None:
    """The share of this machine's CPUs (those this process may run on) that work other than this benchmark and
    the processes it started took since it began (fast.cpu_busy_meter); None off Linux."""
    share = _others_share()
    return None if share is None else round(share, 3)


def machine() -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": cpu_name(), "cpu_capability": cpu_capability().describe(), "cpu_class": cpu_class(),
            "platform": platform.platform(), "others_cpu_share": others_cpu_share()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    for package in ("transformers", "onnxruntime"):  # the engine-only benchmarks run without either
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain fixed-width table on stdout (benchmarks are scripts: printing is their job)."""
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write the results with the command that produced them (`python -m benchmarks.X ...`) and the share of the
    CPUs other work took during the whole run (the machine's "others_cpu_share"); where that is BUSY_SHARE or
    more, say so on stdout, written or not: the figures are not a quiet machine's."""
    share = others_cpu_share()
    if isinstance(payload.get("machine"), dict):
        payload["machine"]["others_cpu_share"] = share
    if share is not None and share >= BUSY_SHARE:
        print(f"# other work took {100 * share:.0f} % of this machine's CPUs during this run (/proc/stat): "
              f"these figures are not a quiet machine's")
    if path:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        program = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
        payload = {"command": " ".join([program, *sys.argv[1:]]), **payload}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


@contextmanager
def int8_kernel_set(kernel: str) -> Iterator[None]:
    """BERT_ENGINE_INT8_KERNEL=kernel for the models loaded inside; the caller's setting restored after."""
    before = os.environ.get("BERT_ENGINE_INT8_KERNEL")
    os.environ["BERT_ENGINE_INT8_KERNEL"] = kernel
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("BERT_ENGINE_INT8_KERNEL", None)
        else:
            os.environ["BERT_ENGINE_INT8_KERNEL"] = before


def time_encoders(shape: str, models: dict[str, Any], sessions: dict[str, Any], reference: Any,
                  rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Encoder forwards on one "BxT" block of random ids, in turn: each of `models` (engine encoders) and
    `sessions` (benchmarks.onnx_runtime sessions). (median ms, max |difference| from `reference`'s output)
    per contender, the outputs checked before anything is timed."""
    batch, tokens = (int(v) for v in shape.split("x"))
    ids = torch.randint(1000, 30000, (batch, tokens), generator=torch.Generator().manual_seed(batch * 1000 + tokens))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    contenders = {name: (lambda m=m: m(**inputs).last_hidden_state) for name, m in models.items()}
    contenders |= {name: (lambda s=s: torch.from_numpy(s(inputs))) for name, s in sessions.items()}
    with torch.inference_mode():
        expected = reference(**inputs).last_hidden_state
        diffs = {name: float((run() - expected).abs().max()) for name, run in contenders.items()}
        times = interleaved(contenders, rounds)
    return {name: 1e3 * median(t) for name, t in times.items()}, diffs
