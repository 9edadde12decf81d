"""Write the Wikipedia paragraphs of SQuAD files as a plain-text corpus for masked-LM training.

    python scripts/squad_contexts.py "../shared/data/squad/train-v1.1.part0*of08.json" runs/corpus/squad-train.txt

One paragraph per line, a blank line between articles (the format `bert-engine train fill_mask` and
`bert-engine pretrain` read). The starter fill-mask model trains on these beside Gutenberg, so it
sees encyclopaedic text ("The capital of France is ..."), not only nineteenth-century fiction; its
WikiText-2 evaluation articles share no title with SQuAD's train articles (checked when this was
written: 0 of 62 test titles). Deterministic: the same input writes the same bytes.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path


def articles(paths: list[str]):
    """(title, [paragraph, ...]) per article, in file order."""
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        for article in data.get("data", []):
            paragraphs = [" ".join(p["context"].split()) for p in article.get("paragraphs", [])]
            yield article.get("title", ""), [p for p in paragraphs if p]


def write_articles(path: Path, documents) -> tuple[int, int]:
    """Each document (a list of paragraphs) as one paragraph per line, a blank line after it (the
    format `bert-engine train fill_mask` reads); empty documents skipped. Returns (documents, words)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = words = 0
    with open(path, "w", encoding="utf-8") as out:
        for paragraphs in documents:
            if paragraphs:
                out.write("\n".join(paragraphs) + "\n\n")
                count += 1
                words += sum(len(p.split()) for p in paragraphs)
    return count, words


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("squad", help="SQuAD JSON file or glob pattern of shards")
    parser.add_argument("out", type=Path, help="text file to write")
    args = parser.parse_args(argv)
    paths = sorted(glob.glob(args.squad)) or [args.squad]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        print(f"error: no SQuAD file at {missing[0]}", file=sys.stderr)
        return 2
    count, words = write_articles(args.out, (paragraphs for _, paragraphs in articles(paths)))
    print(f"{args.out}: {count} articles, {words:,} words from {len(paths)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
