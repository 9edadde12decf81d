"""The fp32 matmul kernels of a whole encoder forward, in turn: oneDNN's packed, MKL's plain, bert_engine's
tiled AVX2 kernel (runtime/tiled_matmul.c), and what BERT_ENGINE_KERNELS=auto chose on this machine; with
ONNX Runtime's fused fp32 graph of the same checkpoint beside them.

    python -m benchmarks.fp32_kernels                                 # MiniLM, 1x12 ... 32x128
    python -m benchmarks.fp32_kernels --shapes 1x24,1x128 --rounds 20 --json out.json

"tiled" and "auto" include the fused layer (bert_engine/runtime/fused_layer.c) wherever all four projections
of a layer run the tiled kernel; run with BERT_ENGINE_FUSED_LAYERS=0 to time them unfused.

Loads MiniLM (the offline backbone) once per BERT_ENGINE_KERNELS value, each as the Predictor prepares it
(`prepare_for_inference`, fp32); "auto" reads or makes this machine's kernel timings (the choice is printed).
Per shape: each contender's max |difference| from transformers' fp32 output, then `--rounds` rounds in
which every contender runs once in turn (benchmarks.common.interleaved); medians, each kernel's speed-up
over packed (the default before the tiled kernel) and over ONNX Runtime. A projection timed alone (what
`choose_kernels` does) shows less of the tiled kernel's gain than a whole forward, where 24 weight
matrices pass through the caches: this script measures the whole forward.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from benchmarks import onnx_runtime
from benchmarks.common import machine, print_table, time_encoders, write_json
from benchmarks.encoder import load_pair, model_folders

SHAPES = "1x12,1x24,1x48,1x128,8x128,32x128"


def load_with(folder: Path, kernels: str, reference: bool = True):
    """The engine's fp32 MiniLM with BERT_ENGINE_KERNELS=`kernels` (restored after), and transformers' on the same
    weights (None without `reference`)."""
    before = os.environ.get("BERT_ENGINE_KERNELS")
    os.environ["BERT_ENGINE_KERNELS"] = kernels
    try:
        return load_pair(folder, "cpu", "fp32", reference)
    finally:
        if before is None:
            os.environ.pop("BERT_ENGINE_KERNELS", None)
        else:
            os.environ["BERT_ENGINE_KERNELS"] = before


def main(argv: list[str] | None = None) -> dict:
    from bert_engine.runtime import native
    from bert_engine.runtime.fast import kernel_label

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="BxT,... (batch x tokens)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-onnx", action="store_true", help="leave ONNX Runtime out")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    kernels = ["packed", "plain"] + (["tiled"] if native.library() is not None else []) + ["auto"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folders(["minilm"], Path(tmp))["minilm"]
        models, reference = {}, None
        for k in kernels:
            models[k], reference = load_with(folder, k)
        timings = getattr(models["auto"], "kernel_choice", {})  # each projection's timings as `auto` read them
        choice = {name: kernel_label(c) for name, c in timings.items()}
        ort = {}
        if not args.no_onnx and onnx_runtime.available():
            path = onnx_runtime.export(folder, Path(tmp) / "onnx", "minilm")["fp32"]
            ort = {"onnxruntime": onnx_runtime.load(path, torch.get_num_threads())}
        rows = []
        for shape in args.shapes.split(","):
            ms, diffs = time_encoders(shape, models, ort, reference, args.rounds)
            for k in ms:
                rows.append({"shape": shape, "kernels": k, "ms": round(ms[k], 3), "max_abs_diff": diffs[k],
                             "vs_packed": round(ms["packed"] / ms[k], 3),
                             "vs_onnxruntime": round(ms["onnxruntime"] / ms[k], 3) if "onnxruntime" in ms else None})
    result = {"machine": machine(), "tiled_kernel": native.unavailable() or "available", "auto_chose": choice,
              "auto_timings_ms": {name: c.get("rows") for name, c in timings.items()},
              "rounds": args.rounds, "rows": rows}
    info = result["machine"]
    print(f"# MiniLM encoder forward, fp32, {info['cpu']} ({info['cpu_capability']}), {info['threads']} threads; "
          f"medians of {args.rounds} rounds in turn; auto chose: {choice or 'nothing (no kernel choice here)'}")
    print_table(rows, ["shape", "kernels", "ms", "max_abs_diff", "vs_packed", "vs_onnxruntime"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
