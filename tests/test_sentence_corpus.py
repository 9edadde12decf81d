"""scripts/sentence_corpus.py: the fill-mask starter's single-sentence corpus never holds a sentence of a
held-out ("test") passage, so the Gutenberg evaluation stays unseen."""

import subprocess
import sys
from pathlib import Path

from bert_engine.training.pretraining import read_documents
from plugins.fill_mask import read_data

ROOT = Path(__file__).resolve().parents[1]


def test_sentences_come_only_from_train_passages(tmp_path):
    # 60 paragraphs of 9 numbered sentences (about 90 words each): passages of 80 words, some held out
    source = tmp_path / "book.txt"
    source.write_text("\n\n".join(" ".join(f"Sentence {p} {k} has exactly eight words here." for k in range(9))
                                  for p in range(60)) + "\n", encoding="utf-8")
    out = tmp_path / "sentences.txt"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "sentence_corpus.py"), str(source), str(out)], check=True,
                   capture_output=True)
    sentences = [" ".join(doc) for doc in read_documents(out)]
    test_text = " ".join(inputs["text"] for inputs, _ in read_data(source, "test"))
    train_text = " ".join(inputs["text"] for inputs, _ in read_data(source, "train"))
    assert test_text and sentences  # the fixture has held-out passages, and sentences were written
    assert all(s.count(" ") == 7 and s not in test_text and s in train_text for s in sentences)


def test_bbc_corpus_holds_only_the_summary_tasks_train_articles(tmp_path):
    import json

    from plugins.summary import split_of

    # the fixture's articles under ids of each split (the split is a hash of the id)
    articles = [json.loads(line) for line in (ROOT / "tests" / "fixtures" / "bbc_tiny.jsonl").read_text(
        encoding="utf-8").splitlines() if line.strip()]
    ids = {}
    for n in range(200):
        ids.setdefault(split_of(f"doc/{n:03d}"), f"doc/{n:03d}")
    items = [dict(a, id=ids[split], article=f"Headline {split} {k}\n\n" + a["article"])
             for k, a in enumerate(articles) for split in ("train", "dev", "test")]
    source = tmp_path / "bbc.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    out = tmp_path / "bbc.txt"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bbc_corpus.py"), str(source), str(out)], check=True,
                   capture_output=True)
    written = out.read_text(encoding="utf-8")
    assert all(f"Headline train {k}\n" in written for k in range(len(articles)))
    assert "Headline dev" not in written and "Headline test" not in written
    assert written.count("\n\n") == len(articles) and "\n\n\n" not in written  # one blank line between articles
