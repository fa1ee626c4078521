"""portable_nn.jax: custom_vjp ops under grad, jit and vmap, on both routes (Numba callback, traced reference).

Oracles: outputs must equal ``portable_nn`` on NumPy inputs; gradients must equal
what ``jax.grad`` computes *through* the reference forward traced with
``jax.numpy`` (``pnj.reference_autodiff``: JAX's own autodiff, independent of
portable_nn's hand-written backward), to 1e-10 in float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import portable_nn as pnn  # noqa: E402
import portable_nn.jax as pnj  # noqa: E402
from pnn_testing import assert_close  # noqa: E402

ROUTES = ("callback", "traced")


@pytest.fixture
def x64():
    """float64 JAX arrays for this test only (JAX defaults to float32)."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def use_route(route: str) -> Any:
    """The configuration that forces ``route``: Numba kernels through the callback, or the traced reference."""
    return pnn.use_backend("numba" if route == "callback" else "reference")


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class _Diff:
    """Marks a differentiated argument inside a call's argument tree."""

    key: Any


@dataclass
class OpCase:
    """One op call with NumPy float64 arguments, and which of them to differentiate.

    ``wrt`` holds positional indices and keyword names.  ``lengths`` stays a
    NumPy array (static); every other array becomes a JAX array, passed to the
    jitted function as an argument so that it is traced.
    """

    id: str
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    wrt: tuple[Any, ...] = (0,)

    def binder(self, dtype: Any = None) -> tuple[dict[Any, Any], list[Any], Any]:
        """``(diff, const, bind)``: ``bind(diff, const)`` rebuilds ``(args, kwargs)`` for the op."""
        args = [_to_jax(a, dtype) for a in self.args]
        kwargs = {k: (v if k == "lengths" else _to_jax(v, dtype)) for k, v in self.kwargs.items()}
        diff = {}
        for key in self.wrt:
            if isinstance(key, int):
                diff[key], args[key] = args[key], _Diff(key)
            else:
                diff[key], kwargs[key] = kwargs[key], _Diff(key)
        leaves, tree = jax.tree_util.tree_flatten((tuple(args), kwargs))
        const_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

        def bind(diff_values: dict[Any, Any], const_values: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            full = list(leaves)
            for i, v in zip(const_at, const_values):
                full[i] = v
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, _Diff):
                    full[i] = diff_values[leaf.key]
            return tree.unflatten(full)

        return diff, [leaves[i] for i in const_at], bind


def _to_jax(value: Any, dtype: Any = None) -> Any:
    if isinstance(value, list):
        return [_to_jax(v, dtype) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_jax(v, dtype) for v in value)
    if isinstance(value, np.ndarray):
        if dtype is not None and np.issubdtype(value.dtype, np.floating):
            return jnp.asarray(value, dtype=dtype)
        return jnp.asarray(value)
    return value


def _rnn_params(rng: np.random.Generator, gates: int, features: int, hidden: int, layers: int, dirs: int,
                bias: bool = True) -> list[tuple[Any, ...]]:
    params = []
    for layer in range(layers):
        inputs = features if layer == 0 else dirs * hidden
        for _ in range(dirs):
            params.append((
                rng.standard_normal((gates * hidden, inputs)) * 0.5,
                rng.standard_normal((gates * hidden, hidden)) * 0.5,
                rng.standard_normal(gates * hidden) * 0.1 if bias else None,
                rng.standard_normal(gates * hidden) * 0.1,
            ))
    return params


def _stats(rng: np.random.Generator, c: int) -> dict[str, Any]:
    return {"running_mean": rng.standard_normal(c), "running_var": np.abs(rng.standard_normal(c)) + 0.5}


def _cases() -> list[OpCase]:
    rng = np.random.default_rng(7)
    n = rng.standard_normal
    probs = np.exp(n((4, 5)))
    probs /= probs.sum(axis=1, keepdims=True)
    targets = np.array([[0, 4, -100], [2, 2, 1], [3, -100, 0], [4, 1, 1]])
    return [
        OpCase("layer_norm", "layer_norm", (n((3, 4, 5)), n(5), n(5)), {"activation": "gelu_tanh"}, (0, 1, 2)),
        OpCase("layer_norm-2axes", "layer_norm", (n((3, 4, 5)), n((4, 5)), None),
               {"axis": (-2, -1), "activation": ("leaky_relu", 0.2)}, (0, 1)),
        # weight and bias are keyword-only: every differentiated argument by name (JAX sorts the keys)
        OpCase("batch_norm-train-stats", "batch_norm", (),
               {"x": n((4, 3, 5)), "weight": n(3), "bias": n(3), **_stats(rng, 3), "return_stats": True,
                "activation": "silu"}, ("x", "weight", "bias")),
        OpCase("batch_norm-eval-last", "batch_norm", (),
               {"x": n((4, 5, 3)), "weight": n(3), "bias": n(3), **_stats(rng, 3), "training": False,
                "channel_axis": -1}, ("x", "weight", "bias")),
        OpCase("group_norm", "group_norm", (n((2, 6, 5)), 3, n(6), n(6)), {"activation": "tanh"}, (0, 2, 3)),
        OpCase("instance_norm-stats", "instance_norm", (),
               {"x": n((2, 3, 6)), "weight": n(3), "bias": n(3), **_stats(rng, 3), "return_stats": True},
               ("x", "weight", "bias")),
        OpCase("rms_norm", "rms_norm", (n((3, 8)), n(8)), {}, (0, 1)),
        OpCase("moments", "moments", (n((3, 4)), 1), {"correction": 1}, (0,)),
        OpCase("rnn_cell", "rnn_cell", (n((3, 4)), n((3, 5)), n((5, 4)), n((5, 5)), n(5), n(5)),
               {"activation": "relu"}, (0, 1, 2, 3, 4, 5)),
        OpCase("lstm_cell", "lstm_cell", (n((3, 4)), n((3, 5)), n((3, 5)), n((20, 4)) * 0.5, n((20, 5)) * 0.5,
                                          n(20), None), {}, (0, 1, 2, 3, 4, 5)),
        OpCase("gru_cell-before", "gru_cell", (n((4,)), n((5,)), n((15, 4)), n((15, 5)), n(15), n(15)),
               {"reset_after": False}, (0, 1, 2, 3, 4, 5)),
        OpCase("rnn", "rnn", (n((3, 2, 3)), _rnn_params(rng, 1, 3, 4, 2, 1), n((2, 2, 4))), {}, (0, 1, 2)),
        OpCase("lstm-bi-lengths", "lstm", (n((3, 3, 3)), _rnn_params(rng, 4, 3, 2, 1, 2, bias=False),
                                           n((2, 3, 2)), n((2, 3, 2))),
               {"bidirectional": True, "lengths": np.array([3, 1, 2])}, (0, 1, 2, 3)),
        OpCase("gru-batch-first", "gru", (n((2, 3, 3)), _rnn_params(rng, 3, 3, 4, 1, 1)),
               {"batch_first": True, "reset_after": False}, (0, 1)),
        OpCase("conv2d", "conv", (n((2, 4, 6, 5)), n((6, 2, 3, 2)), n(6)),
               {"stride": (2, 1), "padding": 1, "groups": 2, "activation": "tanh"}, (0, 1, 2)),
        OpCase("conv1d-last-same", "conv", (n((2, 7, 3)), n((4, 3, 3)), None),
               {"padding": "same", "dilation": 2, "channel_axis": -1}, (0, 1)),
        # padded before dispatch (an input map), traced too; its adjoint against JAX's own of the gather
        OpCase("conv2d-last-reflect", "conv", (n((2, 4, 5, 3)), n((2, 3, 2, 3)), n(2)),
               {"padding": ((3, 1), 2), "padding_mode": "reflect", "channel_axis": -1}, (0, 1, 2)),
        OpCase("dense", "dense", (n((2, 3, 4)), n((5, 4)), n(5)), {"activation": "sigmoid"}, (0, 1, 2)),
        OpCase("max_pool2d", "max_pool", (n((2, 3, 6, 5)), 3), {"stride": 2, "padding": 1}, (0,)),
        OpCase("avg_pool1d", "avg_pool", (n((2, 3, 7)), 3),
               {"stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False}, (0,)),
        OpCase("log_softmax", "log_softmax", (n((3, 5)),), {"axis": 0}, (0,)),
        OpCase("cross_entropy-int", "cross_entropy", (n((4, 5, 3)), targets),
               {"weight": np.abs(n(5)) + 0.1, "label_smoothing": 0.1}, (0,)),
        OpCase("cross_entropy-probs", "cross_entropy", (n((4, 5)), probs), {"reduction": "sum"}, (0, 1)),
    ]


CASES = _cases()
BY_ID = {c.id: c for c in CASES}
#: Cases whose callback route is also differentiated eagerly (the eager host path is the same code for every op).
EAGER_GRAD = ("layer_norm", "lstm-bi-lengths", "conv2d", "cross_entropy-probs")
#: Every op takes both routes (moments included: the Numba kernel runs it on the callback route).
ROUTED = [pytest.param(c, r, id=f"{r}-{c.id}") for c in CASES for r in ROUTES]


@jax.jit
def _scalar(result: Any) -> Any:
    """A loss mixing every floating output with different weights, so every cotangent is non-trivial.

    Jitted so that eager tests compile it once instead of each of its operations.
    """
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(result) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    return sum(jnp.sum(jnp.sin((k + 1.0) * leaf)) for k, leaf in enumerate(leaves))


def _loss(fn: Any, bind: Any) -> Any:
    def loss(diff: dict[Any, Any], const: list[Any]) -> Any:
        args, kwargs = bind(diff, const)
        return _scalar(fn(*args, **kwargs))

    return loss


def _trees_close(actual: Any, expected: Any, tol: float, what: str) -> None:
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, what
    for a, e in zip(a_leaves, e_leaves):
        assert np.asarray(a).dtype == np.asarray(e).dtype, what
        assert_close(np.asarray(a), np.asarray(e), tol, what)


_ORACLES: dict[tuple[str, str], Any] = {}


def _oracle(case: OpCase, bind: Any, dtype: str = "float64") -> Any:
    """jit(value_and_grad) of the case's loss through the reference, differentiated by JAX (cached per case)."""
    key = (case.id, dtype)
    if key not in _ORACLES:
        reference = _loss(lambda *a, **k: pnj.reference_autodiff(case.op, *a, **k), bind)
        _ORACLES[key] = jax.jit(jax.value_and_grad(reference))
    return _ORACLES[key]


@jax.jit
def _shift(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a * 0.9 + 0.01, tree)


# --------------------------------------------------------------------------- every op, both routes


@pytest.mark.parametrize("case, route", ROUTED)
def test_op_forward_grad_and_jit(x64, case, route):
    """Outputs equal portable_nn on NumPy; jit(grad) equals JAX's autodiff of the reference; one trace."""
    expected = getattr(pnn, case.op)(*case.args, **case.kwargs)
    diff, const, bind = case.binder()
    op = getattr(pnj, case.op)
    loss = _loss(op, bind)
    traces = []

    def step(diff, const):
        traces.append(1)
        args, kwargs = bind(diff, const)
        return op(*args, **kwargs), jax.value_and_grad(loss)(diff, const)

    with use_route(route):
        args, kwargs = bind(diff, const)
        assert pnj.explain(op, *args, **kwargs).kind == route
        jitted = jax.jit(step)
        result, first = jitted(diff, const)
        shifted = _shift(diff)
        _, second = jitted(shifted, const)
        if route == "callback":  # eagerly: kernels called directly on NumPy views, no callback
            eager_result = op(*args, **kwargs)
            eager = jax.value_and_grad(loss)(diff, const) if case.id in EAGER_GRAD else first
    assert len(traces) == 1, "recompiled for the same shapes"

    oracle = _oracle(case, bind)
    _trees_close(first, oracle(diff, const), 1e-10, "value and gradient")
    _trees_close(second, oracle(shifted, const), 1e-10, "value and gradient at new values")
    assert not np.allclose(np.asarray(first[0]), np.asarray(second[0]))
    if route == "callback":  # the same kernels on the same data
        _trees_close(result, expected, 0.0, "output")
        _trees_close(eager_result, expected, 0.0, "eager output")
        _trees_close(eager, first, 1e-12, "eager value and gradient")
    else:
        _trees_close(result, expected, 1e-12, "output")


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64:UserWarning")  # the reference's int64 indices
@pytest.mark.parametrize("case_id, route", [("rms_norm", "traced"), ("rnn", "callback"),
                                            ("conv2d", "callback"), ("cross_entropy-int", "traced")])
def test_float32_default(case_id, route):
    """JAX's default float32: float32 results, gradients matching the reference's autodiff in float32."""
    case = BY_ID[case_id]
    diff, const, bind = case.binder(jnp.float32)
    assert jax.tree_util.tree_leaves(diff)[0].dtype == jnp.float32
    op = getattr(pnj, case.op)
    with use_route(route):
        result = jax.jit(lambda d, c: op(*bind(d, c)[0], **bind(d, c)[1]))(diff, const)
        actual = jax.jit(jax.value_and_grad(_loss(op, bind)))(diff, const)
    expected = getattr(pnn, case.op)(*case.args, **case.kwargs)
    for r, e in zip(jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(expected)):
        assert r.dtype == jnp.float32
        assert_close(np.asarray(r), e, 1e-5, "output")
    _trees_close(actual, _oracle(case, bind, "float32")(diff, const), 2e-5, "gradient")


# --------------------------------------------------------------------------- routes


def test_auto_routes_on_cpu():
    """auto: the sequences take the Numba callback, other ops the traced reference; explain says why."""
    assert jax.default_backend() == "cpu"
    x = jnp.ones((3, 2, 4))

    def params(gates, dtype=jnp.float32):
        return [(jnp.ones((gates * 2, 4), dtype), jnp.ones((gates * 2, 2), dtype), None, None)]

    for op, gates in ((pnj.rnn, 1), (pnj.lstm, 4), ("gru", 3)):
        route = pnj.explain(op, x, params(gates))
        assert (route.kind, route.backend) == ("callback", "numba")
        assert "pure_callback" in str(route)
    for op, args in ((pnj.layer_norm, (x,)), (pnj.dense, (x, jnp.ones((3, 4)))), (pnj.lstm_cell, (
            x[0], jnp.ones((2, 2)), jnp.ones((2, 2)), jnp.ones((8, 4)), jnp.ones((8, 2))))):
        route = pnj.explain(op, *args)
        assert (route.kind, route.backend) == ("traced", "reference")
        assert "XLA" in str(route)
    # float16: the CPU kernels take it too (widened to float32), so the sequence takes the callback route
    route = pnj.explain(pnj.lstm, x.astype(jnp.float16), params(4, jnp.float16))
    assert (route.kind, route.backend) == ("callback", "numba")


def test_forced_backend_that_cannot_run_raises_at_trace_time():
    x = jnp.ones((3, 4), jnp.float16)  # the norms' Numba kernels take float16, the moments kernel does not
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="float16"):
        pnj.moments(x, 0)
    with pnn.use_backend("numba"):
        route = pnj.explain(pnj.layer_norm, x)
    assert (route.kind, route.backend) == ("callback", "numba")
    with pnn.use_backend("numba"):  # moments has a Numba kernel: forcing it takes the callback route
        route = pnj.explain(pnj.moments, jnp.ones((3, 4)), 0)
    assert (route.kind, route.backend) == ("callback", "numba")


def test_eager_traced_route(x64):
    """Outside jit the traced reference runs op by op, and its custom_vjp still gives the gradient."""
    case = BY_ID["rms_norm"]
    diff, const, bind = case.binder()
    with use_route("traced"):
        actual = jax.value_and_grad(_loss(pnj.rms_norm, bind))(diff, const)
    _trees_close(actual, _oracle(case, bind)(diff, const), 1e-10, "gradient")


def test_only_wanted_gradients_are_computed(x64, monkeypatch):
    """grad w.r.t. the weight alone asks the backward kernel for the weight alone (no dx)."""
    from portable_nn import dispatch

    seen = []
    original = dispatch.Executed.backward

    def spy(self, cotangents, needs, out):
        seen.append(set(needs))
        return original(self, cotangents, needs, out)

    monkeypatch.setattr(dispatch.Executed, "backward", spy)
    rng = np.random.default_rng(0)
    x, w, b = (jnp.asarray(rng.standard_normal(s)) for s in ((4, 5), (5,), (5,)))
    with use_route("callback"):
        jax.jit(jax.grad(lambda w: jnp.sum(pnj.layer_norm(x, w, b) ** 2)))(w)
        jax.grad(lambda w: jnp.sum(pnj.layer_norm(x, w, b) ** 2))(w)
    assert seen == [{"weight"}, {"weight"}]


# --------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("route", ROUTES)
def test_vmap(x64, route):
    """vmap over examples equals a loop over them, for the op and for its gradient."""
    rng = np.random.default_rng(3)
    xs = jnp.asarray(rng.standard_normal((3, 4, 6)))
    w, b = jnp.asarray(rng.standard_normal(6)), jnp.asarray(rng.standard_normal(6))

    def per_example(x):  # batch statistics over each example's 4 rows
        return pnj.batch_norm(x, weight=w, bias=b, eps=1e-3, activation="silu")

    def grad_w(x):
        return jax.grad(lambda w: jnp.sum(jnp.sin(pnj.layer_norm(x, w, b))))(w)

    with use_route(route):
        batched = jax.jit(jax.vmap(per_example))(xs)
        grads = jax.jit(jax.vmap(grad_w))(xs)
        one, one_grad = jax.jit(per_example), jax.jit(grad_w)
        looped = jnp.stack([one(x) for x in xs])
        grads_loop = jnp.stack([one_grad(x) for x in xs])
    _trees_close(batched, looped, 1e-12, "vmap")
    _trees_close(grads, grads_loop, 1e-12, "vmap of grad")


# --------------------------------------------------------------------------- small models


def _cnn_params(rng: np.random.Generator) -> dict[str, Any]:
    # no conv bias: batch_norm cancels it (its gradient is 0 up to rounding)
    p = {"conv_w": rng.standard_normal((4, 1, 3, 3)) * 0.4,
         "bn_w": 1.0 + 0.1 * rng.standard_normal(4), "bn_b": 0.1 * rng.standard_normal(4),
         "fc_w": rng.standard_normal((3, 4 * 4 * 4)) * 0.2, "fc_b": np.zeros(3)}
    return {k: jnp.asarray(v) for k, v in p.items()}


def _cnn_loss(ops: Any, params: dict[str, Any], stats: tuple[Any, Any], x: Any, y: Any) -> Any:
    h = ops.conv(x, params["conv_w"], padding=1, activation="identity")
    h, mean, var = ops.batch_norm(h, weight=params["bn_w"], bias=params["bn_b"], running_mean=stats[0],
                                  running_var=stats[1], activation="relu", return_stats=True)
    h = ops.max_pool(h, 2)
    logits = ops.dense(jnp.reshape(h, (h.shape[0], -1)), params["fc_w"], params["fc_b"])
    return ops.cross_entropy(logits, y, label_smoothing=0.05), (mean, var)


class _ReferenceOps:
    """The same ops through JAX's autodiff of the traced reference (the oracle)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: pnj.reference_autodiff(name, *a, **k)


@pytest.mark.parametrize("route", ROUTES)  # (auto runs every op of this model on the traced route)
def test_small_cnn_training_step(x64, route):
    """conv -> batch_norm (running stats returned) -> max_pool -> dense -> cross_entropy: grads and SGD."""
    rng = np.random.default_rng(5)
    params = _cnn_params(rng)
    x = jnp.asarray(rng.standard_normal((6, 1, 8, 8)))
    y = jnp.asarray(rng.integers(0, 3, 6))
    stats = (jnp.zeros(4), jnp.ones(4))
    key = ("cnn", "float64")
    if key not in _ORACLES:  # shared by both routes
        _ORACLES[key] = jax.jit(jax.value_and_grad(lambda p, s: _cnn_loss(_ReferenceOps(), p, s, x, y), has_aux=True))(
            params, stats)
    expected = _ORACLES[key]

    @jax.jit
    def step(params, stats):
        (loss, new_stats), grads = jax.value_and_grad(lambda p: _cnn_loss(pnj, p, stats, x, y), has_aux=True)(params)
        return loss, new_stats, jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads), grads

    with use_route(route):
        loss, new_stats, new_params, grads = step(params, stats)
        losses = [float(loss)]
        for _ in range(3):
            loss, new_stats, new_params, _ = step(new_params, new_stats)
            losses.append(float(loss))
    (ref_loss, ref_stats), ref_grads = expected
    assert_close(np.asarray(losses[0]), np.asarray(ref_loss), 1e-12, "loss")
    _trees_close(grads, ref_grads, 1e-10, "model gradient")
    assert losses[-1] < losses[0], losses
    # the running statistics after one step are portable_nn's (PyTorch's) update on the conv output
    h = pnn.conv(np.asarray(x), np.asarray(params["conv_w"]), padding=1)
    mean, var = np.zeros(4), np.ones(4)
    pnn.batch_norm(h, running_mean=mean, running_var=var)
    _trees_close(ref_stats, (mean, var), 1e-12, "running statistics")


def test_small_rnn_model_grad(x64):
    """A sequence layer on the Numba callback and a classifier on the traced reference, in one jit(grad)."""
    rng = np.random.default_rng(6)
    params = {"rnn": [tuple(jnp.asarray(p) for p in layer) for layer in _rnn_params(rng, 1, 3, 5, 1, 1)],
              "fc_w": jnp.asarray(rng.standard_normal((2, 5))), "fc_b": jnp.zeros(2)}
    x = jnp.asarray(rng.standard_normal((4, 3, 3)))
    y = jnp.asarray(rng.integers(0, 2, 3))
    lengths = np.array([4, 1, 3])

    def loss(ops, params):
        _, h_n = ops.rnn(x, params["rnn"], lengths=lengths)
        return ops.cross_entropy(ops.dense(h_n[-1], params["fc_w"], params["fc_b"], activation="tanh"), y)

    assert pnj.explain(pnj.rnn, x, params["rnn"], lengths=lengths).kind == "callback"
    assert pnj.explain(pnj.dense, jnp.ones((3, 5)), params["fc_w"]).kind == "traced"
    actual = jax.jit(jax.value_and_grad(lambda p: loss(pnj, p)))(params)
    expected = jax.jit(jax.value_and_grad(lambda p: loss(_ReferenceOps(), p)))(params)
    _trees_close(actual, expected, 1e-10, "model value and gradient")


def test_traced_lengths_on_the_callback_route(x64):
    """lengths as a jit argument: read by the Numba kernel at run time (one compile for new lengths)."""
    case = BY_ID["lstm-bi-lengths"]
    diff, const, bind = case.binder()
    args, kwargs = bind(diff, const)
    kwargs.pop("lengths")

    @jax.jit
    def run(lengths):
        return pnj.lstm(*args, lengths=lengths, **kwargs)

    for lengths in (np.array([3, 1, 2]), np.array([1, 3, 3])):
        expected = pnn.lstm(*case.args, **{**case.kwargs, "lengths": lengths})
        _trees_close(run(jnp.asarray(lengths)), expected, 0.0, "output")
    assert run._cache_size() == 1
    with use_route("traced"), pytest.raises(TypeError, match="lengths is a traced value"):
        jax.jit(lambda lengths: pnj.lstm(*args, lengths=lengths, **kwargs))(jnp.asarray(lengths))


# --------------------------------------------------------------------------- errors


def test_validation_messages_at_trace_time():
    x = jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        pnj.layer_norm(x, jnp.ones(5))
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        jax.jit(lambda x, w: pnj.layer_norm(x, w))(x, jnp.ones(5))
    with pytest.raises(ValueError, match="unknown activation"):
        pnj.dense(x, jnp.ones((2, 4)), activation="swish")
    with pytest.raises(TypeError, match="x must be an array"):
        pnj.layer_norm([[1.0, 2.0]])
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        pnj.log_softmax(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="num_groups"):
        pnj.group_norm(jnp.ones((2, 6, 3)), 4)
    with pytest.raises(ValueError, match="padding"):
        pnj.max_pool(jnp.ones((1, 1, 4, 4)), 2, padding=3)


def test_running_statistics_need_return_stats():
    x, stats = jnp.ones((4, 3)) + jnp.arange(4.0)[:, None], {"running_mean": jnp.zeros(3), "running_var": jnp.ones(3)}
    with pytest.raises(ValueError, match="return_stats=True"):
        pnj.batch_norm(x, **stats)
    with pytest.raises(ValueError, match="return_stats=True"):
        pnj.instance_norm(jnp.ones((2, 3, 4)), **stats)
    y = pnj.batch_norm(x, training=False, **stats)  # nothing to update: y alone
    assert y.shape == x.shape
    y, mean, var = pnj.batch_norm(x, training=False, return_stats=True, **stats)
    assert mean is stats["running_mean"] and var is stats["running_var"]


def test_no_gradient_for_statistics_or_class_weights():
    x = jnp.ones((4, 3)) + jnp.arange(4.0)[:, None]
    with pytest.raises(ValueError, match="running_mean has no gradient"):
        jax.grad(lambda m: jnp.sum(pnj.batch_norm(x, running_mean=m, running_var=jnp.ones(3), training=False)))(
            jnp.zeros(3))
    logits, target = jnp.ones((4, 3)), jnp.array([0, 1, 2, 1])
    with pytest.raises(ValueError, match="weight has no gradient"):
        jax.grad(lambda w: pnj.cross_entropy(logits, target, weight=w))(jnp.ones(3))
    # stop_gradient is the way out; the new running statistics carry no gradient either
    g = jax.grad(lambda x: jnp.sum(pnj.batch_norm(x, running_mean=jnp.zeros(3), running_var=jnp.ones(3),
                                                  return_stats=True)[1]))(x)
    assert not np.any(np.asarray(g))


def test_class_targets_are_range_checked():
    logits, bad = jnp.ones((2, 3)), jnp.array([0, 3])
    with pytest.raises(ValueError, match=r"target holds class indices outside \[0, 3\)"):
        pnj.cross_entropy(logits, bad)
    # traced targets are checked by the kernel's validation inside the callback, at run time
    with use_route("callback"), pytest.raises(Exception, match=r"target holds class indices outside"):
        jax.block_until_ready(jax.jit(lambda t: pnj.cross_entropy(logits, t))(bad))


def test_merge_moments_is_reexported(x64):
    a, b = jnp.asarray(np.arange(5.0)), jnp.asarray(np.arange(3.0) + 10)
    n, mean, m2 = pnj.merge_moments((5, jnp.mean(a), jnp.var(a) * 5), (3, jnp.mean(b), jnp.var(b) * 3))
    both = jnp.concatenate([a, b])
    assert n == 8
    assert_close(np.asarray(mean), np.asarray(jnp.mean(both)), 1e-14, "mean")
    assert_close(np.asarray(m2 / 8), np.asarray(jnp.var(both)), 1e-14, "var")


def test_plain_pnn_traces_the_reference_with_a_tracer_beside_concrete_parameters(x64):
    """A tracer has no device; it must not count as "another device" next to a concrete weight."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)))
    w = jnp.linspace(0.5, 1.5, 5)

    def loss(x):
        return jnp.sum(pnn.layer_norm(x, w) ** 2 * jnp.arange(5.0))

    expected = jax.grad(lambda x: jnp.sum(pnj.reference_autodiff(pnn.layer_norm, x, w) ** 2 * jnp.arange(5.0)))(x)
    assert_close(jax.grad(loss)(x), expected, 1e-10)


def test_avg_pool_divisor_override_under_jit_and_grad():
    x = np.random.default_rng(3).standard_normal((2, 3, 7, 6)).astype(np.float32)
    kw = dict(stride=2, padding=1, ceil_mode=True, divisor_override=4)
    y = jax.jit(lambda v: pnj.avg_pool(v, 3, **kw))(jnp.asarray(x))
    expected, pullback = pnn.vjp(pnn.avg_pool, x, 3, **kw)
    assert_close(np.asarray(y), expected, 1e-6)
    g = jax.grad(lambda v: pnj.avg_pool(v, 3, **kw).sum())(jnp.asarray(x))
    assert_close(np.asarray(g), pullback(np.ones_like(expected)).x, 1e-6)
