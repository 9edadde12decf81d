"""What bounds a visitor's forward on this machine: the rate the cores issue fused multiply-adds at, the rate
memory is read at and the matmul libraries' peak, beside a starter model's forward at a request's lengths, with
the two floors those give it (its weights read once from memory; its multiply-adds at the issue rate).

    python -m benchmarks.bounds [--task sentiment] [--lengths 1,12,24,48,96,128] [--rounds 40] [--json OUT]

The issue rate is timed by a C loop of independent FMAs (12 chains a thread, no memory), built with the C
compiler bert_engine's kernels use, at AVX-512's width where the CPU has it and at AVX2's, on every thread at
once; the read rate by summing a 256 MB tensor (past any cache) on one thread and on all; the matmul peak is
benchmarks.common.matmul_peak_gflops (torch.mm and oneDNN at 2048^3). A forward's floor is the larger of its
weights over the read rate and its FLOPs over the issue rate: what it would take with one hidden under the other.
Run it alone: other work on the cores moves every column.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.common import machine, matmul_peak_gflops, print_table, write_json

FMA_SOURCE = r"""
#include <immintrin.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define CHAINS(T, SET, FMA, ADD)                                                                             \
    T a0 = SET(0.f), a1 = SET(1.f), a2 = SET(2.f), a3 = SET(3.f), a4 = SET(4.f), a5 = SET(5.f), a6 = SET(6.f),   \
      a7 = SET(7.f), a8 = SET(8.f), a9 = SET(9.f), aa = SET(10.f), ab = SET(11.f);                                \
    const T b = SET(1.0000001f), c = SET(1e-9f);                                                              \
    const double start = now();                                                                               \
    for (long k = 0; k < n; ++k) {                                                                            \
        a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c); a4 = FMA(a4, b, c);    \
        a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c); a8 = FMA(a8, b, c); a9 = FMA(a9, b, c);    \
        aa = FMA(aa, b, c); ab = FMA(ab, b, c);                                                               \
    }                                                                                                         \
    const double seconds = now() - start;                                                                     \
    T s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));                                  \
    s = ADD(s, ADD(ADD(a8, a9), ADD(aa, ab)));                                                                \
    *sink = ((float *)&s)[0];                                                                                 \
    return seconds;
__attribute__((target("avx512f"))) double fma512(long n, float *sink) {
    CHAINS(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps)
}
__attribute__((target("avx2,fma"))) double fma256(long n, float *sink) {
    CHAINS(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps)
}
"""
STEPS = 50_000_000  # loop trips per thread: 600 M FMAs, about 0.1-0.4 s a thread at AVX-512's width
READ_MB = 256  # the tensor read_rate sums: past any CPU's last-level cache


def fma_library(folder: Path) -> ctypes.CDLL:
    """FMA_SOURCE built with bert_engine's C compiler into `folder`.

    Raises:
        RuntimeError: no C compiler, or the build failed (its first error line)."""
    from bert_engine.runtime import native

    cc = native.compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) to build the FMA loop with")
    source, target = folder / "fma_loop.c", folder / "fma_loop.so"
    source.write_text(FMA_SOURCE, encoding="ascii")
    done = subprocess.run([*cc, "-O2", "-shared", "-fPIC", str(source), "-o", str(target)], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"building the FMA loop failed: {(done.stderr or done.stdout).strip().splitlines()[0]}")
    lib = ctypes.CDLL(str(target))
    for name in ("fma512", "fma256"):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_float)]
    return lib


def issue_rate(lib: ctypes.CDLL, width: int, threads: int, steps: int | None = None, rounds: int = 3) -> float:
    """GFLOP/s of `threads` threads running the FMA loop at `width` bits (512 or 256) at once (ctypes lets go of
    the GIL): the best of `rounds`, each round's rate the threads' FLOPs over the slowest thread's time."""
    loop, lanes = (lib.fma512, 16) if width == 512 else (lib.fma256, 8)
    steps = steps or STEPS
    best = 0.0
    for _ in range(rounds):
        seconds = [0.0] * threads
        sinks = [ctypes.c_float() for _ in range(threads)]

        def run(i: int, seconds: list[float] = seconds, sinks: list = sinks) -> None:
            seconds[i] = loop(steps, ctypes.byref(sinks[i]))

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, threads * steps * 12 * lanes * 2 / max(seconds) / 1e9)
    return best


def read_rate(threads: int, megabytes: int | None = None, rounds: int = 8) -> float:
    """GB/s of summing a `megabytes` float tensor on `threads` torch threads (the best of `rounds`)."""
    held = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones((megabytes or READ_MB) * 250_000)
        data.sum()
        best = min(_seconds(data.sum) for _ in range(rounds))
    finally:
        torch.set_num_threads(held)
    return data.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _figures(value: float) -> float:
    """Three significant figures: a one-token floor is hundredths of a millisecond, which two decimals blur (a ratio
    of two such roundings missed the ratio itself by more than 2 %)."""
    return float(f"{value:.3g}")


def forward_costs(config, length: int) -> tuple[float, float]:
    """(FLOPs, weight bytes) of an encoder's layers for one sequence of `length` tokens: the four projections'
    multiply-adds and the attention's (scores and context), and the projections' fp32 weights, read once."""
    H, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    weights = layers * (4 * H * H + 2 * H * inner)
    flops = 2 * length * weights + layers * 4 * length * length * H
    return float(flops), float(4 * weights)


def time_forward(model, length: int, rounds: int) -> float:
    """Median seconds of `model`'s forward on one sequence of `length` random word pieces (after a warm-up)."""
    ids = torch.randint(1000, min(20000, model.config.vocab_size), (1, length))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    with torch.inference_mode():
        for _ in range(5):
            model(**inputs)
        return statistics.median(_seconds(lambda: model(**inputs)) for _ in range(rounds))


def measure(task: str, lengths: list[int], rounds: int) -> dict:
    from bert_engine.runtime.inference import Predictor
    from bert_engine.runtime.precision import cpu_capability
    from bert_engine.tasks.registry import load_registry

    predictor = Predictor.load(load_registry(entry_points=False).task(task))  # (the lengths checked first)
    model = predictor.model
    longest = model.config.max_tokens
    if max(lengths) > longest:
        raise ValueError(f"--lengths: {max(lengths)} tokens is past the {task} model's {longest} positions")
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as folder:
        lib = fma_library(Path(folder))
        widths = [512, 256] if cpu_capability().isa == "AVX512" else [256]
        fma = {f"fma{w}_gflops": {"one_thread": round(issue_rate(lib, w, 1), 1),
                                  "all_threads": round(issue_rate(lib, w, threads), 1)} for w in widths}
    peak_fma = max(v["all_threads"] for v in fma.values())
    reads = {"one_thread": round(read_rate(1), 2), "all_threads": round(read_rate(threads), 2)}
    bounds = {**fma, "read_gbps": reads, "matmul_peak_gflops": round(matmul_peak_gflops(), 1), "threads": threads}
    rows = []
    for length in lengths:
        flops, weight_bytes = forward_costs(model.config, length)
        seconds = time_forward(model, length, rounds)
        weights_ms, compute_ms = 1e3 * weight_bytes / (reads["all_threads"] * 1e9), 1e3 * flops / (peak_fma * 1e9)
        floor = max(weights_ms, compute_ms)
        rows.append({"tokens": length, "forward_ms": _figures(1e3 * seconds), "gflops": round(flops / seconds / 1e9, 1),
                     "share_of_fma_peak": round(flops / seconds / 1e9 / peak_fma, 3),
                     "weights_floor_ms": _figures(weights_ms), "fma_floor_ms": _figures(compute_ms),
                     "floor_ms": _figures(floor), "over_floor": _figures(1e3 * seconds / floor)})
    return {"machine": machine(), "task": task, "model": predictor.provenance()["model"],
            "precision": predictor.provenance()["dtype"], "bounds": bounds, "rounds": rounds, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="sentiment", help="the task whose starter model's forward is timed")
    parser.add_argument("--lengths", default="1,12,24,48,96,128", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        lengths = [int(n) for n in args.lengths.split(",") if n]
    except ValueError:
        parser.error(f"--lengths: {args.lengths!r} is not comma-separated whole numbers")
    if not lengths or min(lengths) < 1:
        parser.error(f"--lengths: {args.lengths!r}: give token counts of at least 1")
    if args.rounds < 1:
        parser.error(f"--rounds: {args.rounds}: give at least 1")
    try:
        result = measure(args.task, lengths, args.rounds)
    except ValueError as err:  # a length past the model's positions, an unknown task
        parser.error(str(err))
    info, bounds = result["machine"], result["bounds"]
    fma = ", ".join(f"{k.removesuffix('_gflops')} {v['one_thread']:,.0f} one thread / {v['all_threads']:,.0f} all"
                    for k, v in bounds.items() if k.startswith("fma"))
    print(f"# what bounds a forward, {info['cpu']} ({info['cpu_capability']}), {bounds['threads']} threads: FMA issue "
          f"GFLOP/s {fma}; memory read GB/s {bounds['read_gbps']['one_thread']} one thread / "
          f"{bounds['read_gbps']['all_threads']} all; matmul peak {bounds['matmul_peak_gflops']:,.0f} GFLOP/s")
    print(f"# {result['task']} starter ({result['precision']}), one sequence, median of {result['rounds']}")
    print_table(result["rows"], ["tokens", "forward_ms", "gflops", "share_of_fma_peak", "weights_floor_ms",
                                 "fma_floor_ms", "floor_ms", "over_floor"])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
