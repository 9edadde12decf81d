"""Progress bars for long work (tqdm) that suit where they are drawn: redrawn in place on a terminal or in a
notebook; in a log file or a pipe, a line of its own at most every FILE_INTERVAL_S seconds (a bar redrawn in place
there is a "\\r"-joined line per tenth of a second: megabytes of one log line over an hour's training)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

FILE_INTERVAL_S = 30.0


class _LogLines:
    """A log file as tqdm's stream: each redraw a line of its own (tqdm begins each with "\\r", to overwrite the
    line on a terminal), blank redraws (a cleared bar) left out."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self._stream.write(line + "\n")

    def flush(self) -> None:
        flush = getattr(self._stream, "flush", None)
        if flush is not None:
            flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _LogBar(tqdm):
    """tqdm whose postfix and description wait for the next timed redraw (the training loop sets its loss every
    few steps: each was a redraw of its own, whatever the interval)."""

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        super().set_postfix_str(s, refresh=False)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        super().set_description(desc, refresh=False)


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """tqdm(iterable, **kwargs); when its stream (`file`, default standard error) is not a terminal, each update a
    line of its own, at most every FILE_INTERVAL_S seconds (unless the caller sets `mininterval`)."""
    stream = kwargs.get("file") or sys.stderr
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        terminal = False
    if terminal or "ipykernel" in sys.modules:  # (a notebook's widget is drawn in place)
        return tqdm(iterable, **kwargs)
    kwargs.setdefault("mininterval", FILE_INTERVAL_S)
    kwargs.setdefault("maxinterval", max(kwargs["mininterval"], FILE_INTERVAL_S))
    kwargs["file"] = _LogLines(stream)
    kwargs.setdefault("ascii", True)  # (a log viewer's font may lack tqdm's block characters)
    return _LogBar(iterable, **kwargs)
