"""Helpers shared by the numba pooling and loss kernel tests (the serial/parallel path fixture, one vjp run)."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

pool = pytest.importorskip("kernels_cpu.pool")

loss = pytest.importorskip("kernels_cpu.loss")


class _Counter:
    """Wraps a module's parallel kernel to count its launches (the serial one stays as is)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


@pytest.fixture(params=["serial", "parallel"])
def path(request, monkeypatch):
    """Forces the serial or the parallel kernels; yields the parallel launch counters."""
    parallel = request.param == "parallel"
    monkeypatch.setattr(pool, "PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    monkeypatch.setattr(loss, "PARALLEL_MIN_ELEMENTS", 0 if parallel else 1 << 62)
    counters = {}
    for module, names in ((pool, ("_forward_parallel", "_backward_parallel")),
                          (loss, ("_lsm_forward_parallel", "_lsm_backward_parallel",
                                  "_ce_forward_parallel", "_ce_backward_parallel"))):
        for name in names:
            counters[name] = _Counter(getattr(module, name))
            monkeypatch.setattr(module, name, counters[name])
    yield request.param, counters


def _check_path(path, *names):
    kind, counters = path
    launched = sum(counters[n].calls for n in names)
    assert (launched > 0) == (kind == "parallel"), (kind, {n: counters[n].calls for n in names})


def _run(backend, op, args, kwargs, cotangent_seed=0, wrt=None):
    """(result, gradients) of op on ``backend``; the cotangent is drawn from the result's shape."""
    with pnn.use_backend(backend), np.errstate(invalid="ignore"):  # rows of -inf are NaN by design
        y, pullback = pnn.vjp(op, *args, wrt=wrt, **kwargs)
        dy = np.random.default_rng(cotangent_seed).standard_normal(np.shape(y)).astype(np.asarray(y).dtype)
        return y, pullback(dy)


def _assert_rel(actual, expected, tol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, what
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=what)
    keep = ~np.isnan(expected)
    if not keep.any():
        return
    a, e = actual[keep], expected[keep]
    np.testing.assert_array_equal(np.isinf(a), np.isinf(e), err_msg=what)
    finite = np.isfinite(e)
    if finite.any():
        scale = max(float(np.max(np.abs(e[finite]))), 1e-300)
        err = float(np.max(np.abs(a[finite] - e[finite]))) / scale
        assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"
    np.testing.assert_array_equal(a[~finite], e[~finite], err_msg=what)

