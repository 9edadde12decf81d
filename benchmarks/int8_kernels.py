"""Whose int8 matmuls an int8 model runs: oneDNN's, FBGEMM's and bert_engine's own AVX2 one with its whole
layer in one C call ("tiled"; bert_engine.runtime.fast.int8_kernel),
timed in turn beside the engine's fp32 and ONNX Runtime's fp32 and int8 graphs.

    python -m benchmarks.int8_kernels                                 # MiniLM, 1x1 ... 32x128
    python -m benchmarks.int8_kernels --shapes 1x24,1x128 --rounds 20 --json out.json

Loads MiniLM (the offline backbone) once per int8 kernel (BERT_ENGINE_INT8_KERNEL set for each load)
and once in fp32; ONNX Runtime runs the same checkpoint's fused graph and its dynamically quantised
copy (benchmarks/onnx_runtime.py) when onnxruntime is installed. Per shape: each contender's max
|difference| from transformers' fp32 output, then `--rounds` rounds in which every contender runs
once in turn (benchmarks.common.interleaved); medians, and each int8 kernel's speed-up over the
engine's fp32 and over ONNX Runtime's int8. Short rows (1-24 tokens) are a visitor's request; 128 and
32x128 a long input and a batch.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks import onnx_runtime
from benchmarks.common import int8_kernel_set, machine, print_table, time_encoders, write_json
from benchmarks.encoder import load_pair, model_folders

SHAPES = "1x1,1x12,1x24,1x48,1x128,32x128"


def load_int8(folder: Path, kernel: str):
    """The engine's int8 model with `kernel`'s matmuls."""
    with int8_kernel_set(kernel):
        return load_pair(folder, "cpu", "int8")[0]


def main(argv: list[str] | None = None) -> dict:
    from bert_engine.runtime.fast import fbgemm_int8_available, int8_kernel, onednn_int8_available, tiled_int8_available

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="BxT,... (batch x tokens)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--no-onnx", action="store_true", help="leave ONNX Runtime out")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    kernels = [k for k, ok in (("onednn", onednn_int8_available()), ("fbgemm", fbgemm_int8_available()),
                               ("tiled", tiled_int8_available())) if ok]
    if not kernels:
        raise SystemExit("this torch build has neither oneDNN's nor FBGEMM's int8 matmul")
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folders(["minilm"], Path(tmp))["minilm"]
        fp32, reference = load_pair(folder, "cpu", "fp32")
        models = {"engine fp32": fp32, **{f"engine int8 ({k})": load_int8(folder, k) for k in kernels}}
        ort = {}
        if not args.no_onnx and onnx_runtime.available():
            paths = onnx_runtime.export(folder, Path(tmp) / "onnx", "minilm")
            ort = {f"onnxruntime {p}": onnx_runtime.load(paths[p], torch.get_num_threads()) for p in ("fp32", "int8")}
        rows = []
        for shape in args.shapes.split(","):
            ms, diffs = time_encoders(shape, models, ort, reference, args.rounds)
            for name in ms:
                row = {"shape": shape, "impl": name, "ms": round(ms[name], 3), "max_abs_diff": round(diffs[name], 4),
                       "vs_engine_fp32": None, "vs_ort_int8": None}
                if name.startswith("engine int8"):
                    row["vs_engine_fp32"] = round(ms["engine fp32"] / ms[name], 3)
                    if "onnxruntime int8" in ms:
                        row["vs_ort_int8"] = round(ms["onnxruntime int8"] / ms[name], 3)
                rows.append(row)
    result = {"machine": machine(), "default_int8_kernel": int8_kernel(), "rounds": args.rounds, "rows": rows}
    info = result["machine"]
    print(f"# MiniLM encoder forward, {info['cpu']} ({info['cpu_capability']}), {info['threads']} threads; "
          f"int8 kernel by default here: {result['default_int8_kernel']}; medians of {args.rounds} rounds in turn")
    print_table(rows, ["shape", "impl", "ms", "max_abs_diff", "vs_engine_fp32", "vs_ort_int8"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
