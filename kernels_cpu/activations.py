"""Scalar activations for Numba kernels, selected by a runtime code.

Codes follow :data:`portable_nn.api.activations.ACTIVATIONS` (identity 0,
relu 1, sigmoid 2, tanh 3, gelu 4, gelu_tanh 5, silu 6, leaky_relu 7), so one
compiled kernel serves every activation.  Functions are inlined into callers.
"""

from __future__ import annotations

import math

from numba import njit

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


@njit(inline="always", error_model="numpy", cache=True)
def act(z, code, slope):
    """act(z) for the activation ``code``."""
    if code == 0:
        return z
    if code == 1:
        return z if not (z <= 0.0) else 0.0  # +0.0 like PyTorch; NaN propagates
    if code == 2:
        return sigmoid(z)
    if code == 3:
        return math.tanh(z)
    if code == 4:
        return 0.5 * z * (1.0 + math.erf(z * _INV_SQRT_2))
    if code == 5:
        return 0.5 * z * (1.0 + math.tanh(_K * (z + _C * z * z * z)))
    if code == 6:
        return z * sigmoid(z)
    return z if z > 0.0 else slope * z


@njit(inline="always", error_model="numpy", cache=True)
def act_grad(z, code, slope):
    """act'(z), with PyTorch's values at kinks (relu'(0) = 0, leaky_relu'(0) = slope)."""
    if code == 0:
        return 1.0
    if code == 1:
        return 1.0 if z > 0.0 else 0.0
    if code == 2:
        s = sigmoid(z)
        return s * (1.0 - s)
    if code == 3:
        t = math.tanh(z)
        return 1.0 - t * t
    if code == 4:
        return 0.5 * (1.0 + math.erf(z * _INV_SQRT_2)) + z * _INV_SQRT_2PI * math.exp(-0.5 * z * z)
    if code == 5:
        t = math.tanh(_K * (z + _C * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * z * z)
    if code == 6:
        s = sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    return 1.0 if z > 0.0 else slope
