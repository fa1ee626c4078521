"""portable_nn.torch's recurrent cells, CrossEntropyLoss and GroupNorm(bias=False) against torch.nn's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import portable_nn.torch as pnt  # noqa: E402

DT = torch.float64


def _twins(name: str, *args, **kwargs):
    torch.manual_seed(0)
    theirs = getattr(nn, name)(*args, **kwargs).to(DT)
    ours = getattr(pnt, name)(*args, **kwargs).to(DT)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _grads(module: nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters()] + [t.grad for t in tensors]


@pytest.mark.parametrize(("name", "kwargs"), [("RNNCell", {}), ("RNNCell", {"nonlinearity": "relu"}),
                                              ("GRUCell", {}), ("LSTMCell", {}), ("GRUCell", {"bias": False})])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("with_state", [True, False])
def test_cells_match_torch(name, kwargs, batched, with_state):
    ours, theirs = _twins(name, 3, 4, **kwargs)
    lead = (5,) if batched else ()
    x = torch.randn(*lead, 3, dtype=DT)
    state = None
    if with_state:
        h = torch.randn(*lead, 4, dtype=DT)
        state = (h, torch.randn(*lead, 4, dtype=DT)) if name == "LSTMCell" else h
    results = []
    for module in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        out = module(xi, state)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sin().sum() for o in outs).backward()
        results.append((outs, _grads(module, xi)))
    (o_ours, g_ours), (o_theirs, g_theirs) = results
    for a, b in zip(o_ours, o_theirs):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_ours, g_theirs):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "none", "ignore_index": 1}, {"label_smoothing": 0.2},
                                    {"weight": "w", "reduction": "sum"}])
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (4,)])
def test_cross_entropy_loss_matches_torch(kwargs, shape):
    torch.manual_seed(2)
    if kwargs.get("weight") == "w":
        kwargs = {**kwargs, "weight": torch.rand(4, dtype=DT) + 0.5}
    ours, theirs = pnt.CrossEntropyLoss(**kwargs), nn.CrossEntropyLoss(**kwargs)
    logits = torch.randn(shape, dtype=DT)
    target_shape = (shape[0], *shape[2:]) if len(shape) > 1 else ()
    target = torch.randint(0, 4, target_shape)
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    la, lb = ours(a, target), theirs(b, target)
    assert torch.allclose(la, lb, rtol=1e-12, atol=1e-12)
    la.sum().backward()
    lb.sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_group_norm_without_bias_matches_torch():
    ours, theirs = _twins("GroupNorm", 2, 4, bias=False)
    assert ours.bias is None and set(ours.state_dict()) == set(theirs.state_dict()) == {"weight"}
    x = torch.randn(3, 4, 5, dtype=DT)
    assert torch.allclose(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
