"""How well a QA model's null score tells unanswerable questions from answerable ones: the ROC AUC of
the null gap (the no-answer logit minus the best span's; higher means "no answer") on

- SQuAD 2.0 dev: its unanswerable questions against its answerable ones (the first --limit questions);
- swapped copies (`qa.read_data`'s "+swapped" on SQuAD 1.1 dev): each swapped question against the
  answerable original it was made from (the first --pairs pairs), the construction training uses.

    python scripts/qa_null_auc.py [--model FOLDER] [--limit 2000] [--pairs 600] [--scores]

Prints one table row per set; 0.5 is chance, 1.0 a perfect separation. --scores adds, on SQuAD 2.0 dev, the
other "no answer" scores a decision rule could use instead of the null gap (each oriented so that higher
means "no answer"): the null logit, the null probability, minus the best span's logit, minus its
probability, minus the margin between the two best spans' probabilities.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from qa_calibrate import need_files  # this folder's

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins import qa

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "squad"


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive scores above a negative), ties counted half (the Mann-Whitney form of ROC AUC)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def _gap(result: dict) -> float:
    gap = result["no_answer"]["null_gap"]
    return float("inf") if gap is None else gap  # no span at all: as sure of "no answer" as it gets


def _span(result: dict, rank: int, key: str) -> float:
    answers = result["answers"]
    return answers[rank][key] if len(answers) > rank else 0.0


SCORES = {  # name -> a result's "no answer" score, higher meaning no answer
    "null gap": _gap,
    "null logit": lambda r: r["no_answer"]["logit"],
    "null probability": lambda r: r["no_answer"]["score"],
    "minus the best span's logit": lambda r: -_span(r, 0, "logit") if r["answers"] else float("inf"),
    "minus the best span's probability": lambda r: -_span(r, 0, "score"),
    "minus the two best spans' probability margin": lambda r: _span(r, 1, "score") - _span(r, 0, "score"),
}


def results(predictor, items: list[dict]) -> list[dict]:
    return qa.predict_many(predictor, items, null_threshold=None, top_k=2, progress=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="QA checkpoint (default: the starter)")
    parser.add_argument("--limit", type=int, default=2000, help="SQuAD 2.0 dev questions")
    parser.add_argument("--pairs", type=int, default=600, help="swapped SQuAD 1.1 dev questions and their originals")
    parser.add_argument("--scores", action="store_true", help="also the AUC of other no-answer scores on SQuAD 2.0 dev")
    parser.add_argument("--data", type=Path, default=DATA,
                        help=f"the folder holding dev-v2.0.json and dev-v1.1.json (default: {DATA})")
    args = parser.parse_args()
    need_files(parser, args.data, "dev-v2.0.json", "dev-v1.1.json")
    logging.basicConfig(level=logging.WARNING)
    predictor = Predictor.load(load_registry(entry_points=False).task("qa"), args.model)

    v2 = list(qa.read_data(args.data / "dev-v2.0.json"))[:args.limit]
    v2_results = results(predictor, [inputs for inputs, _ in v2])
    impossible = [t["starts"][0] < 0 for _, t in v2]

    def v2_auc(score) -> float:
        values = [score(r) for r in v2_results]
        return auc([v for v, no in zip(values, impossible) if no], [v for v, no in zip(values, impossible) if not no])

    examples = list(qa.read_data(args.data / "dev-v1.1.json", "dev+swapped"))
    pairs = [(examples[i - 1][0], inputs) for i, (inputs, target) in enumerate(examples)
             if target["starts"] == [-1] and examples[i - 1][1]["starts"] != [-1]][:args.pairs]
    paired = [_gap(r) for r in results(predictor, [x for pair in pairs for x in pair])]

    print(f"model: {args.model or 'the starter'}")
    print("| set | questions | null-gap ROC AUC |\n|---|---|---|")
    print(f"| SQuAD 2.0 dev, unanswerable vs answerable | {len(v2)} | {v2_auc(_gap):.3f} |")
    print(f"| SQuAD 1.1 dev, swapped vs original | {2 * len(pairs)} | {auc(paired[1::2], paired[0::2]):.3f} |")
    if args.scores:
        print("\n| SQuAD 2.0 dev, unanswerable vs answerable, by | ROC AUC |\n|---|---|")
        for name, score in SCORES.items():
            print(f"| {name} | {v2_auc(score):.3f} |")


if __name__ == "__main__":
    main()
