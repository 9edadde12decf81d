"""Split SQuAD 2.0 dev by article into a part QA may train on and parts it may not.

    python scripts/squad_v2_parts.py ../shared/data/squad/dev-v2.0.json runs/corpus [--articles 11]

No SQuAD 2.0 train set is available offline, and the constructions of plugins/qa_data.py (edits of
SQuAD 1.1 questions) only approximate the crowd's unanswerable questions. The dev file's first half
(its first 5,936 questions, the half `scripts/qa_calibrate.py` calibrates on) can lend real ones:

- `dev-v2-train.json`: the first `--articles` whole articles (11: Normans .. Amazon_rainforest,
  3,650 questions, 1,752 of them unanswerable), for training;
- `dev-v2-calibrate.json`: the rest of the first half's articles, whole (Ctenophora ..
  Civil_disobedience, 2,125 questions), for the training's evaluation and the threshold calibration.

The second half (questions 5,937 on; the article that straddles the middle is in neither file) stays
held out: the figures are reported on it. Refuses a split that would put a training article's
question in the second half. SQuAD 1.1 dev holds the same articles: a model trained on this part is
scored on v1.1 dev without them (`scripts/qa_calibrate.py --trained-on`). Deterministic.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dev", type=Path, help="SQuAD 2.0 dev JSON (dev-v2.0.json)")
    parser.add_argument("out", type=Path, help="folder to write dev-v2-train.json and dev-v2-calibrate.json")
    parser.add_argument("--articles", type=int, default=11, help="whole articles to train on (default 11)")
    args = parser.parse_args(argv)
    try:
        with open(args.dev, encoding="utf-8") as handle:
            document = json.load(handle)
        train, calibrate = parts(document["data"], args.articles)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"error: {args.dev}: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name, articles in (("dev-v2-train.json", train), ("dev-v2-calibrate.json", calibrate)):
        questions = [qa for article in articles for p in article["paragraphs"] for qa in p["qas"]]
        unanswerable = sum(bool(qa.get("is_impossible")) for qa in questions)
        (args.out / name).write_text(json.dumps({"version": document.get("version", "v2.0"), "data": articles}))
        print(f"{args.out / name}: {len(articles)} articles ({articles[0]['title']} .. {articles[-1]['title']}), "
              f"{len(questions)} questions, {unanswerable} unanswerable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
