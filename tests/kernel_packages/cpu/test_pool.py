"""The numba pooling kernels against the reference: every geometry, layout and path."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_TORCH

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

pool = pytest.importorskip("kernels_cpu.pool")


from .pool_loss_testing import _assert_rel, _check_path, _run, path  # noqa: E402, F401

#: (spatial, kwargs): padding, ceil_mode, dilation, overlapping and non-overlapping windows, 1-3-D.
POOLS = {
    "2d-2x2": ((6, 8), dict(window=2)),
    "2d-2x2-ceil": ((7, 8), dict(window=2, ceil_mode=True)),  # vectorized rows and a partial last row
    "2d-3x3-s2-p1-ceil": ((7, 6), dict(window=3, stride=2, padding=1, ceil_mode=True)),
    "2d-3x2-s1-d2": ((7, 6), dict(window=(3, 2), stride=1, padding=(1, 0), dilation=2)),
    "1d-3-s2-p1-ceil": ((9,), dict(window=3, stride=2, padding=1, ceil_mode=True)),
    "3d-2x3x2-p1": ((4, 5, 4), dict(window=(2, 3, 2), stride=(1, 2, 2), padding=(1, 1, 0))),
}


def _pool_input(spatial, layout, batched, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (3, 5, *spatial)).astype(np.float64)  # many ties: first-max rule
    x.reshape(-1)[7] = np.nan
    x.reshape(-1)[40] = -np.inf
    if layout == "last":
        x = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    return x if batched else x[0]


@pytest.mark.parametrize("layout", ["first", "last"])
@pytest.mark.parametrize("geom", list(POOLS))
def test_pool_matches_reference_float64(path, geom, layout):
    spatial, kwargs = POOLS[geom]
    batched = geom != "1d-3-s2-p1-ceil"
    x = _pool_input(spatial, layout, batched, seed=len(spatial))
    if not batched:
        kwargs = dict(kwargs, window=(kwargs["window"],) * len(spatial) if isinstance(kwargs["window"], int)
                      else kwargs["window"])
    kwargs = dict(kwargs, channel_axis=-1 if layout == "last" else 1)
    for op in (pnn.max_pool, pnn.avg_pool):
        kw = dict(kwargs)
        if op is pnn.avg_pool:
            kw.pop("dilation", None)
            kw["count_include_pad"] = geom.endswith("ceil")
        y, grads = _run("numba", op, (x,), kw)
        y_ref, grads_ref = _run("reference", op, (x,), kw)
        _assert_rel(y, y_ref, 1e-12, f"{op.__name__} y")
        _assert_rel(grads.x, grads_ref.x, 1e-12, f"{op.__name__} dx")
        with pnn.use_backend("numba"):
            y_plain = op(x, **kw)  # forward without residuals (no argmax kept)
        _assert_rel(y_plain, y_ref, 1e-12, f"{op.__name__} y without save")
    _check_path(path, "_forward_parallel", "_backward_parallel")


def test_pool_float32_matches_reference_and_keeps_dtype():
    x = _pool_input((9, 7), "last", True, seed=3).astype(np.float32)
    for op in (pnn.max_pool, pnn.avg_pool):
        y, grads = _run("numba", op, (x,), dict(window=3, stride=2, padding=1, channel_axis=-1))
        y_ref, grads_ref = _run("reference", op, (x.astype(np.float64),),
                                dict(window=3, stride=2, padding=1, channel_axis=-1))
        assert y.dtype == np.float32 and grads.x.dtype == np.float32
        _assert_rel(y, y_ref, 1e-6, "y")
        _assert_rel(grads.x, grads_ref.x, 1e-6, "dx")


def test_max_pool_nan_windows_take_the_last_nan_in_every_layout():
    base = np.arange(2 * 3 * 4 * 4, dtype=np.float64).reshape(2, 3, 4, 4)
    base[0, 1, 0, 0] = np.nan
    base[0, 1, 1, 1] = np.nan  # two NaN in one 2x2 window: the gradient goes to the last
    base[1, 2, 3, 2] = np.nan
    dy = np.arange(1.0, 1.0 + 2 * 3 * 2 * 2).reshape(2, 3, 2, 2)
    expected_dx = None
    for layout in ("first", "last"):
        x = base if layout == "first" else np.ascontiguousarray(np.moveaxis(base, 1, -1))
        axis = 1 if layout == "first" else -1
        with pnn.use_backend("numba"):
            y, pullback = pnn.vjp(pnn.max_pool, x, 2, channel_axis=axis)
            dx = pullback(dy if layout == "first" else np.ascontiguousarray(np.moveaxis(dy, 1, -1))).x
        if layout == "last":
            y, dx = np.moveaxis(y, -1, 1), np.moveaxis(dx, -1, 1)
        assert np.isnan(y[0, 1, 0, 0]) and np.isnan(y[1, 2, 1, 1])
        assert dx[0, 1, 1, 1] == dy[0, 1, 0, 0] and dx[0, 1, 0, 0] == 0.0
        expected_dx = dx if expected_dx is None else expected_dx
        np.testing.assert_array_equal(dx, expected_dx)


def test_pool_bitwise_deterministic_and_serial_equals_parallel(monkeypatch):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 6, 20, 18))
    results = []
    for threshold in (0, 0, 1 << 62):
        monkeypatch.setattr(pool, "PARALLEL_MIN_WORK", threshold)
        for op in (pnn.max_pool, pnn.avg_pool):
            y, grads = _run("numba", op, (x,), dict(window=3, stride=2, padding=1))
            results.append((y, grads.x))
    for first, again in zip(results[:2], results[2:4]):
        assert all(np.array_equal(a, b) for a, b in zip(first, again))
    for par, ser in zip(results[:2], results[4:]):
        assert all(np.array_equal(a, b) for a, b in zip(par, ser))


def test_pool_out_buffer_is_written_in_place():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    for op in (pnn.max_pool, pnn.avg_pool):
        with pnn.use_backend("numba"):
            y, pullback = pnn.vjp(op, x, 3, stride=2, padding=1)
            dy = rng.standard_normal(y.shape).astype(np.float32)
            expected = pullback(dy).x
            buffer = np.full_like(x, np.nan)
            got = pullback(dy, out={"x": buffer})
        assert got.x is buffer
        np.testing.assert_array_equal(buffer, expected)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_pool_torch_tensors_and_out_buffers():
    import torch

    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    with pnn.use_backend("numba"):
        y, pullback = pnn.vjp(pnn.avg_pool, x, 2)
        buffer = torch.empty_like(x)
        got = pullback(torch.ones_like(y), out={"x": buffer})
    assert isinstance(y, torch.Tensor) and got.x is buffer
    torch.testing.assert_close(y, torch.nn.functional.avg_pool2d(x, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(buffer, torch.full_like(x, 0.25), rtol=0, atol=0)

