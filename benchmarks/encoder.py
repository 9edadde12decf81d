"""Encoder forward: bert_engine vs transformers' BertModel (SDPA) vs ONNX Runtime, on identical
weights and inputs.

    python -m benchmarks.encoder                     # MiniLM + bert-base, 1x128, 32x128, 8x512, fp32
    python -m benchmarks.encoder --models minilm --shapes 1x128 --repeats 30 --json out.json
    python -m benchmarks.encoder --precisions fp32,bf16,int8   # also the engine's faster CPU modes
    python -m benchmarks.encoder --no-onnx                     # without ONNX Runtime
    python -m benchmarks.encoder --precisions int8,int8+compile  # int8 with torch.compile'd quantisers

For each model and shape: checks the outputs agree (max |difference| of the last hidden state
<= 1e-4) before timing, then runs the contenders in turn and reports median latency, tokens/s,
the ratio to the reference and the fraction of the machine's matmul peak (measured in the same
run, in the precision's own dtype) that the encoder's matmul FLOPs reach: on a GPU this is the
model-FLOPs utilisation (MFU). ONNX Runtime (CPU only, when onnxruntime is installed) runs the
same checkpoint exported from transformers and fused by its BERT optimiser (benchmarks/onnx_runtime.py),
in fp32 and, with --precisions int8, as its dynamically quantised int8 graph; `vs_ort` is ONNX
Runtime's time over this row's in the same precision. The header names the CPU's capability class
(AVX2 / AVX-512 / AMX): the figures hold for that class only. bert-base uses random weights in bert-base-uncased's
shape (no bert-base checkpoint installs offline); MiniLM is the real all-MiniLM-L6-v2.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from benchmarks import onnx_runtime
from benchmarks.common import interleaved, machine, matmul_peak_gflops, median, print_table, write_json

SHAPES = ((1, 128), (32, 128), (8, 512))
AGREEMENT = 1e-4


def matmul_flops(config, batch: int, tokens: int) -> float:
    """Matmul FLOPs of one encoder forward: per token and layer, the fused QKV (3H²), attention output (H²)
    and feed-forward (2HI) projections at 2 FLOPs per multiply-add, plus q·kᵀ and weights·v (2TH each);
    and the pooler (H² per row). Embedding lookups, LayerNorm, softmax and GELU are not matmuls."""
    H, I, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token_layer = 2 * (4 * H * H + 2 * H * I) + 2 * 2 * tokens * H
    return batch * tokens * L * per_token_layer + batch * 2 * H * H


def model_folders(names: list[str], workdir: Path) -> dict[str, Path]:
    """name -> a Hugging Face-layout folder both implementations load (bert-base's is made with transformers;
    MiniLM's needs only the offline backbone)."""
    from bert_engine.checkpoints.hub import default_backbone

    folders = {}
    for name in names:
        if name == "minilm":
            folders[name] = Path(default_backbone())
        elif name == "bert-base":
            folder = workdir / "bert-base-random"
            if not (folder / "config.json").is_file():
                import transformers

                torch.manual_seed(0)
                transformers.BertModel(transformers.BertConfig()).save_pretrained(folder)  # bert-base-uncased sizes
            folders[name] = folder
        else:
            raise SystemExit(f"unknown model {name!r}; choose from minilm, bert-base")
    return folders


def load_pair(folder: Path, device: str, precision: str, reference: bool = True):
    """(the engine's model, transformers' BertModel on the same weights; None without `reference`)."""
    from bert_engine import load_pretrained
    from bert_engine.runtime.precision import prepare_for_inference

    # The engine as the Predictor runs it (packed oneDNN linears on CPU; see bert_engine/runtime/fast.py).
    base, _, compiled = precision.partition("+")  # "int8+compile": load(compile=True)
    ours = prepare_for_inference(load_pretrained(folder, device=device), base, compile=compiled == "compile")
    if not reference:
        return ours, None
    import transformers

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    theirs = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").to(device, dtype).eval()
    return ours, theirs


def run(names: list[str], shapes: list[tuple[int, int]], precisions: list[str], repeats: int, device: str,
        workdir: Path, onnx: bool = True) -> dict:
    # Each precision is held to the matmul peak of its own dtype (int8 to fp32's: its activations
    # are quantised per call, and the fp32 peak is the bar it has to beat).
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32,
              "int8+compile": torch.float32}
    unknown = sorted(set(precisions) - set(dtypes))
    if unknown:
        raise SystemExit(f"--precisions: {unknown} unknown; choose from {', '.join(dtypes)}")
    # The peak is what the machine can do: timed before and after the run, the higher kept, so a slow moment
    # of a shared VM at the start does not read as a low peak (shares over 100 % in session 33's first run)
    peaks = {p: matmul_peak_gflops(dtypes[p], device=device) for p in precisions}
    rows = []
    onnx = onnx and device == "cpu" and onnx_runtime.available()
    for name, folder in model_folders(names, workdir).items():
        exported = onnx_runtime.export(folder, workdir / "onnx", name) if onnx else {}
        for precision in precisions:
            ours, reference = load_pair(folder, device, precision)
            kind = precision.partition("+")[0]  # ONNX Runtime's own int8 beside the engine's int8+compile
            ort = onnx_runtime.load(exported[kind], torch.get_num_threads()) if kind in exported else None
            config = ours.config
            for batch, tokens in shapes:
                g = torch.Generator().manual_seed(batch * 1000 + tokens)
                inputs = {"input_ids": torch.randint(1000, config.vocab_size, (batch, tokens), generator=g).to(device),
                          "attention_mask": torch.ones(batch, tokens, dtype=torch.long, device=device),
                          "token_type_ids": torch.zeros(batch, tokens, dtype=torch.long, device=device)}
                with torch.inference_mode():
                    mine = ours(**inputs).last_hidden_state.float()
                    theirs = reference(**inputs).last_hidden_state.float()
                diffs = {"engine": float((mine - theirs).abs().max()), "transformers": 0.0}
                if ort is not None:
                    diffs["onnxruntime"] = float((torch.from_numpy(ort(inputs)) - theirs).abs().max())
                for impl, diff in diffs.items():
                    if precision == "fp32" and diff > AGREEMENT:  # lower precisions: reported, not required
                        raise SystemExit(f"{name} {batch}x{tokens}: {impl}'s output differs from transformers' by "
                                         f"{diff:.2e} > {AGREEMENT}; not timing")

                def engine(ours=ours, inputs=inputs):
                    with torch.inference_mode():
                        ours(**inputs)

                def transformers_sdpa(reference=reference, inputs=inputs):
                    with torch.inference_mode():
                        reference(**inputs)

                # int8 has no transformers counterpart: it is compared with transformers in fp32.
                contenders = {"engine": engine} if precision.startswith("int8") else {"engine": engine,
                                                                             "transformers": transformers_sdpa}
                if ort is not None:
                    contenders["onnxruntime"] = lambda ort=ort, inputs=inputs: ort(inputs)
                times = interleaved(contenders, repeats, device=device)
                flops = matmul_flops(config, batch, tokens)
                for impl, ts in times.items():
                    seconds = median(ts)
                    rows.append({"model": name, "shape": f"{batch}x{tokens}", "impl": impl, "precision": precision,
                                 "ms": seconds * 1000, "tokens_per_s": batch * tokens / seconds,
                                 "gflops": flops / seconds / 1e9, "max_abs_diff": diffs[impl]})
    peaks = {p: max(peaks[p], matmul_peak_gflops(dtypes[p], device=device)) for p in precisions}
    for row in rows:
        row["roofline"] = row["gflops"] / peaks[row["precision"]]
    _add_ratios(rows)
    result = {"machine": machine(), "device": device, "matmul_peak_gflops": peaks, "repeats": repeats, "rows": rows}
    if any(p.startswith("int8") for p in precisions):
        from bert_engine.runtime.fast import int8_kernel

        result["int8_kernel"] = int8_kernel()  # whose int8 matmuls the engine's int8 rows ran
    return result


def _add_ratios(rows: list[dict]) -> None:
    """speedup = transformers' time / this time, in the same precision (int8: against fp32);
    vs_ort = ONNX Runtime's time / this time, in the same precision."""
    def times(impl):
        return {(r["model"], r["shape"], r["precision"]): r["ms"] for r in rows if r["impl"] == impl}

    reference, ort = times("transformers"), times("onnxruntime")
    for r in rows:
        key = (r["model"], r["shape"], r["precision"])
        base = reference.get((*key[:2], "fp32" if r["precision"].startswith("int8") else r["precision"]))
        r["speedup"] = base / r["ms"] if base else None
        r["vs_ort"] = ort[key] / r["ms"] if key in ort and r["impl"] != "onnxruntime" else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm,bert-base", help="comma-separated: minilm, bert-base")
    parser.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES), help="BxT,... (batch x tokens)")
    parser.add_argument("--precisions", default="fp32",
                        help="engine precisions: fp32 (always compared), bf16, int8, int8+compile")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per contender (after 2 warm-up rounds)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", default=None, help="where the random bert-base folder is kept (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--no-onnx", action="store_true", help="leave ONNX Runtime out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    precisions = ["fp32"] + [p for p in args.precisions.split(",") if p and p != "fp32"]
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.models.split(","), shapes, precisions, args.repeats, args.device,
                     Path(args.workdir) if args.workdir else Path(tmp), onnx=not args.no_onnx)
    info = result["machine"]
    print(f"# encoder forward, {args.device}, {info['cpu']} ({info['cpu_capability']}), {info['threads']} threads, "
          f"torch {info['torch']}, transformers {info.get('transformers')}, onnxruntime {info.get('onnxruntime')}; "
          f"median of {args.repeats}; matmul peak GFLOP/s: "
          + ", ".join(f"{p} {v:,.0f}" for p, v in result["matmul_peak_gflops"].items()))
    print_table(result["rows"], ["model", "shape", "impl", "precision", "ms", "tokens_per_s", "speedup", "vs_ort",
                                 "gflops", "roofline", "max_abs_diff"])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
