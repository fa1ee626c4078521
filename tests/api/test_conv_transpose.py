"""conv_transpose: forward and gradients against PyTorch (float64) on every (library, backend,
dtype), the adjoint identity with conv, finite differences, PyTorch's own samples on each CPU
backend, zero size, half data and validation."""

from __future__ import annotations

import warnings

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
    grid,
    snapshot,
    to_numpy,
    unchanged,
)
from portable_nn.api.conv import conv, conv_transpose
from torch_oracle import TORCH_ACT, activation_arg, check_layer_against_torch, from_layout, to_layout


@pytest.fixture(autouse=True, scope="module")
def _single_threaded_torch():
    """PyTorch's thread pool costs milliseconds per tiny oracle call on small machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TORCH_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}

#: Geometries: the U-Net upsampling (kernel = stride), stride with padding and output_padding,
#: output_padding above padding (the trailing outputs get only the bias), output_padding allowed
#: by dilation rather than stride (even output_padding >= stride), groups, depthwise, batch 1,
#: 1-D to 3-D, per-axis values.
GEOMS = {
    "1d-k3-s1-op1-d2": dict(n=2, c=3, o=4, spatial=(7,), kernel=(3,), stride=1, padding=0,
                            output_padding=1, dilation=2, groups=1),
    "1d-k3-s3-op2-d3": dict(n=1, c=2, o=2, spatial=(4,), kernel=(3,), stride=3, padding=0, output_padding=2,
                            dilation=3, groups=1),
    "2d-unet-k2-s2": dict(n=2, c=4, o=3, spatial=(3, 4), kernel=(2, 2), stride=2, padding=0, output_padding=0,
                          dilation=1, groups=1),
    "2d-k3-s2-p1-op1-g2": dict(n=2, c=4, o=6, spatial=(5, 4), kernel=(3, 3), stride=2, padding=1,
                               output_padding=1, dilation=1, groups=2),
    "2d-k3x2-s1x3-p2x0-depthwise": dict(n=1, c=3, o=3, spatial=(5, 3), kernel=(3, 2), stride=(1, 3),
                                        padding=(2, 0), output_padding=(0, 2), dilation=1, groups=3),
    "3d-k2-s2-p1-op1-g2": dict(n=1, c=2, o=4, spatial=(3, 2, 3), kernel=(2, 2, 2), stride=2, padding=1,
                               output_padding=1, dilation=1, groups=2),
    "3d-k2x1x3-d1x1x2": dict(n=2, c=2, o=2, spatial=(2, 3, 4), kernel=(2, 1, 3), stride=(1, 2, 1),
                             padding=(0, 0, 1), output_padding=(0, 1, 0), dilation=(1, 1, 2), groups=1),
}


def _data(geom, rng, bias=True):
    x = rng.standard_normal((geom["n"], geom["c"], *geom["spatial"]))
    fan = geom["c"] // geom["groups"] * int(np.prod(geom["kernel"]))
    w = rng.standard_normal((geom["c"], geom["o"] // geom["groups"], *geom["kernel"])) / np.sqrt(fan)
    b = rng.standard_normal(geom["o"]) * 0.5 if bias else None
    return x, w, b


def _kwargs(geom, layout="first", act="identity"):
    return dict(stride=geom["stride"], padding=geom["padding"], output_padding=geom["output_padding"],
                dilation=geom["dilation"], groups=geom["groups"], activation=activation_arg(act),
                channel_axis=-1 if layout == "last" else 1)


def torch_conv_transpose(x64, w64, b64, dy64, geom, act):
    """PyTorch's output and gradients (x, weight, bias), float64, batched channels first."""
    d = len(geom["kernel"])
    xt, wt = torch.tensor(x64, requires_grad=True), torch.tensor(w64, requires_grad=True)
    bt = None if b64 is None else torch.tensor(b64, requires_grad=True)
    z = TORCH_CONV_T[d](xt, wt, bt, stride=geom["stride"], padding=geom["padding"],
                        output_padding=geom["output_padding"], groups=geom["groups"], dilation=geom["dilation"])
    yt = TORCH_ACT[act](z)
    if dy64 is None:
        return yt.detach().numpy(), None
    yt.backward(torch.tensor(dy64))
    return yt.detach().numpy(), [None if t is None else t.grad.numpy() for t in (xt, wt, bt)]


def _run_case(case, geom, layout, batched, act, bias, seed):
    rng = np.random.default_rng(seed)
    check_layer_against_torch(
        case, conv_transpose, _data(geom, rng, bias), _kwargs(geom, layout, act), layout, batched, rng,
        lambda x, w, b, dy: torch_conv_transpose(x, w, b, dy, geom, act), "conv_transpose",
    )


_GRID = grid({
    "geom": list(GEOMS),
    "layout": ["first", "last"],
    "batched": [True, False],
    "bias": [True, False],
    "act": ["identity", "relu", "gelu"],
})


@pytest.mark.parametrize("case", cases("conv_transpose"))
@pytest.mark.parametrize("cfg", _GRID)
def test_conv_transpose_matches_torch(case, cfg):
    seed = list(GEOMS).index(cfg["geom"])
    _run_case(case, GEOMS[cfg["geom"]], cfg["layout"], cfg["batched"], cfg["act"], cfg["bias"], seed)


@pytest.mark.parametrize("case", cases("conv_transpose"))
@pytest.mark.parametrize("act", list(TORCH_ACT))
def test_every_activation_matches_torch(case, act):
    _run_case(case, GEOMS["2d-k3-s2-p1-op1-g2"], "last" if len(act) % 2 else "first", True, act, True, seed=3)


@pytest.mark.parametrize("layout", ["first", "last"])
@pytest.mark.parametrize("case", cases("conv_transpose", mixed=False))
def test_zero_batch(case, layout):
    geom = GEOMS["2d-k3-s2-p1-op1-g2"]
    _, w64, b64 = _data(geom, np.random.default_rng(0))
    x64 = np.zeros((0, geom["c"], *geom["spatial"]))
    x = case.asarray(to_layout(x64, layout, True))
    with case.use():
        y, pullback = pnn.vjp(conv_transpose, x, case.asarray(w64), case.asarray(b64), **_kwargs(geom, layout, "gelu"))
        grads = pullback(case.asarray(np.zeros(tuple(y.shape))))
    assert from_layout(to_numpy(y), layout, True).shape == (0, geom["o"], 10, 8)
    assert tuple(grads.x.shape) == tuple(x.shape)
    np.testing.assert_array_equal(to_numpy(grads.weight), np.zeros(w64.shape))
    np.testing.assert_array_equal(to_numpy(grads.bias), np.zeros(b64.shape))


# --------------------------------------------------------------------------- independent oracles


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("geom_name", list(GEOMS))
def test_adjoint_of_conv(backend, geom_name):
    """<conv(z, w), x> = <z, conv_transpose(x, w)> for every z, x: the defining identity,
    with conv's padding (low = padding, high = padding − output_padding, cropped at zero)."""
    geom = GEOMS[geom_name]
    rng = np.random.default_rng(7)
    x, w, _ = _data(geom, rng, bias=False)
    kw = _kwargs(geom)
    del kw["activation"], kw["channel_axis"]
    with pnn.use_backend(backend):
        y = conv_transpose(x, w, **kw)
        z = rng.standard_normal(y.shape)
        pads = np.broadcast_to(geom["padding"], len(geom["kernel"]))
        extra = np.broadcast_to(geom["output_padding"], len(geom["kernel"]))
        padding = tuple((int(p), int(max(p - e, 0))) for p, e in zip(pads, extra))
        cz = conv(z, w, stride=geom["stride"], padding=padding, dilation=geom["dilation"], groups=geom["groups"])
    cz = cz[(..., *(slice(0, s) for s in geom["spatial"]))]
    np.testing.assert_allclose(np.vdot(cz, x), np.vdot(z, y), rtol=1e-10)


@pytest.mark.parametrize("geom_name, layout, act", [("2d-k3-s2-p1-op1-g2", "last", "gelu"),
                                                    ("3d-k2x1x3-d1x1x2", "first", "silu")])
@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_directional_derivatives(backend, geom_name, layout, act):
    geom = GEOMS[geom_name]
    rng = np.random.default_rng(21)
    x64, w64, b64 = _data(geom, rng)
    x = to_layout(x64, layout, True)
    kwargs = _kwargs(geom, layout, act)
    with pnn.use_backend(backend):
        y, pullback = pnn.vjp(conv_transpose, x, w64, b64, **kwargs)
        dy = rng.standard_normal(y.shape)
        g = check_pullback_plumbing(pullback, dy, {"x": x, "weight": w64, "bias": b64})
        directional_check(lambda x, weight, bias: conv_transpose(x, weight, bias, **kwargs),
                          {"x": x, "weight": w64, "bias": b64}, {"x": g.x, "weight": g.weight, "bias": g.bias},
                          dy, directions=3)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_pytorch_samples(backend, d):
    """PyTorch's own OpInfo samples for conv_transpose{d}d, each through the forced backend."""
    pytest.importorskip("expecttest")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    info = next(i for i in op_db if i.name == f"nn.functional.conv_transpose{d}d" and not i.variant_test_name)
    compared = 0
    for sample in info.sample_inputs("cpu", torch.float64, requires_grad=False):
        args, kw = list(sample.args), dict(sample.kwargs)
        names = ["bias", "stride", "padding", "output_padding", "groups", "dilation"]
        weight = args.pop(0) if args else kw.pop("weight")
        kw.update(zip(names, args))
        want = info.op(sample.input, weight, **kw)
        with pnn.use_backend(backend):
            got = conv_transpose(sample.input.numpy(), weight.numpy(),
                                 None if kw.get("bias") is None else kw.pop("bias").numpy(), **{
                                     k: v for k, v in kw.items() if k != "bias"})
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-9, atol=1e-10, err_msg=str(sample))
        compared += 1
    assert compared > 0


# --------------------------------------------------------------------------- details


def test_unbatched_and_half_data():
    geom = GEOMS["2d-k3-s2-p1-op1-g2"]
    x, w, b = _data(geom, np.random.default_rng(1))
    kw = _kwargs(geom)
    np.testing.assert_allclose(conv_transpose(x[0], w, b, **kw), conv_transpose(x[:1], w, b, **kw)[0], rtol=1e-13)
    xh = torch.tensor(x, dtype=torch.bfloat16)
    y = pnn.conv_transpose(xh, torch.tensor(w, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), **kw)
    assert y.dtype == torch.bfloat16
    want = F.conv_transpose2d(xh.double(), torch.tensor(w), torch.tensor(b), stride=2, padding=1, output_padding=1,
                              groups=2)
    assert_close(y, want, 1e-2, "bfloat16 conv_transpose")


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((np.zeros((1, 3, 4, 4)), np.zeros((4, 2, 3, 3))), {}, ValueError,
         r"x has 3 channels .* weight.shape\[0\] = 4"),
        ((np.zeros((1, 4, 4, 4)), np.zeros((4, 2, 3, 3))), {"groups": 3}, ValueError, "groups=3 does not divide"),
        ((np.zeros((1, 4, 4, 4)), np.zeros((4, 2, 3, 3)), np.zeros(3)), {"groups": 2}, ValueError,
         r"bias must have shape \(4,\)"),
        ((np.zeros((1, 4, 4, 4)), np.zeros((4, 2, 3, 3))), {"stride": 2, "output_padding": 2}, ValueError,
         "output_padding must be smaller than stride or dilation"),
        ((np.zeros((1, 4, 2, 2)), np.zeros((4, 2, 1, 1))), {"padding": 1}, ValueError, "leaves no output"),
        ((np.zeros((1, 4, 4, 4)), np.zeros((4, 2, 3, 3))), {"padding": -1}, ValueError, "padding must be >= 0"),
        ((np.zeros((1, 4, 4, 4)), np.zeros((4, 2, 3, 3))), {"stride": 0}, ValueError, "stride must be >= 1"),
        ((np.zeros((1, 4, 4, 4)), np.zeros((4, 2, 3, 3))), {"padding": "same"}, TypeError, "padding must be an int"),
        ((np.zeros((4, 4)), np.zeros((4, 2, 3, 3))), {}, ValueError, "x must have 4 dimensions"),
        ((np.zeros((1, 4, 4)), np.zeros((4, 2, 3)).astype(np.int64)), {}, TypeError, "weight"),
    ],
)
def test_bad_arguments(args, kwargs, exc, match):
    before = snapshot(list(args))
    with pytest.raises(exc, match=match):
        conv_transpose(*args, **kwargs)
    assert unchanged(list(args), before)
