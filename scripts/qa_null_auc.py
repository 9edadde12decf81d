"""How well a QA model's null score tells unanswerable questions from answerable ones: the ROC AUC of
the null gap (the no-answer logit minus the best span's; higher means "no answer") on

- SQuAD 2.0 dev: its unanswerable questions against its answerable ones (the first --limit questions);
- swapped copies (`qa.read_data`'s "+swapped" on SQuAD 1.1 dev): each swapped question against the
  answerable original it was made from (the first --pairs pairs), the construction training uses.

    python scripts/qa_null_auc.py [--model FOLDER] [--limit 2000] [--pairs 600]

Prints one table row per set; 0.5 is chance, 1.0 a perfect separation.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bert_engine.inference import Predictor
from bert_engine.registry import load_registry
from plugins import qa

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "squad"


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive scores above a negative), ties counted half (the Mann-Whitney form of ROC AUC)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def gaps(predictor, items: list[dict]) -> list[float]:
    results = qa.predict_many(predictor, items, null_threshold=None, progress=True)
    return [r["no_answer"]["null_gap"] if r["no_answer"]["null_gap"] is not None else float("inf") for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="QA checkpoint (default: the starter)")
    parser.add_argument("--limit", type=int, default=2000, help="SQuAD 2.0 dev questions")
    parser.add_argument("--pairs", type=int, default=600, help="swapped SQuAD 1.1 dev questions and their originals")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    predictor = Predictor.load(load_registry(entry_points=False).task("qa"), args.model)

    v2 = list(qa.read_data(args.data / "dev-v2.0.json"))[:args.limit]
    scored = gaps(predictor, [inputs for inputs, _ in v2])
    unanswerable = [g for g, (_, t) in zip(scored, v2) if t["starts"][0] < 0]
    answerable = [g for g, (_, t) in zip(scored, v2) if t["starts"][0] >= 0]

    examples = list(qa.read_data(args.data / "dev-v1.1.json", "dev+swapped"))
    pairs = [(examples[i - 1][0], inputs) for i, (inputs, target) in enumerate(examples)
             if target["starts"] == [-1] and examples[i - 1][1]["starts"] != [-1]][:args.pairs]
    paired = gaps(predictor, [x for pair in pairs for x in pair])

    print(f"model: {args.model or 'the starter'}")
    print("| set | questions | null-gap ROC AUC |\n|---|---|---|")
    print(f"| SQuAD 2.0 dev, unanswerable vs answerable | {len(v2)} | {auc(unanswerable, answerable):.3f} |")
    print(f"| SQuAD 1.1 dev, swapped vs original | {2 * len(pairs)} | {auc(paired[1::2], paired[0::2]):.3f} |")


if __name__ == "__main__":
    main()
