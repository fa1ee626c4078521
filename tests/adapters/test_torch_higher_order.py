"""portable_nn.torch: higher-order derivatives (double backward through ``create_graph=True``).

Oracles: ``torch.autograd.gradgradcheck`` (finite differences of the backward, float64) for every op
of the adapter's op table, on the eager path and on the custom-op path (what ``torch.compile``
sees); the ``torch.nn`` modules for a gradient penalty and a Hessian-vector product through the
drop-in modules.  A plain backward must still run the fused backward kernel, never the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import portable_nn.torch as pnt  # noqa: E402
from portable_nn import dispatch  # noqa: E402
from portable_nn.adapters.torch import _ops as adapter_ops  # noqa: E402

DT = torch.float64


def _t(*shape: int, grad: bool = True, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 101 + sum(shape) * 7 + len(shape))
    return (scale * torch.randn(*shape, dtype=DT, generator=gen)).requires_grad_(grad)


def _seq_params(gates: int, inputs: int, hidden: int, layers: int, dirs: int,
                bias: bool = True) -> list[tuple[Any, ...]]:
    params = []
    for layer in range(layers):
        for _ in range(dirs):
            k = len(params)
            i = inputs if layer == 0 else dirs * hidden
            params.append((_t(gates * hidden, i, scale=0.5, seed=4 * k + 1), _t(gates * hidden, hidden, scale=0.5,
                                                                                 seed=4 * k + 2),
                           _t(gates * hidden, scale=0.3, seed=4 * k + 3) if bias else None,
                           _t(gates * hidden, scale=0.3, seed=4 * k + 4) if bias else None))
    return params


def _flat(params: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    return [t for p in params for t in p if t is not None]


def _rebuild(params: list[tuple[Any, ...]], flat: tuple[torch.Tensor, ...]) -> list[tuple[Any, ...]]:
    it = iter(flat)
    return [tuple(None if t is None else next(it) for t in p) for p in params]


def _samples() -> dict[str, list[tuple[str, Callable[..., Any], tuple[Any, ...]]]]:
    """Per op of the adapter, ``(id, function of the differentiated tensors, those tensors)``."""
    rm, rv = torch.zeros(3, dtype=DT), torch.ones(3, dtype=DT)
    labels = torch.tensor([1, 0, 3, 2, 1])
    probs = torch.softmax(_t(5, 4, grad=False, seed=2), 1).requires_grad_()
    pooled, indices = pnt.max_pool(_t(1, 2, 4, 5, grad=False, seed=3), 2, return_indices=True)
    lstm_p, gru_p, rnn_p = _seq_params(4, 3, 2, 1, 1), _seq_params(3, 2, 2, 1, 2), _seq_params(1, 2, 2, 2, 1, False)
    return {
        "conv": [
            ("conv2d", lambda x, w, b: pnt.conv(x, w, b, stride=(2, 1), padding=1, groups=2, activation="tanh"),
             (_t(1, 4, 4, 3), _t(4, 2, 2, 2), _t(4))),
            ("conv1d_reflect_last", lambda x, w: pnt.conv(x, w, padding=1, padding_mode="reflect", channel_axis=-1),
             (_t(2, 5, 2), _t(3, 2, 3))),
        ],
        "conv_transpose": [
            ("conv_transpose2d", lambda x, w, b: pnt.conv_transpose(x, w, b, stride=2, padding=1, output_padding=1,
                                                                    activation="silu"),
             (_t(1, 2, 2, 3), _t(2, 3, 3, 2), _t(3))),
        ],
        "dense": [("dense", lambda x, w, b: pnt.dense(x, w, b, activation="gelu"), (_t(2, 3), _t(4, 3), _t(4)))],
        "log_softmax": [("log_softmax", lambda x: pnt.log_softmax(x, axis=0), (_t(3, 4),))],
        "cross_entropy": [
            ("cross_entropy_labels", lambda z: pnt.cross_entropy(z, labels, label_smoothing=0.1), (_t(5, 4),)),
            ("cross_entropy_probs", lambda z, p: pnt.cross_entropy(z, p, reduction="none"), (_t(5, 4), probs)),
        ],
        "moments": [("moments", lambda x: pnt.moments(x, 1, correction=1), (_t(3, 4),))],
        "batch_norm": [
            ("batch_norm_train", lambda x, w, b: pnt.batch_norm(
                x, weight=w, bias=b, running_mean=rm.clone(), running_var=rv.clone(), activation="silu"),
             (_t(4, 3, 2), _t(3), _t(3))),
            ("batch_norm_eval", lambda x, w: pnt.batch_norm(
                x, weight=w, running_mean=rm + 0.2, running_var=rv * 1.5, training=False, activation="tanh"),
             (_t(4, 3), _t(3))),
        ],
        "layer_norm": [("layer_norm", lambda x, w, b: pnt.layer_norm(x, w, b, activation="gelu_tanh"),
                        (_t(3, 4), _t(4), _t(4)))],
        "rms_norm": [("rms_norm", lambda x, w: pnt.rms_norm(x, w, eps=1e-3), (_t(3, 4), _t(4)))],
        "group_norm": [("group_norm", lambda x, w, b: pnt.group_norm(x, 2, w, b, activation="sigmoid"),
                        (_t(2, 4, 3), _t(4), _t(4)))],
        "instance_norm": [("instance_norm", lambda x, w, b: pnt.instance_norm(x, weight=w, bias=b), (
            _t(2, 3, 4), _t(3), _t(3)))],
        "max_pool": [("max_pool", lambda x: pnt.max_pool(x, 2, stride=1, padding=1), (_t(1, 2, 3, 3),))],
        "avg_pool": [("avg_pool", lambda x: pnt.avg_pool(x, (3,), stride=2, padding=1, count_include_pad=False),
                      (_t(2, 2, 5),))],
        "max_unpool": [("max_unpool", lambda x: pnt.max_unpool(x, indices, 2, output_size=(4, 5)),
                        (pooled.detach().requires_grad_(),))],
        "rnn_cell": [("rnn_cell", lambda x, h, wi, wh, b: pnt.rnn_cell(x, h, wi, wh, b, None),
                      (_t(2, 3), _t(2, 2), _t(2, 3), _t(2, 2), _t(2)))],
        "lstm_cell": [("lstm_cell", lambda x, h, c, wi, wh, b: pnt.lstm_cell(x, h, c, wi, wh, b, None),
                       (_t(2, 3), _t(2, 2), _t(2, 2, seed=1), _t(8, 3, scale=0.5), _t(8, 2, scale=0.5), _t(8)))],
        "gru_cell": [("gru_cell", lambda x, h, wi, wh: pnt.gru_cell(x, h, wi, wh, reset_after=False),
                      (_t(2, 3), _t(2, 2), _t(6, 3, scale=0.5), _t(6, 2, scale=0.5)))],
        "rnn": [("rnn_stacked_relu", lambda x, h0, *flat: pnt.rnn(x, _rebuild(rnn_p, flat), h0, activation="relu"),
                 (_t(2, 2, 2), _t(2, 2, 2, seed=1), *_flat(rnn_p)))],
        "lstm": [("lstm_lengths", lambda x, h0, c0, *flat: pnt.lstm(x, _rebuild(lstm_p, flat), h0, c0,
                                                                   batch_first=True, lengths=[2, 1]),
                  (_t(2, 2, 3), _t(1, 2, 2), _t(1, 2, 2, seed=1), *_flat(lstm_p)))],
        "gru": [("gru_bidirectional", lambda x, *flat: pnt.gru(x, _rebuild(gru_p, flat), bidirectional=True),
                 (_t(2, 1, 2), *_flat(gru_p)))],
    }


_SAMPLES = _samples()
_CASES = {case_id: (op, fn, inputs) for op, cases in _SAMPLES.items() for case_id, fn, inputs in cases}


def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
    """The floating tensors of a nested result (the differentiable outputs)."""
    if isinstance(result, torch.Tensor):
        return (result,) if result.is_floating_point() else ()
    return tuple(t for r in result for t in _outputs(r))


def test_every_op_of_the_adapter_has_a_sample():
    """New ops are covered as soon as they are registered: each needs a sample here."""
    missing = sorted(set(adapter_ops._OPS) - set(_SAMPLES))
    assert not missing, f"add a double-backward sample for {missing} to _samples()"


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_gradgradcheck(case, path, monkeypatch):
    """Second derivatives (the backward's own derivative, with respect to the inputs and the incoming
    cotangents) match finite differences of the first, on both paths."""
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", path == "eager")
    _, fn, inputs = _CASES[case]
    assert torch.autograd.gradgradcheck(lambda *a: _outputs(fn(*a)), inputs, eps=1e-6, atol=1e-6, rtol=1e-5,
                                        fast_mode=True)


def test_full_gradgradcheck_of_a_norm_and_a_cell():
    """The full (not randomly projected) second-derivative Jacobians, for two ops."""
    for case in ("layer_norm", "lstm_cell"):
        _, fn, inputs = _CASES[case]
        assert torch.autograd.gradgradcheck(lambda *a: _outputs(fn(*a)), inputs, eps=1e-6, atol=1e-6)


def _third_derivative(dense: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(dense(x, w).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad((g * g).sum(), w, create_graph=True)
    (t,) = torch.autograd.grad(h.pow(3).sum(), x)
    return t


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_third_order_matches_torch(path, monkeypatch):
    """The recomputed gradients are plain torch graphs: any order works."""
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", path == "eager")
    x, w = _t(3, 4), _t(5, 4, seed=1)
    ours = _third_derivative(lambda x, w: pnt.dense(x, w, activation="tanh"), x, w)
    theirs = _third_derivative(lambda x, w: torch.tanh(x @ w.T), x, w)
    assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)


# =========================================================================== which backward runs


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_plain_backward_keeps_the_fused_kernels(path, monkeypatch):
    """Without create_graph the kept pullback (our backward kernel) runs and the reference never does;
    with it, the reference is differentiated and the pullback is not called."""
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", path == "eager")
    calls = {"pullback": 0, "reference": 0}
    backward, recompute = dispatch.Executed.backward, adapter_ops._differentiable_grads

    def counting_backward(self, *args, **kwargs):  # (every path's kept backward ends here)
        calls["pullback"] += 1
        return backward(self, *args, **kwargs)

    def counting_recompute(*args, **kwargs):
        calls["reference"] += 1
        return recompute(*args, **kwargs)

    monkeypatch.setattr(dispatch.Executed, "backward", counting_backward)
    monkeypatch.setattr(adapter_ops, "_differentiable_grads", counting_recompute)
    x, w, b = _t(3, 4), _t(4), _t(4)
    pnt.layer_norm(x, w, b).pow(2).sum().backward()
    assert calls == {"pullback": 1, "reference": 0}
    (g,) = torch.autograd.grad(pnt.layer_norm(x, w, b).pow(2).sum(), x, create_graph=True)
    assert calls == {"pullback": 1, "reference": 1}
    assert g.requires_grad


def test_create_graph_recomputes_with_pytorch_s_own_kernels_where_autograd_differentiates_them(monkeypatch):
    """Under the custom ops, conv, conv_transpose and dense recompute through ``aten`` (torch ops: the
    penalty's double backward then costs what torch.nn's does); every other op through the reference."""
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", False)
    chosen = []
    pick = adapter_ops._recompute_impl

    def recording(name, call):
        impl = pick(name, call)
        chosen.append((name, impl.backend))
        return impl

    monkeypatch.setattr(adapter_ops, "_recompute_impl", recording)
    x, w, b = _t(2, 3, 5, 5), _t(4, 3, 3, 3, seed=1), _t(4, seed=2)
    for y in (pnt.conv(x, w, b, padding=1, activation="gelu"), pnt.conv_transpose(x, w.transpose(0, 1), b, stride=2),
              pnt.dense(x.flatten(1), _t(4, 75, seed=3)), pnt.layer_norm(x, None, None, axis=(-2, -1))):
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        assert g.requires_grad
    assert chosen == [("conv", "aten"), ("conv_transpose", "aten"), ("dense", "aten"), ("layer_norm", "reference")]


def test_double_backward_with_respect_to_the_cotangent_only():
    """A gradient whose cotangent carries history, of inputs that carry none beyond the op's weight."""
    x, w = _t(2, 3, grad=False), _t(4, 3, seed=1)
    dy = _t(2, 4, seed=2)
    (gw,) = torch.autograd.grad(pnt.dense(x, w, activation="sigmoid"), w, dy, create_graph=True)
    (expected,) = torch.autograd.grad(torch.sigmoid(x @ w.T), w, dy, create_graph=True)
    ours = torch.autograd.grad(gw.sum(), (dy, w))
    theirs = torch.autograd.grad(expected.sum(), (dy, w))
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


# =========================================================================== modules


def _twin_models() -> tuple[nn.Module, nn.Module]:
    """The same small conv net from portable_nn.torch's modules and from torch.nn's, equal weights."""

    def build(lib: Any) -> nn.Module:
        return nn.Sequential(lib.Conv2d(2, 3, 3, padding=1), lib.BatchNorm2d(3), nn.Tanh(), lib.LayerNorm([3, 4, 4]),
                             nn.Flatten(), lib.Linear(48, 2)).to(DT)

    torch.manual_seed(0)
    ours = build(pnt)
    theirs = build(nn)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _gradient_penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """WGAN-GP's penalty: (‖∂ Σ model(x) / ∂x‖ − 1)² per example, averaged."""
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_gradient_penalty_through_modules_matches_torch_nn(path, monkeypatch):
    """Conv2d → BatchNorm2d (training) → LayerNorm → Linear: the penalty's parameter gradients equal
    torch.nn's, and the running statistics are updated once, as torch.nn updates them."""
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", path == "eager")
    ours, theirs = _twin_models()
    x = _t(3, 2, 4, 4, grad=False, seed=5)
    losses = [_gradient_penalty(model, x) for model in (ours, theirs)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], rtol=1e-10)
    # (the biases after the last norms do not move ∂/∂x: no gradient on either side; the conv bias
    # feeds a training batch norm, so its exact gradient is 0 and each side returns rounding noise)
    scale = max(float(q.grad.abs().max()) for q in theirs.parameters() if q.grad is not None)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or torch.allclose(p.grad, q.grad, rtol=1e-8, atol=1e-12 * scale), name
    for name, buffer in theirs[1].named_buffers():
        assert torch.equal(getattr(ours[1], name), buffer) if name == "num_batches_tracked" else \
            torch.allclose(getattr(ours[1], name), buffer, rtol=1e-12), name


def test_hessian_vector_product_through_modules_matches_torch_nn():
    """Hv of a classification loss with respect to a module's weight, by double backward."""
    ours, theirs = _twin_models()
    x, label = _t(3, 2, 4, 4, grad=False, seed=6), torch.tensor([0, 1, 1])
    products = []
    for model in (ours.eval(), theirs.eval()):
        weight = model[0].weight
        v = torch.ones_like(weight)
        loss = nn.functional.cross_entropy(model(x), label)
        (g,) = torch.autograd.grad(loss, weight, create_graph=True)
        products.append(torch.autograd.grad((g * v).sum(), weight)[0])
    assert torch.allclose(products[0], products[1], rtol=1e-8, atol=1e-12)
    assert products[0].abs().max() > 0
