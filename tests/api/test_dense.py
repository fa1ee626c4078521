"""dense: forward and gradients against F.linear + activation (float64), any leading shape,
zero size, finite differences, the residual kept for the backward, plumbing and validation."""

from __future__ import annotations

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
from portable_nn.api._common import spec_of
from portable_nn.api.dense import dense
from portable_nn.reference import dense as ref_dense
from torch_oracle import TORCH_ACT, activation_arg


@pytest.fixture(autouse=True, scope="module")
def _single_threaded_torch():
    """PyTorch's thread pool costs milliseconds per tiny oracle call on small machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)




def torch_dense(x64, w64, b64, dy64, act_label):
    xt = torch.tensor(x64, requires_grad=True)
    wt = torch.tensor(w64, requires_grad=True)
    bt = None if b64 is None else torch.tensor(b64, requires_grad=True)
    yt = TORCH_ACT[act_label](F.linear(xt, wt, bt))
    yt.backward(torch.tensor(dy64))
    return yt.detach().numpy(), [None if t is None else t.grad.numpy() for t in (xt, wt, bt)]


def _run_case(case, lead, sizes, act, bias, seed):
    rng = np.random.default_rng(seed)
    n_in, n_out = sizes
    x64 = rng.standard_normal((*lead, n_in))
    w64 = rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)
    b64 = rng.standard_normal(n_out) * 0.5 if bias else None
    x, w, b = case.asarray(x64), case.param(w64), case.param(b64)
    before = snapshot([x, w, b])
    with case.use():
        y, pullback = pnn.vjp(dense, x, w, b, activation=activation_arg(act))
        dy = case.asarray(rng.standard_normal(tuple(y.shape)))
        grads = pullback(dy)
    assert unchanged([x, w, b], before)
    assert family_of(y) == case.lib and y.dtype == x.dtype
    assert tuple(y.shape) == (*lead, n_out)
    assert grads._fields == ("x", "weight", "bias")
    assert grads.x.dtype == x.dtype and grads.weight.dtype == w.dtype
    y_ref, (dx_ref, dw_ref, db_ref) = torch_dense(to_numpy(x), to_numpy(w), to_numpy(b), to_numpy(dy), act)
    assert_close(y, y_ref, case.tol, "dense output")
    assert_close(grads.x, dx_ref, case.tol, "dense dx")
    assert_close(grads.weight, dw_ref, case.tol, "dense dweight")
    if bias:
        assert grads.bias.dtype == b.dtype
        assert_close(grads.bias, db_ref, case.tol, "dense dbias")
    else:
        assert grads.bias is None


_GRID = grid(
    {
        "lead": [(), (1,), (5,), (2, 3), (2, 1, 3)],
        "sizes": [(1, 1), (4, 3), (7, 9)],
        "act": list(TORCH_ACT),
        "bias": [True, False],
    },
    id_fn=lambda c: f"lead={c['lead']}-sizes={c['sizes']}-{c['act']}-bias={c['bias']}",
)


@pytest.mark.parametrize("case", cases("dense"))
@pytest.mark.parametrize("cfg", _GRID)
def test_dense_matches_torch(case, cfg):
    _run_case(case, cfg["lead"], cfg["sizes"], cfg["act"], cfg["bias"], seed=len(cfg["lead"]) + cfg["sizes"][0])


@pytest.mark.parametrize("lead", [(0,), (3, 0), (0, 4)])
@pytest.mark.parametrize("case", cases("dense", mixed=False))
def test_zero_rows(case, lead):
    rng = np.random.default_rng(1)
    x = case.asarray(np.zeros((*lead, 4)))
    w, b = case.asarray(rng.standard_normal((3, 4))), case.asarray(rng.standard_normal(3))
    with case.use():
        y, pullback = pnn.vjp(dense, x, w, b, activation="gelu")
        grads = pullback(case.asarray(np.zeros((*lead, 3))))
    assert tuple(y.shape) == (*lead, 3)
    assert tuple(grads.x.shape) == (*lead, 4)
    np.testing.assert_array_equal(to_numpy(grads.weight), np.zeros((3, 4)))
    np.testing.assert_array_equal(to_numpy(grads.bias), np.zeros(3))


@pytest.mark.parametrize("act", ["gelu", "silu", "tanh"])
def test_directional_derivatives(act):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 5))
    w = rng.standard_normal((4, 5)) / 2
    b = rng.standard_normal(4)
    y, pullback = pnn.vjp(dense, x, w, b, activation=act)
    dy = rng.standard_normal(y.shape)
    g = pullback(dy)
    directional_check(
        lambda x, weight, bias: dense(x, weight, bias, activation=act),
        {"x": x, "weight": w, "bias": b},
        {"x": g.x, "weight": g.weight, "bias": g.bias},
        dy,
        directions=3,
    )


# --------------------------------------------------------------------------- residuals


def _residuals(*args, **kwargs):
    call = spec_of("dense").prepare(*args, **kwargs).call.replace(save=True)
    (y,), residuals = ref_dense.dense_forward(call)
    return y, residuals


@pytest.mark.parametrize(
    "act, kept",
    [("identity", None), ("relu", "y"), ("sigmoid", "y"), ("tanh", "y"), ("leaky_relu", "y"),
     ("gelu", "z"), ("silu", "z"), (("leaky_relu", -0.3), "z")],
)
def test_backward_keeps_the_output_when_it_suffices(act, kept):
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((2, 5)), rng.standard_normal((3, 5)), rng.standard_normal(3)
    y, residuals = _residuals(x, w, b, activation=act)
    if kept is None:
        assert residuals[3] is None
    elif kept == "y":
        # the output itself (a view of the same memory): no pre-activation, no extra buffer
        assert np.shares_memory(residuals[3], y) and residuals[3].size == y.size
    else:
        np.testing.assert_allclose(residuals[3], x @ w.T + b, rtol=1e-14, atol=1e-14)


# --------------------------------------------------------------------------- plumbing


def test_vjp_wrt_out_buffers_and_repeated_pullbacks():
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((6, 5)), rng.standard_normal((3, 5)), rng.standard_normal(3)
    y, pullback = pnn.vjp(dense, x, w, b, activation="sigmoid")
    np.testing.assert_array_equal(dense(x, w, b, activation="sigmoid"), y)
    dy = rng.standard_normal(y.shape)
    grads = check_pullback_plumbing(pullback, dy, {"x": x, "weight": w, "bias": b})
    _, pb = pnn.vjp(dense, x, w, b, activation="sigmoid", wrt=("weight", "bias"))
    params_only = pb(dy)
    assert params_only.x is None
    np.testing.assert_array_equal(params_only.weight, grads.weight)
    with pytest.raises(ValueError, match="wrt"):
        pnn.vjp(dense, x, w, wrt="input")


def test_one_dimensional_x_and_no_autograd_history():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = dense(x, w, activation="tanh")
    assert isinstance(y, torch.Tensor) and not y.requires_grad and tuple(y.shape) == (3,)
    np.testing.assert_allclose(y.numpy(), torch.tanh(w @ x).detach().numpy(), rtol=1e-14)


def test_mixed_precision_output_dtypes():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 6)).astype(np.float16)
    w = rng.standard_normal((3, 6)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    y, pullback = pnn.vjp(dense, x, w, b, activation="gelu")
    assert y.dtype == np.float16
    g = pullback(np.ones_like(y))
    assert (g.x.dtype, g.weight.dtype, g.bias.dtype) == (np.float16, np.float32, np.float32)


# --------------------------------------------------------------------------- validation


_X = np.zeros((2, 5))
_W = np.zeros((3, 5))


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((_X, np.zeros((3, 4))), {}, ValueError, r"x has 5 features .* in_features = weight.shape\[1\] = 4"),
        ((_X, np.zeros(5)), {}, ValueError, "weight must be 2-D"),
        ((_X, np.zeros((1, 3, 5))), {}, ValueError, "weight must be 2-D"),
        ((np.zeros(()), _W), {}, ValueError, "x must have at least 1 dimension"),
        ((_X, _W, np.zeros(5)), {}, ValueError, r"bias must have shape \(3,\)"),
        ((_X, _W, np.zeros((1, 3))), {}, ValueError, r"bias must have shape \(3,\)"),
        ((_X, _W), {"activation": "softmax"}, ValueError, "unknown activation 'softmax'"),
        ((_X, _W), {"activation": ("leaky_relu", "a")}, ValueError, "slope must be a finite number"),
        ((_X, _W), {"activation": ("elu", float("nan"))}, ValueError, "elu alpha must be a finite number"),
        ((_X, _W), {"activation": ("elu", True)}, ValueError, "elu alpha must be a finite number"),
        ((_X, _W), {"activation": ("elu", 1.0, 2.0)}, ValueError, r"or \('elu', alpha\)"),
        ((_X.astype(np.int32), _W), {}, TypeError, "x must have a floating dtype"),
        ((_X, _W.astype(np.float32)), {}, TypeError, "weight has dtype float32 but x has float64"),
        ((_X.astype(np.float32), _W.astype(np.float16)), {}, TypeError, "expected float32"),
        ((_X.astype(np.float16), _W.astype(np.float32), np.zeros(3, np.float16)), {}, TypeError,
         "unlike the other parameters"),
        ((_X, "w"), {}, TypeError, "weight must be an array"),
        ((_X, _W, [0.0, 0.0, 0.0]), {}, TypeError, "bias must be an array"),
        ((torch.zeros(2, 5, dtype=torch.float64), _W), {}, TypeError, "different libraries"),
    ],
)
def test_bad_arguments(args, kwargs, exc, match):
    arrays = [a for a in args if hasattr(a, "shape")]
    before = snapshot(arrays)
    with pytest.raises(exc, match=match):
        dense(*args, **kwargs)
    assert unchanged(arrays, before)
