"""pytest configuration: kernels compiled ahead of a full run, GPU skipping, and configuration
isolation between tests."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import portable_nn as pnn
from pnn_testing import cupy_has_device

# A full run compiles the Numba kernels first, in parallel processes (`python -m portable_nn compile`,
# one op family per process), then runs the tests on a warm cache.  Otherwise each pytest-xdist worker
# compiles what its first tests need, both workers often the same kernels at the same time, and the
# compilation is spread over the run: the suite from an empty cache took 17 min 20 s on a 2-core
# AMD Zen 5 that way (8 min warm).  A warm cache makes this a 3-4 s no-op; a run of a few files or a
# -k selection skips it.
PRECOMPILE_MIN_TESTS = 2000
_precompiled = False


def _precompile(count: int) -> None:
    global _precompiled
    if _precompiled or count < PRECOMPILE_MIN_TESTS:
        return
    _precompiled = True
    start = time.perf_counter()
    command = [sys.executable, "-m", "portable_nn", "compile", "--dtypes", "float32,float64,float16,bfloat16"]
    done = subprocess.run(command, capture_output=True, text=True)
    status = "ready" if done.returncode == 0 else f"failed ({done.stderr.strip().splitlines()[-1:]})"
    seconds = time.perf_counter() - start
    sys.stderr.write(f"\nportable_nn kernels compiled ahead of the tests: {status} in {seconds:.0f} s\n")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller: the first worker has collected (the others wait to be scheduled)."""
    _precompile(len(ids))


def pytest_collection_finish(session):
    """A run without workers (a worker's own collection is left to the controller's hook)."""
    if not hasattr(session.config, "workerinput"):
        _precompile(len(session.items))


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not cupy_has_device():
        skip = pytest.mark.skip(reason="needs a CUDA device visible to CuPy")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _single_threaded_torch():
    """PyTorch's thread pool costs milliseconds per tiny oracle call on small machines."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _reset_backend_config(monkeypatch):
    """Every test starts from the default configuration and leaves it that way."""
    monkeypatch.delenv("PORTABLE_NN_BACKEND", raising=False)
    pnn.set_backend(None)
    pnn.set_fallback("allow")
    yield
    pnn.set_backend(None)
    pnn.set_fallback("allow")
