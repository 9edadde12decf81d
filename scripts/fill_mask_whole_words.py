"""Fill-mask on whole words, as a visitor uses it: one word of running text replaced by one [MASK],
the model's top-1 / top-5 words compared with it, split into content words (nouns, verbs, adjectives,
adverbs, numbers: anything not in FUNCTION_WORDS) and function words.

    python scripts/fill_mask_whole_words.py [--model FOLDER] [--data ../shared/data/wikitext2/wiki.test.tokens]
        [--words 1000] [--seed 0] [--json OUT]

Words are drawn uniformly (seed 0) from the alphabetic or numeric whitespace-separated words of the
file's passages (`fill_mask.read_data`, split "all"); punctuation and WikiText's "@-@" marks are never
drawn. A word the tokenizer splits into several pieces still gets one [MASK] (what a visitor types), so
the model can only get it right by naming the whole word. Case is ignored (the starter is uncased).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from pathlib import Path

from tqdm.auto import tqdm

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import fill_mask

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.tokens"
# Closed-class English words (determiners, pronouns, prepositions, conjunctions, auxiliaries, particles).
FUNCTION_WORDS = frozenset("""
a an the this that these those my your his her its our their some any no every each either neither all both
i me you he him she it we us they them myself yourself himself herself itself ourselves themselves who whom
whose which what whatever whoever one ones
of in on at by for with from to into onto upon about above below over under between among through during
before after since until till against within without along across around behind beyond near off out up down
as than like via per despite toward towards
and or but nor so yet because although though while whereas if unless whether when where why how then
be am is are was were been being have has had having do does did done can could may might must shall should
will would not n't 's 'd 'll 're 've there here also only just very too more most less least such same other
""".split())


def draw_words(path: Path, count: int, seed: int) -> list[tuple[str, str]]:
    """(masked text, the hidden word) for `count` words drawn uniformly from the file's passages."""
    passages = [inputs["text"] for inputs, _ in fill_mask.read_data(str(path), "all")]
    slots = [(p, i) for p, text in enumerate(passages) for i, word in enumerate(text.split())
             if re.fullmatch(r"[A-Za-z]+|\d+", word)]
    chosen = random.Random(seed).sample(slots, min(count, len(slots)))
    out = []
    for p, i in chosen:
        words = passages[p].split()
        out.append((" ".join(words[:i] + ["[MASK]"] + words[i + 1:]), words[i]))
    return out


def score(predictor, items: list[tuple[str, str]]) -> dict:
    """Top-1 / top-5 shares over all words, content words and function words."""
    tallies = {kind: {"words": 0, "top1": 0, "top5": 0} for kind in ("all", "content", "function")}
    for text, word in tqdm(items, desc="whole words", unit="word"):
        result = predictor.predict({"text": text}, top_k=5)["result"]
        guesses = [c["token"].lower() for c in result["predictions"][0]["candidates"]]
        kind = "function" if word.lower() in FUNCTION_WORDS else "content"
        for key in ("all", kind):
            tallies[key]["words"] += 1
            tallies[key]["top1"] += guesses[:1] == [word.lower()]
            tallies[key]["top5"] += word.lower() in guesses
    return {kind: {"words": t["words"], "top1": round(100 * t["top1"] / max(t["words"], 1), 1),
                   "top5": round(100 * t["top5"] / max(t["words"], 1), 1)} for kind, t in tallies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="fill-mask checkpoint (default: the starter)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--words", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    predictor = Predictor.load(load_registry(entry_points=False).task("fill_mask"), args.model)
    figures = {"model": args.model or "the starter", "data": args.data.name, "seed": args.seed,
               **score(predictor, draw_words(args.data, args.words, args.seed))}
    print("| words | count | top-1 % | top-5 % |\n|---|---|---|---|")
    for kind in ("all", "content", "function"):
        print(f"| {kind} | {figures[kind]['words']} | {figures[kind]['top1']} | {figures[kind]['top5']} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
