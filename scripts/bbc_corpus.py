"""Write the BBC News articles of the summary task's train split as a plain-text corpus for masked-LM training.

    python scripts/bbc_corpus.py ../shared/data/bbc_news_summary/bbc_news_summary.jsonl runs/corpus/bbc-train.txt

One paragraph per line, a blank line between articles (the format `bert-engine train fill_mask` reads).
Only the articles `plugins.summary.split_of` puts in "train" (80 %) are written, so the summary task's
dev and test articles stay unseen by every starter model. Why: the fill-mask starter learnt from
nineteenth-century books and encyclopaedia paragraphs; news text has the everyday words ("credit card",
"this week") its cloze sentences miss. Deterministic: the same input writes the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins import summary  # noqa: E402
from scripts.squad_contexts import write_articles  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bbc", type=Path, help="the BBC News Summary JSON-lines file")
    parser.add_argument("out", type=Path, help="text file to write")
    args = parser.parse_args(argv)
    if not args.bbc.is_file():
        print(f"error: no BBC News Summary file at {args.bbc}", file=sys.stderr)
        return 2
    documents = ([p for p in (" ".join(line.split()) for line in inputs["text"].split("\n")) if p]
                 for inputs, _ in summary.read_data(args.bbc, "train"))
    count, words = write_articles(args.out, documents)
    print(f"{args.out}: {count} articles, {words:,} words (the summary task's train split)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
