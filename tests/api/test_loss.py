"""log_softmax and cross_entropy: forward and gradients against PyTorch (float64), edge cases, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import portable_nn as pnn
from pnn_testing import (
    HAS_STRICT,
    assert_close,
    cases,
    directional_check,
    family_of,
    grid,
    snapshot,
    to_numpy,
    unchanged,
)
from portable_nn.api.loss import cross_entropy, log_softmax


def _assert_close_nan(actual, expected, tol, what):
    """assert_close that also requires NaN in the same places."""
    a, e = to_numpy(actual), np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=what)
    keep = ~np.isnan(e)
    assert_close(a[keep], e[keep], tol, what)


# --------------------------------------------------------------------------- log_softmax


_LOG_SOFTMAX_GRID = grid(
    {
        "shape_axis": [((5,), -1), ((3, 4), 1), ((3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), -1), ((), 0)],
        "offset": [0.0, 1e3],
    },
    id_fn=lambda c: f"shape={c['shape_axis'][0]}-axis={c['shape_axis'][1]}-offset={c['offset']:g}",
)


@pytest.mark.parametrize("case", cases("log_softmax"))
@pytest.mark.parametrize("cfg", _LOG_SOFTMAX_GRID)
def test_log_softmax_matches_torch(case, cfg):
    shape, axis = cfg["shape_axis"]
    rng = np.random.default_rng(len(shape) + 10 * (axis % 7))
    x = case.asarray(cfg["offset"] + 3.0 * rng.standard_normal(shape))
    before = snapshot([x])
    with case.use():
        y, pullback = pnn.vjp(log_softmax, x, axis=axis)
        dy = case.asarray(rng.standard_normal(shape))
        dx = pullback(dy).x
    assert unchanged([x], before)
    assert family_of(y) == case.lib and y.dtype == x.dtype and dx.dtype == x.dtype
    xt = torch.tensor(to_numpy(x), requires_grad=True)
    yt = F.log_softmax(xt, dim=axis)
    yt.backward(torch.tensor(to_numpy(dy)))
    assert_close(y, yt.detach().numpy(), case.tol, "log_softmax")
    assert_close(dx, xt.grad.numpy(), case.tol, "log_softmax dx")


def test_log_softmax_directional_derivative():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 2))
    y, pullback = pnn.vjp(log_softmax, x, axis=1)
    dy = rng.standard_normal(y.shape)
    directional_check(lambda x: log_softmax(x, axis=1), {"x": x}, {"x": pullback(dy).x}, dy)


def test_log_softmax_is_stable_for_large_logits():
    x = np.array([[1e4, 0.0, -1e4], [1e30, 1e30, -1e30]], dtype=np.float32)
    y = log_softmax(x)
    expected = F.log_softmax(torch.tensor(x, dtype=torch.float64), dim=-1).numpy()
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_log_softmax_empty():
    y, pullback = pnn.vjp(log_softmax, np.zeros((2, 0)), axis=1)
    assert y.shape == (2, 0) and pullback(np.zeros((2, 0))).x.shape == (2, 0)
    y, pullback = pnn.vjp(log_softmax, np.zeros((0, 3)))
    assert y.shape == (0, 3) and pullback(np.zeros((0, 3))).x.shape == (0, 3)


# --------------------------------------------------------------------------- cross_entropy oracle grid

#: logits layouts: (shape, axis); C = 5 everywhere.
LAYOUTS = {
    "unbatched": ((5,), 1),
    "NC": ((6, 5), 1),
    "NCd": ((3, 5, 4), 1),
    "NCdd": ((2, 5, 3, 2), 1),
    "last": ((3, 4, 5), -1),
}
C = 5


def _problem(cfg, rng):
    """(logits, target, weight, kwargs) in float64 NumPy, logits in the cfg's layout."""
    shape, axis = LAYOUTS[cfg["layout"]]
    logits = 2.0 * rng.standard_normal(shape)
    class_axis = 0 if len(shape) == 1 else axis % len(shape)
    kwargs = {"axis": axis, "label_smoothing": cfg["smoothing"], "reduction": cfg["reduction"]}
    if cfg["target"] == "prob":
        raw = rng.standard_normal(shape)
        e = np.exp(raw - raw.max(axis=class_axis, keepdims=True))
        target = e / e.sum(axis=class_axis, keepdims=True)
    else:
        pos_shape = tuple(s for i, s in enumerate(shape) if i != class_axis)
        target = np.asarray(rng.integers(0, C, pos_shape))
        flat = target.reshape(-1)
        if cfg["ignore"] == "default":
            flat[::3] = -100  # includes the unbatched target: every position ignored
        elif cfg["ignore"] == "in_range":
            kwargs["ignore_index"] = 2
            flat[::4] = 2
    weight = 0.5 + rng.random(C) if cfg["weight"] else None
    return logits, target, weight, kwargs, class_axis


def _torch_cross_entropy(logits, target, weight, kwargs, class_axis, dy):
    """PyTorch's loss and gradients (float64), logits moved to (N, C, ...)."""
    zt = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    prob = target.dtype.kind == "f"
    tt = torch.tensor(target, dtype=torch.float64 if prob else torch.int64, requires_grad=prob)
    z_in, t_in = zt, tt
    if logits.ndim > 1 and class_axis != 1:
        z_in = torch.movedim(zt, class_axis, 1)
        if prob:
            t_in = torch.movedim(tt, class_axis, 1)
    kw = {k: v for k, v in kwargs.items() if k != "axis"}
    w = None if weight is None else torch.tensor(weight, dtype=torch.float64)
    out = F.cross_entropy(z_in, t_in, weight=w, **kw)
    out.backward(torch.tensor(dy, dtype=torch.float64))
    return out.detach().numpy(), zt.grad.numpy(), (tt.grad.numpy() if prob else None)


_CE_GRID = grid(
    {
        "layout": list(LAYOUTS),
        "target": ["int", "prob"],
        "weight": [False, True],
        "ignore": ["none", "default", "in_range"],
        "smoothing": [0.0, 0.25, 1.0],
        "reduction": ["mean", "sum", "none"],
    }
)


@pytest.mark.parametrize("case", cases("cross_entropy"))
@pytest.mark.parametrize("cfg", _CE_GRID)
def test_cross_entropy_matches_torch(case, cfg):
    rng = np.random.default_rng(sorted(LAYOUTS).index(cfg["layout"]) + 7 * (cfg["target"] == "prob"))
    logits, target, weight, kwargs, class_axis = _problem(cfg, rng)
    z = case.asarray(logits)
    t = case.asarray(target) if cfg["target"] == "prob" else case.asarray(target, "int64")
    w = case.param(weight)
    before = snapshot([z, t, w])
    with case.use():
        loss, pullback = pnn.vjp(cross_entropy, z, t, weight=w, **kwargs)
        dy = case.asarray(rng.standard_normal(tuple(loss.shape)))
        grads = pullback(dy)
    assert unchanged([z, t, w], before)
    assert family_of(loss) == case.lib and loss.dtype == z.dtype
    if case.lib == "numpy":
        assert isinstance(loss, np.ndarray)  # a 0-d array, not a NumPy scalar
    expected_fields = ("logits", "target") if cfg["target"] == "prob" else ("logits",)
    assert grads._fields == expected_fields
    ref_loss, ref_dz, ref_dt = _torch_cross_entropy(
        to_numpy(z), to_numpy(t) if cfg["target"] == "prob" else target, to_numpy(w), kwargs, class_axis,
        to_numpy(dy),
    )
    _assert_close_nan(loss, ref_loss, case.tol, "cross_entropy")
    assert grads.logits.dtype == z.dtype
    assert_close(grads.logits, ref_dz, case.tol, "cross_entropy dlogits")
    if ref_dt is not None:
        assert grads.target.dtype == t.dtype
        assert_close(grads.target, ref_dt, case.tol, "cross_entropy dtarget")


# --------------------------------------------------------------------------- special cases against torch


def _compare(logits, target, dy=None, **kwargs):
    weight = kwargs.pop("weight", None)
    loss, pullback = pnn.vjp(cross_entropy, logits, target, weight=weight, **kwargs)
    dy = np.ones(np.shape(loss)) if dy is None else dy
    grads = pullback(dy)
    axis = kwargs.get("axis", 1)
    class_axis = 0 if logits.ndim == 1 else axis % logits.ndim
    ref = _torch_cross_entropy(logits, target, weight, kwargs, class_axis, dy)
    _assert_close_nan(loss, ref[0], 1e-12, "loss")
    assert_close(grads.logits, ref[1], 1e-12, "dlogits")
    if ref[2] is not None:
        assert_close(grads.target, ref[2], 1e-12, "dtarget")
    return loss, grads


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", ["int", "prob"])
def test_cross_entropy_zero_batch(reduction, kind):
    logits = np.zeros((0, 4, 3))
    target = np.zeros((0, 4, 3)) if kind == "prob" else np.zeros((0, 3), dtype=np.int64)
    loss, grads = _compare(logits, target, reduction=reduction)
    if reduction == "mean":
        assert np.isnan(loss)
    assert grads.logits.shape == (0, 4, 3)


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_all_ignored_is_nan_with_zero_gradient(smoothing, weighted):
    rng = np.random.default_rng(2)
    weight = rng.random(4) if weighted else None
    loss, grads = _compare(
        rng.standard_normal((3, 4)), np.full(3, -100), weight=weight, label_smoothing=smoothing
    )
    assert np.isnan(loss)
    np.testing.assert_array_equal(grads.logits, np.zeros((3, 4)))


def test_cross_entropy_ignore_index_outside_class_range():
    rng = np.random.default_rng(3)
    _compare(rng.standard_normal((4, 3)), np.array([0, 7, 2, 7]), ignore_index=7, weight=rng.random(3))


def test_cross_entropy_infinite_logits_of_other_classes():
    logits = np.array([[0.5, -np.inf, 2.0], [-np.inf, 1.0, -np.inf]])
    loss, grads = _compare(logits, np.array([0, 1]))
    assert np.isfinite(loss) and np.all(np.isfinite(grads.logits))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_is_stable_for_large_logits(dtype):
    logits = np.array([[1e4, 0.0, -1e4], [5e3, 5e3 + 1.0, 5e3 - 1.0]], dtype=dtype)
    target = np.array([1, 2])
    loss, pullback = pnn.vjp(cross_entropy, logits, target, reduction="none")
    dz = pullback(np.ones(2, dtype=dtype)).logits
    ref = _torch_cross_entropy(logits.astype(np.float64), target, None, {"reduction": "none"}, 1, np.ones(2))
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(dz))
    np.testing.assert_allclose(loss, ref[0], rtol=1e-6)
    np.testing.assert_allclose(dz, ref[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int16])
def test_cross_entropy_accepts_any_integer_target_dtype(dtype):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((5, 3))
    target = np.array([0, 2, 1, 1, 0])
    expected = cross_entropy(logits, target, label_smoothing=0.1)
    np.testing.assert_array_equal(cross_entropy(logits, target.astype(dtype), label_smoothing=0.1), expected)


def test_cross_entropy_torch_results_have_no_autograd_history():
    z = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    t = torch.softmax(torch.randn(4, 3, dtype=torch.float64), 1).requires_grad_()
    for target in (torch.tensor([0, 1, 2, 0]), t):
        out = cross_entropy(z, target)
        assert isinstance(out, torch.Tensor) and not out.requires_grad


# --------------------------------------------------------------------------- finite differences, vjp plumbing


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_directional_derivative_integer_target(reduction):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 4, 2))
    target = np.array([[0, 3], [-100, 1], [2, 2]])
    kwargs = dict(weight=0.5 + rng.random(4), label_smoothing=0.2, reduction=reduction)
    loss, pullback = pnn.vjp(cross_entropy, logits, target, **kwargs)
    dy = rng.standard_normal(np.shape(loss))
    directional_check(
        lambda logits: cross_entropy(logits, target, **kwargs), {"logits": logits},
        {"logits": pullback(dy).logits}, dy,
    )


def test_cross_entropy_directional_derivative_probability_target():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((2, 3, 4))
    target = rng.random((2, 4, 3))
    kwargs = dict(axis=-1, weight=0.5 + rng.random(3), label_smoothing=0.3)
    logits = np.moveaxis(logits, 1, -1)
    _, pullback = pnn.vjp(cross_entropy, logits, target, **kwargs)
    grads = pullback(np.asarray(1.7))
    directional_check(
        lambda logits, target: cross_entropy(logits, target, **kwargs),
        {"logits": logits, "target": target}, {"logits": grads.logits, "target": grads.target}, np.asarray(1.7),
    )


def test_cross_entropy_vjp_fields_and_wrt():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((4, 3))
    probs = rng.random((4, 3))
    _, pullback = pnn.vjp(cross_entropy, logits, np.array([0, 1, 2, 1]))
    assert pullback(np.asarray(1.0))._fields == ("logits",)
    with pytest.raises(ValueError, match="no differentiable argument 'target'"):
        pnn.vjp(cross_entropy, logits, np.array([0, 1, 2, 1]), wrt="target")
    _, pullback = pnn.vjp(cross_entropy, logits, probs, wrt="target")
    grads = pullback(np.asarray(1.0))
    assert grads._fields == ("logits", "target")
    assert grads.logits is None and grads.target.shape == (4, 3)
    full = pnn.vjp(cross_entropy, logits, probs)[1](np.asarray(1.0))
    np.testing.assert_array_equal(grads.target, full.target)
    buffers = {"logits": np.empty((4, 3)), "target": np.empty((4, 3))}
    got = pnn.vjp(cross_entropy, logits, probs)[1](np.asarray(1.0), out=buffers)
    assert got.logits is buffers["logits"] and got.target is buffers["target"]
    np.testing.assert_array_equal(got.logits, full.logits)


def test_log_softmax_vjp_fields():
    _, pullback = pnn.vjp(log_softmax, np.zeros((2, 3)))
    grads = pullback(np.ones((2, 3)))
    assert grads._fields == ("x",)
    np.testing.assert_allclose(grads.x, np.zeros((2, 3)), atol=1e-15)


# --------------------------------------------------------------------------- validation

_Z = np.zeros((4, 3))
_T = np.array([0, 1, 2, 1])


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(target=np.array([0, 3, 1, 1])), ValueError, r"target holds class indices outside \[0, 3\)"),
        (dict(target=np.array([0, -1, 1, 1])), ValueError, "target holds class indices outside"),
        (dict(target=np.array([0, 1, 1, 5]), ignore_index=4), ValueError, "ignore_index=4"),
        (dict(target=np.array([0, 1, 1])), ValueError, r"target must have shape \(4,\)"),
        (dict(target=np.zeros((4, 2))), ValueError, r"target must have shape \(4, 3\)"),
        (dict(target=np.zeros((4, 3), dtype=np.float32)), TypeError, "target has dtype float32"),
        (dict(target=np.zeros(4, dtype=bool)), TypeError, "target must hold integer class indices"),
        (dict(weight=np.ones(4)), ValueError, r"weight must have shape \(3,\)"),
        (dict(weight=np.ones(3, dtype=np.float32)), TypeError, "weight has dtype float32"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(reduction=None), TypeError, "reduction must be one of"),
        (dict(axis=0), ValueError, "axis must not be 0"),
        (dict(axis=2), ValueError, "axis=2 is out of range"),
        (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (dict(target=np.ones((4, 3)), ignore_index=0), ValueError, "ignore_index=0 cannot apply to probability"),
        (dict(logits=np.zeros((4, 3), dtype=np.int64)), TypeError, "logits must have a floating dtype"),
        (dict(logits=np.zeros((4, 0)), target=np.zeros(4, dtype=np.int64)), ValueError, "at least one class"),
        (dict(logits=np.zeros(3), target=np.asarray(1), axis=2), ValueError, "unbatched logits"),
        (dict(target=[0, 1, 2, 1]), TypeError, "target must be an array"),
        (dict(target=torch.tensor([0, 1, 2, 1])), TypeError, "different libraries"),
    ],
)
def test_cross_entropy_bad_arguments(kwargs, exc, match):
    args = {"logits": _Z, "target": _T, **kwargs}
    arrays = [args["logits"], args["target"]]
    before = snapshot(arrays)
    with pytest.raises(exc, match=match):
        cross_entropy(args.pop("logits"), args.pop("target"), **args)
    assert unchanged(arrays, before)


def test_cross_entropy_label_check_on_every_library():
    libs = [torch.tensor]
    if HAS_STRICT:
        import array_api_strict as xps

        libs.append(xps.asarray)
    for to in [np.asarray, *libs]:
        for labels in ([0, 3], [-1, 2], [0, 3, -100]):
            with pytest.raises(ValueError, match="target holds class indices"):
                cross_entropy(to(np.zeros((len(labels), 3))), to(np.array(labels)))
        # ignore_index is not a class, whether the labels are checked the quick way or the exact one
        kept = cross_entropy(to(np.zeros((3, 3))), to(np.array([0, -100, 2])))
        assert float(kept) == pytest.approx(np.log(3))
        with pytest.raises(ValueError, match="target holds class indices"):
            cross_entropy(to(np.zeros((3, 3))), to(np.array([0, -100, 2])), ignore_index=-5)


@pytest.mark.parametrize(
    "x, kwargs, exc, match",
    [
        (np.zeros((2, 3)), dict(axis=2), ValueError, "axis=2 is out of range"),
        (np.zeros((2, 3), dtype=np.int32), {}, TypeError, "x must have a floating dtype"),
        ([1.0, 2.0], {}, TypeError, "x must be an array"),
    ],
)
def test_log_softmax_bad_arguments(x, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        log_softmax(x, **kwargs)


def test_float_labels_say_labels_need_an_integer_dtype():
    with pytest.raises(TypeError, match="integer dtype"):
        pnn.cross_entropy(np.ones((4, 3)), np.array([0.0, 1.0, 2.0, 0.0]))
