"""pytest configuration: GPU skipping and configuration isolation between tests."""

from __future__ import annotations

import pytest

import portable_nn as pnn
from pnn_testing import cupy_has_device


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
