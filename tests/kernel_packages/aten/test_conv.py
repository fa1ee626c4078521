"""The aten conv kernel: PyTorch's convolution against the reference, both layouts, only the needed gradients."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import rel_err
from portable_nn.api._common import spec_of

torch = pytest.importorskip("torch")

F = torch.nn.functional

pytestmark = pytest.mark.skipif(not pnn.available_backends()["aten"], reason="aten backend unavailable")


ACTS = ["identity", "relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "silu", "leaky_relu", ("leaky_relu", -0.3),
        ("leaky_relu", 0.0)]

from .aten_testing import CONV_GEOMS, _assert_agree, _both, _conv_problem, _t  # noqa: E402


@pytest.mark.parametrize("geom", list(CONV_GEOMS))
@pytest.mark.parametrize("layout", ["first", "last"])
@pytest.mark.parametrize("batched", [True, False])
def test_conv_matches_reference(geom, layout, batched):
    x, w, b, kwargs = _conv_problem(CONV_GEOMS[geom], layout, batched, bias=True)
    with pnn.use_backend("reference"):
        y = pnn.conv(_t(x), _t(w), _t(b), activation="gelu", **kwargs)
    dy = np.random.default_rng(1).standard_normal(tuple(y.shape))
    results = _both(pnn.conv, (_t(x), _t(w), _t(b)), {**kwargs, "activation": "gelu"}, _t(dy))
    _assert_agree(results, 1e-12)
    y_aten = results[0][0]
    assert y_aten.is_contiguous()


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_conv_every_activation_matches_reference_and_torch(act):
    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-asym-s2-d2-g2"], "first", True, bias=True, seed=3)
    xt, wt, bt = _t(x), _t(w), _t(b)
    with pnn.use_backend("reference"):
        y = pnn.conv(xt, wt, bt, activation=act, **kwargs)
    dy = _t(np.random.default_rng(4).standard_normal(tuple(y.shape)))
    results = _both(pnn.conv, (xt, wt, bt), {**kwargs, "activation": act}, dy)
    _assert_agree(results, 1e-12)
    # PyTorch's own composition: F.pad, conv2d, the activation, autograd
    leaves = [t.clone().requires_grad_(True) for t in (xt, wt, bt)]
    z = F.conv2d(F.pad(leaves[0], (0, 1, 1, 2)), leaves[1], leaves[2], stride=2, dilation=2, groups=2)
    name, slope = (act, 0.01) if isinstance(act, str) else act
    torch_act = {"identity": lambda v: v, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
                 "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu,
                 "leaky_relu": lambda v: F.leaky_relu(v, slope)}[name]
    y_torch = torch_act(z)
    expected = torch.autograd.grad(y_torch, leaves, dy)
    y_aten, grads = results[0]
    assert torch.equal(y_aten, y_torch.detach())
    for got, exp in zip(grads, expected):
        assert rel_err(got, exp) <= 1e-13


def test_conv_zero_batch_and_no_bias():
    x = torch.zeros(0, 3, 5, 5, dtype=torch.float64)
    w = torch.ones(4, 3, 3, 3, dtype=torch.float64)
    with pnn.use_backend("aten"):
        y, pullback = pnn.vjp(pnn.conv, x, w, padding=((0, 1), 1), activation="silu")
        grads = pullback(torch.zeros_like(y))
    assert tuple(y.shape) == (0, 4, 4, 5)
    assert tuple(grads.x.shape) == (0, 3, 5, 5) and grads.bias is None
    assert not grads.weight.any()


@pytest.fixture
def conv_backward_spy(monkeypatch):
    """Records the output_mask of every aten::convolution_backward call."""
    masks = []
    original = torch.ops.aten.convolution_backward

    def spy(*args, **kwargs):
        masks.append(list(args[-1]))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "convolution_backward", spy)
    return masks


def test_conv_wrt_weight_and_bias_computes_no_dx(conv_backward_spy):
    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-pad1"], "first", True, bias=True)
    with pnn.use_backend("aten"):
        y, pullback = pnn.vjp(pnn.conv, _t(x), _t(w), _t(b), wrt=("weight", "bias"), activation="relu", **kwargs)
        grads = pullback(torch.ones_like(y))
        assert conv_backward_spy == [[False, True, True]]
        assert grads.x is None and grads.weight is not None and grads.bias is not None
        _, pullback = pnn.vjp(pnn.conv, _t(x), _t(w), _t(b), wrt="x", **kwargs)
        pullback(torch.ones_like(y))
    assert conv_backward_spy[-1] == [True, False, False]


def test_channels_last_reaches_torch_as_a_view(monkeypatch):
    """NHWC data goes to oneDNN as a channels_last-strided view of the caller's tensor: no copy."""
    seen = []
    original = torch.ops.aten.convolution

    def spy(x, *args):
        seen.append((x.data_ptr(), x.is_contiguous(memory_format=torch.channels_last)))
        return original(x, *args)

    monkeypatch.setattr(torch.ops.aten, "convolution", spy)
    x = torch.randn(2, 7, 6, 4)
    w = torch.randn(5, 4, 3, 3)
    with pnn.use_backend("aten"):
        y, pullback = pnn.vjp(pnn.conv, x, w, padding=1, channel_axis=-1)
        grads = pullback(torch.ones_like(y))
    assert seen == [(x.data_ptr(), True)]
    assert tuple(y.shape) == (2, 7, 6, 5) and y.is_contiguous()
    assert tuple(grads.x.shape) == tuple(x.shape) and grads.x.is_contiguous()
    with pnn.use_backend("reference"):
        expected = pnn.conv(x, w, padding=1, channel_axis=-1)
    assert rel_err(y, expected) <= 1e-5


def test_conv_keeps_output_or_preactivation():
    from kernels_aten.conv import conv_forward

    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-pad1"], "first", True, bias=True)
    for act, kept in (("relu", "y"), ("tanh", "y"), (("leaky_relu", 0.2), "y"), ("gelu", "z"),
                      (("leaky_relu", -0.2), "z"), ("identity", None)):
        prepared = spec_of(pnn.conv).prepare(_t(x), _t(w), _t(b), activation=act, **kwargs)
        (y,), residuals = conv_forward(prepared.call.replace(save=True))
        kept_tensor = residuals[2]
        if kept is None:
            assert kept_tensor is None
        elif kept == "y":
            assert torch.equal(kept_tensor, y)
        else:
            assert not torch.equal(kept_tensor, y)



def test_cuda_float32_convolutions_run_without_tf32(monkeypatch):
    """cuDNN's default TF32 gave dx errors of 1e-4..5e-4 on an H200: the aten conv switches it off
    around its forward and backward calls for float32 CUDA tensors (and leaves the flags as found)."""
    import torch

    from kernels_aten import conv as aconv

    cudnn = torch.backends.cudnn
    before = (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32)
    with aconv._no_tf32():
        assert cudnn.allow_tf32 is False
        assert (cudnn.enabled, cudnn.benchmark, cudnn.deterministic) == before[:3]
    assert (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32) == before
    seen = []
    monkeypatch.setattr(aconv, "_ieee_float32", lambda t: seen.append(t.dtype) or aconv.nullcontext())
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    import portable_nn as pnn

    with pnn.use_backend("aten"):
        y, pullback = pnn.vjp(pnn.conv, x, w)
        pullback(torch.ones_like(y))
    assert seen == [torch.float32, torch.float32]  # forward and backward
