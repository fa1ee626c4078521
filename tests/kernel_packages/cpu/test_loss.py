"""The numba log_softmax and cross_entropy kernels against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")


loss = pytest.importorskip("kernels_cpu.loss")

from .pool_loss_testing import _assert_rel, _check_path, _run, path  # noqa: E402, F401


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
    huge = np.broadcast_to(np.zeros(1, np.float32), (1, 1, 1 << 16, 1 << 16))  # a plane of 2**32 positions
    report = pnn.explain(pnn.max_pool, huge, 2)
    assert report.backend == "reference" and any(b == "numba" and "int32" in why for b, why in report.passed_over)
    z, t = np.zeros((2, 3), np.float32), np.array([0, 1])
    report = pnn.explain(pnn.cross_entropy, z, t, ignore_index=2**70)
    assert report.backend == "reference"
    assert any(b == "numba" and "int64 ignore_index" in why for b, why in report.passed_over)


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


def test_exp_accuracy_and_special_values():
    """The shared exponential the loss kernels use (kernels_cpu._vmath.exp; test_vmath.py has the rest)."""
    from numba import njit

    from kernels_cpu import _vmath

    exp = njit(lambda v: _vmath.exp(v))
    d = np.concatenate([np.linspace(-700.0, 700.0, 20001), np.linspace(-1.0, 1.0, 2001)])
    got = np.array([exp(v) for v in d[::7]])
    ref = np.exp(d[::7])
    assert np.max(np.abs(got - ref) / ref) < 1e-15
    d32 = np.linspace(-86.0, 87.5, 4001).astype(np.float32)
    got32 = np.array([exp(v) for v in d32], np.float64)
    ref32 = np.exp(d32.astype(np.float64))
    assert np.max(np.abs(got32 - ref32) / ref32) < 2e-7
    assert exp(-np.inf) == 0.0 and exp(-800.0) == 0.0 and exp(0.0) == 1.0
    assert exp(710.0) == np.inf and np.isnan(exp(np.nan))
    assert exp(np.float32(-np.inf)) == 0.0 and np.isnan(exp(np.float32(np.nan)))
    assert exp(np.float32(89.0)) == np.inf

