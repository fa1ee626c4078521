"""The numba layer/RMS norm kernels over a block of middle axes (``kernels_cpu._norm_middle``):
selection, the parallel and serial paths, column blocks, thread-count independence, stable
statistics, every activation kind, against the reference.

Agreement with PyTorch over every library and backend runs in tests/api/test_norm.py (the
``any_axes`` grids)."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import rel_err

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

from .cpu_testing import _data  # noqa: E402


def _both(op, x, *params, axis, wrt=None, **kwargs):
    """(y, grads) from numba and from the reference for the same call and cotangent."""
    dy = _data(x.shape, x.dtype, seed=5)
    out = []
    for backend in ("numba", "reference"):
        with pnn.use_backend(backend):
            y, pullback = pnn.vjp(getattr(pnn, op), x, *params, axis=axis, wrt=wrt, **kwargs)
            out.append((y, pullback(dy)))
    return out


def test_auto_runs_the_middle_axes_on_numba_and_scattered_ones_on_the_reference():
    x = _data((2, 6, 5, 4))
    report = pnn.explain(pnn.layer_norm, x, axis=1)
    assert report.backend == "numba" and "layout middle_axes" in str(report) and not report.copies
    report = pnn.explain(pnn.rms_norm, x, axis=(1, 2))
    assert report.backend == "numba"
    report = pnn.explain(pnn.layer_norm, x, axis=(0, 2))
    assert report.backend == "reference" and report.fallback
    assert any(b == "numba" and "scattered_axes" in why for b, why in report.passed_over)
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="scattered_axes"):
        pnn.layer_norm(x, axis=(0, 2))
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="float16"):
        pnn.layer_norm(x.astype(np.float16), axis=1)


@pytest.mark.parametrize("activation", ["identity", "relu", ("leaky_relu", 0.2), "gelu", "silu", "tanh"])
@pytest.mark.parametrize("shape, axis", [
    ((3, 8, 70), 1),                  # serial, one column block
    ((4, 96, 30, 30), 1),             # parallel, several column blocks of the 900 columns
    ((2, 5, 3, 1200), (1, 2)),        # a two-axis block, 1200 columns
    ((64, 9), 0),                     # no outer axes
    ((5, 7, 1), 1),                   # one column: the rows case reached through the middle layout
])
def test_matches_the_reference(shape, axis, activation):
    x = _data(shape, np.float64) + 2.0
    axes = (axis,) if isinstance(axis, int) else axis
    wshape = tuple(shape[a] for a in axes)
    w, b = _data(wshape, np.float64, seed=1), _data(wshape, np.float64, seed=2)
    (y, g), (y_ref, g_ref) = _both("layer_norm", x, w, b, axis=axis, activation=activation)
    assert rel_err(y, y_ref) < 1e-12
    for name in ("x", "weight", "bias"):
        assert rel_err(getattr(g, name), getattr(g_ref, name)) < 1e-11, name


@pytest.mark.parametrize("wrt", [("x",), ("weight",), ("x", "weight")])
def test_rms_norm_and_the_gradients_asked_for(wrt):
    x = _data((3, 12, 40), np.float64)
    w = _data((12,), np.float64, seed=1)
    (y, g), (y_ref, g_ref) = _both("rms_norm", x, w, axis=1, wrt=wrt)
    assert rel_err(y, y_ref) < 1e-12
    for name in ("x", "weight"):
        assert (getattr(g, name) is None) == (name not in wrt)
        if name in wrt:
            assert rel_err(getattr(g, name), getattr(g_ref, name)) < 1e-11


def test_float32_keeps_the_precision_of_offset_data():
    """Shifted float64 sums: a mean of 1e4 costs nothing (E[x²] − E[x]² in float32 would lose it all)."""
    x = (_data((4, 16, 300)) * 0.01 + 1e4).astype(np.float32)
    y = pnn.layer_norm(x, axis=1)
    with pnn.use_backend("reference"):
        y_ref = pnn.layer_norm(x.astype(np.float64), axis=1)
    assert np.abs(y - y_ref).max() < 1e-3


def test_results_do_not_depend_on_the_thread_count():
    x = _data((8, 32, 40, 40))
    w, b = _data((32,), seed=1), _data((32,), seed=2)
    dy = _data(x.shape, seed=3)
    results = []
    for n in (1, 2):
        with pnn.use_threads(n):
            y, pullback = pnn.vjp(pnn.layer_norm, x, w, b, axis=1, activation="gelu")
            results.append((y, *pullback(dy)))
    for a, b_ in zip(*results):
        np.testing.assert_array_equal(a, b_)


def test_empty_outer_or_inner_axes():
    for shape in ((0, 4, 5), (2, 4, 0)):
        x = np.zeros(shape, np.float32)
        w = np.ones(4, np.float32)
        y, pullback = pnn.vjp(pnn.layer_norm, x, w, w, axis=1)
        g = pullback(np.zeros(shape, np.float32))
        assert y.shape == shape and g.x.shape == shape
        np.testing.assert_array_equal(g.weight, 0.0)
        np.testing.assert_array_equal(g.bias, 0.0)
