"""One row through MiniLM's six layers: the engine's eager packed layers against the same layers traced by
TorchScript with oneDNN Graph fusion (tried for a visitor's short request, not shipped).

    python -m benchmarks.onednn_graph [--lengths 12,23,40] [--calls 400] [--json out.json]

Each variant runs in a process of its own (the fusion switch is global, and one process's weights would evict
the other's from the cache): per length, `--calls` timed calls after 20 untimed ones, the median. Then, in the
fused process, the cost of a length's first calls (the graph is compiled per input length) and of going back
to a length already seen. Outputs are compared with the eager layers'. Frozen TorchScript without the fusion
is timed too (nn.Linear through MKL, not the packed oneDNN matmuls).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from benchmarks.common import machine, print_table, write_json

VARIANTS = ("eager", "torchscript", "onednn_graph")


def _layers(variant: str, length: int):
    """(a callable running the six layers on (1, length, 384) inputs, the eager reference callable)."""
    from bert_engine import load_pretrained
    from bert_engine.checkpoints.hub import default_backbone
    from bert_engine.runtime.precision import prepare_for_inference

    model = load_pretrained(default_backbone()).eval()
    packed = prepare_for_inference(load_pretrained(default_backbone()), "fp32")

    def stack_of(encoder):
        class Stack(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers, self.schedule = encoder.layers, list(encoder.schedule)

            def forward(self, x):
                for i in self.schedule:
                    x, _ = self.layers[i](x, None)
                return x
        return Stack().eval()

    reference = stack_of(packed)
    if variant == "eager":
        return reference, reference
    torch.jit.enable_onednn_fusion(variant == "onednn_graph")
    with torch.no_grad():
        traced = torch.jit.freeze(torch.jit.trace(stack_of(model), (torch.randn(1, length, 384),), check_trace=False))
    return traced, reference


def _child(variant: str, lengths: list[int], calls: int) -> dict:
    """Run in a process of its own: the variant's median per length, its max |diff| to eager, and (traced
    variants) the first calls at a new length and at one seen before."""
    runner, reference = _layers(variant, lengths[0])
    rows = []
    with torch.no_grad():
        for length in lengths:
            x = torch.randn(1, length, 384, generator=torch.Generator().manual_seed(length))
            first = []
            for _ in range(3):
                start = time.perf_counter()
                out = runner(x)
                first.append(1e3 * (time.perf_counter() - start))
            for _ in range(20):
                runner(x)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                runner(x)
                times.append(time.perf_counter() - start)
            times.sort()
            rows.append({"length": length, "ms": round(1e3 * times[len(times) // 2], 3),
                         "first_3_calls_ms": [round(t, 1) for t in first],
                         "max_abs_diff": float((out - reference(x)).abs().max())})
        if variant != "eager":  # back to the first length, after the others
            x = torch.randn(1, lengths[0], 384)
            start = time.perf_counter()
            runner(x)
            back = 1e3 * (time.perf_counter() - start)
            rows[0]["back_to_a_seen_length_ms"] = round(back, 1)
    return {"variant": variant, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="12,23,40")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [int(v) for v in args.lengths.split(",")]
    if args.child:
        print(json.dumps(_child(args.child, lengths, args.calls)))
        return {}
    runs = {}
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, "-m", "benchmarks.onednn_graph", "--child", variant, "--lengths",
                               args.lengths, "--calls", str(args.calls)], capture_output=True, text=True, check=True)
        runs[variant] = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    rows = []
    for i, length in enumerate(lengths):
        eager = runs["eager"][i]["ms"]
        row = {"length": length, **{f"{v}_ms": runs[v][i]["ms"] for v in VARIANTS}}
        row["fused_speedup"] = round(eager / runs["onednn_graph"][i]["ms"], 3)
        row["fused_first_3_calls_ms"] = runs["onednn_graph"][i]["first_3_calls_ms"]
        row["fused_max_abs_diff"] = runs["onednn_graph"][i]["max_abs_diff"]
        rows.append(row)
    back = runs["onednn_graph"][0].get("back_to_a_seen_length_ms")
    result = {"machine": machine(), "calls": args.calls, "rows": rows, "fused_back_to_a_seen_length_ms": back}
    print(f"# MiniLM's six layers, one row: eager packed vs TorchScript (+ oneDNN Graph fusion), "
          f"{result['machine']['cpu']} ({result['machine']['cpu_capability']}); medians of {args.calls} calls")
    print_table(rows, list(rows[0]))
    print(f"fused graph, first call back at length {lengths[0]} after the others: {back} ms")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
