"""``portable_nn.torch``'s pooling modules against ``torch.nn``'s, and the constructor audit of every drop-in."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import portable_nn.torch as pnt  # noqa: E402

DT = torch.float64


def _same(ours: nn.Module, theirs: nn.Module, x: torch.Tensor) -> None:
    """Equal outputs and input gradients, float64."""
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    ya, yb = ours(a), theirs(b)
    assert ya.shape == yb.shape
    assert torch.allclose(ya, yb, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(yb)
    ya.backward(g)
    yb.backward(g)
    assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)


_POOLS = [
    ("MaxPool1d", dict(kernel_size=3, stride=2, padding=1, dilation=2, ceil_mode=True), (2, 3, 11)),
    ("MaxPool2d", dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0)), (2, 3, 7, 6)),
    ("MaxPool3d", dict(kernel_size=2), (1, 2, 4, 5, 4)),
    ("MaxPool2d", dict(kernel_size=3, stride=2, ceil_mode=True), (3, 7, 7)),  # unbatched
    ("AvgPool1d", dict(kernel_size=4, stride=3, padding=2, count_include_pad=False), (2, 3, 10)),
    ("AvgPool2d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, divisor_override=5), (2, 3, 7, 6)),
    ("AvgPool2d", dict(kernel_size=2), (3, 6, 4)),  # unbatched
    ("AvgPool3d", dict(kernel_size=(2, 3, 2), padding=(1, 1, 0), count_include_pad=False), (1, 2, 4, 5, 4)),
]


@pytest.mark.parametrize(("name", "kwargs", "shape"), _POOLS, ids=[f"{p[0]}-{len(p[2])}d" for p in _POOLS])
def test_pool_modules_match_torch(name, kwargs, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=DT)
    ours, theirs = getattr(pnt, name)(**kwargs), getattr(nn, name)(**kwargs)
    assert isinstance(ours, getattr(nn, name))
    _same(ours, theirs, x)
    assert repr(ours) == repr(theirs)


def test_pool_module_channels_last():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 7, 6, dtype=DT)
    ours = pnt.AvgPool2d(3, stride=2, padding=1, channel_axis=-1)
    y = ours(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    assert torch.allclose(y, nn.AvgPool2d(3, stride=2, padding=1)(x), rtol=1e-12)


def test_max_pool_return_indices_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="return_indices"):
        pnt.MaxPool2d(2, return_indices=True)


def _drop_ins():
    for name in pnt.__all__:
        cls = getattr(pnt, name)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(nn, name):
            yield name, cls


def _torch_parameters(name: str) -> set[str]:
    twin = getattr(nn, name)
    params = inspect.signature(twin.__init__).parameters
    if any(p.kind is p.VAR_POSITIONAL for p in params.values()):  # LSTM, GRU, RNN: RNNBase's, less ``mode``
        params = {k: v for k, v in inspect.signature(nn.RNNBase.__init__).parameters.items() if k != "mode"}
        if name == "RNN":
            params = {**params, "nonlinearity": None}
        if name in ("RNN", "GRU"):  # torch.nn refuses proj_size for them ("only supported for LSTM")
            params.pop("proj_size")
    return set(params) - {"self"}


@pytest.mark.parametrize(("name", "cls"), list(_drop_ins()), ids=[n for n, _ in _drop_ins()])
def test_every_drop_in_takes_every_argument_of_its_torch_nn_twin(name, cls):
    """torch 2.13's constructor arguments all exist on ours (ours may add keyword-only options)."""
    ours = set(inspect.signature(cls.__init__).parameters) - {"self"}
    missing = _torch_parameters(name) - ours
    assert not missing, f"portable_nn.torch.{name} lacks {sorted(missing)}"
