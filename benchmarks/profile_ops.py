"""Where the encoder's time goes, per operator: bert_engine (packed and plain linears) vs transformers.

    python -m benchmarks.profile_ops --model minilm --shape 32x128
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        BERT_ENGINE_CPU_CAPABILITY=avx2 python -m benchmarks.profile_ops   # as an AVX2-only CPU would run

torch.profiler over `--repeats` forwards after two warm-up ones; for each implementation, the
operators by self CPU time (milliseconds per forward) and their share of its total. The environment
variables in the second line hold oneDNN, MKL and PyTorch's own kernels to AVX2 on an AVX-512
machine: an emulation of an AVX2 CPU's code paths (not of its clock or caches), labelled as such.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from benchmarks.common import machine, print_table
from benchmarks.encoder import load_pair, model_folders

EMULATION = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def emulated_isa() -> str | None:
    """"AVX2 (emulated)" when the kernel libraries are held to AVX2 by the environment, else None."""
    values = {k: os.environ.get(k, "").upper() for k in EMULATION}
    return "AVX2 (emulated)" if values["ONEDNN_MAX_CPU_ISA"] == "AVX2" and values["ATEN_CPU_CAPABILITY"] == "AVX2" \
        else None


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
    args = parser.parse_args(argv)
    batch, tokens = (int(n) for n in args.shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folders([args.model], Path(tmp))[args.model]
        packed, reference = load_pair(folder, "cpu", "fp32")
        plain = load_pretrained(folder).eval()  # the engine without packed linears
    ids = torch.randint(1000, packed.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    runs = {"engine (packed)": packed, "engine (plain nn.Linear)": plain, "transformers": reference}
    totals, rows = {}, []
    for name, model in runs.items():
        def call(model=model):
            with torch.inference_mode():
                model(**inputs)
        times = profile(call, args.repeats)
        totals[name] = sum(times.values())
        for op, ms in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            rows.append({"impl": name, "op": op, "ms": ms, "share": ms / totals[name]})
    info = machine()
    isa = emulated_isa() or info["cpu_capability"]
    print(f"# self CPU time per forward, {args.model} {args.shape}, {info['cpu']} as {isa}, {info['threads']} threads; "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in totals.items()))
    print_table(rows, ["impl", "op", "ms", "share"])


if __name__ == "__main__":
    main()
