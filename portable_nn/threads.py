"""How many threads portable_nn's CPU kernels may use: ``set_num_threads``, ``use_threads``.

The number bounds our own parallel kernels (and the products they split across threads); it
never changes another library's setting beyond the duration of one of our calls.  Its default
follows the user's ``OMP_NUM_THREADS`` (the variable every OpenMP library, PyTorch included,
reads), else ``NUMBA_NUM_THREADS``, else the cores this process may run on — read once, when
first needed, as those libraries read it at start-up.

Precedence, highest first: the innermost :func:`use_threads` context (private to its thread or
asyncio task), then :func:`set_num_threads`, then the default.

This module also keeps one process fact the CPU kernels need: whether this process is a
``fork()`` child of the process that imported portable_nn (GNU OpenMP's thread pool does not
survive a fork, so the kernels then run serially instead of hanging; see
``kernels_cpu._runtime``).  Importing it loads nothing heavy.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

__all__ = ["get_num_threads", "set_num_threads", "use_threads"]

_context: contextvars.ContextVar[int | None] = contextvars.ContextVar("portable_nn_threads", default=None)
_global: int | None = None


def _env_threads(name: str) -> int | None:
    """A positive thread count from an environment variable (OMP_NUM_THREADS may be a list)."""
    text = os.environ.get(name, "").split(",")[0].strip()
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


_default: int | None = None


def default_num_threads() -> int:
    """``OMP_NUM_THREADS``, else ``NUMBA_NUM_THREADS``, else the cores this process may use.

    Read once, on first use, as OpenMP runtimes and PyTorch read them at start-up: reading the
    environment was ~10 µs of every parallel kernel launch (four ``os.environ`` lookups each), a
    tenth of a batch_norm forward at resnet18's (8, 256, 4, 4) on a Zen 3.
    """
    global _default
    if _default is None:
        _default = _read_default()
    return _default


def _read_default() -> int:
    for name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        value = _env_threads(name)
        if value is not None:
            return value
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _forget_default() -> None:
    """Read the environment again on the next use (for tests that change it)."""
    global _default
    _default = None


def _check(n: object, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} must be a positive int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{what} must be a positive int, got {n}")
    return n


def set_num_threads(n: int | None) -> None:
    """Bound the threads portable_nn's CPU kernels use, process-wide.

    Like ``torch.set_num_threads``, but for portable_nn's own kernels only: PyTorch's, NumPy's
    and Numba's other users' settings are left alone.  Parallel kernels use at most ``n``
    threads (and at most the size of Numba's pool, ``NUMBA_NUM_THREADS``); with ``n == 1``
    every kernel runs its serial form.  Results depend on the thread count only where they
    cannot differ (work is partitioned by problem size).

    Args:
        n: a positive thread count, or ``None`` to return to the default
            (``OMP_NUM_THREADS``, else ``NUMBA_NUM_THREADS``, else the available cores).

    Raises:
        TypeError: ``n`` is not an int or ``None``.
        ValueError: ``n`` is less than 1.
    """
    global _global
    _global = None if n is None else _check(n, "set_num_threads(n)")
    from . import config

    config.bump_generation()  # a plan made under the former count is not reused (portable_nn.plans)


def state() -> int | None:
    """The innermost :func:`use_threads` value of this thread or task (``None`` outside one): the
    part of the thread configuration the plan cache keys calls by (:func:`set_num_threads` bumps
    the configuration's generation instead)."""
    return _context.get()


def get_num_threads() -> int:
    """The number of threads portable_nn's CPU kernels may use here and now.

    Returns:
        The innermost :func:`use_threads` value, else the :func:`set_num_threads` value, else
        the default (``OMP_NUM_THREADS``, else ``NUMBA_NUM_THREADS``, else the available cores).
    """
    value = _context.get()
    if value is not None:
        return value
    return _global if _global is not None else default_num_threads()


@contextlib.contextmanager
def use_threads(n: int) -> Iterator[None]:
    """Bound portable_nn's CPU kernels to ``n`` threads inside a ``with`` block.

    Private to the current thread or asyncio task, like :func:`portable_nn.use_backend`::

        with pnn.use_threads(1):      # e.g. inside a data-loading worker
            y = pnn.layer_norm(x)

    Args:
        n: a positive thread count.

    Raises:
        TypeError, ValueError: as :func:`set_num_threads`.
    """
    token = _context.set(_check(n, "use_threads(n)"))
    try:
        yield
    finally:
        _context.reset(token)


# --------------------------------------------------------------------------- fork children

_forked = False


def _mark_forked() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


def in_forked_child() -> bool:
    """Whether this process was forked after portable_nn was imported, or by ``multiprocessing``.

    A ``multiprocessing`` child (PyTorch's ``DataLoader`` workers are) counts even when its
    parent forked before importing portable_nn: the parent may have started an OpenMP pool.
    """
    if _forked:
        return True
    import sys

    mp = sys.modules.get("multiprocessing")
    return mp is not None and mp.parent_process() is not None
