"""conv: forward and gradients against PyTorch (float64), layouts, zero size, finite
differences, the residual kept for the backward, gradient plumbing and validation."""

from __future__ import annotations

from typing import Any

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
from portable_nn.api.conv import conv
from portable_nn.reference import conv as ref_conv
from torch_oracle import TORCH_ACT, activation_arg, check_layer_against_torch, from_layout, to_layout

# PyTorch notes that "same" with an even kernel pads a copy of the input; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")


@pytest.fixture(autouse=True, scope="module")
def _single_threaded_torch():
    """PyTorch's thread pool costs milliseconds per tiny oracle call on small machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}



#: Geometries: odd sizes, batch 1, stride > 1 with dilation > 1, groups > 1, depthwise
#: (groups == C, with and without a channel multiplier), asymmetric (low, high) padding,
#: "same" with even kernels (the extra padding on the high side), "valid", 1x1 kernels.
GEOMS = {
    "1d-k3-s2-p1-N1": dict(n=1, c=4, o=6, spatial=(9,), kernel=(3,), stride=2, padding=1, dilation=1, groups=1),
    "1d-k2-d3-g2-asym": dict(n=2, c=4, o=2, spatial=(8,), kernel=(2,), stride=1, padding=((2, 1),), dilation=3,
                             groups=2),
    "1d-k4-same-d2": dict(n=2, c=3, o=5, spatial=(7,), kernel=(4,), stride=1, padding="same", dilation=2, groups=1),
    "2d-k3x2-s2-d2-g2-asym": dict(n=2, c=4, o=6, spatial=(7, 6), kernel=(3, 2), stride=2, padding=(1, (0, 2)),
                                  dilation=2, groups=2),
    "2d-depthwise-x2-same": dict(n=2, c=3, o=6, spatial=(5, 6), kernel=(3, 3), stride=1, padding="same",
                                 dilation=1, groups=3),
    "2d-k1-s2x1-valid": dict(n=3, c=3, o=4, spatial=(5, 3), kernel=(1, 1), stride=(2, 1), padding="valid",
                             dilation=1, groups=1),
    "2d-k2x3-s3x2-d1x2": dict(n=1, c=2, o=3, spatial=(8, 9), kernel=(2, 3), stride=(3, 2), padding=((1, 0), 1),
                              dilation=(1, 2), groups=1),
    "3d-k2x3x2-s2x1x2-d1x2x1-g2": dict(n=2, c=2, o=4, spatial=(5, 6, 6), kernel=(2, 3, 2), stride=(2, 1, 2),
                                       padding=(1, 0, (0, 1)), dilation=(1, 2, 1), groups=2),
    "3d-k3x2x3-same": dict(n=1, c=2, o=3, spatial=(3, 4, 5), kernel=(3, 2, 3), stride=1, padding="same",
                           dilation=1, groups=1),
    "3d-depthwise-s2-p1": dict(n=2, c=3, o=3, spatial=(4, 3, 5), kernel=(2, 2, 2), stride=2, padding=1,
                               dilation=1, groups=3),
}


# --------------------------------------------------------------------------- helpers




def _torch_padding(padding: Any, d: int, geom: dict | None = None) -> tuple[Any, tuple[int, ...]]:
    """(padding for torch's conv, F.pad widths): strings go to torch as they are; numbers
    are expanded to (low, high) pairs here and applied with F.pad.  With a ``geom`` whose
    ``padding_mode`` is not zeros, "same" is expanded too (as torch.nn.Conv2d does), since
    F.pad then applies all of it with the mode."""
    if padding == "same" and geom is not None and geom.get("padding_mode", "zeros") != "zeros":
        totals = [dl * (k - 1) for k, dl in zip(geom["kernel"], _per_axis(geom["dilation"], d))]
        padding = tuple((t // 2, t - t // 2) for t in totals)
    if isinstance(padding, str):
        return padding, (0,) * (2 * d)
    entries = padding if isinstance(padding, tuple) else (padding,) * d
    pairs = [e if isinstance(e, tuple) else (e, e) for e in entries]
    widths: list[int] = []
    for lo, hi in reversed(pairs):  # F.pad lists the last axis first
        widths += [lo, hi]
    return 0, tuple(widths)


def _per_axis(value: Any, d: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, tuple) else (value,) * d


def torch_conv(x64, w64, b64, dy64, geom, act_label):
    """PyTorch's output and gradients (x, weight, bias), float64, batched channels-first
    (``geom["padding_mode"]``, when given, pads with F.pad as torch.nn.Conv2d does)."""
    d = len(geom["kernel"])
    xt = torch.tensor(x64, requires_grad=True)
    wt = torch.tensor(w64, requires_grad=True)
    bt = None if b64 is None else torch.tensor(b64, requires_grad=True)
    padding, widths = _torch_padding(geom["padding"], d, geom)
    mode = geom.get("padding_mode", "zeros")
    xin = F.pad(xt, widths, mode="constant" if mode == "zeros" else mode) if any(widths) else xt
    z = TORCH_CONV[d](
        xin, wt, bt, stride=geom["stride"], padding=padding, dilation=geom["dilation"], groups=geom["groups"]
    )
    yt = TORCH_ACT[act_label](z)
    if dy64 is None:
        return yt.detach().numpy(), None
    yt.backward(torch.tensor(dy64))
    grads = [t.grad.numpy() if t is not None else None for t in (xt, wt, bt)]
    return yt.detach().numpy(), grads


def _data(geom, rng, bias=True):
    x = rng.standard_normal((geom["n"], geom["c"], *geom["spatial"]))
    fan_in = geom["c"] // geom["groups"] * int(np.prod(geom["kernel"]))
    w = rng.standard_normal((geom["o"], geom["c"] // geom["groups"], *geom["kernel"])) / np.sqrt(fan_in)
    b = rng.standard_normal(geom["o"]) * 0.5 if bias else None
    return x, w, b


def _conv_kwargs(geom, layout="first", act="identity"):
    kwargs = dict(
        stride=geom["stride"], padding=geom["padding"], dilation=geom["dilation"], groups=geom["groups"],
        activation=activation_arg(act), channel_axis=-1 if layout == "last" else 1,
    )
    if "padding_mode" in geom:
        kwargs["padding_mode"] = geom["padding_mode"]
    return kwargs


def _run_case(case, geom, layout, batched, act, bias, seed):
    rng = np.random.default_rng(seed)
    check_layer_against_torch(
        case, conv, _data(geom, rng, bias), _conv_kwargs(geom, layout, act), layout, batched, rng,
        lambda x, w, b, dy: torch_conv(x, w, b, dy, geom, act), "conv",
    )


# --------------------------------------------------------------------------- against PyTorch


_GRID = grid(
    {
        "geom": list(GEOMS),
        "layout": ["first", "last"],
        "batched": [True, False],
        "bias": [True, False],
        "act": ["identity", "relu", "gelu", "silu"],
    }
)


@pytest.mark.parametrize("case", cases("conv"))
@pytest.mark.parametrize("cfg", _GRID)
def test_conv_matches_torch(case, cfg):
    seed = list(GEOMS).index(cfg["geom"])
    _run_case(case, GEOMS[cfg["geom"]], cfg["layout"], cfg["batched"], cfg["act"], cfg["bias"], seed)


_ACT_GEOMS = ["2d-k3x2-s2-d2-g2-asym", "1d-k2-d3-g2-asym"]


@pytest.mark.parametrize("case", cases("conv"))
@pytest.mark.parametrize("act", list(TORCH_ACT))
@pytest.mark.parametrize("layout", ["first", "last"])
def test_conv_every_activation_matches_torch(case, act, layout):
    geom = _ACT_GEOMS[0] if layout == "first" else _ACT_GEOMS[1]
    _run_case(case, GEOMS[geom], layout, True, act, True, seed=5)


@pytest.mark.parametrize("mode", ["zeros", "reflect"])
@pytest.mark.parametrize("layout", ["first", "last"])
@pytest.mark.parametrize("case", cases("conv", mixed=False))
def test_zero_batch(case, layout, mode):
    geom = dict(GEOMS["2d-k3x2-s2-d2-g2-asym"], padding_mode=mode)
    rng = np.random.default_rng(0)
    _, w64, b64 = _data(geom, rng)
    x64 = np.zeros((0, geom["c"], *geom["spatial"]))
    x = case.asarray(to_layout(x64, layout, True))
    w, b = case.asarray(w64), case.asarray(b64)
    with case.use():
        y, pullback = pnn.vjp(conv, x, w, b, **_conv_kwargs(geom, layout, "gelu"))
        grads = pullback(case.asarray(np.zeros(tuple(y.shape))))
    y_ref, _ = torch_conv(x64, w64, b64, None, geom, "gelu")
    assert from_layout(to_numpy(y), layout, True).shape == y_ref.shape == (0, geom["o"], 3, 3)
    assert tuple(grads.x.shape) == tuple(x.shape)
    np.testing.assert_array_equal(to_numpy(grads.weight), np.zeros(w64.shape))
    np.testing.assert_array_equal(to_numpy(grads.bias), np.zeros(b64.shape))


def test_same_padding_keeps_the_size_and_puts_the_extra_on_the_high_side():
    # Even kernel, 1-D: the total padding 3 splits 1 low, 2 high (PyTorch's convention).
    x = np.arange(1.0, 6.0)[None, None]
    w = np.ones((1, 1, 4))
    y = conv(x, w, padding="same")
    np.testing.assert_array_equal(y, [[[6.0, 10.0, 14.0, 12.0, 9.0]]])
    assert_close(y, F.conv1d(torch.tensor(x), torch.tensor(w), padding="same").numpy(), 0.0)


# --------------------------------------------------------------------------- padding modes

#: Geometries for the padding modes, each within every mode's limits: asymmetric padding with a
#: stride, "same" with a dilation and groups, and 3-D padding as large as reflect allows (its two
#: borders then read the same positions; replicate's border repeats one position three times).
MODE_GEOMS = {
    "1d-k3-s2-asym": dict(n=2, c=2, o=3, spatial=(6,), kernel=(3,), stride=2, padding=((2, 1),), dilation=1,
                          groups=1),
    "2d-same-d2-g2": dict(n=1, c=4, o=2, spatial=(5, 4), kernel=(3, 2), stride=1, padding="same", dilation=(2, 1),
                          groups=2),
    "3d-pad-to-the-limit": dict(n=2, c=2, o=2, spatial=(3, 4, 2), kernel=(2, 2, 2), stride=(1, 2, 1),
                                padding=(2, (0, 3), 1), dilation=1, groups=1),
}
MODES = ("reflect", "replicate", "circular")

_MODE_GRID = grid({"mode": list(MODES), "geom": list(MODE_GEOMS), "layout": ["first", "last"],
                   "batched": [True, False]})


@pytest.mark.parametrize("case", cases("conv"))
@pytest.mark.parametrize("cfg", _MODE_GRID)
def test_padding_modes_match_torch(case, cfg):
    """Output and gradients against torch.nn's way: F.pad with the mode, then an unpadded convolution."""
    geom = dict(MODE_GEOMS[cfg["geom"]], padding_mode=cfg["mode"])
    _run_case(case, geom, cfg["layout"], cfg["batched"], "gelu", True, seed=11)


@pytest.mark.parametrize("case", cases("conv", mixed=False))
@pytest.mark.parametrize("mode", MODES)
def test_padding_at_the_limits_matches_torch(case, mode):
    """The largest padding each mode takes (reflect L − 1, circular L, replicate any: 2L here),
    where one position feeds several border positions, and the gradient must sum them all."""
    length = 3
    pad = {"reflect": length - 1, "circular": length, "replicate": 2 * length}[mode]
    geom = dict(n=2, c=2, o=2, spatial=(length, 2), kernel=(2, 1), stride=1, padding=((pad, 1), 0), dilation=1,
                groups=1, padding_mode=mode)
    for layout in ("first", "last"):
        _run_case(case, geom, layout, True, "identity", True, seed=2)


def test_padding_modes_beyond_the_limits_are_refused_before_any_work():
    x = np.arange(3.0)[None, None]
    w = np.ones((1, 1, 1))
    conv(x, w, padding=2, padding_mode="reflect")
    conv(x, w, padding=3, padding_mode="circular")
    conv(x, w, padding=9, padding_mode="replicate")
    with pytest.raises(ValueError, match=r"padding_mode='reflect' needs padding smaller than x's size"):
        conv(x, w, padding=3, padding_mode="reflect")
    with pytest.raises(ValueError, match=r"padding_mode='circular' needs padding at most x's size"):
        conv(x, w, padding=((0, 4),), padding_mode="circular")


def test_padding_mode_explained_with_the_convolution_backend():
    """explain names the convolution's implementation and the padding applied before it; a strided
    x is not copied for the kernel (the padded x is a new array)."""
    x = np.zeros((1, 2, 5, 6)).transpose(0, 2, 3, 1)  # channels last, non-contiguous
    w = np.zeros((3, 2, 3, 3))
    with pnn.use_backend("numba"):
        report = pnn.explain(conv, x, w, padding=(1, (0, 2)), padding_mode="replicate", channel_axis=-1)
    assert report.implementation == "conv[numba]"
    assert "x" not in report.copies
    assert "input map: x padded with padding_mode='replicate' (axis 1: (1, 1), axis 2: (0, 2))" in str(report)
    plain = pnn.explain(conv, x, w, padding=(1, (0, 2)), channel_axis=-1)
    assert "input map" not in str(plain)


def test_padding_mode_pullback_plumbing():
    """out= buffers have x's shape (not the padded x's), wrt skips what is not asked, repeated pullbacks."""
    geom = dict(MODE_GEOMS["2d-same-d2-g2"], padding_mode="circular")
    rng = np.random.default_rng(6)
    x, w, b = _data(geom, rng)
    kwargs = _conv_kwargs(geom, "first", "tanh")
    y, pullback = pnn.vjp(conv, x, w, b, **kwargs)
    dy = rng.standard_normal(y.shape)
    grads = check_pullback_plumbing(pullback, dy, {"x": x, "weight": w, "bias": b})
    assert grads.x.shape == x.shape
    _, pb_x = pnn.vjp(conv, x, w, b, wrt="x", **kwargs)
    only_x = pb_x(dy, out={"x": np.empty_like(x)})
    assert only_x.weight is None and only_x.bias is None
    np.testing.assert_array_equal(only_x.x, grads.x)


# --------------------------------------------------------------------------- finite differences


def _directional_check(geom, layout, act):
    rng = np.random.default_rng(21)
    x64, w64, b64 = _data(geom, rng)
    x = to_layout(x64, layout, True)
    kwargs = _conv_kwargs(geom, layout, act)
    y, pullback = pnn.vjp(conv, x, w64, b64, **kwargs)
    dy = rng.standard_normal(y.shape)
    g = pullback(dy)
    directional_check(
        lambda x, weight, bias: conv(x, weight, bias, **kwargs),
        {"x": x, "weight": w64, "bias": b64},
        {"x": g.x, "weight": g.weight, "bias": g.bias},
        dy,
        directions=3,
    )


@pytest.mark.parametrize(
    "geom_name, layout, act",
    [("2d-k3x2-s2-d2-g2-asym", "last", "gelu"), ("3d-k2x3x2-s2x1x2-d1x2x1-g2", "first", "silu")],
)
def test_directional_derivatives(geom_name, layout, act):
    _directional_check(GEOMS[geom_name], layout, act)


@pytest.mark.parametrize("mode, layout", [("reflect", "last"), ("replicate", "first"), ("circular", "last")])
def test_padding_mode_directional_derivatives(mode, layout):
    _directional_check(dict(MODE_GEOMS["3d-pad-to-the-limit"], padding_mode=mode), layout, "silu")


# --------------------------------------------------------------------------- implementation details


@pytest.mark.parametrize("layout", ["first", "last"])
@pytest.mark.parametrize("geom_name", ["2d-k3x2-s2-d2-g2-asym", "3d-depthwise-s2-p1"])
def test_functional_path_for_immutable_arrays(monkeypatch, layout, geom_name):
    """Arrays that cannot be written in place (JAX) take the concat/stack padding and
    scatter; they must agree with the in-place path."""
    geom = GEOMS[geom_name]
    rng = np.random.default_rng(3)
    x64, w64, b64 = _data(geom, rng)
    x = to_layout(x64, layout, True)
    kwargs = _conv_kwargs(geom, layout, "tanh")
    y, pullback = pnn.vjp(conv, x, w64, b64, **kwargs)
    dy = rng.standard_normal(y.shape)
    expected = pullback(dy)
    monkeypatch.setattr(ref_conv, "_writable", lambda a: False)
    y2, pullback2 = pnn.vjp(conv, x, w64, b64, **kwargs)
    got = pullback2(dy)
    assert_close(y2, y, 1e-14, "y")
    for name in ("x", "weight", "bias"):
        assert_close(getattr(got, name), getattr(expected, name), 1e-14, name)


def _residuals(*args, **kwargs):
    from portable_nn.api._common import spec_of

    _prepare_conv = spec_of("conv").prepare

    call = _prepare_conv(*args, **kwargs).call.replace(save=True)
    (y,), residuals = ref_conv.conv_forward(call)
    return y, residuals


@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh", "leaky_relu"])
def test_backward_keeps_only_the_output_when_it_suffices(act):
    rng = np.random.default_rng(4)
    x, w, b = _data(GEOMS["1d-k3-s2-p1-N1"], rng)
    y, residuals = _residuals(x, w, b, padding=1, stride=2, activation=act)
    kept = residuals[3]
    # the output itself (the same memory): no pre-activation, no extra buffer
    assert np.shares_memory(kept, y) and kept.size == y.size


def test_half_data_keeps_the_float32_output():
    rng = np.random.default_rng(4)
    x, w, b = _data(GEOMS["1d-k3-s2-p1-N1"], rng)
    y, residuals = _residuals(x.astype(np.float16), w.astype(np.float32), b.astype(np.float32),
                              padding=1, stride=2, activation="tanh")
    kept = residuals[3]
    assert kept.dtype == np.float32 and y.dtype == np.float16
    np.testing.assert_array_equal(kept.astype(np.float16), y)


@pytest.mark.parametrize("act, kept_kind", [("identity", None), ("gelu", "z"), (("leaky_relu", -0.3), "z")])
def test_backward_keeps_the_pre_activation_only_when_needed(act, kept_kind):
    rng = np.random.default_rng(4)
    x, w, b = _data(GEOMS["1d-k3-s2-p1-N1"], rng)
    _, residuals = _residuals(x, w, b, padding=1, stride=2, activation=act)
    kept = residuals[3]
    if kept_kind is None:
        assert kept is None
    else:
        z = conv(x, w, b, padding=1, stride=2)
        np.testing.assert_allclose(kept, z, rtol=1e-14, atol=1e-14)


# --------------------------------------------------------------------------- vjp plumbing


def test_vjp_wrt_out_buffers_and_repeated_pullbacks():
    geom = GEOMS["2d-k3x2-s2-d2-g2-asym"]
    rng = np.random.default_rng(6)
    x, w, b = _data(geom, rng)
    kwargs = _conv_kwargs(geom, "first", "gelu_tanh")
    y, pullback = pnn.vjp(conv, x, w, b, **kwargs)
    np.testing.assert_array_equal(conv(x, w, b, **kwargs), y)
    dy = rng.standard_normal(y.shape)
    grads = check_pullback_plumbing(pullback, dy, {"x": x, "weight": w, "bias": b})

    _, pb_params = pnn.vjp(conv, x, w, b, wrt=("weight", "bias"), **kwargs)
    params_only = pb_params(dy)
    assert params_only.x is None
    np.testing.assert_array_equal(params_only.weight, grads.weight)
    np.testing.assert_array_equal(params_only.bias, grads.bias)

    _, pb_bias = pnn.vjp(conv, x, w, b, wrt="bias", **kwargs)
    bias_only = pb_bias(dy)
    assert bias_only.x is None and bias_only.weight is None
    np.testing.assert_array_equal(bias_only.bias, grads.bias)

    _, pb_x = pnn.vjp(conv, x, w, None, wrt="x", **kwargs)
    only_x = pb_x(dy)
    assert only_x.weight is None and only_x.bias is None
    with pytest.raises(ValueError, match="wrt"):
        pnn.vjp(conv, x, w, wrt=("input",), **kwargs)


def test_torch_results_have_no_autograd_history():
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    y = conv(x, w, activation="relu")
    assert isinstance(y, torch.Tensor) and not y.requires_grad
    padded = conv(x, w, padding=1, padding_mode="reflect")  # the padding before dispatch records nothing either
    assert not padded.requires_grad


def test_unbatched_matches_batch_of_one():
    geom = GEOMS["3d-depthwise-s2-p1"]
    rng = np.random.default_rng(8)
    x, w, b = _data(geom, rng)
    for layout in ("first", "last"):
        kwargs = _conv_kwargs(geom, layout, "sigmoid")
        one = conv(to_layout(x[:1], layout, True), w, b, **kwargs)
        single = conv(to_layout(x[:1], layout, False), w, b, **kwargs)
        assert single.shape == one.shape[1:]
        np.testing.assert_array_equal(single, one[0])


# --------------------------------------------------------------------------- validation


_X = np.zeros((2, 4, 6, 5))
_W = np.zeros((6, 2, 3, 3))


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((_X, np.zeros((6, 4, 3))), {}, ValueError, "x must have 3 dimensions"),
        ((_X, np.zeros((6, 4))), {}, ValueError, "weight must be"),
        ((_X, np.zeros((6, 4, 1, 1, 1, 1))), {}, ValueError, "weight must be"),
        ((_X, np.zeros((6, 3, 3, 3))), {}, ValueError, r"groups \* weight.shape\[1\] = 1 \* 3 = 3"),
        ((_X, _W), {}, ValueError, "x has 4 channels"),
        ((_X, _W), {"groups": 3}, ValueError, "groups=3 does not divide"),
        ((_X, np.zeros((5, 2, 3, 3))), {"groups": 2}, ValueError, "5 output channels"),
        ((_X, np.zeros((6, 2, 0, 3))), {"groups": 2}, ValueError, "kernel sizes >= 1"),
        ((_X, _W, np.zeros(5)), {"groups": 2}, ValueError, r"bias must have shape \(6,\)"),
        ((_X, _W), {"groups": 0}, ValueError, "groups must be >= 1"),
        ((_X, _W), {"groups": 2, "stride": 0}, ValueError, "stride must be >= 1"),
        ((_X, _W), {"groups": 2, "stride": (1, -2)}, ValueError, "stride must be >= 1"),
        ((_X, _W), {"groups": 2, "stride": (1, 1, 1)}, ValueError, "stride must be an int or a tuple of 2"),
        ((_X, _W), {"groups": 2, "dilation": 0}, ValueError, "dilation must be >= 1"),
        ((_X, _W), {"groups": 2, "padding": -1}, ValueError, "padding must be >= 0"),
        ((_X, _W), {"groups": 2, "padding": (1, (0, -1))}, ValueError, "padding must be >= 0"),
        ((_X, _W), {"groups": 2, "padding": (1, 2, 3)}, ValueError, "tuple of 2 entries"),
        ((_X, _W), {"groups": 2, "padding": ((1, 2, 3), 1)}, ValueError, r"\(low, high\) pair"),
        ((_X, _W), {"groups": 2, "padding": "full"}, ValueError, "unknown padding mode 'full'"),
        ((_X, _W), {"groups": 2, "padding": "same", "stride": (1, 2)}, ValueError, "'same' needs stride=1"),
        ((_X, _W), {"groups": 2, "padding_mode": "mirror"}, ValueError,
         "padding_mode must be one of 'zeros', 'reflect'"),
        ((_X, _W), {"groups": 2, "padding_mode": 0}, TypeError, "padding_mode must be a string"),
        ((_X, _W), {"groups": 2, "padding": (1, (0, 5)), "padding_mode": "reflect"}, ValueError,
         r"padding_mode='reflect' needs padding smaller than .* got padding \(0, 5\) on spatial axis 1 of size 5"),
        ((_X, _W), {"groups": 2, "padding": (7, 0), "padding_mode": "circular"}, ValueError,
         r"padding_mode='circular' needs padding at most .* \(7, 7\) on spatial axis 0 of size 6"),
        ((np.zeros((1, 1, 2)), np.zeros((1, 1, 5))), {"padding": "same", "padding_mode": "reflect"}, ValueError,
         r"padding_mode='reflect' .* padding \(2, 2\) on spatial axis 0 of size 2"),
        ((np.zeros((1, 2, 0)), np.zeros((1, 2, 1))), {"padding": 1, "padding_mode": "replicate"}, ValueError,
         "padding_mode='replicate' needs a non-empty spatial axis"),
        ((_X, _W), {"groups": 2, "dilation": 3}, ValueError, "larger than x's padded size"),
        ((_X, np.zeros((6, 2, 7, 1))), {"groups": 2}, ValueError, r"kernel size 7 on spatial axis 0"),
        ((np.zeros((4, 3)), np.zeros((2, 4, 2))), {"padding": ((0, 1),), "dilation": 4}, ValueError,
         r"x's padded size there \(3 \+ padding 0 \+ 1 = 4;"),
        ((np.zeros((2, 4, 5)), np.zeros((2, 4, 2))), {"padding": (1, 2)}, ValueError, r"write \(\(low, high\),\)"),
        ((_X, _W), {"groups": 2, "channel_axis": 2}, ValueError, "channel_axis must be 1"),
        ((_X, _W), {"groups": 2, "channel_axis": 9}, ValueError, "channel_axis=9 is out of range"),
        ((_X, _W), {"groups": 2, "activation": "swish"}, ValueError, "unknown activation 'swish'"),
        ((_X, _W), {"groups": 2.0}, TypeError, "groups must be an int"),
        ((_X, _W), {"groups": 2, "stride": 1.5}, TypeError, "stride must be an int"),
        ((_X, _W), {"groups": 2, "padding": 1.0}, TypeError, "padding must be an int"),
        ((_X.astype(np.int64), _W), {"groups": 2}, TypeError, "x must have a floating dtype"),
        ((_X, _W.astype(np.float32)), {"groups": 2}, TypeError, "weight has dtype float32 but x has float64"),
        ((_X.astype(np.float16), _W.astype(np.float64)), {"groups": 2}, TypeError, "expected float16 or float32"),
        ((_X.astype(np.float16), _W.astype(np.float32), np.zeros(6, np.float16)), {"groups": 2}, TypeError,
         "unlike the other parameters"),
        ((_X.tolist(), _W), {"groups": 2}, TypeError, "x must be an array"),
        ((_X, None), {"groups": 2}, TypeError, "weight must be an array"),
        ((_X, _W, torch.zeros(6, dtype=torch.float64)), {"groups": 2}, TypeError, "different libraries"),
    ],
)
def test_bad_arguments(args, kwargs, exc, match):
    before = snapshot([a for a in args if not isinstance(a, list)])
    with pytest.raises(exc, match=match):
        conv(*args, **kwargs)
    assert unchanged([a for a in args if not isinstance(a, list)], before)


def test_mixed_precision_output_dtypes():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 4, 6, 5)).astype(np.float16)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    y, pullback = pnn.vjp(conv, x, w, b, groups=2, activation="silu")
    assert y.dtype == np.float16
    g = pullback(np.ones_like(y))
    assert (g.x.dtype, g.weight.dtype, g.bias.dtype) == (np.float16, np.float32, np.float32)
