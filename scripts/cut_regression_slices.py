"""Cut the starter pack's regression slices (tests/fixtures/regression/) from ../shared/data.

    python scripts/cut_regression_slices.py [--data ../shared/data]

Each slice is a small, fixed part of real data that no starter model was trained on and none was
tuned on where the data allows it, in the task's own file format, so `bert-engine eval TASK --data
SLICE --split all` (or the split named in tests/test_regression.py) scores it. The cut is
deterministic: rerunning this script rewrites the same bytes.

- sentiment: SST-2 dev, every 4th sentence (218). The sentiment run kept its best checkpoint by
  SST-2 dev accuracy (one choice among four), so this slice is mildly optimistic; SST-2 has no
  other labelled held-out data.
- ner: CoNLL-2003 eng.testb, the first 250 sentences (the runs evaluated on eng.testa).
- qa: SQuAD 2.0 dev, whole paragraphs from the second half of the questions (the QA threshold is
  calibrated on the first half), 200 questions, answerable and not.
- qa (long documents): COVID-QA, whole papers of 8,000-20,000 characters (cc-by), the first ones in file
  order until 20 questions, every one answerable; never trained or tuned on (the verifier's paragraph
  window was chosen on a sample's even-numbered papers, which these may be among).
- summary: BBC News Summary, the first 16 test-split documents (training used train, selection dev).
- fill_mask: WikiText-2 test, 3 articles (the fill-mask run trained on Gutenberg, WikiText-2 valid and SQuAD
  train paragraphs, none of them these articles, and was selected on Gutenberg).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "tests" / "fixtures" / "regression"


def sentiment(data: Path) -> None:
    header, *rows = (data / "sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (OUT / "sst2_dev_every4th.tsv").write_text(header + "".join(rows[::4]), encoding="utf-8")


def ner(data: Path, sentences: int = 250) -> None:
    lines, seen = [], 0
    for line in (data / "conll2003" / "eng.testb").read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.strip() and lines and lines[-1].strip():
            seen += 1
            if seen == sentences:
                lines.append(line)
                break
        lines.append(line)
    (OUT / "conll_testb_first250.txt").write_text("".join(lines), encoding="utf-8")


def qa(data: Path, questions: int = 200) -> None:
    source = json.loads((data / "squad" / "dev-v2.0.json").read_text(encoding="utf-8"))
    total = sum(len(p["qas"]) for a in source["data"] for p in a["paragraphs"])
    position, kept, articles = 0, 0, []
    for article in source["data"]:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            first = position
            position += len(paragraph["qas"])
            if first >= total // 2 and kept < questions:  # the held-out half of the calibration split
                paragraphs.append(paragraph)
                kept += len(paragraph["qas"])
        if paragraphs:
            articles.append({"title": article["title"], "paragraphs": paragraphs})
    payload = {"version": source["version"], "data": articles}
    (OUT / "squad_v2_dev_second_half.json").write_text(json.dumps(payload, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")


def qa_long(data: Path, questions: int = 20) -> None:
    """Whole COVID-QA papers (never trained or tuned on; every question answerable), in file order, those of
    8,000 to 20,000 characters that say `License: cc-by`, until `questions` questions: the shipped "no answer"
    decision on long documents, where it once refused a fifth of the questions."""
    source = json.loads((data / "covid_qa" / "COVID-QA.200423.json").read_text(encoding="utf-8"))
    articles, kept = [], 0
    for article in source["data"]:
        paragraph = article["paragraphs"][0]
        if kept < questions and 8000 < len(paragraph["context"]) <= 20000 and "License: cc-by" in paragraph["context"][:3000]:
            articles.append(article)
            kept += len(paragraph["qas"])
    payload = {"version": source.get("version", "covid-qa"), "data": articles}
    (OUT / "covid_qa_first_papers.json").write_text(json.dumps(payload, ensure_ascii=False) + "\n", encoding="utf-8")


def summary(data: Path, documents: int = 16) -> None:
    from plugins.summary import split_of

    kept = []
    for line in (data / "bbc_news_summary" / "bbc_news_summary.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip() and split_of(json.loads(line)["id"]) == "test":
            kept.append(line + "\n")
            if len(kept) == documents:
                break
    (OUT / "bbc_test_first16.jsonl").write_text("".join(kept), encoding="utf-8")


def fill_mask(data: Path, articles: int = 3) -> None:
    kept, count = [], 0
    for line in (data / "wikitext2" / "wiki.test.tokens").read_text(encoding="utf-8").splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("= ") and not stripped.startswith("= ="):  # an article's title
            count += 1
            if count > articles:
                break
        kept.append(line)
    (OUT / "wikitext2_test_first3.txt").write_text("".join(kept), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    data = Path(parser.parse_args().data)
    OUT.mkdir(parents=True, exist_ok=True)
    for cut in (sentiment, ner, qa, qa_long, summary, fill_mask):
        cut(data)
    for path in sorted(OUT.iterdir()):
        print(f"{path.relative_to(ROOT)}  {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
