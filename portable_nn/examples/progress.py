"""A dependency-free progress bar for the demo's epochs.

On a terminal the bar redraws in place (``\\r``) as batches finish, at most every 50 ms, and the
finished epoch leaves one summary line.  When stdout is not a terminal (a pipe, a log file, CI)
nothing is drawn while the epoch runs: only the summary line is printed, so logs stay clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "is_terminal"]

_REDRAW_S = 0.05


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (``isatty``), False when that cannot be told."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """One epoch's bar: ``prefix [#####.....] done/total  loss 0.1234``.

    Args:
        total: batches in the epoch.
        prefix: text before the bar (e.g. ``"  epoch  3/20"``).
        stream: where to write (stdout by default).
        width: characters of the bar itself.
    """

    def __init__(self, total: int, prefix: str, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.prefix = prefix
        self.stream = sys.stdout if stream is None else stream
        self.width = width
        self.live = is_terminal(self.stream)
        self._last_draw = 0.0
        self._drawn = 0

    def update(self, done: int, loss: float) -> None:
        """``done`` batches finished, running mean loss ``loss``; redraws on a terminal only."""
        if not self.live:
            return
        now = time.perf_counter()
        if done < self.total and now - self._last_draw < _REDRAW_S:
            return
        self._last_draw = now
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self._write(f"{self.prefix}  [{bar}] {done:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}")

    def finish(self, summary: str) -> None:
        """Replace the bar (if drawn) by the epoch's summary line."""
        if self.live:
            self._write(summary)
            self.stream.write("\n")
        else:
            self.stream.write(summary + "\n")
        self.stream.flush()

    def _write(self, line: str) -> None:
        pad = max(self._drawn - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._drawn = len(line)
