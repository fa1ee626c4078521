"""kernels_cpu._vmath (vectorisable exp, erf, Φ, tanh, σ) and the row activations built on it.

Errors are in units in the last place of the correctly rounded value, against mpmath (40 digits);
the bounds are the measured maxima (see _vmath's docstring) with a little room."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import portable_nn as pnn

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")
mp = pytest.importorskip("mpmath")

from numba import njit  # noqa: E402

from kernels_cpu import _vmath as vm  # noqa: E402
from kernels_cpu import activations as acts  # noqa: E402
from portable_nn.kernel_codes import ACTIVATION_CODES  # noqa: E402

# name: (the compiled function's stub, mpmath reference, (float32, float64) bound in ulp)
FUNCTIONS = {
    "exp": (vm.exp, mp.exp, (2, 2)),
    "erf": (vm.erf, mp.erf, (3, 4)),
    "ndtr": (vm.ndtr, mp.ncdf, (6, 6)),
    "tanh": (vm.tanh, mp.tanh, (2, 3)),
    "sigmoid": (vm.sigmoid, lambda x: 1 / (1 + mp.exp(-x)), (3, 4)),
}


def _row(fn):
    @njit(error_model="numpy", fastmath={"contract"})
    def row(x, y):
        for i in range(x.shape[0]):
            y[i] = fn(x[i])

    return row


_ROWS = {name: _row(f[0]) for name, f in FUNCTIONS.items()}


def _grid(name, dtype):
    """A dense grid over the function's interesting range, both tails, tiny arguments and random points."""
    lo, hi = (-87.0, 88.0) if dtype == np.float32 else (-708.0, 709.0)  # exp: flushed to 0 / ∞ beyond
    if name != "exp":
        hi = 14.0 if dtype == np.float32 else 40.0
        lo = -hi
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(lo, hi, 4001), np.linspace(-1.5, 1.5, 1201), rng.standard_normal(1500) * 4,
                        np.logspace(-30, 0.5, 200), -np.logspace(-30, 0.5, 200)])
    return x.astype(dtype)


def _ulp_errors(got, x, ref, dtype):
    mp.mp.dps = 40
    tiny = float(np.finfo(dtype).tiny)
    out = []
    for xi, gi in zip(x, got):
        r = ref(mp.mpf(float(xi)))
        rf = float(r)
        if abs(rf) < tiny:  # flushed to zero below the normal range (documented)
            out.append(0.0 if abs(float(gi)) <= tiny else np.inf)
            continue
        out.append(abs(float(gi) - rf) / float(np.spacing(dtype(abs(rf)))))
    return np.array(out)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_functions_are_within_a_few_ulp_of_the_exact_value(name, dtype):
    _, ref, bounds = FUNCTIONS[name]
    x = _grid(name, dtype)
    y = np.empty_like(x)
    _ROWS[name](x, y)
    assert y.dtype == dtype
    err = _ulp_errors(y, x, ref, dtype)
    bound = bounds[0] if dtype == np.float32 else bounds[1]
    worst = int(np.argmax(err))
    assert err[worst] <= bound, f"{name}({x[worst]!r}) = {y[worst]!r}: {err[worst]:.2f} ulp > {bound}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_special_values_are_those_of_libm(dtype):
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype)
    for name, libm in (("exp", math.exp), ("erf", math.erf), ("tanh", math.tanh),
                       ("ndtr", lambda v: 0.5 * math.erfc(-v / math.sqrt(2.0))),
                       ("sigmoid", lambda v: 0.0 if v < -700 else 1.0 / (1.0 + math.exp(-v)))):
        y = np.empty_like(special)
        _ROWS[name](special, y)
        expected = np.array([libm(float(v)) for v in special], dtype)
        np.testing.assert_array_equal(y, expected, err_msg=name)
        assert np.array_equal(np.signbit(y[3:]), np.signbit(expected[3:])), name  # signed zeros


# --------------------------------------------------------------------------- rows


@njit
def _libm_rows(z, y, g, code, slope):
    for i in range(z.shape[0]):
        y[i] = acts.act(np.float64(z[i]), code, slope)
        g[i] = acts.act_grad(np.float64(z[i]), code, slope)


def _accurate(name, z):
    """act and act' in float64 without the cancellations of the libm formulas (scipy.special)."""
    special = pytest.importorskip("scipy.special")
    expit, ndtr = special.expit, special.ndtr
    if name == "sigmoid":
        return expit(z), expit(z) * expit(-z)
    if name == "tanh":
        return np.tanh(z), 1.0 / np.cosh(z) ** 2
    if name == "gelu":
        return z * ndtr(z), ndtr(z) + z * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    if name == "gelu_tanh":
        k, c = math.sqrt(2 / math.pi), 0.044715
        v = 2 * k * (z + c * z ** 3)
        return z * expit(v), expit(v) + z * expit(v) * expit(-v) * 2 * k * (1 + 3 * c * z * z)
    if name == "silu":
        return z * expit(z), expit(z) + z * expit(z) * expit(-z)
    if name in ("hardswish", "hardsigmoid", "relu6"):
        inner = np.clip(z + (0.0 if name == "relu6" else 3.0), 0.0, 6.0)
        if name == "relu6":
            return inner, np.where((z > 0) & (z < 6), 1.0, 0.0)
        if name == "hardsigmoid":
            return inner / 6, np.where((z > -3) & (z < 3), 1 / 6, 0.0)
        return z * inner / 6, np.where(z <= -3, 0.0, np.where(z < 3, z / 3 + 0.5, 1.0))
    if name == "mish":
        softplus = np.logaddexp(0.0, z)
        with np.errstate(over="ignore"):
            return z * np.tanh(softplus), np.tanh(softplus) + z * expit(z) / np.cosh(softplus) ** 2
    if name == "elu":
        return np.where(z > 0, z, np.expm1(np.minimum(z, 0.0))), np.where(z > 0, 1.0, np.exp(np.minimum(z, 0.0)))
    slope = 0.01 if name == "leaky_relu" else 0.0
    return np.where(z > 0, z, slope * z), np.where(z > 0, 1.0, slope)


ROW_ACTIVATIONS = ["sigmoid", "tanh", "gelu", "gelu_tanh", "silu", "relu", "leaky_relu", "hardswish", "hardsigmoid",
                   "relu6", "mish", "elu"]
#: The parameter the row tests pass: leaky_relu's slope, elu's alpha (ignored by the others).
_PARAM = {"elu": 1.0}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", ROW_ACTIVATIONS)
def test_rows_match_float64_activations(name, dtype):
    """act_row and act_grad_row: within a few ulp of the value (plus a few ulp of the terms' scale,
    1, where act' is a difference: silu' and gelu' cross zero), on a dense grid with both tails."""
    rng = np.random.default_rng(1)
    z = np.concatenate([np.linspace(-40, 40, 40001), rng.standard_normal(20000) * 3]).astype(dtype)
    code = ACTIVATION_CODES[name]
    param = _PARAM.get(name, 0.01)
    y = z.copy()
    acts.act_row(y, code, param)
    g = np.ones_like(z)
    acts.act_grad_row(z, g, code, param)
    ry, rg = _accurate(name, z.astype(np.float64))
    eps = float(np.finfo(dtype).eps)
    for what, got, ref in (("act", y, ry), ("act'", g, rg)):
        err = np.abs(got.astype(np.float64) - ref)
        bound = 8 * eps * np.abs(ref) + 4 * eps + 8 * float(np.finfo(dtype).tiny)
        worst = int(np.argmax(err / bound))
        assert err[worst] <= bound[worst], f"{name} {what}({z[worst]!r}) = {got[worst]!r}, expected {ref[worst]!r}"
    # the libm path (float64) agrees to its own accuracy
    ly, lg = np.empty(z.size), np.empty(z.size)
    _libm_rows(z, ly, lg, code, param)
    scale = max(1.0, float(np.max(np.abs(ly))))
    assert np.max(np.abs(y - ly)) <= 1e-6 * scale if dtype == np.float32 else 1e-14 * scale


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "relu", "leaky_relu"])
def test_grad_from_output_rows(name):
    z = np.linspace(-8, 8, 1001)
    code = ACTIVATION_CODES[name]
    y = z.copy()
    acts.act_row(y, code, 0.01)
    g = np.full_like(z, 2.0)
    acts.act_grad_from_output_row(y, g, code, 0.01)
    _, rg = _accurate(name, z)
    np.testing.assert_allclose(g, 2.0 * rg, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "gelu", "gelu_tanh", "silu", "hardswish", "hardsigmoid", "relu6",
                                  "mish", "elu"])
def test_row_special_values_are_those_of_the_scalar_functions(name):
    """NaN propagates; ±∞ as act/act_grad give them (silu(−∞) and gelu(−∞) are NaN there, as in PyTorch)."""
    code = ACTIVATION_CODES[name]
    for dtype in (np.float32, np.float64):
        kinks = [-3.0, 3.0, 6.0] if name in ("hardswish", "hardsigmoid", "relu6") else []
        z = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, *kinks], dtype)
        param = _PARAM.get(name, 0.0)
        y = z.copy()
        acts.act_row(y, code, param)
        g = np.ones_like(z)
        acts.act_grad_row(z, g, code, param)
        ey = np.array([acts.act(float(v), code, param) for v in z], dtype)
        eg = np.array([acts.act_grad(float(v), code, param) for v in z], dtype)
        np.testing.assert_array_equal(y, ey, err_msg=f"{name} {dtype}")
        np.testing.assert_array_equal(g, eg, err_msg=f"{name}' {dtype}")
        assert np.array_equal(np.signbit(y[3:]), np.signbit(ey[3:])), name


def test_rows_are_vectorised_without_libm_calls():
    """The point of the module: the row loops call no libm function and use 8-lane float32 vectors."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    options = {"error_model": "numpy", "fastmath": {"contract"}}  # a fresh compilation: cached code has no IR
    for fn, args in ((njit(**options)(acts.act_row.py_func), (np.zeros(8, np.float32), 4, 0.0)),
                     (njit(**options)(acts.act_grad_row.py_func),
                      (np.zeros(8, np.float32), np.zeros(8, np.float32), 4, 0.0))):
        fn(*args)
        for sig, ir in fn.inspect_llvm().items():
            if "float32" not in str(sig):
                continue
            calls = set(re.findall(r"call [^@]*@([\w.]+)", ir))
            libm = {"exp", "expf", "erf", "erff", "erfc", "erfcf", "tanh", "tanhf", "expm1", "expm1f"}
            assert not calls & libm, calls
            if features.get("avx2"):
                assert "<8 x float>" in ir
