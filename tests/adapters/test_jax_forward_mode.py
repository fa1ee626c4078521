"""portable_nn.jax: forward mode and higher-order derivatives, on both routes (Numba callback,
traced reference).

Oracles: JAX's own differentiation of the reference forward traced with ``jax.numpy``
(``pnj.reference_autodiff``) for forward mode and every second-order combination (to 1e-10 in
float64), and ``jax.test_util.check_grads`` (finite differences) to second order in both modes.
First-order ``jax.grad`` must still run the route's backward (the fused kernels on the callback
route), never the reference's forward mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import portable_nn as pnn  # noqa: E402
import portable_nn.jax as pnj  # noqa: E402
from pnn_testing import assert_close  # noqa: E402
from portable_nn.adapters.jax import _ops as adapter_ops  # noqa: E402

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


# --------------------------------------------------------------------------- samples

#: A sample: ``(id, call, differentiated arrays)``; ``call(op, *arrays)`` calls ``op`` (a
#: ``portable_nn.jax`` function, or the reference differentiated by JAX) and returns its
#: differentiable outputs.
Sample = tuple[str, Callable[..., Any], tuple[np.ndarray, ...]]


def _rnn_params(rng: np.random.Generator, gates: int, features: int, hidden: int, layers: int,
                dirs: int) -> list[tuple[np.ndarray, ...]]:
    params = []
    for layer in range(layers):
        for _ in range(dirs):
            inputs = features if layer == 0 else dirs * hidden
            params.append(tuple(rng.standard_normal(s) * 0.5 for s in (
                (gates * hidden, inputs), (gates * hidden, hidden), (gates * hidden,), (gates * hidden,))))
    return params


def _nested(params: list[tuple[Any, ...]], flat: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """``params``' structure filled with the arrays of ``flat``."""
    it = iter(flat)
    return [tuple(next(it) for _ in p) for p in params]


def _samples() -> dict[str, list[Sample]]:
    """Per op of the adapter, small float64 calls and the arrays to differentiate."""
    rng = np.random.default_rng(11)
    n = rng.standard_normal
    stats = {"running_mean": n(3), "running_var": np.abs(n(3)) + 0.5}
    probs = np.exp(n((4, 3)))
    probs /= probs.sum(axis=1, keepdims=True)
    labels = np.array([[0, 2], [1, -100], [2, 2], [0, 1]])
    pooled, indices = pnn.max_pool(n((1, 2, 4, 5)), 2, return_indices=True)
    lstm_p, gru_p, rnn_p = _rnn_params(rng, 4, 2, 2, 1, 1), _rnn_params(rng, 3, 2, 2, 1, 2), _rnn_params(
        rng, 1, 2, 2, 2, 1)
    return {
        "conv": [("conv2d", lambda op, x, w, b: op(x, w, b, stride=(2, 1), padding=1, groups=2, activation="tanh"),
                  (n((1, 4, 4, 3)), n((4, 2, 2, 2)), n(4))),
                 ("conv1d_reflect_last", lambda op, x, w: op(x, w, padding=1, padding_mode="reflect", channel_axis=-1),
                  (n((2, 5, 2)), n((3, 2, 3))))],
        "conv_transpose": [("conv_transpose", lambda op, x, w, b: op(x, w, b, stride=2, padding=1, output_padding=1,
                                                                     activation="silu"),
                            (n((1, 2, 2, 3)), n((2, 3, 3, 2)), n(3)))],
        "dense": [("dense", lambda op, x, w, b: op(x, w, b, activation="silu"), (n((2, 3)), n((4, 3)), n(4)))],
        "log_softmax": [("log_softmax", lambda op, x: op(x, axis=0), (n((3, 4)),))],
        "cross_entropy": [
            ("cross_entropy_labels", lambda op, z: op(z, jnp.asarray(labels), label_smoothing=0.1), (n((4, 3, 2)),)),
            ("cross_entropy_probs", lambda op, z, p: op(z, p, reduction="sum"), (n((4, 3)), probs)),
        ],
        "moments": [("moments", lambda op, x: op(x, 1, correction=1), (n((3, 4)),))],
        "batch_norm": [
            ("batch_norm_train", lambda op, x, w, b: op(x, weight=w, bias=b, return_stats=True, activation="silu",
                                                        **{k: jnp.asarray(v) for k, v in stats.items()})[0],
             (n((4, 3, 2)), n(3), n(3))),
            ("batch_norm_eval", lambda op, x, w: op(x, weight=w, training=False, channel_axis=-1,
                                                    **{k: jnp.asarray(v) for k, v in stats.items()}),
             (n((4, 3)), n(3))),
        ],
        "layer_norm": [("layer_norm", lambda op, x, w, b: op(x, w, b, activation="gelu_tanh"),
                        (n((3, 4)), n(4), n(4)))],
        "rms_norm": [("rms_norm", lambda op, x, w: op(x, w, eps=1e-3), (n((3, 4)), n(4)))],
        "group_norm": [("group_norm", lambda op, x, w, b: op(x, 2, w, b, activation="sigmoid"),
                        (n((2, 4, 3)), n(4), n(4)))],
        "instance_norm": [("instance_norm", lambda op, x, w, b: op(x, weight=w, bias=b), (n((2, 3, 4)), n(3), n(3)))],
        "max_pool": [("max_pool", lambda op, x: op(x, 2, stride=1, padding=1), (n((1, 2, 3, 3)),))],
        "avg_pool": [("avg_pool", lambda op, x: op(x, (3,), stride=2, padding=1, count_include_pad=False),
                      (n((2, 2, 5)),))],
        "max_unpool": [("max_unpool", lambda op, x: op(x, jnp.asarray(indices), 2, output_size=(4, 5)), (pooled,))],
        "rnn_cell": [("rnn_cell", lambda op, x, h, wi, wh, b: op(x, h, wi, wh, b, None, activation="relu"),
                      (n((2, 3)), n((2, 2)), n((2, 3)), n((2, 2)), n(2)))],
        "lstm_cell": [("lstm_cell", lambda op, x, h, c, wi, wh, b: op(x, h, c, wi, wh, b, None),
                       (n((2, 3)), n((2, 2)), n((2, 2)), n((8, 3)) * 0.5, n((8, 2)) * 0.5, n(8)))],
        "gru_cell": [("gru_cell", lambda op, x, h, wi, wh: op(x, h, wi, wh, reset_after=False),
                      (n((2, 3)), n((2, 2)), n((6, 3)) * 0.5, n((6, 2)) * 0.5))],
        "rnn": [("rnn_stacked", lambda op, x, h0, *flat: op(x, _nested(rnn_p, flat), h0, activation="tanh"),
                 (n((2, 1, 2)), n((2, 1, 2)), *(a for p in rnn_p for a in p)))],
        "lstm": [("lstm_lengths", lambda op, x, c0, *flat: op(x, _nested(lstm_p, flat), None, c0,
                                                               lengths=np.array([2, 1])),
                  (n((2, 2, 2)), n((1, 2, 2)), *(a for p in lstm_p for a in p)))],
        "gru": [("gru_bidirectional_batch_first", lambda op, x, *flat: op(x, _nested(gru_p, flat), batch_first=True,
                                                                          bidirectional=True),
                 (n((1, 2, 2)), *(a for p in gru_p for a in p)))],
    }


_SAMPLES = _samples()
_CASES = {sample[0]: (op, *sample[1:]) for op, samples in _SAMPLES.items() for sample in samples}
#: Cases also checked on the traced route in the default run (the route's own code is the same for
#: every op; ``-m slow`` checks all of them on both routes).
TRACED_QUICK = ("layer_norm", "cross_entropy_probs")


def _reference(op: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: pnj.reference_autodiff(op, *args, **kwargs)


def _flat(result: Any) -> tuple[Any, ...]:
    """The floating arrays of a (nested) result."""
    return tuple(leaf for leaf in jax.tree_util.tree_leaves(result) if jnp.issubdtype(leaf.dtype, jnp.floating))


def _scalar(result: Any) -> Any:
    """A loss mixing every floating output with different weights, so every cotangent is non-trivial."""
    return sum(jnp.sum(jnp.sin((k + 1.0) * leaf)) for k, leaf in enumerate(_flat(result)))


def _dot(a: Any, b: Any) -> Any:
    return sum(jnp.vdot(p, q) for p, q in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _derivatives(call: Callable[..., Any], arrays: tuple[Any, ...], tangents: tuple[Any, ...],
                 second_orders: bool = True) -> dict[str, Any]:
    """Forward mode and the four second-order compositions of a call (``arrays`` differentiated)."""
    every = tuple(range(len(arrays)))

    def loss(*a: Any) -> Any:
        return _scalar(call(*a))

    def jvp(*a: Any) -> Any:
        return jax.jvp(call, a, tangents)[1]

    result = {"forward": jvp(*arrays), "reverse": jax.grad(loss, every)(*arrays)}
    # forward over reverse: a Hessian-vector product H·t (what jax.hessian and jax.jacfwd(jax.grad) do)
    result["forward_over_reverse"] = jax.jvp(jax.grad(loss, every), arrays, tangents)[1]
    # reverse over reverse: ∇ ⟨∇loss, t⟩, the same H·t (grad of grad)
    result["reverse_over_reverse"] = jax.grad(lambda *a: _dot(jax.grad(loss, every)(*a), tangents), every)(*arrays)
    if second_orders:
        # reverse over forward: ∇ Σ sin(J t), and forward over forward: the second directional derivative
        result["reverse_over_forward"] = jax.grad(lambda *a: _scalar(jvp(*a)), every)(*arrays)
        result["forward_over_forward"] = jax.jvp(jvp, arrays, tangents)[1]
    return result


def _compare(case_id: str, route: str, second_orders: bool = True) -> None:
    op, call, arrays = _CASES[case_id]
    arrays = tuple(jnp.asarray(a) for a in arrays)
    rng = np.random.default_rng(5)
    tangents = tuple(jnp.asarray(rng.standard_normal(a.shape)) for a in arrays)
    ours = getattr(pnj, op)
    with use_route(route):
        assert _route_of(ours, call, arrays) == route
        both = jax.jit(lambda a, t: (_derivatives(lambda *x: call(ours, *x), a, t, second_orders),
                                     _derivatives(lambda *x: call(_reference(op), *x), a, t, second_orders)))
        actual, expected = both(arrays, tangents)
    for kind, value in expected.items():
        for a, e in zip(jax.tree_util.tree_leaves(actual[kind]), jax.tree_util.tree_leaves(value)):
            assert_close(np.asarray(a), np.asarray(e), 1e-10, f"{case_id} {kind}")


def _route_of(op: Callable[..., Any], call: Callable[..., Any], arrays: tuple[Any, ...]) -> str:
    """The route ``call`` takes for ``op`` (its arguments captured by a recording stand-in)."""
    captured = []

    def record(*args: Any, **kwargs: Any) -> Any:
        captured.append((args, kwargs))
        raise _Captured

    try:
        call(record, *arrays)
    except _Captured:
        pass
    args, kwargs = captured[0]
    return pnj.explain(op, *args, **kwargs).kind


class _Captured(Exception):
    """Stops a sample's call once its arguments are recorded."""


# --------------------------------------------------------------------------- every op


def test_every_op_of_the_adapter_has_a_sample():
    """New ops are covered as soon as they are registered: each needs a sample here."""
    missing = sorted(set(adapter_ops._OPS) - set(_SAMPLES))
    assert not missing, f"add a forward-mode sample for {missing} to _samples()"


@pytest.mark.parametrize("case_id", sorted(_CASES))
def test_forward_mode_and_second_order_on_the_callback_route(x64, case_id):
    """jvp, and grad, jvp and their compositions to second order, equal JAX's differentiation of the
    reference, with Numba kernels on the callback route (which JAX cannot differentiate)."""
    _compare(case_id, "callback", second_orders=False)


@pytest.mark.parametrize("case_id", TRACED_QUICK)
def test_forward_mode_and_second_order_on_the_traced_route(x64, case_id):
    _compare(case_id, "traced")


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case_id", sorted(_CASES))
def test_every_composition_on_both_routes(x64, case_id, route):
    _compare(case_id, route)


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case_id", sorted(_CASES))
def test_check_grads_to_second_order_in_both_modes(x64, case_id, route):
    """``jax.test_util.check_grads`` (finite differences) to order 2, forward and reverse."""
    op, call, arrays = _CASES[case_id]
    with use_route(route):
        check_grads(lambda *a: _flat(call(getattr(pnj, op), *a)), tuple(jnp.asarray(a) for a in arrays), order=2,
                    modes=("fwd", "rev"), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case_id, route", [("moments", "callback"), ("log_softmax", "traced")])
def test_check_grads_to_second_order_in_both_modes_quick(x64, case_id, route):
    op, call, arrays = _CASES[case_id]
    with use_route(route):
        check_grads(lambda *a: call(getattr(pnj, op), *a), tuple(jnp.asarray(a) for a in arrays), order=2,
                    modes=("fwd", "rev"), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- which code runs


def _layer_norm_args() -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(s)) for s in ((4, 5), (5,), (5,)))


def test_first_order_reverse_mode_runs_the_backward_kernels(x64, monkeypatch):
    """jax.grad asks the fused backward for exactly the gradients wanted and never runs the reference's
    forward mode; jax.jvp runs the reference's forward mode and no backward."""
    from portable_nn import dispatch

    seen: list[Any] = []
    backward = dispatch.Executed.backward
    reference_jvp = adapter_ops._Plan.reference_jvp
    monkeypatch.setattr(dispatch.Executed, "backward", lambda self, *a: seen.append(set(a[1])) or backward(self, *a))
    monkeypatch.setattr(adapter_ops._Plan, "reference_jvp",
                        lambda *a: seen.append("reference_jvp") or reference_jvp(*a))
    x, w, b = _layer_norm_args()

    def loss(w: Any) -> Any:
        return jnp.sum(pnj.layer_norm(x, w, b, activation="tanh") ** 2)

    with use_route("callback"):
        jax.jit(jax.grad(loss))(w)
        jax.grad(loss)(w)
        assert seen == [{"weight"}, {"weight"}]
        seen.clear()
        jax.jit(lambda w: jax.jvp(loss, (w,), (w,)))(w)
        assert seen == ["reference_jvp"]


def test_hessian_jacfwd_and_nested_vmap(x64):
    """jax.hessian and jax.jacfwd (vmapped tangents: the tangent's batching rule) and vmap of vmap of
    jvp with an unbatched weight, on the callback route, equal the reference's."""
    x, w, b = _layer_norm_args()
    ws = jnp.stack([w, 2 * w, -w])

    def run(op: Callable[..., Any]) -> Any:
        def loss(x: Any, w: Any) -> Any:
            return jnp.sum(jnp.sin(op(x, w, b, activation="tanh")))

        per_row = jax.vmap(jax.vmap(lambda r, w: jax.jvp(lambda r: op(r, w, b), (r,), (jnp.ones_like(r),))[1],
                                    in_axes=(0, None)), in_axes=(None, 0))
        return (jax.hessian(loss, (0, 1))(x, w), jax.jacfwd(lambda w: op(x, w, b))(w),
                jax.jacrev(jax.jacfwd(loss, 1), 1)(x, w), per_row(x[:, None], ws))

    with use_route("callback"):
        actual = jax.jit(lambda: run(pnj.layer_norm))()
    expected = jax.jit(lambda: run(_reference("layer_norm")))()
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        assert_close(np.asarray(a), np.asarray(e), 1e-10, "hessian, jacfwd, jacrev(jacfwd), vmap(vmap(jvp))")


def test_forward_mode_through_running_statistics(x64):
    """jvp of batch_norm with return_stats: the new statistics carry no tangent; differentiating with
    respect to a running statistic is refused as in reverse mode."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 3)))
    stats = {"running_mean": jnp.zeros(3), "running_var": jnp.ones(3)}
    (_, mean, _), (dy, dmean, dvar) = jax.jvp(
        lambda x: pnj.batch_norm(x, return_stats=True, **stats), (x,), (jnp.cos(x),))
    assert np.any(np.asarray(dy)) and np.any(np.asarray(mean))
    assert not np.any(np.asarray(dmean)) and not np.any(np.asarray(dvar))
    with pytest.raises(ValueError, match="running_mean has no gradient"):
        jax.jvp(lambda m: pnj.batch_norm(x, running_mean=m, running_var=jnp.ones(3), training=False),
                (jnp.zeros(3),), (jnp.ones(3),))


def test_traced_lengths_first_order_only(x64):
    """Traced lengths (callback route): jax.grad runs the kernels, which read them at run time;
    forward mode needs the reference, which cannot, and says so."""
    _, _, arrays = _CASES["lstm_lengths"]
    x, _, *flat = (jnp.asarray(a) for a in arrays)
    params = _nested([tuple(range(4))], tuple(flat))

    def loss(x: Any, lengths: Any) -> Any:
        return _scalar(pnj.lstm(x, params, lengths=lengths))

    lengths = jnp.array([2, 1])
    with use_route("callback"):  # concrete lengths: the same kernels
        expected = jax.grad(loss)(x, np.array([2, 1]))
    assert_close(np.asarray(jax.jit(jax.grad(loss))(x, lengths)), np.asarray(expected), 1e-12)
    with pytest.raises(TypeError, match="lengths is a traced value.*first-order jax.grad works"):
        jax.jit(lambda x, lengths: jax.jvp(lambda x: loss(x, lengths), (x,), (x,)))(x, lengths)


def test_axis_name_with_forward_mode(x64):
    """Collective batch norm (axis_name under a named vmap) composes with forward mode and with the
    other ops' tangents."""
    rng = np.random.default_rng(4)
    parts = jnp.asarray(rng.standard_normal((3, 4, 2)))
    w = jnp.asarray(rng.standard_normal(2))

    def run(layer_norm: Callable[..., Any]) -> Any:
        def step(part: Any, w: Any) -> Any:
            return pnj.batch_norm(layer_norm(part, w), axis_name="parts", activation="tanh")

        mapped = jax.vmap(step, in_axes=(0, None), axis_name="parts")
        return jax.jvp(mapped, (parts, w), (jnp.ones_like(parts), w)), jax.jacfwd(lambda w: mapped(parts, w))(w)

    with use_route("callback"):
        actual = jax.jit(lambda: run(pnj.layer_norm))()
    expected = jax.jit(lambda: run(_reference("layer_norm")))()
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        assert_close(np.asarray(a), np.asarray(e), 1e-9, "axis_name")
