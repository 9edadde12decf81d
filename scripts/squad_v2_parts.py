"""Split SQuAD 2.0 dev by article into a part QA may train on and parts it may not.

    python scripts/squad_v2_parts.py ../shared/data/squad/dev-v2.0.json runs/corpus [--articles 11]
        [--v1 ../shared/data/squad/dev-v1.1.json]

No SQuAD 2.0 train set is available offline, and the constructions of plugins/qa_data.py (edits of
SQuAD 1.1 questions) only approximate the crowd's unanswerable questions. The dev file's first half
(its first 5,936 questions, the half `scripts/qa_calibrate.py` calibrates on) can lend real ones:

- `dev-v2-train.json`: the first `--articles` whole articles (11: Normans .. Amazon_rainforest,
  3,650 questions, 1,752 of them unanswerable), for training;
- `dev-v2-calibrate.json`: the rest of the first half's articles, whole (Ctenophora ..
  Civil_disobedience, 2,125 questions), for the training's evaluation and the threshold calibration.

- `dev-v2-heldout.json`: the second half (questions 5,937 on, as `qa_metric.v2_scores` and
  qa_calibrate.py split it; of the article that straddles the middle, only its second-half questions):
  held out, the figures are reported on it;
- with --v1: `dev-v1.1-untrained.json`, SQuAD 1.1 dev less the training articles (v1.1 dev holds the
  same Wikipedia articles and most of the same answerable questions).

Refuses a split that would put a training article's question in the second half. Deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parts(data: list[dict], articles: int) -> tuple[list[dict], list[dict]]:
    """(training articles, calibration articles) of a SQuAD 2.0 file's `data`: the first `articles`
    whole articles, then the following whole articles that still lie in the first half of the questions.

    Raises:
        ValueError: the training articles reach into the second half, or none would be left to calibrate.
    """
    sizes = [sum(len(p["qas"]) for p in article["paragraphs"]) for article in data]
    half = sum(sizes) // 2
    if articles < 1 or sum(sizes[:articles]) > half:
        raise ValueError(f"--articles {articles}: the training part must be at least one article and lie in the "
                         f"first {half} questions (the first {articles} articles hold {sum(sizes[:articles])})")
    end = articles
    while end < len(data) and sum(sizes[:end + 1]) <= half:
        end += 1
    if end == articles:
        raise ValueError(f"--articles {articles}: no whole article of the first half is left to calibrate on")
    return data[:articles], data[articles:end]


def second_half(data: list[dict]) -> list[dict]:
    """The articles of a SQuAD 2.0 file's `data` cut to the questions of its second half (paragraphs
    left without a question dropped)."""
    half = sum(len(p["qas"]) for article in data for p in article["paragraphs"]) // 2
    seen, out = 0, []
    for article in data:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            kept = [qa for k, qa in enumerate(paragraph["qas"]) if seen + k >= half]
            seen += len(paragraph["qas"])
            if kept:
                paragraphs.append({**paragraph, "qas": kept})
        if paragraphs:
            out.append({**article, "paragraphs": paragraphs})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dev", type=Path, help="SQuAD 2.0 dev JSON (dev-v2.0.json)")
    parser.add_argument("out", type=Path, help="folder to write dev-v2-train.json, dev-v2-calibrate.json, "
                        "dev-v2-heldout.json (and with --v1 dev-v1.1-untrained.json)")
    parser.add_argument("--articles", type=int, default=11, help="whole articles to train on (default 11)")
    parser.add_argument("--v1", type=Path, help="SQuAD 1.1 dev JSON: also write it less the training articles")
    args = parser.parse_args(argv)
    try:
        with open(args.dev, encoding="utf-8") as handle:
            document = json.load(handle)
        train, calibrate = parts(document["data"], args.articles)
        written = [("dev-v2-train.json", document, train), ("dev-v2-calibrate.json", document, calibrate),
                   ("dev-v2-heldout.json", document, second_half(document["data"]))]
        if args.v1 is not None:
            with open(args.v1, encoding="utf-8") as handle:
                v1 = json.load(handle)
            titles = {article["title"] for article in train}
            written.append(("dev-v1.1-untrained.json", v1, [a for a in v1["data"] if a["title"] not in titles]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"error: {args.dev}: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name, source, articles in written:
        questions = [qa for article in articles for p in article["paragraphs"] for qa in p["qas"]]
        unanswerable = sum(bool(qa.get("is_impossible")) for qa in questions)
        (args.out / name).write_text(json.dumps({"version": source.get("version", ""), "data": articles}))
        print(f"{args.out / name}: {len(articles)} articles ({articles[0]['title']} .. {articles[-1]['title']}), "
              f"{len(questions)} questions, {unanswerable} unanswerable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
