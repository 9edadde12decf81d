"""int8 with and without the fused (torch.compile'd) input quantisers, timed in turn on the same inputs.

    python -m benchmarks.int8_fused [--shapes 1x128,8x128,32x128] [--rounds 12] [--json out.json]

Loads MiniLM (the offline backbone) twice in int8: as `precision="int8"` loads it, and with
`compile=True` (each projection's input quantiser compiled; used on inputs of fast.FUSED_MIN_ROWS rows
and more). Per shape: three warm-up calls of each (the first compiled call compiles), then `--rounds`
rounds, each timing one call of each in turn; medians, their ratio, and the outputs' max |difference|.
Needs a C++ compiler (torch.compile's CPU backend); without one the second model runs uncompiled and
the ratio reads about 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import machine


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x128,8x128,32x128", help="BxT,... (batch x tokens)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
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
        times = {"eager": [], "fused": []}
        with torch.inference_mode():
            diff = float((eager(ids, mask).last_hidden_state - fused(ids, mask).last_hidden_state).abs().max())
            for _ in range(2):
                eager(ids, mask), fused(ids, mask)
            for _ in range(args.rounds):
                for name, model in (("eager", eager), ("fused", fused)):
                    start = time.perf_counter()
                    model(ids, mask)
                    times[name].append(time.perf_counter() - start)
        e, f = (1e3 * statistics.median(times[k]) for k in ("eager", "fused"))
        rows.append({"shape": shape, "rows": batch * tokens, "eager_ms": round(e, 2), "fused_ms": round(f, 2),
                     "speedup": round(e / f, 3), "max_abs_diff": diff})
    result = {"machine": machine(), "command": " ".join(["python -m benchmarks.int8_fused", *(sys.argv[1:] if argv is None else argv)]),
              "rounds": args.rounds, "rows": rows}
    print(f"# int8, eager vs fused quantisers (MiniLM), {result['machine'].get('cpu')}; medians of {args.rounds} "
          "rounds in turn")
    print("shape    rows    eager ms  fused ms  speed-up  max |diff|")
    for r in rows:
        print(f"{r['shape']:8} {r['rows']:6}  {r['eager_ms']:8.1f}  {r['fused_ms']:8.1f}  {r['speedup']:7.2f}x  "
              f"{r['max_abs_diff']:.2e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
