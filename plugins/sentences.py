"""Sentence splitting with character spans: pysbd (abbreviations, decimals, quotes), line by line,
in linear time however long the line."""

from __future__ import annotations

import threading

import pysbd

_segmenter_lock = threading.Lock()
_segmenter = None


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Character spans (start, end) of the sentences of `text`, whitespace trimmed, in order.

    Line breaks always end a sentence (titles, list items); within a line pysbd decides. pysbd's
    time grows faster than linearly with the length of what it is given, so a long line is read in
    chunks of SEGMENT_CHARS: all sentences of a chunk but the last (which may be cut) are kept, and
    the next chunk starts where that last sentence starts. Time stays linear in the text.
    """
    spans = []
    cursor = 0
    for line in text.splitlines(keepends=True):
        begin = cursor
        cursor += len(line)
        if not line.strip():
            continue
        offset = 0
        while offset < len(line):
            chunk = line[offset:offset + SEGMENT_CHARS]
            pieces = _segment(chunk)
            last_chunk = offset + len(chunk) >= len(line)
            if last_chunk or len(pieces) < 2:  # the end, or one sentence longer than a chunk: keep it whole
                spans += [(begin + offset + a, begin + offset + b) for a, b in pieces]
                offset += len(chunk)
            else:
                spans += [(begin + offset + a, begin + offset + b) for a, b in pieces[:-1]]
                offset += pieces[-1][0]
    return spans


SEGMENT_CHARS = 4000


def _segment(chunk: str) -> list[tuple[int, int]]:
    """pysbd's sentences of one piece of a line, as trimmed (start, end) spans in it."""
    global _segmenter
    with _segmenter_lock:
        _segmenter = _segmenter or pysbd.Segmenter(language="en", clean=False)
        pieces = _segmenter.segment(chunk)
    spans, search = [], 0
    for piece in pieces:
        piece = piece.strip()
        if not piece:
            continue
        at = chunk.find(piece, search)
        if at < 0:  # pysbd never rewrites text with clean=False; guard anyway
            continue
        spans.append((at, at + len(piece)))
        search = at + len(piece)
    return spans
