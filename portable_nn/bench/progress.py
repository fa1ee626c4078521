"""Progress messages for long benchmark runs: a tqdm bar on a terminal, plain lines in a log.

A log (CI, ``2> file``, a pipe) gets one line per step and never a carriage return, so it
reads top to bottom; a terminal gets a redrawn bar when tqdm is installed
(``pip install tqdm``, in the ``bench`` extra) and the same plain lines when it is not.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["Progress"]


def _tqdm(total: int, stream: TextIO) -> Any:
    """A tqdm bar on ``stream`` when it is a terminal and tqdm is installed, else ``None``."""
    if not stream.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # A pseudo-terminal may report a 0x0 size (tqdm would then hide its bar): fall back to 100x20.
    size = shutil.get_terminal_size((100, 20))
    return tqdm(total=total, file=stream, ncols=min(size.columns, 160), nrows=size.lines, leave=True)


class Progress:
    """Counts ``total`` steps; ``with progress.step("label"):`` announces one and counts it when done.

    Args:
        total: the number of steps planned.
        enabled: ``False`` makes every call a no-op.
        stream: where messages go (default ``sys.stderr``).
    """

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self._bar = _tqdm(self.total, self.stream) if enabled else None

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Announce the step ``label`` (a line, or the bar's description) and count it once done."""
        if self._bar is not None:
            self._bar.set_description_str(label[:60])
        elif self.enabled:
            self.stream.write(f"[{self.done + 1}/{self.total}] {label}\n")
            self.stream.flush()
        try:
            yield
        finally:
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)

    def close(self) -> None:
        """Finish the bar (plain lines need nothing)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
