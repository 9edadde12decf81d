"""The slow requests of the hardening review, timed on the starter models: each is now refused up front
(InputError) or runs in bounded time. Prints the machine (CPU capability included) and one row each.

    python -m benchmarks.request_costs [--json FILE]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks.common import machine, print_table, write_json
from bert_engine.hookspecs import InputError
from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.registry import load_registry
from plugins.summary import mmr_select

SENTENCE = "The committee met on Tuesday to discuss the budget for next year. "

CASES = [  # (name, task, inputs, options)
    ("summary, 1,990 sentences, auto", "summary", {"text": SENTENCE * 1990}, {}),
    ("summary, 1,990 sentences, centroid", "summary", {"text": SENTENCE * 1990}, {"mode": "centroid"}),
    ("fill-mask, 2,000 target words", "fill_mask", {"text": "The capital of France is [MASK]."},
     {"targets": [f"word{i}" for i in range(2000)]}),
    ("fill-mask, a target of 600 pieces", "fill_mask", {"text": "The capital of France is [MASK]."},
     {"targets": ["the " * 600]}),
    ("fill-mask, 100 targets", "fill_mask", {"text": "The capital of France is [MASK]."},
     {"targets": [f"word{i}" for i in range(100)]}),
    ("sentiment, 1 MB with windows", "sentiment", {"text": "good movie. " * 83_000}, {"long_input": "windows"}),
    ("sentiment, 0.5 + 0.5 MB pair with windows", "sentiment",
     {"text": "good movie. " * 41_000, "pair": "bad film. " * 50_000}, {"long_input": "windows"}),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="also write the rows and the machine here")
    args = parser.parse_args(argv)  # (--help said nothing and ran the whole benchmark)
    registry = load_registry(entry_points=False)
    predictors = {}
    rows = []
    for name, task, inputs, options in CASES:
        predictor = predictors.get(task) or predictors.setdefault(task, Predictor.load(registry.task(task)))
        start = time.perf_counter()
        try:
            predictor.predict(inputs, **options)
            outcome = "answered"
        except InputError as err:
            outcome = "refused: " + str(err)[:90]
        rows.append({"request": name, "s": time.perf_counter() - start, "outcome": outcome})
    for n in (500, 1000, 2000):
        embeddings, scores = torch.randn(n, 384), torch.rand(n)
        start = time.perf_counter()
        mmr_select(scores, embeddings, list(range(n)), math.ceil(0.3 * n), 0.7)
        rows.append({"request": f"MMR alone, {n:,} sentences", "s": time.perf_counter() - start, "outcome": "chosen"})
    info = machine()
    print(info)
    print_table(rows, ["request", "s", "outcome"])
    write_json(args.json, {"machine": info, "rows": rows})


if __name__ == "__main__":
    main()
