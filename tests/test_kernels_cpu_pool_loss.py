"""Numba kernels for pooling and the softmax losses: serial and parallel paths against the
reference (float64 to 1e-12), bitwise determinism, out= buffers, selection under auto, exp.

The per-op suites (tests/test_pool.py, tests/test_loss.py) already run every case on the
numba backend against PyTorch; this file covers what is specific to the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_TORCH

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

pool = pytest.importorskip("kernels_cpu.pool")
loss = pytest.importorskip("kernels_cpu.loss")


# --------------------------------------------------------------------------- helpers


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


# --------------------------------------------------------------------------- selection


@pytest.mark.parametrize("op", ["max_pool", "avg_pool", "log_softmax", "cross_entropy"])
def test_auto_picks_numba_for_numpy_float32(op):
    x = np.zeros((2, 3, 4, 4), np.float32)
    if op == "cross_entropy":
        report = pnn.explain(op, x, np.zeros((2, 4, 4), np.int64))
    elif op == "log_softmax":
        report = pnn.explain(op, x, axis=1)
    else:
        report = pnn.explain(op, x, 2, channel_axis=-1)
    assert report.backend == "numba", str(report)


def test_undeclared_cases_fall_back_to_the_reference():
    x = np.zeros((2, 3, 4, 4), np.float16)
    report = pnn.explain(pnn.max_pool, x, 2)
    assert report.backend == "reference" and any(b == "numba" for b, _ in report.passed_over)
    z, t = np.zeros((2, 3), np.float32), np.array([0, 1])
    report = pnn.explain(pnn.cross_entropy, z, t, ignore_index=2**70)
    assert report.backend == "reference"
    assert any(b == "numba" and "int64 ignore_index" in why for b, why in report.passed_over)


# --------------------------------------------------------------------------- pooling vs the reference

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


# --------------------------------------------------------------------------- log_softmax


#: (shape, axis): the class axis last (rows) or not (tiles of q, including a partial tile).
SOFTMAX_CASES = [((7, 37), -1), ((3, 21, 5), 1), ((2, 5, 70), 1), ((70, 3), 0), ((), 0), ((4, 1), 1)]


@pytest.mark.parametrize("shape, axis", SOFTMAX_CASES)
def test_log_softmax_matches_reference_float64(path, shape, axis):
    rng = np.random.default_rng(len(shape))
    x = np.asarray(3.0 * rng.standard_normal(shape) + 100.0)
    if x.ndim == 2:
        x[0, 0] = -np.inf
    y, grads = _run("numba", pnn.log_softmax, (x,), dict(axis=axis))
    y_ref, grads_ref = _run("reference", pnn.log_softmax, (x,), dict(axis=axis))
    _assert_rel(y, y_ref, 1e-12, "y")
    _assert_rel(grads.x, grads_ref.x, 1e-12, "dx")
    if x.size > 1:
        _check_path(path, "_lsm_forward_parallel", "_lsm_backward_parallel")


def test_log_softmax_nan_row_and_float32():
    x = np.random.default_rng(1).standard_normal((3, 40)).astype(np.float32)
    x[1, 17] = np.nan
    with pnn.use_backend("numba"):
        y = pnn.log_softmax(x)
    with pnn.use_backend("reference"):
        y_ref = pnn.log_softmax(x.astype(np.float64))
    assert y.dtype == np.float32 and np.isnan(y[1]).all() and not np.isnan(y[[0, 2]]).any()
    _assert_rel(y, y_ref, 1e-6, "float32 y")


# --------------------------------------------------------------------------- cross_entropy

CE_LAYOUTS = {"NC": ((9, 37), 1), "NCd": ((2, 6, 70), 1), "last": ((3, 4, 6), -1), "unbatched": ((6,), 0)}


def _ce_problem(layout, target, weighted, seed):
    shape, axis = CE_LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal(shape)
    class_axis = axis % len(shape)
    classes = shape[class_axis]
    kwargs = {"axis": axis, "weight": 0.5 + rng.random(classes) if weighted else None}
    if target == "prob":
        t = rng.random(shape)
        t /= t.sum(axis=class_axis, keepdims=True)
    else:
        t = np.asarray(rng.integers(0, classes, tuple(s for i, s in enumerate(shape) if i != class_axis)))
        if t.ndim:
            t.reshape(-1)[::4] = 2
            kwargs["ignore_index"] = 2
    return logits, t, kwargs


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("target, weighted", [("int", False), ("int", True), ("prob", True)])
@pytest.mark.parametrize("layout", list(CE_LAYOUTS))
def test_cross_entropy_matches_reference_float64(path, layout, target, weighted, smoothing, reduction):
    logits, t, kwargs = _ce_problem(layout, target, weighted, seed=len(layout))
    kwargs.update(label_smoothing=smoothing, reduction=reduction)
    out, grads = _run("numba", pnn.cross_entropy, (logits, t), kwargs)
    out_ref, grads_ref = _run("reference", pnn.cross_entropy, (logits, t), kwargs)
    assert np.asarray(out).dtype == np.float64 and np.shape(out) == np.shape(out_ref)
    _assert_rel(out, out_ref, 1e-12, "loss")
    _assert_rel(grads.logits, grads_ref.logits, 1e-12, "dlogits")
    if target == "prob":
        _assert_rel(grads.target, grads_ref.target, 1e-12, "dtarget")
    if layout != "unbatched":
        _check_path(path, "_ce_forward_parallel", "_ce_backward_parallel")


def test_cross_entropy_gradient_of_the_target_alone():
    logits, t, kwargs = _ce_problem("NCd", "prob", True, seed=3)
    with pnn.use_backend("numba"):
        _, pullback = pnn.vjp(pnn.cross_entropy, logits, t, wrt="target", label_smoothing=0.2, **kwargs)
        grads = pullback(np.asarray(1.5))
    with pnn.use_backend("reference"):
        _, pullback = pnn.vjp(pnn.cross_entropy, logits, t, label_smoothing=0.2, **kwargs)
        expected = pullback(np.asarray(1.5))
    assert grads.logits is None
    _assert_rel(grads.target, expected.target, 1e-12, "dtarget")


def test_cross_entropy_float32_edge_cases():
    """Infinite other logits stay finite, NaN logits give NaN, all ignored gives NaN with zero gradient."""
    logits = np.array([[0.5, -np.inf, 2.0], [-np.inf, 1.0, -np.inf], [np.nan, 0.0, 1.0]], np.float32)
    with pnn.use_backend("numba"):
        per, pullback = pnn.vjp(pnn.cross_entropy, logits, np.array([0, 1, 2]), reduction="none")
        dz = pullback(np.ones(3, np.float32)).logits
        all_ignored, pb2 = pnn.vjp(pnn.cross_entropy, logits[:2], np.array([-100, -100]))
        dz2 = pb2(np.asarray(1.0, np.float32)).logits
    assert per.dtype == np.float32 and np.isfinite(per[:2]).all() and np.isnan(per[2])
    assert np.isfinite(dz[:2]).all() and np.isnan(dz[2]).all()
    assert np.isnan(all_ignored)
    np.testing.assert_array_equal(dz2, np.zeros((2, 3), np.float32))


def test_loss_bitwise_deterministic_and_serial_equals_parallel(monkeypatch):
    rng = np.random.default_rng(6)
    z = rng.standard_normal((64, 300))
    z4 = rng.standard_normal((3, 7, 90))
    t = rng.integers(0, 300, 64)
    t4 = rng.integers(0, 7, (3, 90))
    runs = []
    for threshold in (0, 0, 1 << 62):
        monkeypatch.setattr(loss, "PARALLEL_MIN_ELEMENTS", threshold)
        out = []
        for args, kw in (((z, t), {"label_smoothing": 0.1}), ((z4, t4), {"reduction": "none"})):
            value, grads = _run("numba", pnn.cross_entropy, args, kw)
            out += [value, grads.logits]
        y, grads = _run("numba", pnn.log_softmax, (z4,), {"axis": 1})
        runs.append([*out, y, grads.x])
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], runs[1]))
    for a, b in zip(runs[0], runs[2]):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-15)


def test_loss_out_buffers_are_written_in_place():
    rng = np.random.default_rng(7)
    z, t = rng.standard_normal((5, 8)).astype(np.float32), rng.random((5, 8)).astype(np.float32)
    with pnn.use_backend("numba"):
        _, pullback = pnn.vjp(pnn.cross_entropy, z, t)
        expected = pullback(np.asarray(1.0, np.float32))
        buffers = {"logits": np.full_like(z, np.nan), "target": np.full_like(t, np.nan)}
        got = pullback(np.asarray(1.0, np.float32), out=buffers)
        y, pb = pnn.vjp(pnn.log_softmax, z)
        dx = np.full_like(z, np.nan)
        got_x = pb(np.ones_like(y), out={"x": dx})
    assert got.logits is buffers["logits"] and got.target is buffers["target"] and got_x.x is dx
    np.testing.assert_array_equal(buffers["logits"], expected.logits)
    np.testing.assert_array_equal(buffers["target"], expected.target)
    np.testing.assert_allclose(dx, np.ones_like(z) - 8 * np.exp(y), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the vectorizable exp


def test_exp_accuracy_and_special_values():
    d = np.concatenate([np.linspace(-700.0, 700.0, 20001), np.linspace(-1.0, 1.0, 2001)])
    got = np.array([loss._exp64(v) for v in d[::7]])
    ref = np.exp(d[::7])
    assert np.max(np.abs(got - ref) / ref) < 1e-15
    d32 = np.linspace(-86.0, 87.5, 4001).astype(np.float32)
    got32 = np.array([loss._exp32(v) for v in d32], np.float64)
    ref32 = np.exp(d32.astype(np.float64))
    assert np.max(np.abs(got32 - ref32) / ref32) < 2e-7
    assert loss._exp64(-np.inf) == 0.0 and loss._exp64(-800.0) == 0.0 and loss._exp64(0.0) == 1.0
    assert loss._exp64(710.0) == np.inf and np.isnan(loss._exp64(np.nan))
    assert loss._exp32(np.float32(-np.inf)) == 0.0 and np.isnan(loss._exp32(np.float32(np.nan)))
    assert loss._exp32(np.float32(89.0)) == np.inf
