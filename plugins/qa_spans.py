"""QA's span search helpers: a window's (start, distance) band as a strided view, and a span widened to whole
words (plugins/qa.py's postprocess)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def bands(values: np.ndarray, T: int, A: int) -> np.ndarray:
    """(T, A) read-only view of `values` (T + A - 1,): row t holds values[t:t + A] (numpy's sliding_window_view,
    without its checks, which cost more than the rest of a window's span search)."""
    step = values.strides[0]
    return as_strided(values, shape=(T, A), strides=(step, step), writeable=False)


def whole_words(text: str, start: int, end: int) -> tuple[int, int]:
    """A character span widened to whole words: a span whose edge falls inside a word (a word piece
    boundary, e.g. "20:1" of "20:17") takes the rest of that word."""
    while 0 < start < len(text) and text[start - 1].isalnum() and text[start].isalnum():
        start -= 1
    while 0 < end < len(text) and text[end - 1].isalnum() and text[end].isalnum():
        end += 1
    return start, end
