"""int8 with and without the fused (torch.compile'd) input quantisers, timed in turn on the same inputs.

    python -m benchmarks.int8_fused [--shapes 1x128,8x128,32x128] [--rounds 12] [--json out.json]

Loads MiniLM (the offline backbone) twice in int8: as `precision="int8"` loads it, and with
`compile=True` (each projection's input quantiser compiled; used on inputs of fast.FUSED_MIN_ROWS rows
and more). Per shape: one call of each (the first compiled call compiles; outputs compared), two warm-up
rounds, then `--rounds` rounds, each timing one call of each in turn (benchmarks.common.interleaved); medians, their ratio, and the outputs' max |difference|.
Needs a C++ compiler (torch.compile's CPU backend); without one the second model runs uncompiled and
the ratio reads about 1.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import interleaved, machine, median, print_table, write_json


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x128,8x128,32x128", help="BxT,... (batch x tokens)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    from bert_engine import load_pretrained
    from bert_engine.checkpoints.hub import default_backbone
    from bert_engine.runtime.precision import prepare_for_inference

    eager = prepare_for_inference(load_pretrained(default_backbone()), "int8")
    fused = prepare_for_inference(load_pretrained(default_backbone()), "int8", compile=True)
    rows = []
    for shape in args.shapes.split(","):
        batch, tokens = (int(v) for v in shape.split("x"))
        ids = torch.randint(1000, 30000, (batch, tokens), generator=torch.Generator().manual_seed(batch * 1000 + tokens))
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            diff = float((eager(ids, mask).last_hidden_state - fused(ids, mask).last_hidden_state).abs().max())
            times = interleaved({"eager": lambda ids=ids, mask=mask: eager(ids, mask),
                                  "fused": lambda ids=ids, mask=mask: fused(ids, mask)}, args.rounds)
        e, f = (1e3 * median(times[k]) for k in ("eager", "fused"))
        rows.append({"shape": shape, "rows": batch * tokens, "eager_ms": round(e, 2), "fused_ms": round(f, 2),
                     "speedup": round(e / f, 3), "max_abs_diff": diff})
    result = {"machine": machine(), "rounds": args.rounds, "rows": rows}
    print(f"# int8, eager vs fused quantisers (MiniLM), {result['machine']['cpu']} "
          f"({result['machine']['cpu_capability']}); medians of {args.rounds} rounds in turn")
    print_table(rows, list(rows[0]))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
