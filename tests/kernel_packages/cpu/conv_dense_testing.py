"""Helpers shared by the numba conv and dense kernel tests (the serial/parallel path fixture, one vjp run)."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

pytest.importorskip("numba")


from kernels_cpu import conv as kc
from kernels_cpu import dense as kd


def _run(op, args, kwargs, backend, seed=1, out=None, wrt=None):
    with pnn.use_backend(backend):
        y, pullback = pnn.vjp(op, *args, wrt=wrt, **kwargs)
        dy = np.random.default_rng(seed).standard_normal(y.shape).astype(y.dtype)
        grads = pullback(dy) if out is None else pullback(dy, out=out)
    return (y, *grads)


@pytest.fixture(params=["serial", "parallel"])
def path(request, monkeypatch):
    """Force the serial or the parallel kernels (the size thresholds pick them otherwise)."""
    parallel = request.param == "parallel"
    monkeypatch.setattr(kc, "PARALLEL_MIN_MACS", 0 if parallel else 1 << 62)
    monkeypatch.setattr(kd, "SERIAL_MAX_MACS", -1 if parallel else 1 << 62)
    if parallel:  # several parts even for tiny layers
        monkeypatch.setattr(kd, "PART_MACS", 1)
        monkeypatch.setattr(kd, "MIN_PART_ROWS", 1)
    return request.param

