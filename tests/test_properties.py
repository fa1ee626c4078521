"""Property-based tests (hypothesis): each kernel backend against the reference on random problems.

Shapes, reduction axes, channel axes, groups and memory layouts (contiguous, strided slices,
permuted views) are drawn by hypothesis; each example runs the op forward and backward (all
gradients) on every non-reference backend that declares it, forced, and on the reference, in
float64, and requires agreement to 1e-12 relative (norm-wise), plus: the backend really ran
(``explain``), inputs are unchanged, and results are bitwise identical when repeated.

Example counts are bounded and derandomised (a fixed seed derived from the test), so CI runs
the same examples every time; ``PNN_HYPOTHESIS_EXAMPLES`` raises the count for a longer hunt.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_nn as pnn
from pnn_testing import rel_err
from portable_nn import dispatch

EXAMPLES = int(os.environ.get("PNN_HYPOTHESIS_EXAMPLES", "20"))
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOL = 1e-12


def kernel_backends(op: str) -> list[str]:
    """Available non-reference backends that register ``op``."""
    return [i.backend for i in dispatch.implementations(op) if i.backend != "reference"
            and dispatch.backend_status(i.backend)]


def _backend_params(ops: tuple[str, ...]) -> list[Any]:
    params = [pytest.param(op, b, id=f"{op}-{b}") for op in ops for b in kernel_backends(op)]
    return params or [pytest.param(None, None, marks=pytest.mark.skip(reason="no kernel backend registered"))]


# --------------------------------------------------------------------------- layouts


@st.composite
def laid_out(draw: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A float64 array of ``shape`` as a contiguous array, a strided slice or a permuted view."""
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["contiguous", "strided", "permuted"]))
    if kind == "strided" and shape:
        base = rng.standard_normal((*shape[:-1], 2 * shape[-1] + 1))
        return base[..., 1::2]
    if kind == "permuted" and len(shape) >= 2:
        order = draw(st.permutations(range(len(shape))))
        stored = rng.standard_normal(tuple(shape[k] for k in order))
        return np.transpose(stored, np.argsort(order))
    return rng.standard_normal(shape)


def _with_offset(x: np.ndarray, offset: float) -> np.ndarray:
    """``x + offset`` keeping ``x``'s memory layout (the large-offset stability case)."""
    if offset:
        x += offset
    return x


# --------------------------------------------------------------------------- the check


def check_against_reference(op: str, backend: str, args: tuple, kwargs: dict, cotangent: Any,
                            tol: float = TOL) -> None:
    """Forward and every gradient of ``op`` under ``backend`` equal the reference's to ``tol``."""
    fn = getattr(pnn, op)
    before = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    with pnn.use_backend(backend):
        assert pnn.explain(fn, *args, **kwargs).backend == backend
        y, pullback = pnn.vjp(fn, *args, **kwargs)
        grads = pullback(cotangent)
        y2, pullback2 = pnn.vjp(fn, *args, **kwargs)
        grads2 = pullback2(cotangent)
    with pnn.use_backend("reference"):
        y_ref, pullback_ref = pnn.vjp(fn, *args, **kwargs)
        grads_ref = pullback_ref(cotangent)
    for a, b in zip(args, before):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f"{op} modified an input")
    assert rel_err(y, y_ref) <= tol, f"{op} forward: {rel_err(y, y_ref):.2e}"
    np.testing.assert_array_equal(y, y2, err_msg=f"{op} forward is not reproducible")
    for name in grads._fields:
        g, g_ref, g2 = getattr(grads, name), getattr(grads_ref, name), getattr(grads2, name)
        if g_ref is None:
            assert g is None, f"{op}: d{name} should be None"
            continue
        err = _grad_err(g, g_ref, cotangent)
        assert err <= tol, f"{op} d{name}: {err:.2e}"
        np.testing.assert_array_equal(g, g2, err_msg=f"{op} d{name} is not reproducible")


def _grad_err(g: Any, g_ref: Any, cotangent: Any) -> float:
    """Norm-wise relative error of a gradient, with a floor of 1% of the cotangent's scale.

    A gradient much smaller than the cotangent that produced it is a cancellation (a group of two
    elements normalised: dx = r·(g − mean g − x̂·mean(g·x̂)) nearly vanishes); its rounding error
    is set by the cancelled terms, of the cotangent's size, not by the small result.
    """
    leaves = cotangent if isinstance(cotangent, tuple) else (cotangent,)
    floor = 0.01 * max((float(np.max(np.abs(c))) for c in leaves if c is not None and np.size(c)), default=0.0)
    e = np.asarray(g_ref, dtype=np.float64)
    scale = max(float(np.max(np.abs(e))) if e.size else 0.0, floor, 1e-30)
    return float(np.max(np.abs(np.asarray(g, dtype=np.float64) - e))) / scale if e.size else 0.0


# --------------------------------------------------------------------------- norms


@st.composite
def norm_problem(draw: Any, op: str) -> tuple[tuple, dict, np.ndarray, float]:
    """Random arguments of a norm: rank, sizes, axes/channel axis/groups, parameters, layout, offset.

    Returns ``(args, kwargs, cotangent, tolerance)``.  With a 1e4 offset the float64 inputs
    themselves carry only ~12 significant digits of their deviation from the mean (condition
    number offset/std), so two correct implementations agree to ~1e-12·1e4·eps⁻¹·eps — the
    tolerance is scaled accordingly.
    """
    seed = draw(st.integers(0, 2**16))
    offset = draw(st.sampled_from([0.0, 0.0, 1e4]))
    tol = TOL if not offset else 1e-12 * offset / 10
    activation = draw(st.sampled_from(["identity", "identity", "relu", "tanh", "gelu", ("leaky_relu", 0.2)]))
    if op in ("layer_norm", "rms_norm"):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
        k = draw(st.integers(1, len(shape)))
        axis = tuple(range(len(shape) - k, len(shape))) if draw(st.booleans()) else tuple(range(-k, 0))
        if math.prod(shape[-k:]) < 2:
            shape = (*shape[:-1], 3)
        pshape = shape[len(shape) - k:]
        x = _with_offset(draw(laid_out(shape, seed)), offset if op == "layer_norm" else 0.0)
        rng = np.random.default_rng(seed + 1)
        w = rng.standard_normal(pshape) if draw(st.booleans()) else None
        if op == "rms_norm":
            return (x, w), {"axis": axis}, rng.standard_normal(shape), TOL
        b = rng.standard_normal(pshape) if draw(st.booleans()) else None
        return (x, w, b), {"axis": axis, "activation": activation}, rng.standard_normal(shape), tol
    rank = draw(st.integers(2 if op == "batch_norm" else 3, 5))
    channels_last = draw(st.booleans())
    groups = draw(st.integers(1, 3)) if op == "group_norm" else 1
    c = groups * draw(st.integers(1, 3))
    n = draw(st.integers(1 if op != "batch_norm" else 2, 4))
    spatial = tuple(draw(st.integers(1 if op == "batch_norm" else 2, 5)) for _ in range(rank - 2))
    shape = (n, *spatial, c) if channels_last else (n, c, *spatial)
    x = _with_offset(draw(laid_out(shape, seed)), offset)
    rng = np.random.default_rng(seed + 1)
    w = rng.standard_normal(c) if draw(st.booleans()) else None
    b = rng.standard_normal(c) if draw(st.booleans()) else None
    kwargs = {"channel_axis": -1 if channels_last else 1, "activation": activation}
    if op == "batch_norm" and draw(st.booleans()):
        kwargs.update(running_mean=np.zeros(c) + 0.5, running_var=np.ones(c) * 2.0, training=False)
    args = (x, groups, w, b) if op == "group_norm" else (x, w, b)
    return args, kwargs, rng.standard_normal(shape), tol


NORMS = ("layer_norm", "rms_norm", "batch_norm", "group_norm", "instance_norm")


@pytest.mark.parametrize(("op", "backend"), _backend_params(NORMS))
@SETTINGS
@given(data=st.data())
def test_norms_match_reference(op, backend, data):
    args, kwargs, dy, tol = data.draw(norm_problem(op))
    check_against_reference(op, backend, args, kwargs, dy, tol)
