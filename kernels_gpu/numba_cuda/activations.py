"""Activations as CUDA device functions selected by a runtime code.

Codes are the names of :mod:`portable_nn.kernel_codes` (identity 0, relu 1, sigmoid 2,
tanh 3, gelu 4, gelu_tanh 5, silu 6, leaky_relu 7, hardswish 8, hardsigmoid 9, relu6 10,
mish 11, elu 12), so one compiled kernel serves every activation; ``slope`` is the one
parameter (leaky_relu's slope, elu's alpha).  Constants take the argument's type
(:func:`~._runtime.cast_as`): with a float32 argument (float32 and half-precision data)
everything stays in float32 (``expf``/``erff``/``tanhf`` from libdevice), with a float64
argument it is float64 throughout.  Callers pass
``slope`` in the compute type.
"""

from __future__ import annotations

import math

from portable_nn.kernel_codes import (
    ELU,
    GELU,
    GELU_TANH,
    HARDSIGMOID,
    HARDSWISH,
    IDENTITY,
    MISH,
    RELU,
    RELU6,
    SIGMOID,
    SILU,
    TANH,
)

from ._runtime import cast_as, device

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
# mish: from z = 40 on, tanh(softplus(z)) = 1 and z · (1 − tanh²) < 1e-32 (portable_nn/reference/activations.py)
_MISH_CLIP = 40.0


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
def clip06(v):
    """min(max(v, 0), 6), NaN kept."""
    zero_ = cast_as(v, 0.0)
    six_ = cast_as(v, 6.0)
    v = zero_ if v < zero_ else v
    return six_ if v > six_ else v


@device
def tanh_softplus(z):
    """(tanh(softplus(z)), 1 − tanh²(softplus(z))) from n = e^z: u / (u + 2) and 4(u + 1) / (u + 2)²,
    u = n(n + 2), neither a difference; the second is 0 from the clip on."""
    clip_ = cast_as(z, _MISH_CLIP)
    one_ = cast_as(z, 1.0)
    two_ = cast_as(z, 2.0)
    below = z < clip_
    n = math.exp(z if below else clip_)
    u = n * (n + two_)
    d = u + two_
    dt = cast_as(z, 4.0) * (u + one_) / (d * d) if below else cast_as(z, 0.0)
    return u / d, dt


@device
def act(z, code, slope):
    """act(z) for the activation ``code`` (``slope``: leaky_relu's negative slope or elu's alpha)."""
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
    if code == HARDSWISH:
        return z * clip06(z + cast_as(z, 3.0)) / cast_as(z, 6.0)
    if code == HARDSIGMOID:
        return clip06(z + cast_as(z, 3.0)) / cast_as(z, 6.0)
    if code == RELU6:
        return clip06(z)
    if code == MISH:
        return z * tanh_softplus(z)[0]
    if code == ELU:
        return slope * math.expm1(z) if z <= zero_ else z
    return z if z > zero_ else slope * z


@device
def act_grad(z, code, slope):
    """act'(z), with PyTorch's values at kinks (relu'(0) = 0, leaky_relu'(0) = slope, the others as
    :data:`portable_nn.ACTIVATIONS` lists them)."""
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
    if code == HARDSWISH:  # PyTorch's pieces; NaN passes the gradient, as there
        if z <= -three_:
            return zero_
        return z / three_ + half_ if z < three_ else one_
    if code == HARDSIGMOID:
        return cast_as(z, 1.0 / 6.0) if z > -three_ and z < three_ else zero_
    if code == RELU6:
        return zero_ if z <= zero_ or z >= cast_as(z, 6.0) else one_
    if code == MISH:
        t, dt = tanh_softplus(z)
        return t + z * sigmoid(z) * dt
    if code == ELU:
        return slope * math.exp(z) if z <= zero_ else one_
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
