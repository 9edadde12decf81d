"""Does the fill-mask model copy visible words too often? Top-1 with a logit penalty on every word visible
elsewhere in the passage, at several strengths, over held-out text (a diagnosis, not a decoding mode).

    python scripts/fill_mask_copy_penalty.py runs/corpus/squad-dev.txt [--model plugins/starter/fill_mask] [--limit 400]

The passages are masked as `bert-engine eval fill_mask` masks them (15 %, 80/10/10, seed 0). A masked position's
own input token (the 10 % left unchanged) does not count as visible. Prints, per penalty, top-1 and how often the
top-1 is a visible word, beside how often the true word is.
"""

from __future__ import annotations

import argparse

import torch

from bert_engine.heads import IGNORE_INDEX
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import fill_mask

PENALTIES = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="plain text (a file or a folder), read as fill_mask's passages")
    parser.add_argument("--model", default=None, help="fill-mask model (default: the starter)")
    parser.add_argument("--split", default="all")
    parser.add_argument("--limit", type=int, default=400)
    args = parser.parse_args(argv)
    predictor = Predictor.load(load_registry(entry_points=False).task("fill_mask"), args.model)
    model, tokenizer = predictor.model, predictor.tokenizer
    examples = list(fill_mask.read_data(args.data, args.split))[:args.limit]
    generator = torch.Generator().manual_seed(0)
    right = dict.fromkeys(PENALTIES, 0)
    visible_top = dict.fromkeys(PENALTIES, 0)
    masked = visible_truth = 0
    with torch.inference_mode():
        for start in range(0, len(examples), 64):
            batch, labels = fill_mask.training_batch(examples[start:start + 64], tokenizer, generator=generator)
            output = model(**batch.model_inputs())
            chosen = labels != IGNORE_INDEX
            logits = output.head.logits(output.hidden_states[chosen]).float()  # (M, V)
            rows, cols = chosen.nonzero(as_tuple=True)
            ids = batch.input_ids
            counts = torch.zeros(ids.shape[0], logits.shape[1])
            for r in range(ids.shape[0]):
                real = batch.attention_mask[r].bool()
                counts[r].index_add_(0, ids[r][real], torch.ones(int(real.sum())))
            visible = counts[rows]
            visible[torch.arange(len(rows)), ids[rows, cols]] -= 1  # a position's own input token is not "elsewhere"
            visible = visible > 0
            truth = labels[chosen]
            masked += len(rows)
            visible_truth += int(visible[torch.arange(len(rows)), truth].sum())
            for penalty in PENALTIES:
                top = (logits - penalty * visible.float()).argmax(-1)
                right[penalty] += int((top == truth).sum())
                visible_top[penalty] += int(visible[torch.arange(len(rows)), top].sum())
    print(f"# {args.data}: {len(examples)} passages, {masked:,} masked tokens; the true word is visible elsewhere "
          f"{100 * visible_truth / masked:.1f} % of the time")
    print("penalty  top-1 %  top-1 visible %")
    for penalty in PENALTIES:
        print(f"{penalty:7.1f}  {100 * right[penalty] / masked:7.2f}  {100 * visible_top[penalty] / masked:15.1f}")


if __name__ == "__main__":
    main()
