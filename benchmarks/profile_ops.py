"""Where the encoder's time goes, per operator: bert_engine (packed and plain linears) vs transformers,
and ONNX Runtime's own profile of its fused graph beside them.

    python -m benchmarks.profile_ops --model minilm --shape 32x128
    python -m benchmarks.profile_ops --model minilm --shape 1x128 --precision int8 --json out.json
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        BERT_ENGINE_CPU_CAPABILITY=avx2 python -m benchmarks.profile_ops   # as an AVX2-only CPU would run

torch.profiler over `--repeats` forwards after two warm-up ones; for each implementation, the
operators by self CPU time (milliseconds per forward) and their share of its total. The environment
variables in the second line hold oneDNN, MKL and PyTorch's own kernels to AVX2 on an AVX-512
machine: an emulation of an AVX2 CPU's code paths (not of its clock or caches), labelled as such.

When onnxruntime is installed, the same checkpoint's fused ONNX Runtime graph (benchmarks/onnx_runtime.py;
its int8 graph with `--precision int8`) runs under ONNX Runtime's profiler, and a second table puts
each side's time into the same kinds of work (matmuls, attention, LayerNorm and residual adds,
embeddings, GELU and other element-wise work, activation quantisation). ONNX Runtime's fused Attention
node includes its QKV projection, so its "attention" holds a quarter of a layer's projections; the
"matmuls + attention" row compares like with like. The profilers' own totals are beside each
contender's median wall time per forward measured without them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import onnx_runtime
from benchmarks.common import machine, median, print_table, write_json
from benchmarks.encoder import load_pair, model_folders

EMULATION = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def emulated_isa() -> str | None:
    """"AVX2 (emulated)" when the kernel libraries are held to AVX2 by the environment, else None."""
    values = {k: os.environ.get(k, "").upper() for k in EMULATION}
    return "AVX2 (emulated)" if values["ONEDNN_MAX_CPU_ISA"] == "AVX2" and values["ATEN_CPU_CAPABILITY"] == "AVX2" \
        else None


# Kinds of work, matched on lower-cased operator names (torch) or op types (ONNX Runtime), first match wins.
KINDS = (
    ("activation quantisation", ("dynamicquantize", "quantize_per", "round", "amax", "amin", "aminmax", "clamp",
                                 "_codes", "addcmul")),
    ("attention", ("attention", "softmax", "bmm", "baddbmm")),
    ("matmuls", ("linear", "addmm", "matmul", "gemm", "::mm", "qlinear", "onednn::")),
    ("embeddings", ("embedding", "embedlayernorm", "index_select", "gather")),
    ("LayerNorm and residual adds", ("layer_norm", "layernorm", "skiplayernorm")),
    ("GELU and other element-wise", ("gelu", "add", "mul", "tanh", "div", "sub", "where", "erf", "cast", "to_copy",
                                     "copy_")),
)


def kind_of(op: str) -> str:
    name = op.lower()
    # ONNX Runtime's int8 matmuls quantise their input inside the op: matmuls, as the engine's are
    if name in ("mm", "aten::mm") or (name.endswith("matmul") and "quantize" in name):
        return "matmuls"
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other (views, reshapes, dispatch)"


def by_kind(times: dict[str, float]) -> dict[str, float]:
    """Milliseconds per forward by kind of work, plus "matmuls + attention"."""
    kinds: dict[str, float] = {}
    for op, ms in times.items():
        kinds[kind_of(op)] = kinds.get(kind_of(op), 0.0) + ms
    kinds["matmuls + attention"] = kinds.get("matmuls", 0.0) + kinds.get("attention", 0.0)
    return kinds


def ort_profile(path: Path, inputs: dict[str, torch.Tensor], repeats: int, workdir: Path) -> dict[str, float]:
    """ONNX Runtime's own profiler: kernel microseconds per forward, by op type, over `repeats` runs
    after two warm-up ones (left out of the sums: their node events come first in the trace)."""
    model = onnx_runtime.load(path, torch.get_num_threads(), profile_prefix=str(workdir / "ort_profile"))
    for _ in range(2 + repeats):
        model(inputs)
    trace = json.loads(Path(model.session.end_profiling()).read_text())
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if len(runs) != 2 + repeats:
        raise RuntimeError(f"ONNX Runtime's profile holds {len(runs)} runs, not {2 + repeats}")
    start = runs[2]["ts"]  # the first timed run
    times: dict[str, float] = {}
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= start:
            op = event["args"]["op_name"]
            times[op] = times.get(op, 0.0) + event["dur"] / 1000 / repeats
    return times


def wall_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts) * 1000


def profile(fn, repeats: int) -> dict[str, float]:
    """Self CPU milliseconds per call, by operator name."""
    fn()
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    return {e.key: e.self_cpu_time_total / 1000 / repeats for e in prof.key_averages()}


def main(argv: list[str] | None = None) -> None:
    from bert_engine import load_pretrained

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", help="minilm or bert-base")
    parser.add_argument("--shape", default="32x128")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "int8"),
                        help="the engine's precision; int8 is profiled beside ONNX Runtime's int8 graph")
    parser.add_argument("--no-onnx", action="store_true", help="leave ONNX Runtime out")
    parser.add_argument("--json", default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    batch, tokens = (int(n) for n in args.shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folders([args.model], Path(tmp))[args.model]
        packed, reference = load_pair(folder, "cpu", args.precision)
        ids = torch.randint(1000, packed.config.vocab_size, (batch, tokens),
                            generator=torch.Generator().manual_seed(0))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        engine = f"engine ({args.precision}, packed)"
        runs = {engine: packed}
        if args.precision == "fp32":
            runs["engine (plain nn.Linear)"] = load_pretrained(folder).eval()  # without packed linears
            runs["transformers"] = reference
        profiles, walls = {}, {}
        for name, model in runs.items():
            def call(model=model):
                with torch.inference_mode():
                    model(**inputs)
            walls[name] = wall_ms(call, args.repeats)
            profiles[name] = profile(call, args.repeats)
        if not args.no_onnx and onnx_runtime.available():
            path = onnx_runtime.export(folder, Path(tmp) / "onnx", args.model)[args.precision]
            session = onnx_runtime.load(path, torch.get_num_threads())
            name = f"onnxruntime ({args.precision})"
            walls[name] = wall_ms(lambda: session(inputs), args.repeats)
            profiles[name] = ort_profile(path, inputs, args.repeats, Path(tmp))
    totals = {name: sum(times.values()) for name, times in profiles.items()}
    rows = []
    for name, times in profiles.items():
        for op, ms in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            rows.append({"impl": name, "op": op, "kind": kind_of(op), "ms": ms, "share": ms / totals[name]})
    kinds = {name: by_kind(times) for name, times in profiles.items()}
    compared = [engine] + [n for n in profiles if n.startswith("onnxruntime")]
    kind_rows = [{"kind": kind, **{name: kinds[name].get(kind, 0.0) for name in compared}}
                 for kind in [k for k, _ in KINDS] + ["other (views, reshapes, dispatch)", "matmuls + attention"]]
    kind_rows.append({"kind": "profiled total", **{name: totals[name] for name in compared}})
    kind_rows.append({"kind": "wall time per forward (median, no profiler)", **{name: walls[name] for name in compared}})
    info = machine()
    isa = emulated_isa() or info["cpu_capability"]
    print(f"# self time per forward (ms), {args.model} {args.shape}, {info['cpu']} as {isa}, {info['threads']} threads; "
          + ", ".join(f"{k}: profiled {totals[k]:.2f}, wall {walls[k]:.2f}" for k in profiles))
    print_table(rows, ["impl", "op", "kind", "ms", "share"])
    print()
    print_table(kind_rows, ["kind", *compared])
    write_json(args.json, {"machine": info, "isa": isa, "model": args.model, "shape": args.shape,
                           "precision": args.precision, "repeats": args.repeats, "wall_ms": walls,
                           "profiled_ms": totals, "ops": rows, "kinds": kind_rows})


if __name__ == "__main__":
    main()
