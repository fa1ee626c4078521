"""Numba conv and dense kernels: serial and parallel paths, chunk boundaries, determinism, ``out=``
buffers, selection under ``auto``, what the forward keeps, and float64 agreement with the reference.

Agreement with PyTorch over the full argument grids runs in ``test_conv.py`` and ``test_dense.py``
(every registered backend is forced there); this file covers what is particular to the kernels."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import assert_matches, rel_err

pytest.importorskip("numba")

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

from kernels_cpu import _conv_direct as kdirect  # noqa: E402
from kernels_cpu import _conv_shifted as ks  # noqa: E402
from kernels_cpu import conv as kc  # noqa: E402  (imports numba)

#: Small geometries that reach every branch of the canonical form: 1-D/3-D, strides, dilation,
#: asymmetric padding, groups (depthwise with a multiplier), a 1x1 kernel, unbatched input.
GEOMS = {
    "2d-s2-d2-g2-pad": dict(x=(3, 4, 7, 6), w=(6, 2, 3, 2), stride=2, padding=(1, (0, 2)), dilation=2, groups=2),
    "2d-same-depthwise": dict(x=(2, 3, 5, 6), w=(6, 1, 3, 3), stride=1, padding="same", dilation=1, groups=3),
    "1d-k4-s3": dict(x=(3, 2, 11), w=(3, 2, 4), stride=3, padding=((2, 1),), dilation=1, groups=1),
    "3d-mixed": dict(x=(2, 2, 4, 5, 4), w=(4, 1, 2, 3, 2), stride=(1, 2, 1), padding=(1, 0, (0, 1)),
                     dilation=(2, 1, 1), groups=2),
    "2d-1x1-unbatched": dict(x=(3, 5, 4), w=(2, 3, 1, 1), stride=1, padding=0, dilation=1, groups=1),
    "lenet-like": dict(x=(5, 3, 9, 9), w=(4, 3, 5, 5), stride=1, padding=0, dilation=1, groups=1),
}

from .conv_dense_testing import _run, path  # noqa: E402, F401


def _conv_data(geom, layout, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(geom["x"])
    batched = len(geom["x"]) == len(geom["w"])
    if layout == "last":
        x = np.moveaxis(x, 1 if batched else 0, -1)
    w = rng.standard_normal(geom["w"]) / np.sqrt(np.prod(geom["w"][1:]))
    b = rng.standard_normal(geom["w"][0]) * 0.5
    kwargs = {k: geom[k] for k in ("stride", "padding", "dilation", "groups")}
    kwargs["channel_axis"] = -1 if layout == "last" else 1
    return [np.ascontiguousarray(a, dtype=dtype) for a in (x, w, b)], kwargs


@pytest.fixture(params=["im2col", "shifted", "direct"])
def method(request, monkeypatch):
    """The im2col kernels, the shifted products or the direct loops (stride 1, channels first; other
    calls fall through to im2col), whatever the geometry."""
    monkeypatch.setattr(kc, "_PLANS", {})  # plans are cached by geometry
    monkeypatch.setattr(ks, "SHIFTED_MIN_CHANNELS", 1 if request.param == "shifted" else 1 << 30)
    monkeypatch.setattr(ks, "SHIFTED_MAX_DROPPED", 1.0)
    monkeypatch.setattr(kdirect, "DIRECT_MAX_WIDTH", 1 << 30 if request.param == "direct" else 0)
    return request.param


@pytest.fixture(params=["one-line", "crossing", "default"])
def chunks(request, monkeypatch):
    """Chunk sizes: one output line / image per chunk, 3-line chunks crossing image boundaries, default.
    For the shifted products: one-row blocks (weight gradient: one tap per task), odd-sized blocks, default."""
    monkeypatch.setattr(kc, "_PLANS", {})  # plans are cached by geometry
    if request.param == "one-line":
        monkeypatch.setattr(kc, "CHUNK_ELEMENTS", 1)
        monkeypatch.setattr(ks, "BLOCK_ELEMENTS", 1)
        monkeypatch.setattr(ks, "WEIGHT_BLOCK_BYTES", 1)
        monkeypatch.setattr(ks, "WEIGHT_TASKS", 1000)
    elif request.param == "crossing":
        original = kc._Plan.__init__

        def three_lines(self, call, weight_shape):
            original(self, call, weight_shape)
            self.lines = 3
            self.images = 2

        monkeypatch.setattr(kc._Plan, "__init__", three_lines)
        monkeypatch.setattr(ks, "BLOCK_ELEMENTS", 7)
        monkeypatch.setattr(ks, "WEIGHT_BLOCK_BYTES", 700)
        monkeypatch.setattr(ks, "WEIGHT_PARTIAL_BYTES", 3000)
        monkeypatch.setattr(ks, "WEIGHT_TASKS", 5)
    return request.param


def test_auto_picks_numba_for_numpy_float32():
    (x, w, b), kwargs = _conv_data(GEOMS["2d-s2-d2-g2-pad"], "first", np.float32)
    assert pnn.explain(pnn.conv, x, w, b, **kwargs).backend == "numba"
    (x, w, b), kwargs = _conv_data(GEOMS["3d-mixed"], "last", np.float32)
    assert pnn.explain(pnn.conv, x, w, b, **kwargs).backend == "numba"


@pytest.mark.parametrize("layout", ["first", "last"])
@pytest.mark.parametrize("geom", list(GEOMS))
def test_conv_float64_matches_reference(geom, layout, path, chunks, method):
    args, kwargs = _conv_data(GEOMS[geom], layout, np.float64)
    kwargs["activation"] = "gelu" if layout == "first" else "relu"
    got = _run(pnn.conv, args, kwargs, "numba")
    expected = _run(pnn.conv, args, kwargs, "reference")
    for name, a, e in zip(("y", "dx", "dweight", "dbias"), got, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert rel_err(a, e) <= 1e-12, f"{name}: {rel_err(a, e):.2e}"


@pytest.mark.parametrize("act", ["identity", "relu", ("leaky_relu", 0.2), ("leaky_relu", -0.3), "sigmoid", "tanh",
                                 "silu", "gelu_tanh"])
def test_conv_every_activation_float32(act, path, method):
    """float32 against the float64 reference: each activation's epilogue and derivative branch."""
    args, kwargs = _conv_data(GEOMS["2d-s2-d2-g2-pad"], "last", np.float32)
    kwargs["activation"] = act
    got = _run(pnn.conv, args, kwargs, "numba")
    expected = _run(pnn.conv, [a.astype(np.float64) for a in args], kwargs, "reference")
    for name, a, e in zip(("y", "dx", "dweight", "dbias"), got, expected):
        assert a.dtype == np.float32
        assert rel_err(a, e) <= 1e-5, f"{name}: {rel_err(a, e):.2e}"


@pytest.mark.parametrize("wrt", [("weight",), ("x",), ("bias",), ("x", "bias")])
def test_conv_partial_gradients(wrt, method):
    args, kwargs = _conv_data(GEOMS["2d-same-depthwise"], "first", np.float64)
    kwargs["activation"] = "silu"
    got = _run(pnn.conv, args, kwargs, "numba", wrt=wrt)
    expected = _run(pnn.conv, args, kwargs, "reference")
    for name, a, e in zip(("y", "x", "weight", "bias"), got, expected):
        if name != "y" and name not in wrt:
            assert a is None
        else:
            assert rel_err(a, e) <= 1e-12, name


@pytest.mark.parametrize("layout", ["first", "last"])
def test_conv_serial_and_parallel_agree_bitwise(layout, method, monkeypatch):
    """Chunking depends on the shape only and partial sums are reduced in chunk order."""
    args, kwargs = _conv_data(GEOMS["lenet-like"], layout, np.float32)
    kwargs["activation"] = "relu"
    results = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(kc, "PARALLEL_MIN_MACS", threshold)
        results.append(_run(pnn.conv, args, kwargs, "numba"))
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_conv_bitwise_deterministic(path, method):
    args, kwargs = _conv_data(GEOMS["3d-mixed"], "first", np.float32)
    kwargs["activation"] = "gelu"
    first, second = (_run(pnn.conv, args, kwargs, "numba") for _ in range(2))
    for a, b in zip(first, second):
        assert np.array_equal(a, b)


def test_conv_out_buffers_written_in_place(path, method):
    args, kwargs = _conv_data(GEOMS["2d-s2-d2-g2-pad"], "last", np.float32)
    kwargs["activation"] = "tanh"
    expected = _run(pnn.conv, args, kwargs, "numba")
    x, w, b = args
    buffers = {"x": np.full_like(x, np.nan), "weight": np.full_like(w, np.nan), "bias": np.full_like(b, np.nan)}
    got = _run(pnn.conv, args, kwargs, "numba", out=buffers)
    for name, value, want in zip(("x", "weight", "bias"), got[1:], expected[1:]):
        assert value is buffers[name]
        assert np.array_equal(value, want)
    # A buffer the kernel cannot write directly (Fortran order) still receives the gradient.
    fortran = {"weight": np.asfortranarray(np.zeros_like(w))}
    got = _run(pnn.conv, args, kwargs, "numba", out=fortran)
    assert got[2] is fortran["weight"] and np.array_equal(got[2], expected[2])


def _unwrapped(residuals):
    """(the path's own residuals, what the backward reads act' from): an activation applied as a pass
    of its own (kc.Activated) wraps the identity convolution's residuals."""
    if isinstance(residuals, kc.Activated):
        return residuals.inner, residuals.kept
    kept = residuals.kept if hasattr(residuals, "kept") else residuals[2]
    return residuals, kept


def _check_kept(kept_array, kept, y):
    """What the backward reads act' from: nothing (identity), y itself, or a z of y's shape of its own."""
    if kept is None:
        assert kept_array is None
    elif kept == "y":
        assert kept_array is y
    else:
        assert kept_array.shape == y.shape and not np.shares_memory(kept_array, y)


@pytest.mark.parametrize("act, kept", [("identity", None), ("relu", "y"), ("tanh", "y"), ("gelu", "z")])
def test_conv_residuals_are_modest(act, kept):
    """No im2col buffer is kept: the (padded) input, the weight matrix and y or z only."""
    from portable_nn.api._common import spec_of

    _prepare_conv = spec_of("conv").prepare

    (x, w, b), kwargs = _conv_data(GEOMS["lenet-like"], "first", np.float32)
    call = _prepare_conv(x, w, b, activation=act, **kwargs).call.replace(save=True)
    (y,), residuals = kc.conv_forward(call)
    residuals, kept_array = _unwrapped(residuals)
    xp, w3, inner_kept, _, _ = residuals
    assert inner_kept is None or kept_array is inner_kept
    assert np.shares_memory(xp, x)  # no padding here: the input itself
    assert w3.size == w.size
    _check_kept(kept_array, kept, y)


def test_conv_lenet_first_layer_takes_the_direct_loops():
    """One input channel, stride 1, channels first: the direct path by default, float32 accurate."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
    w = (rng.standard_normal((6, 1, 5, 5)) / 5).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    call = _prepared(x, w, b, {"activation": "relu"}).replace(save=True)
    assert kdirect.applies(call, w.shape)
    assert isinstance(kc.conv_forward(call)[1], kdirect.Residuals)
    got = _run(pnn.conv, (x, w, b), {"activation": "relu"}, "numba")
    expected = _run(pnn.conv, [a.astype(np.float64) for a in (x, w, b)], {"activation": "relu"}, "reference")
    for name, a, e in zip(("y", "dx", "dweight", "dbias"), got, expected):
        assert rel_err(a, e) <= 1e-5, f"{name}: {rel_err(a, e):.2e}"


@pytest.mark.parametrize("act, kept", [("identity", None), ("relu", "y"), ("gelu", "z")])
def test_conv_shifted_residuals(act, kept):
    """The shifted products keep their phase buffer (about x's size), the tap weights and y or z."""
    from portable_nn.api._common import spec_of

    _prepare_conv = spec_of("conv").prepare

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 48, 24, 24)).astype(np.float32)  # 16 channels per group, 7.6% dropped
    w = rng.standard_normal((6, 16, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    kwargs = {"padding": "same", "groups": 3}
    call = _prepare_conv(x, w, b, activation=act, **kwargs).call.replace(save=True)
    (y,), residuals = kc.conv_forward(call)
    residuals, kept_array = _unwrapped(residuals)
    assert isinstance(residuals, ks.Residuals)
    assert residuals.xs.size <= 1.3 * x.size and residuals.wk.size == w.size
    _check_kept(kept_array, kept, y)


def test_conv_resnet_layer_float32_matches_reference():
    """A ResNet-like 3x3 layer (the shifted path by default), stride 1 and 2, both layouts, float32."""
    rng = np.random.default_rng(0)
    for stride, last in ((1, False), (2, True)):
        x = rng.standard_normal((2, 32, 28, 28)).astype(np.float32)
        w = (rng.standard_normal((24, 32, 3, 3)) / 17).astype(np.float32)
        b = rng.standard_normal(24).astype(np.float32)
        if last:
            x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        kwargs = {"stride": stride, "padding": 1, "activation": "relu", "channel_axis": -1 if last else 1}
        assert ks.applies(_prepared(x, w, b, kwargs), w.shape)
        got = _run(pnn.conv, (x, w, b), kwargs, "numba")
        expected = _run(pnn.conv, [a.astype(np.float64) for a in (x, w, b)], kwargs, "reference")
        for name, a, e in zip(("y", "dx", "dweight", "dbias"), got, expected):
            assert rel_err(a, e) <= 1e-5, f"{name}: {rel_err(a, e):.2e}"


def _prepared(x, w, b, kwargs):
    from portable_nn.api._common import spec_of

    _prepare_conv = spec_of("conv").prepare

    return _prepare_conv(x, w, b, **kwargs).call


@pytest.mark.parametrize("x_shape, w_shape", [((2, 3, 0), (4, 3, 3)), ((2, 3, 5), (0, 3, 2)), ((2, 0, 5), (4, 0, 2))],
                         ids=["no-input-positions", "no-output-channels", "no-input-channels"])
def test_conv_empty_extents(x_shape, w_shape):
    x = np.zeros(x_shape, np.float64)
    w = np.random.default_rng(0).standard_normal(w_shape)
    b = np.arange(float(w_shape[0]))
    kwargs = {"padding": 2, "activation": "sigmoid"}
    got = _run(pnn.conv, (x, w, b), kwargs, "numba")
    expected = _run(pnn.conv, (x, w, b), kwargs, "reference")
    for a, e in zip(got, expected):
        assert a.shape == e.shape
        assert rel_err(a, e) <= 1e-12


def test_conv_strided_input_is_copied_and_correct(method):
    (x, w, b), kwargs = _conv_data(GEOMS["2d-s2-d2-g2-pad"], "first", np.float64)
    strided = np.repeat(x, 2, axis=-1)[..., ::2]
    assert pnn.explain(pnn.conv, strided, w, b, **kwargs).copies == ["x"]
    got = _run(pnn.conv, (strided, w, b), kwargs, "numba")
    expected = _run(pnn.conv, (x, w, b), kwargs, "reference")
    for a, e in zip(got, expected):
        assert rel_err(a, e) <= 1e-12


def test_backward_takes_a_read_only_cotangent():
    """JAX and frozen arrays hand over read-only buffers; the kernel must not need to write them."""
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 4, 5, 5)), rng.standard_normal((6, 2, 3, 3)), rng.standard_normal(6)
    kwargs = dict(stride=(2, 1), padding=1, groups=2, activation="tanh")
    with pnn.use_backend("numba"):
        y, pullback = pnn.vjp(pnn.conv, x, w, b, **kwargs)
        dy = rng.standard_normal(y.shape)
        expected = pullback(dy.copy())
        dy.flags.writeable = False
        got = pullback(dy)
    for name in ("x", "weight", "bias"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))



@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (the reference's NumPy: inf − inf)
def test_infinite_entries_give_the_reference_s_values(method, request):
    """±inf in x or in the weight: NaN exactly where the reference (and IEEE arithmetic over the real
    taps) has it, ±inf and finite values equal.  An infinite entry that only the padded grid's
    dropped columns reach (x's last column for the first tap) must not turn into 0 · inf = NaN."""
    if method == "shifted":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "known: the shifted products run over the dropped rows too (G = 0 there), so an infinite x "
            "gives NaN in 24 dW entries and an infinite weight NaN in 80 dx entries where the reference "
            "has none; the direct loops and im2col sum only real taps")))
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    x[0, 1, 2, 5] = np.inf
    w[0, 0, 0, 0], w[3, 2, 2, 2] = np.inf, -np.inf
    finite_x, finite_w = rng.standard_normal(x.shape), rng.standard_normal(w.shape)
    for args in ((x, finite_w, b), (finite_x, w, b), (x, w, b)):
        got = _run(pnn.conv, args, {}, "numba")
        expected = _run(pnn.conv, args, {}, "reference")
        for name, a, e in zip(("y", "dx", "dweight", "dbias"), got, expected, strict=True):
            assert_matches(a, e, 1e-12, name)
