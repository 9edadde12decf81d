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
