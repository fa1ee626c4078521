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


_UNPOOLS = [
    (1, dict(kernel_size=3, stride=2, padding=1), (2, 3, 11), None),
    (2, dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0)), (2, 3, 7, 6), None),
    (2, dict(kernel_size=3, stride=2), (3, 8, 7), (8, 8)),  # unbatched, output_size
    (3, dict(kernel_size=2), (1, 2, 4, 5, 4), (1, 2, 5, 5, 4)),  # full-shape output_size
]


@pytest.mark.parametrize(("d", "kwargs", "shape", "output_size"), _UNPOOLS, ids=[f"{u[0]}d-{k}" for k, u in
                                                                                 enumerate(_UNPOOLS)])
def test_max_pool_indices_and_unpool_modules_match_torch(d, kwargs, shape, output_size):
    """MaxPool*d(return_indices=True) then MaxUnpool*d: outputs, indices and gradients as torch.nn's.

    Overlapping windows give duplicate indices: the last entry wins, as on PyTorch's CPU; the
    gradient goes to that entry only (torch.nn gives it to every duplicate)."""
    torch.manual_seed(2)
    x = torch.randint(-3, 4, shape).to(DT)  # ties
    results = []
    for lib in (pnt, nn):
        y, idx = getattr(lib, f"MaxPool{d}d")(**kwargs, return_indices=True)(x)
        y = y.detach().requires_grad_(True)
        unpool = getattr(lib, f"MaxUnpool{d}d")(**kwargs)
        u = unpool(y, idx, output_size=output_size)
        u.backward(torch.arange(u.numel(), dtype=DT).reshape(u.shape))
        results.append((y.detach(), idx, u.detach(), y.grad))
        assert repr(unpool) == repr(getattr(nn, f"MaxUnpool{d}d")(**kwargs))
    (y, idx, u, dy), (y_t, idx_t, u_t, dy_t) = results
    for ours, theirs in ((y, y_t), (idx, idx_t), (u, u_t)):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    planes = idx.reshape(-1, idx.shape[-d:].numel()) if idx.ndim > d else idx.reshape(1, -1)
    written = torch.zeros(planes.shape, dtype=torch.bool)
    for plane, won in zip(planes.tolist(), written):
        won[list({q: p for p, q in enumerate(plane)}.values())] = True
    assert torch.equal(dy, torch.where(written.reshape(idx.shape), dy_t, 0.0))


def test_unpool_module_channels_last():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 6, 6, dtype=DT)
    y, idx = nn.functional.max_pool2d(x, 2, return_indices=True)
    ours = pnt.MaxUnpool2d(2, channel_axis=-1)
    u = ours(y.permute(0, 2, 3, 1).contiguous(), idx.permute(0, 2, 3, 1).contiguous()).permute(0, 3, 1, 2)
    assert torch.equal(u, nn.MaxUnpool2d(2)(y, idx))


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
