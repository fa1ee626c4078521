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

import importlib.util
import math
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_nn as pnn
from pnn_testing import norm_arguments, rel_err
from portable_nn import dispatch

EXAMPLES = int(os.environ.get("PNN_HYPOTHESIS_EXAMPLES", "20"))
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOL = 1e-12


def _takes_numpy(impl: dispatch.Implementation) -> bool:
    return impl.supports.families is None or "numpy" in impl.supports.families


def _takes_cpu_torch(impl: dispatch.Implementation) -> bool:
    s = impl.supports
    return (importlib.util.find_spec("torch") is not None and (s.families is None or "torch" in s.families)
            and (s.devices is None or "cpu" in s.devices))


def kernel_backends(op: str) -> list[str]:
    """Available non-reference backends that register ``op`` for NumPy arrays or CPU torch tensors
    (a torch-only backend, ``aten``, gets the problems as zero-copy tensors)."""
    return [i.backend for i in dispatch.implementations(op) if i.backend != "reference"
            and dispatch.backend_status(i.backend) and (_takes_numpy(i) or _takes_cpu_torch(i))]


#: Arguments a backend declares it cannot take (its Support declines them; forced, it must raise
#: saying so): the drawn problems include them, and are then checked to raise.
DECLINED = {"aten": ("reset_after=False",)}


def _as_tensors(value: Any) -> Any:
    """NumPy floating arrays (nested in tuples/lists too) as torch tensors sharing their memory and strides."""
    import torch

    if isinstance(value, (tuple, list)):
        return type(value)(_as_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_tensors(v) for k, v in value.items()}
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return torch.from_numpy(value)
    return value


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


def _leaves(value: Any) -> list[Any]:
    """The arrays of a possibly nested result (an LSTM's ``(out, (h, c))``, RNN parameter lists)."""
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def check_against_reference(op: str, backend: str, args: tuple, kwargs: dict, cotangent: Any,
                            tol: float = TOL) -> None:
    """Forward and every gradient of ``op`` under ``backend`` equal the reference's to ``tol``."""
    fn = getattr(pnn, op)
    before = [a.copy() for a in _leaves(args) if isinstance(a, np.ndarray)]
    impl = next(i for i in dispatch.implementations(op) if i.backend == backend)
    # the backend's own arrays: a torch-only backend gets the very same memory as tensors
    b_args, b_kwargs, b_cot = (args, kwargs, cotangent)
    if not _takes_numpy(impl):
        b_args, b_kwargs, b_cot = _as_tensors((args, kwargs, cotangent))
    with pnn.use_backend(backend):
        report = pnn.explain(fn, *b_args, **b_kwargs)
        if report.error is not None and any(why in report.error for why in DECLINED.get(backend, ())):
            with pytest.raises(pnn.BackendUnavailableError, match="cannot run this call"):
                fn(*b_args, **b_kwargs)
            return
        assert report.backend == backend, str(report)
        y, pullback = pnn.vjp(fn, *b_args, **b_kwargs)
        grads = pullback(b_cot)
        y2, pullback2 = pnn.vjp(fn, *b_args, **b_kwargs)
        grads2 = pullback2(b_cot)
    with pnn.use_backend("reference"):
        y_ref, pullback_ref = pnn.vjp(fn, *args, **kwargs)
        grads_ref = pullback_ref(cotangent)
    for a, b in zip([a for a in _leaves(args) if isinstance(a, np.ndarray)], before):
        np.testing.assert_array_equal(a, b, err_msg=f"{op} modified an input")
    for k, (out, out2, ref) in enumerate(zip(_leaves(y), _leaves(y2), _leaves(y_ref), strict=True)):
        assert rel_err(out, ref) <= tol, f"{op} output {k}: {rel_err(out, ref):.2e}"
        np.testing.assert_array_equal(out, out2, err_msg=f"{op} output {k} is not reproducible")
    for name in grads._fields:
        g, g_ref, g2 = getattr(grads, name), getattr(grads_ref, name), getattr(grads2, name)
        if g_ref is None:
            assert g is None, f"{op}: d{name} should be None"
            continue
        for k, (leaf, leaf2, ref) in enumerate(zip(_leaves(g), _leaves(g2), _leaves(g_ref), strict=True)):
            if ref is None:  # an absent RNN bias
                assert leaf is None, f"{op}: d{name}[{k}] should be None"
                continue
            err = _grad_err(leaf, ref, cotangent)
            assert err <= tol, f"{op} d{name}[{k}]: {err:.2e}"
            np.testing.assert_array_equal(leaf, leaf2, err_msg=f"{op} d{name}[{k}] is not reproducible")


def _grad_err(g: Any, g_ref: Any, cotangent: Any) -> float:
    """Norm-wise relative error of a gradient, with a floor of 1% of the cotangent's scale.

    A gradient much smaller than the cotangent that produced it is a cancellation (a group of two
    elements normalised: dx = r·(g − mean g − x̂·mean(g·x̂)) nearly vanishes); its rounding error
    is set by the cancelled terms, of the cotangent's size, not by the small result.
    """
    leaves = [c for c in _leaves(cotangent) if c is not None and np.size(c)]
    floor = 0.01 * max((float(np.max(np.abs(c))) for c in leaves), default=0.0)
    e = np.asarray(g_ref, dtype=np.float64)
    if not e.size:
        return 0.0
    scale = max(float(np.max(np.abs(e))), floor, 1e-30)
    return float(np.max(np.abs(np.asarray(g, dtype=np.float64) - e))) / scale


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
    args, params = norm_arguments(op, x, w, b, groups)
    return args, {**params, **kwargs}, rng.standard_normal(shape), tol


NORMS = ("layer_norm", "rms_norm", "batch_norm", "group_norm", "instance_norm")


@pytest.mark.parametrize(("op", "backend"), _backend_params(NORMS))
@SETTINGS
@given(data=st.data())
def test_norms_match_reference(op, backend, data):
    args, kwargs, dy, tol = data.draw(norm_problem(op))
    check_against_reference(op, backend, args, kwargs, dy, tol)


# --------------------------------------------------------------------------- conv and dense

ACTS = ["identity", "relu", "tanh", "sigmoid", "gelu", ("leaky_relu", 0.1)]


@st.composite
def conv_problem(draw: Any) -> tuple[tuple, dict, np.ndarray]:
    """Random conv: 1-3 spatial axes, groups, stride, dilation, padding forms, layout, bias, activation."""
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    d = draw(st.sampled_from([1, 1, 2, 2, 3]))
    groups = draw(st.integers(1, 3))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 3))
    k = tuple(draw(st.integers(1, 3)) for _ in range(d))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(d))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
    padding = draw(st.sampled_from([0, 1, "valid", "same", "pairs"]))
    if padding == "same" and max(stride) > 1:
        padding = 0
    if padding == "pairs":
        padding = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(d))
    spatial = tuple(max(draw(st.integers(1, 6)), dl * (kk - 1) + 1) for kk, dl in zip(k, dilation))
    n = draw(st.integers(1, 2))
    channels_last = draw(st.booleans())
    shape = (n, *spatial, cin) if channels_last else (n, cin, *spatial)
    x = draw(laid_out(shape, seed))
    w = rng.standard_normal((cout, cin // groups, *k))
    b = rng.standard_normal(cout) if draw(st.booleans()) else None
    kwargs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups,
              "activation": draw(st.sampled_from(ACTS)), "channel_axis": -1 if channels_last else 1}
    with pnn.use_backend("reference"):
        y = pnn.conv(x, w, b, **kwargs)
    return (x, w, b), kwargs, rng.standard_normal(y.shape)


@pytest.mark.parametrize(("op", "backend"), _backend_params(("conv",)))
@SETTINGS
@given(data=st.data())
def test_conv_matches_reference(op, backend, data):
    args, kwargs, dy = data.draw(conv_problem())
    check_against_reference(op, backend, args, kwargs, dy)


@st.composite
def dense_problem(draw: Any) -> tuple[tuple, dict, np.ndarray]:
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    lead = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
    fin, fout = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    x = draw(laid_out((*lead, fin), seed))
    w = rng.standard_normal((fout, fin))
    b = rng.standard_normal(fout) if draw(st.booleans()) else None
    return (x, w, b), {"activation": draw(st.sampled_from(ACTS))}, rng.standard_normal((*lead, fout))


@pytest.mark.parametrize(("op", "backend"), _backend_params(("dense",)))
@SETTINGS
@given(data=st.data())
def test_dense_matches_reference(op, backend, data):
    args, kwargs, dy = data.draw(dense_problem())
    check_against_reference(op, backend, args, kwargs, dy)


# --------------------------------------------------------------------------- pooling and losses


@st.composite
def pool_problem(draw: Any, op: str) -> tuple[tuple, dict, np.ndarray]:
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    d = draw(st.sampled_from([1, 2, 2, 3]))
    window = tuple(draw(st.integers(1, 3)) for _ in range(d))
    stride = None if draw(st.booleans()) else tuple(draw(st.integers(1, 3)) for _ in range(d))
    padding = tuple(draw(st.integers(0, w // 2)) for w in window)
    kwargs: dict[str, Any] = {"stride": stride, "padding": padding, "ceil_mode": draw(st.booleans())}
    dilation = (1,) * d
    if op == "max_pool":
        dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
        kwargs["dilation"] = dilation
    else:
        kwargs["count_include_pad"] = draw(st.booleans())
    spatial = tuple(max(draw(st.integers(1, 7)), dl * (w - 1) + 1) for w, dl in zip(window, dilation))
    channels_last = draw(st.booleans())
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    shape = (n, *spatial, c) if channels_last else (n, c, *spatial)
    kwargs["channel_axis"] = -1 if channels_last else 1
    x = draw(laid_out(shape, seed))
    if op == "max_pool" and draw(st.booleans()):  # ties: the gradient goes to the first maximum
        x = np.round(x)
    with pnn.use_backend("reference"):
        y = getattr(pnn, op)(x, window, **kwargs)
    return (x, window), kwargs, rng.standard_normal(y.shape)


@pytest.mark.parametrize(("op", "backend"), _backend_params(("max_pool", "avg_pool")))
@SETTINGS
@given(data=st.data())
def test_pooling_matches_reference(op, backend, data):
    args, kwargs, dy = data.draw(pool_problem(op))
    check_against_reference(op, backend, args, kwargs, dy)


@st.composite
def loss_problem(draw: Any, op: str) -> tuple[tuple, dict, Any]:
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    c = draw(st.integers(1, 7))
    extra = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n = draw(st.integers(1, 4))
    shape = (n, c, *extra)
    logits = draw(laid_out(shape, seed)) * draw(st.sampled_from([1.0, 30.0]))
    if op == "log_softmax":
        axis = draw(st.integers(-len(shape), len(shape) - 1))
        return (logits,), {"axis": axis}, rng.standard_normal(shape)
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    kwargs: dict[str, Any] = {"reduction": reduction, "label_smoothing": draw(st.sampled_from([0.0, 0.0, 0.2]))}
    if draw(st.booleans()):
        kwargs["weight"] = rng.uniform(0.5, 2.0, c)
    if draw(st.booleans()):
        target = rng.integers(0, c, (n, *extra))
        if draw(st.booleans()):
            target.flat[0] = kwargs["ignore_index"] = -1
    else:
        target = rng.dirichlet(np.ones(c), (n, *extra))
        target = np.moveaxis(target, -1, 1)
    cot = rng.standard_normal((n, *extra)) if reduction == "none" else np.asarray(rng.standard_normal())
    return (logits, target), kwargs, cot


@pytest.mark.parametrize(("op", "backend"), _backend_params(("log_softmax", "cross_entropy")))
@SETTINGS
@given(data=st.data())
def test_losses_match_reference(op, backend, data):
    args, kwargs, dy = data.draw(loss_problem(op))
    check_against_reference(op, backend, args, kwargs, dy)


# --------------------------------------------------------------------------- recurrent


def _rnn_weights(rng: np.random.Generator, gates: int, inp: int, hidden: int, biases: bool) -> tuple:
    w = (rng.standard_normal((gates * hidden, inp)) * 0.5, rng.standard_normal((gates * hidden, hidden)) * 0.5)
    if not biases:
        return w
    return (*w, rng.standard_normal(gates * hidden) * 0.5, rng.standard_normal(gates * hidden) * 0.5)


GATES = {"rnn": 1, "lstm": 4, "gru": 3, "rnn_cell": 1, "lstm_cell": 4, "gru_cell": 3}


@st.composite
def cell_problem(draw: Any, op: str) -> tuple[tuple, dict, Any]:
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    n, inp, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    x = draw(laid_out((n, inp), seed))
    h = rng.standard_normal((n, hidden))
    weights = _rnn_weights(rng, GATES[op], inp, hidden, draw(st.booleans()))
    kwargs: dict[str, Any] = {}
    if op == "lstm_cell":
        return (x, h, rng.standard_normal((n, hidden)), *weights), kwargs, (
            rng.standard_normal((n, hidden)), rng.standard_normal((n, hidden)))
    if op == "gru_cell":
        kwargs["reset_after"] = draw(st.booleans())
    else:
        kwargs["activation"] = draw(st.sampled_from(["tanh", "relu"]))
    return (x, h, *weights), kwargs, rng.standard_normal((n, hidden))


@pytest.mark.parametrize(("op", "backend"), _backend_params(("rnn_cell", "lstm_cell", "gru_cell")))
@SETTINGS
@given(data=st.data())
def test_cells_match_reference(op, backend, data):
    args, kwargs, dy = data.draw(cell_problem(op))
    check_against_reference(op, backend, args, kwargs, dy)


@st.composite
def sequence_problem(draw: Any, op: str) -> tuple[tuple, dict, Any]:
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    t, n = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    inp, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    layers, bidirectional = draw(st.integers(1, 2)), draw(st.booleans())
    batch_first = draw(st.booleans())
    dirs = 2 if bidirectional else 1
    biases = draw(st.booleans())
    params = [(*_rnn_weights(rng, GATES[op], inp if layer == 0 else dirs * hidden, hidden, True)[:2 + 2 * biases],
               *((None, None) if not biases else ()))
              for layer in range(layers) for _ in range(dirs)]
    x = draw(laid_out((n, t, inp) if batch_first else (t, n, inp), seed))
    kwargs: dict[str, Any] = {"batch_first": batch_first, "bidirectional": bidirectional}
    if draw(st.booleans()):
        kwargs["lengths"] = np.sort(rng.integers(1, t + 1, n))[::-1].copy()
        kwargs["lengths"][0] = t
    if op == "gru":
        kwargs["reset_after"] = draw(st.booleans())
    if op == "rnn":
        kwargs["activation"] = draw(st.sampled_from(["tanh", "relu"]))
    state = (layers * dirs, n, hidden)
    args: tuple = (x, params)
    if draw(st.booleans()):
        args = (x, params, rng.standard_normal(state), *((rng.standard_normal(state),) if op == "lstm" else ()))
    out = rng.standard_normal((n, t, dirs * hidden) if batch_first else (t, n, dirs * hidden))
    final = (rng.standard_normal(state), rng.standard_normal(state)) if op == "lstm" else rng.standard_normal(state)
    return args, kwargs, (out, final)


@pytest.mark.parametrize(("op", "backend"), _backend_params(("rnn", "lstm", "gru")))
@SETTINGS
@given(data=st.data())
def test_sequences_match_reference(op, backend, data):
    args, kwargs, dy = data.draw(sequence_problem(op))
    check_against_reference(op, backend, args, kwargs, dy)
