"""float16/bfloat16 on the numba kernels: the conversions, the norms' every path, the widened families.

Every result is compared with the float64 reference on the very values the half-precision inputs hold
(norm-wise relative error): float16 within 4e-4, bfloat16 within 3e-3, and — so that a conversion
that truncated instead of rounding would be caught — within 1.25 times the error of the float64
result rounded correctly to the same type.  float32 gradients of mixed-precision parameters are
float32-accurate.  NumPy float16, ml_dtypes bfloat16 (as JAX gives) and CPU torch float16/bfloat16
tensors (zero-copy) all run the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_TORCH, norm_arguments

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")
ml_dtypes = pytest.importorskip("ml_dtypes")

from kernels_cpu import _half, norm  # noqa: E402

HALF = ("float16", "bfloat16")
#: Norm-wise relative error allowed against the float64 oracle.
TOL = {"float16": 4e-4, "bfloat16": 3e-3}
NUMPY_TYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _rounded(a, dtype):
    return np.asarray(a, np.float64).astype(NUMPY_TYPES[dtype]).astype(np.float64)


def _rel(a, ref):
    scale = np.linalg.norm(ref)
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / (scale if scale else 1.0))


def _as64(a):
    if type(a).__module__.startswith("torch"):
        import torch

        return a.detach().to(torch.float64).numpy()
    return np.asarray(a, np.float64) if a.dtype != np.uint16 else a.astype(np.float64)


def assert_half_close(got, ref, dtype, what):
    """``got`` (half) against the float64 ``ref``: within TOL, and within 1.25x the error of ``ref``
    correctly rounded to ``dtype`` (the best a half-precision result can do)."""
    err = _rel(_as64(got), ref)
    floor = _rel(_rounded(ref, dtype), ref)
    assert err <= TOL[dtype], f"{what}: error {err:.2e} > {TOL[dtype]:.0e}"
    assert err <= 1.25 * floor + 1e-7, f"{what}: error {err:.2e} vs {floor:.2e} for correct rounding"


# --------------------------------------------------------------------------- conversions


@pytest.mark.parametrize("dtype", HALF)
def test_widening_is_exact_for_every_bit_pattern(dtype):
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = _half.widen(bits, _half.kind(dtype))
    expected = bits.view(NUMPY_TYPES[dtype]).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


def _narrowing_inputs():
    """Random float32 bit patterns (every exponent, NaNs and infinities included), every half value of
    either type, the midpoints between neighbours (ties: round to even) and their float32 neighbours,
    the overflow thresholds and subnormal ties."""
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = [random]
    bits = np.arange(1 << 16, dtype=np.uint16)
    for npt, exponent in ((np.float16, 0x7C00), (ml_dtypes.bfloat16, 0x7F80)):
        every = bits[(bits & exponent) != exponent].view(npt).astype(np.float64)  # the finite values
        every.sort()
        mid = ((every[1:] + every[:-1]) / 2).astype(np.float32)
        values += [every.astype(np.float32), mid, np.nextafter(mid, np.float32(np.inf)),
                   np.nextafter(mid, np.float32(-np.inf))]
    values.append(np.array([65504, 65519.996, 65520, 3.4e38, -65520, 2.0**-25, 3 * 2.0**-25, 2.0**-26, 0.0, -0.0,
                            np.inf, -np.inf], np.float32))
    return np.concatenate(values)


@pytest.mark.parametrize("dtype", HALF)
def test_narrowing_rounds_to_nearest_even_as_numpy_and_ml_dtypes(dtype):
    v = _narrowing_inputs()
    got = _half.narrow(v, _half.kind(dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        expected = v.astype(NUMPY_TYPES[dtype]).view(np.uint16)
    nan = np.isnan(v)
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.isnan(got[nan].view(NUMPY_TYPES[dtype]).astype(np.float32)).all()  # NaN stays NaN


def test_float16_integer_fallback_matches_the_instructions():
    """The conversions used where the CPU has no F16C give the same bits (NaN payloads included)."""
    from numba import njit

    @njit
    def soft(bits, values, widened, narrowed):
        for i in range(bits.shape[0]):
            widened[i] = _half.f16_to_f32_soft(bits[i])
        for i in range(values.shape[0]):
            narrowed[i] = _half.f32_to_f16_soft(values[i])

    bits = np.arange(1 << 16, dtype=np.uint16)
    values = _narrowing_inputs()
    widened, narrowed = np.empty(bits.size, np.float32), np.empty(values.size, np.uint16)
    soft(bits, values, widened, narrowed)
    hard = _half.widen(bits, _half.FLOAT16)
    assert np.array_equal(widened.view(np.uint32), hard.view(np.uint32))
    assert np.array_equal(narrowed, _half.narrow(values, _half.FLOAT16))


# --------------------------------------------------------------------------- the norms


def _norm_problem(op, shape, channel_axis, dtype, mixed, seed=0):
    """(args, kwargs, dy, float64 versions of them) for a norm call with half data."""
    rng = np.random.default_rng(seed)
    npt = NUMPY_TYPES[dtype]
    x = (rng.standard_normal(shape) * 2.0 + 3.0).astype(npt)
    dy = rng.standard_normal(shape).astype(npt)
    c = shape[-1] if op in ("layer_norm", "rms_norm") else shape[channel_axis]
    pdt = np.float32 if mixed else npt
    w = (rng.standard_normal(c) + 1.0).astype(pdt)
    b = rng.standard_normal(c).astype(pdt)
    return x, dy, w, b


def _norm_call(op, x, w, b, channel_axis, activation, training=True):
    args, kwargs = norm_arguments(op, x, w, b, 2)
    if op in ("batch_norm", "group_norm", "instance_norm"):
        kwargs["channel_axis"] = channel_axis
    if op != "rms_norm":
        kwargs["activation"] = activation
    if op == "batch_norm" and not training:
        c = x.shape[channel_axis]
        kwargs.update(running_mean=np.linspace(2.5, 3.5, c).astype(w.dtype),
                      running_var=np.linspace(3.0, 5.0, c).astype(w.dtype), training=False)
    return args, kwargs


def _vjp(op, args, kwargs, dy, backend):
    with pnn.use_backend(backend):
        y, pullback = pnn.vjp(op, *args, **kwargs)
        return (y, *pullback(dy))


def _check_norm(op, shape, channel_axis, dtype, mixed, activation="identity", training=True):
    x, dy, w, b = _norm_problem(op, shape, channel_axis, dtype, mixed)
    args, kwargs = _norm_call(op, x, w, b, channel_axis, activation, training)
    got = _vjp(op, args, kwargs, dy, "numba")
    to64 = lambda a: a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype != np.int64 else a  # noqa: E731
    ref = _vjp(op, tuple(to64(a) for a in args), {k: to64(v) for k, v in kwargs.items()}, dy.astype(np.float64),
               "reference")
    names = ("y", "dx", "dweight", "dbias")
    for name, g, r, like in zip(names, got, ref, (x, x, w, b)):
        assert g.dtype == like.dtype, f"{name}: dtype {g.dtype}, expected {like.dtype}"
        if like.dtype == np.float32:
            assert _rel(g, r) <= 1e-5, f"{name}: float32 gradient error {_rel(g, r):.2e}"
        else:
            assert_half_close(g, r, dtype, name)


#: (op, shape, channel_axis): every path of the kernels — rows (layer/rms norm, group and instance
#: norm over large planes), segments (batch norm, channels first), columns (channels last, small planes).
NORM_PATHS = [
    ("layer_norm", (24, 300), 1),
    ("rms_norm", (24, 300), 1),
    ("batch_norm", (6, 5, 9, 7), 1),
    ("batch_norm", (6, 9, 7, 5), -1),
    ("batch_norm", (16, 5), 1),
    ("group_norm", (3, 4, 40), 1),
    ("group_norm", (3, 40, 4), -1),
    ("instance_norm", (3, 4, 40), 1),
    ("instance_norm", (3, 6, 7, 4), -1),
]


@pytest.mark.parametrize("mixed", [True, False], ids=["float32-params", "half-params"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op, shape, channel_axis", NORM_PATHS)
def test_norms_forward_and_backward_match_the_float64_oracle(op, shape, channel_axis, dtype, mixed):
    _check_norm(op, shape, channel_axis, dtype, mixed)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "silu"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op, shape, channel_axis",
                         [("layer_norm", (24, 300), 1), ("batch_norm", (6, 5, 9, 7), 1),
                          ("batch_norm", (6, 9, 7, 5), -1)])
def test_fused_activations_round_once(op, shape, channel_axis, dtype, activation):
    """The activation runs in float32 before the one rounding of y (rounding twice would err more)."""
    _check_norm(op, shape, channel_axis, dtype, True, activation)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("channel_axis", [1, -1], ids=["channels_first", "channels_last"])
def test_inference_with_running_statistics(dtype, channel_axis):
    shape = (6, 5, 9, 7) if channel_axis == 1 else (6, 9, 7, 5)
    _check_norm("batch_norm", shape, channel_axis, dtype, False, "relu", training=False)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", ["serial", "parallel", "pipelined"])
def test_threads_and_pipelining_agree_bitwise(dtype, mode, monkeypatch):
    """The half kernels keep the float kernels' guarantee: the same bits on every path."""
    x, dy, w, b = _norm_problem("layer_norm", (64, 700), 1, dtype, True)
    results = {}
    for label, parallel, pipeline in (("serial", 1 << 62, 1 << 62), (mode, 0 if mode != "serial" else 1 << 62,
                                                                      -1 if mode == "pipelined" else 1 << 62)):
        monkeypatch.setattr(norm, "PARALLEL_MIN_ELEMENTS", parallel)
        monkeypatch.setattr(norm, "PIPELINE_MIN_BYTES", pipeline)
        results[label] = _vjp("layer_norm", (x, w, b), {}, dy, "numba")
    for a, c in zip(results["serial"], results[mode]):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(c).view(np.uint8))


def test_half_norms_run_on_numba_and_moments_still_declines():
    x16 = np.ones((4, 6), np.float16)
    for op, args in (("layer_norm", (x16,)), ("rms_norm", (x16,)), ("batch_norm", (x16,)),
                     ("group_norm", (x16, 2)), ("instance_norm", (x16.reshape(2, 2, 6),))):
        report = pnn.explain(op, *args)
        assert report.backend == "numba" and not report.copies, str(report)
    report = pnn.explain(pnn.moments, x16, 0)
    assert report.backend == "reference" and any(b == "numba" and "float16" in why for b, why in report.passed_over)


@pytest.mark.parametrize("dtype", HALF)
def test_numpy_half_arrays_come_back_in_their_dtype(dtype):
    x = np.linspace(-2, 2, 24).reshape(4, 6).astype(NUMPY_TYPES[dtype])
    with pnn.use_backend("numba"):
        y = pnn.layer_norm(x)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("dtype", HALF)
def test_torch_half_tensors_run_the_kernels_zero_copy(dtype):
    """bfloat16 tensors reach the kernels as their uint16 bits (NumPy has no bfloat16), float16 ones as
    NumPy float16 views; results and gradients come back as tensors of the argument's dtype, running
    statistics (float32) are updated in place."""
    import torch
    import torch.nn.functional as F

    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 4, 6, 5, generator=g) * 2 + 3).to(tdt)
    w, b = torch.randn(4, generator=g) + 1, torch.randn(4, generator=g)
    rm, rv = torch.zeros(4), torch.ones(4)
    assert pnn.explain(pnn.batch_norm, x, weight=w, bias=b, running_mean=rm, running_var=rv).backend == "numba"
    with pnn.use_backend("numba"):
        y, pullback = pnn.vjp(pnn.batch_norm, x, weight=w, bias=b, running_mean=rm, running_var=rv)
        dy = torch.randn(x.shape, generator=g).to(tdt)
        grads = pullback(dy)
    assert isinstance(y, torch.Tensor) and y.dtype == tdt and grads.x.dtype == tdt
    assert grads.weight.dtype == grads.bias.dtype == torch.float32
    xd = x.double().requires_grad_(True)
    wd, bd = w.double().requires_grad_(True), b.double().requires_grad_(True)
    rm_ref, rv_ref = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    yd = F.batch_norm(xd, rm_ref, rv_ref, wd, bd, training=True)
    yd.backward(dy.double())
    assert_half_close(y, yd.detach().numpy(), dtype, "y")
    assert_half_close(grads.x, xd.grad.numpy(), dtype, "dx")
    assert _rel(grads.weight.double().numpy(), wd.grad.numpy()) <= 1e-5
    np.testing.assert_allclose(rm.double().numpy(), rm_ref.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rv.double().numpy(), rv_ref.numpy(), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- the widened families


def _widened_problem(op, dtype, rng):
    npt = NUMPY_TYPES[dtype]
    h = lambda *s: rng.standard_normal(s).astype(npt)  # noqa: E731
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    if op == "conv":
        return (h(2, 3, 9, 9), f(4, 3, 3, 3), f(4)), {"padding": 1}
    if op == "dense":
        return (h(5, 7), f(3, 7), f(3)), {}
    if op == "max_pool":
        return (h(2, 3, 8, 8), 2), {}
    if op == "avg_pool":
        return (h(2, 3, 8, 8), 3), {"stride": 2, "padding": 1}
    if op == "log_softmax":
        return (h(4, 10),), {}
    if op == "cross_entropy":
        return (h(6, 10), np.array([1, 2, 3, 4, 0, 9])), {}
    return (h(4, 5), h(4, 6), h(4, 6), f(24, 5), f(24, 6), f(24), f(24)), {}  # lstm_cell


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", ["conv", "dense", "max_pool", "avg_pool", "log_softmax", "cross_entropy",
                                "lstm_cell"])
def test_widened_families_match_the_float64_oracle(op, dtype):
    """Convolution, dense, pooling, the losses and the recurrences widen half data to float32 on entry
    and round each result once: outputs and half gradients at the rounding floor, float32 gradients
    float32-accurate."""
    rng = np.random.default_rng(1)
    args, kwargs = _widened_problem(op, dtype, rng)
    assert pnn.explain(op, *args, **kwargs).backend == "numba"
    with pnn.use_backend("numba"):
        y, pullback = pnn.vjp(op, *args, **kwargs)
    outputs = y if isinstance(y, tuple) else (y,)
    cts = tuple(rng.standard_normal(o.shape).astype(o.dtype) for o in outputs)
    with pnn.use_backend("numba"):
        grads = pullback(cts if isinstance(y, tuple) else cts[0])
    to64 = lambda a: a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind != "i" else a  # noqa: E731
    with pnn.use_backend("reference"):
        y64, pullback64 = pnn.vjp(op, *(to64(a) for a in args), **kwargs)
        outputs64 = y64 if isinstance(y64, tuple) else (y64,)
        grads64 = pullback64(tuple(c.astype(np.float64) for c in cts) if isinstance(y, tuple) else
                             cts[0].astype(np.float64))
    for i, (o, r) in enumerate(zip(outputs, outputs64)):
        assert o.dtype == args[0].dtype
        assert_half_close(o, r, dtype, f"output {i}")
    for name in grads._fields:
        g, r = getattr(grads, name), getattr(grads64, name)
        if g.dtype == np.float32:
            assert _rel(g, r) <= 1e-5, f"d{name}: float32 gradient error {_rel(g, r):.2e}"
        else:
            assert g.dtype == args[0].dtype, f"d{name}: dtype {g.dtype}"
            assert_half_close(g, r, dtype, f"d{name}")
