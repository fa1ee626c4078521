"""max_pool and avg_pool: forward and gradient against PyTorch (float64), edge cases, validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import portable_nn as pnn
from pnn_testing import (
    assert_close,
    cases,
    check_pullback_plumbing,
    directional_check,
    family_of,
    grid,
    snapshot,
    to_numpy,
    unchanged,
)
from portable_nn.api.pool import avg_pool, max_pool
from torch_oracle import from_layout, to_layout

TORCH_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
TORCH_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}

#: Geometries: odd sizes, stride != window, padding, dilation > 1 with stride > 1 (max only).
GEOMS = {
    "1d-k3-s2-p1": dict(spatial=(7,), window=3, stride=2, padding=1, dilation=1),
    "1d-k2-d2": dict(spatial=(9,), window=2, stride=None, padding=0, dilation=2),
    "2d-k2x3-s1x2-p1x0-d2x1": dict(spatial=(5, 6), window=(2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1)),
    "2d-k3-p1": dict(spatial=(7, 5), window=3, stride=None, padding=1, dilation=1),
    "2d-k3x2-s2x3-p1-d2": dict(spatial=(6, 7), window=(3, 2), stride=(2, 3), padding=1, dilation=2),
    "3d-k2-s2x1x2-p1x0x1": dict(spatial=(4, 5, 3), window=2, stride=(2, 1, 2), padding=(1, 0, 1), dilation=1),
    "3d-k3x2x3-s2x2x1-d1x2x1": dict(
        spatial=(5, 4, 6), window=(3, 2, 3), stride=(2, 2, 1), padding=(1, 1, 0), dilation=(1, 2, 1)
    ),
}




def _geometry_kwargs(geom: dict, batched: bool, *, use_dilation: bool) -> dict:
    d = len(geom["spatial"])
    window = geom["window"]
    if not batched and isinstance(window, int):
        window = (window,) * d  # unbatched input needs a tuple window
    kwargs = dict(window=window, stride=geom["stride"], padding=geom["padding"])
    if use_dilation:
        kwargs["dilation"] = geom["dilation"]
    return kwargs


def _torch_pool(kind: str, x64: np.ndarray, dy64: np.ndarray, d: int, kwargs: dict) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's output and input gradient, float64, batched channels-first."""
    fn = (TORCH_MAX if kind == "max" else TORCH_AVG)[d]
    kw = dict(kwargs)
    window = kw.pop("window")
    if kw.get("stride") is None:
        kw.pop("stride", None)
    if kw.get("divisor_override", 0) is None:
        kw.pop("divisor_override")
    xt = torch.tensor(x64, dtype=torch.float64, requires_grad=True)
    if d == 1 and kw.get("divisor_override") is not None:
        # F.avg_pool1d has no divisor_override: the same pooling as 2-D over a unit axis.
        pair = lambda v: (1, v[0] if isinstance(v, (tuple, list)) else v)  # noqa: E731
        kw2 = {**kw, **{k: pair(kw[k]) for k in ("stride",) if k in kw}, "padding": (0, pair(kw["padding"])[1])}
        yt = F.avg_pool2d(xt[:, :, None, :], pair(window), **kw2)[:, :, 0, :]
    else:
        yt = fn(xt, window, **kw)
    yt.backward(torch.tensor(dy64, dtype=torch.float64))
    return yt.detach().numpy(), xt.grad.numpy()


def _run_case(case, kind, geom, layout, batched, extra, rng):
    d = len(geom["spatial"])
    shape = (2, 3, *geom["spatial"])
    if kind == "max":
        base = rng.integers(-3, 4, shape).astype(np.float64)  # integer values: many ties
    else:
        base = rng.standard_normal(shape)
    kwargs = _geometry_kwargs(geom, batched, use_dilation=kind == "max")
    kwargs.update(extra)
    op = max_pool if kind == "max" else avg_pool
    x = case.asarray(to_layout(base, layout, batched))
    channel_axis = -1 if layout == "last" else 1
    before = snapshot([x])
    with case.use():
        y, pullback = pnn.vjp(op, x, channel_axis=channel_axis, **kwargs)
        dy = case.asarray(rng.standard_normal(tuple(y.shape)))
        grads = pullback(dy)
    assert unchanged([x], before)
    assert family_of(y) == case.lib and family_of(grads.x) == case.lib
    assert y.dtype == x.dtype and grads.x.dtype == x.dtype
    x64 = from_layout(to_numpy(x), layout, batched)
    dy64 = from_layout(to_numpy(dy), layout, batched)
    torch_kwargs = dict(_geometry_kwargs(geom, True, use_dilation=kind == "max"))
    torch_kwargs.update(extra)
    y_ref, dx_ref = _torch_pool(kind, x64, dy64, d, torch_kwargs)
    assert_close(from_layout(to_numpy(y), layout, batched), y_ref, case.tol, f"{kind}_pool output")
    assert_close(from_layout(to_numpy(grads.x), layout, batched), dx_ref, case.tol, f"{kind}_pool dx")


_MAX_GRID = grid(
    {"geom": list(GEOMS), "layout": ["first", "last"], "batched": [True, False], "ceil_mode": [False, True]}
)
_AVG_GRID = grid(
    {
        "geom": list(GEOMS),
        "layout": ["first", "last"],
        "batched": [True, False],
        "ceil_mode": [False, True],
        "count_include_pad": [True, False],
        "divisor_override": [None, 3, -2],
    }
)


@pytest.mark.parametrize("case", cases("max_pool"))
@pytest.mark.parametrize("cfg", _MAX_GRID)
def test_max_pool_matches_torch(case, cfg):
    rng = np.random.default_rng(list(GEOMS).index(cfg["geom"]))
    _run_case(case, "max", GEOMS[cfg["geom"]], cfg["layout"], cfg["batched"], {"ceil_mode": cfg["ceil_mode"]}, rng)


@pytest.mark.parametrize("case", cases("avg_pool"))
@pytest.mark.parametrize("cfg", _AVG_GRID)
def test_avg_pool_matches_torch(case, cfg):
    rng = np.random.default_rng(list(GEOMS).index(cfg["geom"]))
    extra = {"ceil_mode": cfg["ceil_mode"], "count_include_pad": cfg["count_include_pad"],
             "divisor_override": cfg["divisor_override"]}
    _run_case(case, "avg", GEOMS[cfg["geom"]], cfg["layout"], cfg["batched"], extra, rng)


# --------------------------------------------------------------------------- 1-D sweep of the size rules


def _sweep(full: bool):
    lengths = range(1, 8) if full else (1, 2, 3, 5, 6)
    for n, k, s, dl, ceil in itertools.product(lengths, range(1, 5), range(1, 4), (1, 2), (False, True)):
        for p in range(k // 2 + 1):
            yield n, k, s, p, dl, ceil


def _check_sweep(full: bool) -> int:
    """Output sizes, values and gradients of every small 1-D geometry agree with PyTorch,
    including ceil_mode's last-window rule and avg_pool's divisors; where PyTorch
    finds no output, we raise ValueError naming the window."""
    rng = np.random.default_rng(7)
    checked = 0
    for n, k, s, p, dl, ceil in _sweep(full):
        x = rng.integers(-2, 3, (1, 2, n)).astype(np.float64)
        for kind in ("max", "avg", "avg_nopad"):
            if kind != "max" and dl != 1:
                continue
            kw = dict(stride=s, padding=p, ceil_mode=ceil)
            if kind == "max":
                kw["dilation"] = dl
            if kind == "avg_nopad":
                kw["count_include_pad"] = False
            op = max_pool if kind == "max" else avg_pool
            torch_fn = F.max_pool1d if kind == "max" else F.avg_pool1d
            xt = torch.tensor(x, requires_grad=True)
            try:
                yt = torch_fn(xt, k, **kw)
            except RuntimeError:
                with pytest.raises(ValueError, match="window"):
                    op(x, k, **kw)
                continue
            y, pullback = pnn.vjp(op, x, k, **kw)
            assert y.shape == tuple(yt.shape), (n, k, s, p, dl, ceil, kind)
            dy = rng.standard_normal(y.shape)
            yt.backward(torch.tensor(dy))
            np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
            if np.isinf(y).any():
                # A dilated window that sees only padding: PyTorch sends its gradient
                # to an out-of-range index; see test_max_pool_window_of_padding_only.
                continue
            np.testing.assert_allclose(pullback(dy).x, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
            checked += 1
    return checked


def test_1d_sweep_matches_torch():
    assert _check_sweep(full=False) > 300


@pytest.mark.slow
def test_1d_sweep_matches_torch_full():
    assert _check_sweep(full=True) > 500


# --------------------------------------------------------------------------- ties, NaN, -inf


@pytest.mark.parametrize("case", cases("max_pool", mixed=False))
def test_max_pool_gradient_goes_to_first_maximum(case):
    # 2x2 windows over a 2x4 image: [[5, 1 | 2, 7], [5, 5 | 7, 7]] -> first max in row-major order.
    x = case.asarray(np.array([[[[5.0, 1, 2, 7], [5, 5, 7, 7]]]]))
    with case.use():
        y, pullback = pnn.vjp(max_pool, x, 2)
        dx = to_numpy(pullback(case.asarray(np.array([[[[1.0, 10.0]]]]))).x)
    np.testing.assert_array_equal(to_numpy(y), [[[[5.0, 7.0]]]])
    np.testing.assert_array_equal(dx, [[[[1.0, 0, 0, 10], [0, 0, 0, 0]]]])


@pytest.mark.parametrize("case", cases("max_pool", mixed=False))
@pytest.mark.parametrize("layout", ["first", "last"])
def test_max_pool_nan_propagates_like_torch(case, layout):
    rng = np.random.default_rng(3)
    base = rng.integers(-2, 3, (1, 2, 5, 6)).astype(np.float64)
    base[0, 0, 1, 1] = np.nan  # one NaN shared by overlapping windows
    base[0, 1, 0, 2] = np.nan
    base[0, 1, 1, 3] = np.nan  # two NaN in one window
    base[0, 1, 4, 5] = np.nan  # in a ceil-mode edge window
    x = case.asarray(to_layout(base, layout, True))
    kwargs = dict(window=(2, 3), stride=(1, 2), padding=1, ceil_mode=True)
    with case.use():
        y, pullback = pnn.vjp(max_pool, x, channel_axis=-1 if layout == "last" else 1, **kwargs)
        dy = rng.standard_normal(tuple(y.shape))
        dx = pullback(case.asarray(dy)).x
    y_ref, dx_ref = _torch_pool("max", base, from_layout(dy, layout, True), 2, kwargs)
    y64 = from_layout(to_numpy(y), layout, True)
    assert np.isnan(y_ref).any()
    np.testing.assert_array_equal(np.isnan(y64), np.isnan(y_ref))
    finite = ~np.isnan(y_ref)
    np.testing.assert_allclose(y64[finite], y_ref[finite], rtol=case.tol)
    assert_close(from_layout(to_numpy(dx), layout, True), dx_ref, case.tol, "dx with NaN")


def test_max_pool_infinite_windows_like_torch():
    """All -inf windows: output -inf, gradient to the first real position (padding never wins)."""
    x = np.full((1, 1, 3, 4), -np.inf)
    x[0, 0, 2, 3] = 1.0
    kwargs = dict(window=2, stride=1, padding=1)
    y, pullback = pnn.vjp(max_pool, x, **kwargs)
    dy = np.arange(1.0, 1.0 + np.prod(y.shape)).reshape(y.shape)
    y_ref, dx_ref = _torch_pool("max", x, dy, 2, kwargs)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(pullback(dy).x, dx_ref)


def test_max_pool_window_of_padding_only():
    # Dilation can make a window see padding only: output -inf and no gradient
    # (PyTorch reports an out-of-range index there).
    x = np.array([[[1.0, 2.0]]])
    y, pullback = pnn.vjp(max_pool, x, 2, stride=1, padding=1, dilation=3)
    np.testing.assert_array_equal(y, [[[-np.inf]]])
    np.testing.assert_array_equal(pullback(np.ones((1, 1, 1))).x, np.zeros((1, 1, 2)))


# --------------------------------------------------------------------------- zero size, finite differences


@pytest.mark.parametrize("op, torch_fn", [(max_pool, F.max_pool2d), (avg_pool, F.avg_pool2d)])
@pytest.mark.parametrize("case", cases("max_pool", mixed=False))
def test_zero_batch(op, torch_fn, case):
    x = case.asarray(np.zeros((0, 3, 5, 4)))
    with case.use():
        y, pullback = pnn.vjp(op, x, 2, padding=1, ceil_mode=True)
        dx = pullback(case.asarray(np.zeros(tuple(y.shape)))).x
    assert tuple(y.shape) == tuple(torch_fn(torch.zeros(0, 3, 5, 4), 2, padding=1, ceil_mode=True).shape)
    assert tuple(dx.shape) == (0, 3, 5, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window=(2, 3), stride=(2, 1), padding=(1, 1), ceil_mode=True, count_include_pad=False),
        dict(window=3, stride=2, padding=1, ceil_mode=True),
    ],
)
def test_avg_pool_directional_derivative(kwargs):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 2, 5, 6))
    y, pullback = pnn.vjp(avg_pool, x, **kwargs)
    dy = rng.standard_normal(y.shape)
    directional_check(lambda x: avg_pool(x, **kwargs), {"x": x}, {"x": pullback(dy).x}, dy)


def test_max_pool_directional_derivative():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 2, 4, 5, 3))  # distinct values: max is locally linear
    kwargs = dict(window=(2, 3, 2), stride=(1, 2, 1), padding=(1, 1, 0), dilation=(2, 1, 1), channel_axis=-1)
    x = np.moveaxis(x, 1, -1)
    y, pullback = pnn.vjp(max_pool, x, **kwargs)
    dy = rng.standard_normal(y.shape)
    directional_check(lambda x: max_pool(x, **kwargs), {"x": x}, {"x": pullback(dy).x}, dy)


# --------------------------------------------------------------------------- vjp plumbing


@pytest.mark.parametrize("op", [max_pool, avg_pool])
def test_vjp_fields_wrt_and_out_buffers(op):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 6, 5))
    y, pullback = pnn.vjp(op, x, 3, stride=2, padding=1)
    dy = rng.standard_normal(y.shape)
    grads = check_pullback_plumbing(pullback, dy, {"x": x})
    assert grads._fields == ("x",)
    _, pullback_none = pnn.vjp(op, x, 3, stride=2, padding=1, wrt=())
    assert pullback_none(dy).x is None
    with pytest.raises(ValueError, match="wrt"):
        pnn.vjp(op, x, 3, wrt=("weight",))
    np.testing.assert_array_equal(op(x, 3, stride=2, padding=1), y)


def test_torch_results_have_no_autograd_history():
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    for op in (max_pool, avg_pool):
        y = op(x, 2)
        assert isinstance(y, torch.Tensor) and not y.requires_grad


def test_window_of_one_returns_a_new_array():
    x = np.arange(6.0).reshape(1, 1, 6)
    y = max_pool(x, 1)
    y[...] = 0
    assert x[0, 0, 5] == 5.0


# --------------------------------------------------------------------------- validation


_X4 = np.zeros((2, 3, 4, 5))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda op: op(_X4, 6), ValueError, "window=6 is larger than the padded input"),
        (lambda op: op(_X4, (2, 6), padding=(0, 0)), ValueError, "larger than the padded input"),
        (lambda op: op(_X4, 2, stride=0), ValueError, "stride must be >= 1"),
        (lambda op: op(_X4, 2, stride=(1, -1)), ValueError, "stride must be >= 1"),
        (lambda op: op(_X4, 0), ValueError, "window must be >= 1"),
        (lambda op: op(_X4, 2, padding=-1), ValueError, "padding must be >= 0"),
        (lambda op: op(_X4, 3, padding=2), ValueError, "padding must be at most half the window"),
        (lambda op: op(_X4, (2, 2, 2, 2)), ValueError, "window must have 1 to 3 entries"),
        (lambda op: op(_X4, (2, 2), stride=(1, 1, 1)), ValueError, "stride must be an int or a tuple of 2"),
        (lambda op: op(np.zeros((3, 4)), 2), ValueError, "pass a tuple window for unbatched input"),
        (lambda op: op(np.zeros((1, 2, 3, 4, 5)), (2, 2)), ValueError, "x must have 4 dimensions"),
        (lambda op: op(_X4, 2, channel_axis=2), ValueError, "channel_axis must be 1"),
        (lambda op: op(_X4, 2, channel_axis=7), ValueError, "channel_axis=7 is out of range"),
        (lambda op: op(np.zeros((2, 3, 4, 5), dtype=np.int64), 2), TypeError, "x must have a floating dtype"),
        (lambda op: op([[1.0, 2.0]], (1,)), TypeError, "x must be an array"),
        (lambda op: op(_X4, 2.5), TypeError, "window must be an int"),
        (lambda op: op(_X4, 2, ceil_mode="yes"), TypeError, "ceil_mode must be True or False"),
    ],
)
@pytest.mark.parametrize("op", [max_pool, avg_pool])
def test_bad_arguments(op, call, exc, match):
    with pytest.raises(exc, match=match):
        call(op)


def test_bad_dilation():
    with pytest.raises(ValueError, match="dilation must be >= 1"):
        max_pool(_X4, 2, dilation=0)
    with pytest.raises(ValueError, match="effective size 7"):
        max_pool(_X4, 3, dilation=3)


def test_avg_pool_rejects_a_bad_divisor_override():
    with pytest.raises(ValueError, match="divisor_override"):
        avg_pool(_X4, 2, divisor_override=0)
    with pytest.raises(TypeError, match="divisor_override"):
        avg_pool(_X4, 2, divisor_override=1.5)


def test_avg_pool_rejects_bad_count_include_pad():
    with pytest.raises(TypeError, match="count_include_pad"):
        avg_pool(_X4, 2, count_include_pad=None)
