"""Write single sentences of a fill-mask training corpus, one per paragraph, for masked-LM training.

    python scripts/sentence_corpus.py ../shared/data/gutenberg,runs/corpus/squad-train.txt runs/corpus/sentences.txt

Why: trained on 80-word passages only, the starter model learns that the masked word is often
another word of the passage (45 % of masked tokens are) and over-uses that: its top-1 is a
visible word 59 % of the time, and a visitor's single sentence gets its own words back ("Paris is
the capital of [MASK]." -> "paris"). Single sentences, where a copied word is rarely right, are
what the playground's tab is given.

Only sentences lying wholly inside a passage of the "train" split (fill_mask.read_data's hash
split) are written, so the held-out "test" passages stay unseen. Sentences of 8 to 60 words.
Deterministic: the same input writes the same bytes.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bert_engine.training.pretraining import read_documents  # noqa: E402
from plugins.fill_mask import PASSAGE_WORDS, held_out  # noqa: E402

# a sentence ends at . ! or ? (and any closing quotes or brackets) before a space and a capital,
# a digit or an opening quote; enough for training text, where a rare wrong split costs little
_END = re.compile(r"""(?<=[.!?])["'\u201d\u2019)\]]*\s+(?=["'\u201c\u2018(\[]?[A-Z0-9])""")
MIN_WORDS, MAX_WORDS = 8, 60


def train_sentences(document: list[str]):
    """The sentences (as word lists) of one document that lie inside one of its train passages."""
    words = " ".join(document).split()
    text = " ".join(words)
    held = [held_out(" ".join(words[start:start + PASSAGE_WORDS])) for start in range(0, len(words), PASSAGE_WORDS)]
    first_word = 0
    for piece in _END.split(text):
        sentence = piece.split()
        start, end = first_word, first_word + len(sentence)  # word range [start, end)
        first_word = end
        if not MIN_WORDS <= len(sentence) <= MAX_WORDS:
            continue
        if start // PASSAGE_WORDS != (end - 1) // PASSAGE_WORDS or held[start // PASSAGE_WORDS]:
            continue  # crosses a passage boundary, or lies in a held-out passage
        yield sentence


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", help="text files or folders, comma-separated (fill_mask's training format)")
    parser.add_argument("out", type=Path, help="text file to write")
    args = parser.parse_args(argv)
    count = 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as out:
        for source in args.sources.split(","):
            for document in read_documents(source):
                for sentence in train_sentences(document):
                    out.write(" ".join(sentence) + "\n\n")
                    count += 1
    print(f"{count} sentences -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
