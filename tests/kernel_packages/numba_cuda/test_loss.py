"""The Numba-CUDA log_softmax and cross_entropy kernels on the device against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

from . import _sim_checks as sim


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("shape", "axis"), [((5, 37), -1), ((3, 300, 4), 1), ((2050,), 0)])
def test_gpu_log_softmax_matches_reference(shape, axis, dtype):
    import cupy

    rng = np.random.default_rng(0)
    x = (3.0 * rng.standard_normal(shape)).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gx = cupy.asarray(x)
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(pnn.log_softmax, gx, axis=axis).backend == "numba_cuda"
        y, pullback = pnn.vjp(pnn.log_softmax, gx, axis=axis)
        (dx,) = pullback(cupy.asarray(dy))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(pnn.log_softmax, x.astype(np.float64), axis=axis)
        (dx_ref,) = pull_ref(dy.astype(np.float64))
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}[dtype]
    assert sim.rel(cupy.asnumpy(y).astype(np.float64), y_ref) <= tol
    assert sim.rel(cupy.asnumpy(dx).astype(np.float64), dx_ref) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("shape", "axis", "kw", "probabilities"), [
    ((37, 1000), 1, {"label_smoothing": 0.1, "ignore_index": 3}, False),
    ((4, 7, 5, 3), 1, {"reduction": "sum", "weighted": True}, False),
    ((3, 5, 11), -1, {"reduction": "none", "weighted": True, "label_smoothing": 0.2}, False),
    ((3000, 3), 1, {"weighted": True}, False),
    ((6, 9, 4), 1, {"label_smoothing": 0.3, "weighted": True}, True),
    ((5, 2, 300), -1, {"reduction": "none"}, True),
])
def test_gpu_cross_entropy_matches_reference(shape, axis, kw, probabilities, dtype):
    import cupy

    rng = np.random.default_rng(0)
    kw = dict(kw)
    classes = shape[axis]
    logits = (2.0 * rng.standard_normal(shape)).astype(dtype)
    if probabilities:
        e = np.exp(rng.standard_normal(shape))
        target = (e / e.sum(axis=axis, keepdims=True)).astype(dtype)
        gt, ht = cupy.asarray(target), target.astype(np.float64)
    else:
        pos_shape = tuple(s for i, s in enumerate(shape) if i != axis % len(shape))
        target = rng.integers(0, classes, pos_shape)
        target.reshape(-1)[::7] = kw.get("ignore_index", -100)
        gt, ht = cupy.asarray(target), target
    if kw.pop("weighted", False):
        w = rng.random(classes) + 0.5
        kw["weight"] = w.astype("float32" if dtype == "float16" else dtype)
    hkw = {**kw, "axis": axis, **({"weight": kw["weight"].astype(np.float64)} if "weight" in kw else {})}
    gkw = {**kw, "axis": axis, **({"weight": cupy.asarray(kw["weight"])} if "weight" in kw else {})}
    tol = {"float64": 1e-10, "float32": 1e-5, "float16": 3e-3}[dtype]
    wrt = ("logits", "target") if probabilities else ("logits",)
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(pnn.cross_entropy, cupy.asarray(logits), gt, **gkw).backend == "numba_cuda"
        y, pullback = pnn.vjp(pnn.cross_entropy, cupy.asarray(logits), gt, wrt=wrt, **gkw)
        dy = rng.standard_normal(tuple(y.shape))
        grads = pullback(cupy.asarray(dy.astype(dtype)))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(pnn.cross_entropy, logits.astype(np.float64), ht, wrt=wrt, **hkw)
        g_ref = pull_ref(dy.astype(dtype).astype(np.float64))
    assert sim.rel(cupy.asnumpy(y).astype(np.float64), y_ref) <= tol
    for name in wrt:
        assert sim.rel(cupy.asnumpy(getattr(grads, name)).astype(np.float64), getattr(g_ref, name)) <= 10 * tol, name

