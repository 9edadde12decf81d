"""Build plugins/qa_antonyms.tsv, the antonym list behind QA's "+antonym" unanswerable questions.

Reads WordNet 3.0's antonym pointers ("!" in data.adj / data.adv / data.verb / data.noun, format in
wndb(5); Debian: `apt-get install wordnet-base` puts them in /usr/share/wordnet) and keeps the pairs of
single lower-case words that both occur at least --min-count times in a corpus (SQuAD 1.1 train's
questions and paragraphs by default), so the list holds words questions really use. Regular inflections
(larger/largest, increased/increasing, wins, ...) are added where both inflected forms occur in the corpus
too; four irregular comparatives are added by hand (better/worse, best/worst, more/less, most/least).

    python scripts/build_antonyms.py [--wordnet /usr/share/wordnet] [--corpus "../shared/data/squad/train-v1.1.part0*of08.json"]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "plugins" / "qa_antonyms.tsv"
POS_FILES = {"adj": "data.adj", "adv": "data.adv", "verb": "data.verb", "noun": "data.noun"}
HAND = [("better", "worse", "adj"), ("best", "worst", "adj"), ("more", "less", "adj"), ("most", "least", "adj")]
VOWELS = set("aeiou")


def wordnet_pairs(folder: Path) -> set[tuple[str, str, str]]:
    """(word, antonym, pos) for every lexical antonym pointer of WordNet's data files."""
    pairs = set()
    for pos, name in POS_FILES.items():
        offsets: dict[str, list[str]] = {}
        pointers = []
        for line in (folder / name).read_text(encoding="latin-1").splitlines():
            if line.startswith("  "):  # the licence header
                continue
            fields = line.split(" | ")[0].split()
            offset, count = fields[0], int(fields[3], 16)
            words = [re.sub(r"\(.*\)$", "", w).lower() for w in fields[4:4 + 2 * count:2]]
            offsets[offset] = words
            at = 4 + 2 * count
            for p in range(int(fields[at])):
                symbol, target, _, link = fields[at + 1 + 4 * p: at + 5 + 4 * p]
                if symbol == "!":
                    pointers.append((words[int(link[:2], 16) - 1], target, int(link[2:], 16) - 1))
        for word, target, index in pointers:
            other = offsets.get(target, [])
            if 0 <= index < len(other):
                pairs.add((word, other[index], pos))
    return pairs


def inflections(word: str, pos: str) -> list[tuple[str, str]]:
    """(form, kind) regular inflections: comparative/superlative, plural/third person, past, -ing."""
    if pos == "adj":
        if word.endswith("e"):
            return [(word + "r", "er"), (word + "st", "est")]
        if word.endswith("y") and word[-2:-1] not in VOWELS:
            return [(word[:-1] + "ier", "er"), (word[:-1] + "iest", "est")]
        stem = word + word[-1] if len(word) <= 4 and word[-1] not in VOWELS | {"w", "y"} and word[-2] in VOWELS \
            and word[-3:-2] not in VOWELS else word
        return [(stem + "er", "er"), (stem + "est", "est")]
    if pos in ("verb", "noun"):
        plural = word + "es" if re.search(r"(s|x|z|ch|sh)$", word) else (
            word[:-1] + "ies" if word.endswith("y") and word[-2:-1] not in VOWELS else word + "s")
        forms = [(plural, "s")]
        if pos == "verb":
            base = word[:-1] if word.endswith("e") else word
            past = word + "d" if word.endswith("e") else (word[:-1] + "ied" if word.endswith("y")
                                                          and word[-2:-1] not in VOWELS else word + "ed")
            forms += [(past, "ed"), (base + "ing", "ing")]
        return forms
    return []


def corpus_counts(pattern: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for path in sorted(glob.glob(pattern)):
        for article in json.load(open(path, encoding="utf-8"))["data"]:
            for paragraph in article["paragraphs"]:
                texts = [paragraph["context"]] + [qa["question"] for qa in paragraph["qas"]]
                for text in texts:
                    counts.update(re.findall(r"[a-z]+", text.lower()))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wordnet", type=Path, default=Path("/usr/share/wordnet"))
    parser.add_argument("--corpus", default="../shared/data/squad/train-v1.1.part0*of08.json")
    parser.add_argument("--min-count", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    counts = corpus_counts(args.corpus)
    if not counts:
        raise SystemExit(f"no corpus files match {args.corpus!r}")
    found = lambda w: re.fullmatch(r"[a-z]{3,}", w) is not None and counts[w] >= args.min_count  # noqa: E731
    rows: dict[tuple[str, str], str] = {}
    for word, other, pos in sorted(wordnet_pairs(args.wordnet)) + HAND:
        if word == other or not (found(word) and found(other)):
            continue
        key = tuple(sorted((word, other)))
        rows.setdefault(key, pos)
        theirs = {kind: form for form, kind in inflections(other, pos)}
        for form, kind in inflections(word, pos):
            if kind in theirs and found(form) and found(theirs[kind]):
                rows.setdefault(tuple(sorted((form, theirs[kind]))), pos)
    header = [
        "# Antonym pairs for QA's '+antonym' unanswerable questions (plugins/qa_data.py).",
        "# Built by scripts/build_antonyms.py from WordNet 3.0's antonym pointers (Princeton University, WordNet",
        "# 3.0 licence: free to use, copy and distribute with this notice; https://wordnet.princeton.edu/license-and-commercial-use),",
        f"# kept where both words occur >= {args.min_count} times in SQuAD 1.1 train; regular inflections added the same way,",
        f"# 4 irregular comparatives by hand. {len(rows)} pairs. Columns: word, antonym, WordNet part of speech.",
    ]
    lines = [f"{a}\t{b}\t{pos}" for (a, b), pos in sorted(rows.items())]
    args.out.write_text("\n".join(header + lines) + "\n", encoding="utf-8")
    print(f"{len(rows)} pairs -> {args.out}")


if __name__ == "__main__":
    main()
