"""Activations as CUDA device functions selected by a runtime code.

Codes are the names of :mod:`portable_nn.kernel_codes` (identity 0, relu 1, sigmoid 2,
tanh 3, gelu 4, gelu_tanh 5, silu 6, leaky_relu 7), so one compiled kernel serves every
activation.  Constants take the argument's type (:func:`~._runtime.cast_as`): with a float32
argument (float32 and half-precision data) everything stays in float32 (``expf``/``erff``/
``tanhf`` from libdevice), with a float64 argument it is float64 throughout.  Callers pass
``slope`` in the compute type.
"""

from __future__ import annotations

import math

from portable_nn.kernel_codes import GELU, GELU_TANH, IDENTITY, RELU, SIGMOID, SILU, TANH

from ._runtime import cast_as, device

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


@device
def sigmoid(z):
    """1 / (1 + e^{-z}) without overflow for large |z|."""
    zero_ = cast_as(z, 0.0)
    one_ = cast_as(z, 1.0)
    if z >= zero_:
        return one_ / (one_ + math.exp(-z))
    e = math.exp(z)
    return e / (one_ + e)


@device
def act(z, code, slope):
    """act(z) for the activation ``code`` (``slope``: leaky_relu's negative slope)."""
    zero_ = cast_as(z, 0.0)
    one_ = cast_as(z, 1.0)
    half_ = cast_as(z, 0.5)
    k_ = cast_as(z, _GELU_K)
    c_ = cast_as(z, _GELU_C)
    if code == IDENTITY:
        return z
    if code == RELU:
        return z if z > zero_ else zero_ * z
    if code == SIGMOID:
        return sigmoid(z)
    if code == TANH:
        return math.tanh(z)
    if code == GELU:
        return half_ * z * (one_ + math.erf(z * cast_as(z, _INV_SQRT_2)))
    if code == GELU_TANH:
        return half_ * z * (one_ + math.tanh(k_ * (z + c_ * z * z * z)))
    if code == SILU:
        return z * sigmoid(z)
    return z if z > zero_ else slope * z


@device
def act_grad(z, code, slope):
    """act'(z), with PyTorch's values at kinks (relu'(0) = 0, leaky_relu'(0) = slope)."""
    zero_ = cast_as(z, 0.0)
    one_ = cast_as(z, 1.0)
    half_ = cast_as(z, 0.5)
    three_ = cast_as(z, 3.0)
    k_ = cast_as(z, _GELU_K)
    c_ = cast_as(z, _GELU_C)
    if code == IDENTITY:
        return one_ + zero_ * z
    if code == RELU:
        return one_ + zero_ * z if z > zero_ else zero_ * z
    if code == SIGMOID:
        s = sigmoid(z)
        return s * (one_ - s)
    if code == TANH:
        t = math.tanh(z)
        return one_ - t * t
    if code == GELU:
        density = cast_as(z, _INV_SQRT_2PI) * math.exp(-half_ * z * z)
        return half_ * (one_ + math.erf(z * cast_as(z, _INV_SQRT_2))) + z * density
    if code == GELU_TANH:
        t = math.tanh(k_ * (z + c_ * z * z * z))
        return half_ * (one_ + t) + half_ * z * (one_ - t * t) * k_ * (one_ + three_ * c_ * z * z)
    if code == SILU:
        s = sigmoid(z)
        return s * (one_ + z * (one_ - s))
    return one_ + zero_ * z if z > zero_ else slope + zero_ * z


@device
def act_grad_from_output(y, code, slope):
    """act'(z) from y = act(z), for the activations whose derivative the output determines.

    Valid for identity, relu, sigmoid, tanh and leaky_relu with slope > 0 (codes 0-3, 7); the
    callers keep z instead for the others.
    """
    zero_ = cast_as(y, 0.0)
    one_ = cast_as(y, 1.0)
    if code == IDENTITY:
        return one_ + zero_ * y
    if code == RELU:
        return one_ + zero_ * y if y > zero_ else zero_ * y
    if code == SIGMOID:
        return y * (one_ - y)
    if code == TANH:
        return one_ - y * y
    return one_ + zero_ * y if y > zero_ else slope + zero_ * y
