"""Write docs/qa-unanswerable.md: how many unanswerable questions each construction of a QA training
split made from SQuAD 1.1 train, their shares, and the first 20 of each kind beside the question they
were made from (the model card links it).

    python scripts/qa_negatives_report.py [--split SPLIT] [--data "../shared/data/squad/train-v1.1.part0*of08.json"]
"""

from __future__ import annotations

import argparse
import collections
import glob
from pathlib import Path

from plugins.qa_data import CONSTRUCTIONS, construction_report

OUT = Path(__file__).resolve().parents[1] / "docs" / "qa-unanswerable.md"
SPLIT = "train+negatives:0.1+absent:0.15+removed:0.15+swapped+antonym+numbers+negated:0.25"  # QA v3's recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default=SPLIT)
    parser.add_argument("--data", default="../shared/data/squad/train-v1.1.part0*of08.json")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    files = sorted(glob.glob(args.data))
    if not files:
        raise SystemExit(f"no SQuAD files match {args.data!r}")
    counts: collections.Counter = collections.Counter()
    samples: dict[str, list] = collections.defaultdict(list)
    for path in files:
        report = construction_report(path, args.split, samples=args.samples)
        for kind, figures in report["counts"].items():
            counts[kind] += figures["questions"]
        for kind, shown in report["samples"].items():
            samples[kind].extend(shown[:args.samples - len(samples[kind])])
    total = sum(counts.values())
    lines = ["# Unanswerable QA training questions, by construction", "",
             f"Made by `plugins/qa_data.py` from SQuAD 1.1 train ({len(files)} files) with the split `{args.split}`;",
             "written by `python scripts/qa_negatives_report.py`. Every choice is a hash of the question id, so the same",
             "split gives the same questions on every run. A copy is kept only where the paragraph provably no longer",
             "answers it (no answer text in a new paragraph; a swapped word, name or number the paragraph never says).", "",
             "| kind | what it does | questions | share of all |", "|---|---|---|---|"]
    for kind, n in counts.most_common():
        what = CONSTRUCTIONS.get(kind, "the file's own questions")
        lines.append(f"| {kind} | {what} | {n:,} | {100 * n / total:.1f} % |")
    lines.append(f"| all | | {total:,} | 100 % |")
    for kind in CONSTRUCTIONS:
        if not samples.get(kind):
            continue
        lines += ["", f"## {kind}: the first {len(samples[kind])}", "", "| from | made | paragraph starts |", "|---|---|---|"]
        for s in samples[kind]:
            cells = [str(s["original"]), s["question"], s["context_start"].replace("\n", " ") + "…"]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{total:,} questions -> {args.out}")


if __name__ == "__main__":
    main()
