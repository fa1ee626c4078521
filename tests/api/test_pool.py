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
from portable_nn.api.pool import avg_pool, max_pool, max_unpool
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


def _torch_pool(kind: str, x64: np.ndarray, dy64: np.ndarray, d: int, kwargs: dict) -> tuple[np.ndarray, ...]:
    """PyTorch's output and input gradient (and indices, with ``return_indices``), float64, batched
    channels-first."""
    fn = (TORCH_MAX if kind == "max" else TORCH_AVG)[d]
    kw = dict(kwargs)
    if kw.pop("return_indices", False):
        xt = torch.tensor(x64, dtype=torch.float64, requires_grad=True)
        window = kw.pop("window")
        if kw.get("stride") is None:
            kw.pop("stride", None)
        yt, it = fn(xt, window, return_indices=True, **kw)
        yt.backward(torch.tensor(dy64, dtype=torch.float64))
        return yt.detach().numpy(), xt.grad.numpy(), it.numpy()
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
    indices = None
    with case.use():
        y, pullback = pnn.vjp(op, x, channel_axis=channel_axis, **kwargs)
        if kwargs.get("return_indices"):
            y, indices = y
        dy = case.asarray(rng.standard_normal(tuple(y.shape)))
        grads = pullback((dy, None) if indices is not None else dy)
    assert unchanged([x], before)
    assert family_of(y) == case.lib and family_of(grads.x) == case.lib
    assert y.dtype == x.dtype and grads.x.dtype == x.dtype
    x64 = from_layout(to_numpy(x), layout, batched)
    dy64 = from_layout(to_numpy(dy), layout, batched)
    torch_kwargs = dict(_geometry_kwargs(geom, True, use_dilation=kind == "max"))
    torch_kwargs.update(extra)
    y_ref, dx_ref, *index_ref = _torch_pool(kind, x64, dy64, d, torch_kwargs)
    if indices is not None:
        assert family_of(indices) == case.lib and tuple(indices.shape) == tuple(y.shape)
        assert "int64" in str(indices.dtype)
        np.testing.assert_array_equal(from_layout(np.asarray(to_numpy(indices)), layout, batched), index_ref[0])
    assert_close(from_layout(to_numpy(y), layout, batched), y_ref, case.tol, f"{kind}_pool output")
    assert_close(from_layout(to_numpy(grads.x), layout, batched), dx_ref, case.tol, f"{kind}_pool dx")


_MAX_GRID = grid(
    {"geom": list(GEOMS), "layout": ["first", "last"], "batched": [True, False], "ceil_mode": [False, True],
     "return_indices": [False, True]}
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
    extra = {"ceil_mode": cfg["ceil_mode"], "return_indices": cfg["return_indices"]}
    _run_case(case, "max", GEOMS[cfg["geom"]], cfg["layout"], cfg["batched"], extra, rng)


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


# --------------------------------------------------------------------------- max_unpool

TORCH_UNPOOL = {1: F.max_unpool1d, 2: F.max_unpool2d, 3: F.max_unpool3d}

#: (x spatial before pooling, window, stride, padding, output_size): overlapping windows give
#: duplicate indices; output_size within a stride of the default.
UNPOOLS = {
    "1d-k3-s2-p1": ((9,), 3, 2, 1, None),
    "2d-k3-s2-overlap": ((7, 6), 3, 2, 0, (8, 6)),
    "2d-k2x3-s1x2-p1x0": ((5, 6), (2, 3), (1, 2), (1, 0), (5, 6)),
    "3d-k2": ((4, 5, 4), 2, None, 0, (5, 5, 4)),
}

_UNPOOL_GRID = grid({"geom": list(UNPOOLS), "layout": ["first", "last"], "batched": [True, False]})


def _written_entries(indices: np.ndarray) -> np.ndarray:
    """Per entry of (N, C, *spatial) indices, whether it is the last in its plane naming its index."""
    planes = indices.reshape(indices.shape[0] * indices.shape[1], -1)
    wins = np.zeros(planes.shape, bool)
    for plane, won in zip(planes, wins):
        last = {q: p for p, q in enumerate(plane)}
        won[list(last.values())] = True
    return wins.reshape(indices.shape)


def _torch_unpool_case(geom: str, rng: np.random.Generator):
    """x, indices from PyTorch's max_pool over tied values, max_unpool's output and dx, float64.

    PyTorch gives every duplicate entry the cotangent; the derivative (ours) gives it to the entry
    that was written only."""
    spatial, window, stride, padding, output_size = UNPOOLS[geom]
    d = len(spatial)
    source = torch.tensor(rng.integers(-2, 3, (2, 3, *spatial)).astype(np.float64))
    pooled, indices = TORCH_MAX[d](source, window, stride=stride, padding=padding, return_indices=True)
    x = pooled.clone().requires_grad_(True)
    y = TORCH_UNPOOL[d](x, indices, window, stride=stride, padding=padding, output_size=output_size)
    dy = torch.tensor(rng.standard_normal(tuple(y.shape)))
    y.backward(dy)
    kwargs = dict(stride=stride, padding=padding, output_size=output_size)
    dx = np.where(_written_entries(indices.numpy()), x.grad.numpy(), 0.0)
    return x.detach().numpy(), indices.numpy(), y.detach().numpy(), dy.numpy(), dx, window, kwargs


@pytest.mark.parametrize("case", cases("max_unpool", mixed=False))
@pytest.mark.parametrize("cfg", _UNPOOL_GRID)
def test_max_unpool_matches_torch(case, cfg):
    rng = np.random.default_rng(list(UNPOOLS).index(cfg["geom"]))
    x64, idx64, y_ref, dy64, dx_ref, window, kwargs = _torch_unpool_case(cfg["geom"], rng)
    layout, batched = cfg["layout"], cfg["batched"]
    if not batched and isinstance(window, int):
        window = (window,) * (x64.ndim - 2)
    x = case.asarray(to_layout(x64, layout, batched))
    indices = case.asarray(to_layout(idx64, layout, batched), "int64")
    before = snapshot([x, indices])
    with case.use():
        y, pullback = pnn.vjp(max_unpool, x, indices, window, channel_axis=-1 if layout == "last" else 1, **kwargs)
        dx = pullback(case.asarray(to_layout(dy64, layout, batched))).x
    assert unchanged([x, indices], before)
    assert family_of(y) == case.lib and y.dtype == x.dtype and dx.dtype == x.dtype
    if not batched:  # the case is the first sample alone
        y_ref, dx_ref = y_ref[:1], dx_ref[:1]
    np.testing.assert_array_equal(from_layout(to_numpy(y), layout, batched), to_numpy(case.asarray(y_ref)))
    assert_close(from_layout(to_numpy(dx), layout, batched), dx_ref, case.tol, "max_unpool dx")


@pytest.mark.parametrize("case", cases("max_unpool", mixed=False))
def test_max_unpool_duplicates_last_entry_wins(case):
    x = case.asarray(np.array([[[1.0, 2.0, 3.0, 4.0]]]))
    indices = case.asarray(np.array([[[5, 0, 5, 0]]]), "int64")
    with case.use():
        y, pullback = pnn.vjp(max_unpool, x, indices, 2)
        dx = pullback(case.asarray(np.arange(8.0).reshape(1, 1, 8))).x
    np.testing.assert_array_equal(to_numpy(y), [[[4.0, 0, 0, 0, 0, 3.0, 0, 0]]])
    np.testing.assert_array_equal(to_numpy(dx), [[[0.0, 0.0, 5.0, 0.0]]])  # the overwritten entries get 0


def test_max_unpool_inverts_max_pool_indices_in_every_layout():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 6, 3))  # channels last, distinct values
    y, indices = max_pool(x, 2, channel_axis=-1, return_indices=True)
    restored = max_unpool(y, indices, 2, channel_axis=-1, output_size=(5, 6))
    kept = restored != 0
    np.testing.assert_array_equal(restored[kept], x[kept])
    assert kept.sum() == y.size


def test_max_unpool_directional_derivative():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 4))
    indices = rng.integers(0, 8, (2, 3, 4))
    y, pullback = pnn.vjp(max_unpool, x, indices, 3, stride=2, padding=1, output_size=(8,))
    dy = rng.standard_normal(y.shape)
    directional_check(lambda x: max_unpool(x, indices, 3, stride=2, padding=1, output_size=(8,)), {"x": x},
                      {"x": pullback(dy).x}, dy)


_XU = np.zeros((2, 3, 2, 2))
_IU = np.zeros((2, 3, 2, 2), dtype=np.int64)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: max_unpool(_XU, _IU + 16, 2), ValueError, r"indices must be flat positions in \[0, 16\)"),
        (lambda: max_unpool(_XU, _IU - 1, 2), ValueError, r"got values in \[-1, -1\]"),
        (lambda: max_unpool(_XU, _IU[..., :1], 2), ValueError, "indices must have shape"),
        (lambda: max_unpool(_XU, _IU.astype(np.float64), 2), TypeError, "indices must have an integer dtype"),
        (lambda: max_unpool(_XU, [[0]], 2), TypeError, "indices must be an array"),
        (lambda: max_unpool(_XU, _IU, 2, output_size=(6, 4)), ValueError, "strictly between 2 and 6"),
        (lambda: max_unpool(_XU, _IU, 2, output_size=(4, 4, 4)), ValueError, "output_size must have 2 entries"),
        (lambda: max_unpool(_XU, _IU, 2, padding=-1), ValueError, "padding must be >= 0"),
        (lambda: max_unpool(_XU, _IU, 1, padding=1), ValueError, "max_unpool has no output"),
        (lambda: max_unpool(_XU.astype(np.int64), _IU, 2), TypeError, "x must have a floating dtype"),
        (lambda: max_unpool(_XU, torch.zeros(2, 3, 2, 2, dtype=torch.int64), 2), TypeError, "different libraries"),
    ],
)
def test_max_unpool_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_max_unpool_accepts_a_full_shape_output_size_as_torch():
    x = np.ones((1, 2, 2, 2))
    indices = np.zeros((1, 2, 2, 2), dtype=np.int64)
    assert max_unpool(x, indices, 2, output_size=(1, 2, 5, 4)).shape == (1, 2, 5, 4)
    assert max_unpool(x, indices, 2, output_size=5).shape == (1, 2, 5, 5)


def test_max_pool_return_indices_validation():
    with pytest.raises(TypeError, match="return_indices must be True or False"):
        max_pool(_X4, 2, return_indices="yes")
