"""``portable_nn.threads``: the public thread count (its effect on kernels:
tests/kernel_packages/cpu/test_runtime.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import portable_nn as pnn
from portable_nn import threads


@pytest.fixture(autouse=True)
def _default_count():
    yield
    pnn.set_num_threads(None)


def test_default_follows_omp_num_threads(monkeypatch):
    """Read from the environment on first use (each ``_forget_default`` stands for a new process)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")
    monkeypatch.setenv("NUMBA_NUM_THREADS", "5")
    threads._forget_default()
    assert pnn.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")
    assert pnn.get_num_threads() == 3  # read once, as OpenMP and PyTorch read it
    threads._forget_default()
    assert pnn.get_num_threads() == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("NUMBA_NUM_THREADS")
    threads._forget_default()
    try:
        assert pnn.get_num_threads() == threads.default_num_threads() >= 1
    finally:
        monkeypatch.undo()
        threads._forget_default()


def test_set_and_context_precedence():
    pnn.set_num_threads(3)
    assert pnn.get_num_threads() == 3
    with pnn.use_threads(1):
        assert pnn.get_num_threads() == 1
        with pnn.use_threads(2):
            assert pnn.get_num_threads() == 2
        assert pnn.get_num_threads() == 1
    assert pnn.get_num_threads() == 3
    pnn.set_num_threads(None)
    assert pnn.get_num_threads() == threads.default_num_threads()


def test_the_context_is_private_to_its_thread_and_task():
    seen = {}

    def other():
        seen["thread"] = pnn.get_num_threads()

    async def task():
        with pnn.use_threads(7):
            await asyncio.sleep(0)
            return pnn.get_num_threads()

    async def both():
        return await asyncio.gather(task(), asyncio.sleep(0, result=pnn.get_num_threads()))

    with pnn.use_threads(5):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        inside, outside = asyncio.run(both())
    assert seen["thread"] == threads.default_num_threads()
    assert inside == 7 and outside == 5


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("2", TypeError),
                                        (True, TypeError)])
def test_bad_counts_are_clear_errors(bad, error):
    with pytest.raises(error, match="positive int"):
        pnn.set_num_threads(bad)
    with pytest.raises(error, match="use_threads"):
        with pnn.use_threads(bad):
            pass
    assert pnn.get_num_threads() == threads.default_num_threads()  # nothing changed
