"""Fill-mask on whole words, as a visitor uses it: one word of running text replaced by one [MASK],
the model's top-1 / top-5 words compared with it, split into content and function words
(plugins/fill_mask_words.py says how words are drawn and scored).

    python scripts/fill_mask_whole_words.py [--model FOLDER] [--data ../shared/data/wikitext2/wiki.test.tokens]
        [--words 1000] [--seed 0] [--json OUT]

Words are drawn from the file's passages (`fill_mask.read_data`, split "all"), so `bert-engine eval
fill_mask --data FILE --split all` reports the same figures (words_top1, content_top1, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import fill_mask
from plugins.fill_mask_words import draw_words, score_words

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.tokens"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="fill-mask checkpoint (default: the starter)")
    parser.add_argument("--data", type=Path, default=DATA,
                        help="a text file or folder to draw words from (default: WikiText-2 test in ../shared/data, "
                        "the datasets folder beside the repository)")
    parser.add_argument("--words", type=int, default=1000, help="how many words to draw (default: 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.data.exists():
        parser.error(f"--data: no text file or folder at {args.data} (point it at WikiText-2's wiki.test.tokens, "
                     "or any plain text)")
    if args.words < 1:
        parser.error(f"--words must be at least 1, got {args.words}")
    predictor = Predictor.load(load_registry(entry_points=False).task("fill_mask"), args.model)
    passages = [inputs["text"] for inputs, _ in fill_mask.read_data(str(args.data), "all")]
    scores = score_words(predictor, draw_words(passages, args.words, args.seed), progress=True)
    figures = {"model": args.model or "the starter", "data": args.data.name, "seed": args.seed,
               **{kind: {"words": f["words"], "top1": round(100 * f["top1"], 1), "top5": round(100 * f["top5"], 1),
                         # the counts, so that runs over other words (another --seed) add up exactly
                         "top1_right": round(f["top1"] * f["words"]), "top5_right": round(f["top5"] * f["words"])}
                  for kind, f in scores.items()}}
    print("| words | count | top-1 % | top-5 % |\n|---|---|---|---|")
    for kind in ("all", "content", "function"):
        print(f"| {kind} | {figures[kind]['words']} | {figures[kind]['top1']} | {figures[kind]['top5']} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
