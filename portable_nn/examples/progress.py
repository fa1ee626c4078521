"""The demo's per-epoch progress: a tqdm bar on a terminal, one summary line per epoch always.

On a terminal, with tqdm installed (the ``examples`` extra), a bar follows the epoch's batches
and the running loss and is replaced by the epoch's summary line.  Anywhere else (a pipe, a log
file, CI, or no tqdm) nothing is drawn while the epoch runs, so logs hold only the summaries and
never a carriage return.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["Progress", "is_terminal"]


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (``isatty``), False when that cannot be told."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _tqdm(total: int, prefix: str, stream: TextIO) -> Any:
    """A transient tqdm bar on ``stream``, or ``None`` without a terminal or without tqdm."""
    if not is_terminal(stream):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=prefix, file=stream, leave=False, unit="batch", mininterval=0.05)


class Progress:
    """One epoch's bar, then its summary line.

    Args:
        total: batches in the epoch.
        prefix: text before the bar (e.g. ``"  epoch  3/20"``).
        stream: where to write (stdout by default).
    """

    def __init__(self, total: int, prefix: str, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.prefix = prefix
        self.stream = sys.stdout if stream is None else stream
        self._bar = _tqdm(self.total, prefix, self.stream)

    def update(self, done: int, loss: float) -> None:
        """``done`` batches finished, running mean loss ``loss`` (drawn on a terminal only)."""
        if self._bar is not None:
            self._bar.n = done
            self._bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
            self._bar.refresh()

    def finish(self, summary: str) -> None:
        """Remove the bar (if drawn) and print the epoch's summary line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.stream.write(summary + "\n")
        self.stream.flush()
