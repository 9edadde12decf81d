"""Fill-mask on everyday cloze sentences: where the expected word ranks, per model.

Thirty short sentences of common facts and usage ("The capital of France is [MASK].", "Birds can
[MASK].") written once, before any model was scored on them, and never used for training or for
choosing a checkpoint: the kind of sentence a visitor types into the tab, where the held-out passage
splits measure running text.

    python scripts/fill_mask_probes.py [MODEL ...]     # default: the starter

Prints, per model, how many expected words rank first and in the top five, the mean reciprocal rank
(over the top 50), and each sentence's first answer.
"""

from __future__ import annotations

import argparse
import logging

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry

PROBES = [("The capital of France is [MASK].", "paris"), ("The capital of Italy is [MASK].", "rome"),
    ("The capital of Japan is [MASK].", "tokyo"), ("The capital of England is [MASK].", "london"),
    ("Berlin is the capital of [MASK].", "germany"), ("The sun rises in the [MASK].", "east"),
    ("Water freezes at zero [MASK].", "degrees"), ("A week has seven [MASK].", "days"),
    ("She drank a cup of hot [MASK].", "tea"), ("The cat chased the [MASK].", "mouse"),
    ("He played the [MASK] in the band.", "guitar"), ("She plays the [MASK] in an orchestra.", "violin"),
    ("The doctor works in a [MASK].", "hospital"), ("Birds can [MASK].", "fly"),
    ("It was a dark and stormy [MASK].", "night"), ("The opposite of hot is [MASK].", "cold"),
    ("Christmas is celebrated in [MASK].", "december"), ("The earth goes around the [MASK].", "sun"),
    ("He opened the [MASK] and walked into the room.", "door"), ("I need a [MASK] to cut the paper.", "knife"),
    ("The children went to [MASK] in the morning.", "school"), ("The sky is [MASK].", "blue"),
    ("Shakespeare wrote many [MASK].", "plays"), ("The moon orbits the [MASK].", "earth"),
    ("A dog is a kind of [MASK].", "animal"), ("Snow is [MASK].", "white"), ("He wrote a letter with a [MASK].", "pen"),
    ("The train arrived at the [MASK].", "station"), ("She bought bread at the [MASK].", "bakery"),
    ("Einstein was a famous [MASK].", "physicist")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=[None], help="fill-mask models (default: the starter)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    task = load_registry(entry_points=False).task("fill_mask")
    print("| model | top-1 | top-5 | MRR | first answers |\n|---|---|---|---|---|")
    for model in args.models:
        predictor = Predictor.load(task, model)
        top1 = top5 = 0
        reciprocal, firsts = 0.0, []
        for text, expected in PROBES:
            candidates = predictor.predict({"text": text}, top_k=50)["result"]["predictions"][0]["candidates"]
            words = [c["token"] for c in candidates]
            rank = words.index(expected) + 1 if expected in words else None
            top1 += rank == 1
            top5 += rank is not None and rank <= 5
            reciprocal += 1 / rank if rank else 0.0
            firsts.append(words[0])
        print(f"| {model or 'the starter'} | {top1}/{len(PROBES)} | {top5}/{len(PROBES)} | "
              f"{reciprocal / len(PROBES):.3f} | {' '.join(firsts)} |")


if __name__ == "__main__":
    main()
