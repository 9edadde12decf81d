"""Progress bars for long work (tqdm) that suit where they are drawn: redrawn in place on a terminal or in a
notebook; written a line at a time, at most every FILE_INTERVAL_S seconds, into a log file or a pipe (a redrawn
bar there is a "\\r"-joined line per tenth of a second: megabytes of one log line over an hour's training)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

FILE_INTERVAL_S = 30.0


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """tqdm(iterable, **kwargs), its updates spaced FILE_INTERVAL_S apart when its stream (`file`, default standard
    error) is not a terminal, unless the caller sets `mininterval`."""
    stream = kwargs.get("file") or sys.stderr
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        terminal = False
    if not terminal and "ipykernel" not in sys.modules:  # (a notebook's widget is drawn in place)
        kwargs.setdefault("mininterval", FILE_INTERVAL_S)
        kwargs.setdefault("maxinterval", max(kwargs["mininterval"], FILE_INTERVAL_S))
    return tqdm(iterable, **kwargs)
