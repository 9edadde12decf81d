"""Sentence splitting (plugins/sentences.py): spans, abbreviations, and linear time on long lines."""

import plugins.sentences as sentences
from plugins.sentences import split_sentences

DOC = ("Dr. Smith paid $3.50 for it on Jan. 5. \"Is it done?\" she asked. The U.S. economy grew 2.5 per cent.\n"
       "A title line without a full stop\nMr. Brown left at 10 p.m. and did not return.")


def test_sentence_splitter_handles_abbreviations_decimals_quotes_and_newlines():
    spans = split_sentences(DOC)
    assert [DOC[a:b] for a, b in spans] == [
        "Dr. Smith paid $3.50 for it on Jan. 5.",
        "\"Is it done?\" she asked.",
        "The U.S. economy grew 2.5 per cent.",
        "A title line without a full stop",
        "Mr. Brown left at 10 p.m. and did not return.",
    ]
    assert split_sentences("   \n\n  ") == []


def test_long_lines_are_split_in_chunks_with_the_same_sentences(monkeypatch):
    line = ("Mr. Smith paid $3.50 at 5 p.m. in the U.S. on Tuesday. \"Is it over?\" she asked. It was not! "
            "The report (see p. 4) said 3.14 was close. ") * 40
    whole = sentences.split_sentences(line)
    monkeypatch.setattr(sentences, "SEGMENT_CHARS", 150)  # many chunk boundaries, some inside sentences
    assert sentences.split_sentences(line) == whole and len(whole) == 160
    monkeypatch.setattr(sentences, "SEGMENT_CHARS", 20)  # a sentence longer than a chunk: cut, never lost
    text = "word " * 30 + "end. Next one."
    spans = sentences.split_sentences(text)
    assert all(0 <= a < b <= len(text) and text[a:b] == text[a:b].strip() for a, b in spans)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    assert "".join(text[a:b] for a, b in spans).replace(" ", "") == text.replace(" ", "")
