"""What the int8 input rotation costs: a task starter's encoder in fp32 (packed) and in int8 with and
without rotation (bert_engine.runtime.fast.quantize_int8(rotation=)), interleaved, per input shape.

    python -m benchmarks.int8_rotation                                  # QA starter, 1x128 / 32x128 / 8x512
    python -m benchmarks.int8_rotation --task sentiment --blocks 8,16 --shapes 32x128

Agreement with fp32 (what the rotation buys) is benchmarks.int8_sensitivity's (its "no rotation" row).
"""

from __future__ import annotations

import argparse
import copy
import logging

import torch

from benchmarks.common import interleaved, machine, median, print_table, write_json


def main(argv: list[str] | None = None) -> None:
    from bert_engine.runtime.fast import ROTATION_BLOCK, pack_linear_layers, quantize_int8
    from bert_engine.runtime.inference import Predictor
    from bert_engine.tasks.registry import load_registry

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="qa", help="whose starter model to time (the encoder only)")
    parser.add_argument("--shapes", default="1x128,32x128,8x512", help="BATCHxTOKENS, comma-separated")
    parser.add_argument("--blocks", default=str(ROTATION_BLOCK), help="rotation block sizes to time beside none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    task = load_registry(entry_points=False).task(args.task)
    plain = Predictor.load(task, precision="fp32", pack=False).model
    contenders = {"fp32": pack_linear_layers(copy.deepcopy(plain)).encoder,
                  "int8, no rotation": quantize_int8(copy.deepcopy(plain), rotation=None).encoder}
    for block in (int(b) for b in args.blocks.split(",")):
        contenders[f"int8, rotation {block}"] = quantize_int8(copy.deepcopy(plain), rotation=block).encoder
    rows = []
    for shape in args.shapes.split(","):
        batch, tokens = (int(v) for v in shape.split("x"))
        ids = torch.randint(1000, 20000, (batch, tokens), generator=torch.Generator().manual_seed(0))

        def run(encoder, ids=ids):
            def call():
                with torch.inference_mode():
                    encoder(input_ids=ids)
            return call

        times = interleaved({name: run(encoder) for name, encoder in contenders.items()}, args.repeats)
        base = median(times["fp32"])
        rows += [{"shape": shape, "model": name, "ms": 1000 * median(t), "vs_fp32": base / median(t)}
                 for name, t in times.items()]
    info = machine()
    print(f"# {args.task} starter's encoder, {info['cpu']} ({info['cpu_capability']}), {info['threads']} threads; "
          f"median of {args.repeats} interleaved rounds")
    print_table(rows, ["shape", "model", "ms", "vs_fp32"])
    write_json(args.json, {"machine": info, "rows": rows})


if __name__ == "__main__":
    main()
