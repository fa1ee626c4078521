"""Scalar activations for Numba kernels, selected by a runtime code.

Codes are the names of :mod:`portable_nn.kernel_codes` (identity 0,
relu 1, sigmoid 2, tanh 3, gelu 4, gelu_tanh 5, silu 6, leaky_relu 7), so one
compiled kernel serves every activation.  Functions are inlined into callers.
"""

from __future__ import annotations

import math

from numba import njit

from portable_nn.kernel_codes import GELU, GELU_TANH, IDENTITY, LEAKY_RELU, RELU, SIGMOID, SILU, TANH

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


@njit(inline="always", error_model="numpy", cache=True)
def sigmoid(z):
    if z >= 0.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


# ``act`` and ``act_grad`` are compiled once and called, not inlined at the Numba level: the norm
# kernels reach them from five loops (row and segment sums, parameters, dx), and inlining the eight
# branches at each made the first compilation twice as long (the README's layer_norm forward and
# gradient, empty cache: 16.3 s inlined, 7.7 s called; the loops of the common identity and
# rectifier cases do not call them, so their speed is unchanged: (4096, 1024) float32 backward
# 1.6 ms either way; gelu, the case that calls them, 100 ms either way).
@njit(error_model="numpy", cache=True)
def act(z, code, slope):
    """act(z) for the activation ``code``."""
    if code == IDENTITY:
        return z
    if code == RELU:
        return z if not (z <= 0.0) else 0.0  # +0.0 like PyTorch; NaN propagates
    if code == SIGMOID:
        return sigmoid(z)
    if code == TANH:
        return math.tanh(z)
    if code == GELU:
        return 0.5 * z * (1.0 + math.erf(z * _INV_SQRT_2))
    if code == GELU_TANH:
        return 0.5 * z * (1.0 + math.tanh(_K * (z + _C * z * z * z)))
    if code == SILU:
        return z * sigmoid(z)
    return z if z > 0.0 else slope * z


@njit(error_model="numpy", cache=True)
def act_grad(z, code, slope):
    """act'(z), with PyTorch's values at kinks (relu'(0) = 0, leaky_relu'(0) = slope)."""
    if code == IDENTITY:
        return 1.0
    if code == RELU:
        return 1.0 if z > 0.0 else 0.0
    if code == SIGMOID:
        s = sigmoid(z)
        return s * (1.0 - s)
    if code == TANH:
        t = math.tanh(z)
        return 1.0 - t * t
    if code == GELU:
        return 0.5 * (1.0 + math.erf(z * _INV_SQRT_2)) + z * _INV_SQRT_2PI * math.exp(-0.5 * z * z)
    if code == GELU_TANH:
        t = math.tanh(_K * (z + _C * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * z * z)
    if code == SILU:
        s = sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    return 1.0 if z > 0.0 else slope


_KIND_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}

# --------------------------------------------------------------------------- activation kinds of loop nests
#
# A loop calling act(v, code, slope) with a runtime code is neither unswitched nor vectorised
# by LLVM: relu then branches on the data's sign and mispredicts half the time (35x slower
# measured).  So the loop nests take a *kind*, passed as a literal by the entry points: 0
# identity, 1 rectifier (relu, or leaky_relu: max-like selects once the literal is folded; relu
# is the slope-0 case), 2 any other activation, whose libm calls dominate anyway and which goes
# through one called (not inlined) function, so that every activation's code is compiled once
# rather than into each loop nest.  Three copies of each loop nest, not one per activation,
# keeps the compile time down.


@njit(**_KIND_OPTS)
def _act_any(v, code, slope):
    return act(v, code, slope)


@njit(**_KIND_OPTS)
def _dact_any(v, code, slope, from_output):
    """act' at an element, from the output y (``from_output``) or from the pre-activation z."""
    if code == IDENTITY:
        return 1.0
    if from_output:
        if code == RELU:
            return 1.0 if v > 0.0 else 0.0
        if code == SIGMOID:
            return v * (1.0 - v)
        if code == TANH:
            return 1.0 - v * v
        return 1.0 if v > 0.0 else slope
    return act_grad(v, code, slope)


@njit(inline="always", **_KIND_OPTS)
def apply_kind(v, kind, code, slope):
    """act(v) for a loop of the given kind (see above); kind 1 takes the rectifier's slope."""
    if kind == 0:
        return v
    if kind == 1:
        return v if v > 0.0 else slope * v + 0.0  # + 0.0: relu gives +0.0, as PyTorch does, not -0.0
    return _act_any(v, code, slope)


@njit(inline="always", **_KIND_OPTS)
def deriv_kind(v, kind, code, slope, from_output):
    """act'(v) for a loop of the given kind; kind 1 reads it from the output y."""
    if kind == 0:
        return 1.0
    if kind == 1:
        return 1.0 if v > 0.0 else slope
    return _dact_any(v, code, slope, from_output)


@njit(inline="always", **_KIND_OPTS)
def is_rectifier(code):
    """relu (code 1) or leaky_relu (7): the activations whose loops get a branch-free select form."""
    return code == RELU or code == LEAKY_RELU


@njit(inline="always", **_KIND_OPTS)
def rectifier_slope(code, slope):
    """The negative-side slope of relu (0) or leaky_relu."""
    return 0.0 if code == RELU else slope
