"""Activations and their derivatives in the array API (the reference and oracle).

``apply(xp, z, act)`` is act(z); ``derivative(xp, z, act)`` is act'(z), both
elementwise on the pre-activation ``z``.  The array API has no ``erf``, so the
exact GELU uses :func:`erf`, a series accurate to double precision.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..kernel_codes import OUTPUT_DERIVATIVE, keeps_output_only

if TYPE_CHECKING:  # the reference needs an activation's name and slope, not the API
    from ..api.activations import Activation

__all__ = ["OUTPUT_DERIVATIVE", "apply", "derivative", "derivative_from_output", "erf", "keeps_output_only", "sigmoid"]

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_GELU_K = math.sqrt(2.0 / math.pi)
_TANH_GELU_C = 0.044715
# Beyond |x| = 6, erf(x) = ±1 to double precision (erfc(6) ≈ 2e-17).
_ERF_CLIP = 6.0
_ERF_TERMS = 110


def erf(xp: Any, x: Any) -> Any:
    """erf(x): the library's own where it has one (JAX, PyTorch), else the all-positive series
    erf(x) = 2/√π·e^{-x²}·Σ (2x²)ⁿ x / (2n+1)!!.

    Every term of the series is positive, so there is no cancellation: the relative error is a few
    ulp for |x| <= 6 (beyond that erf is ±1 in double precision).  Its 110 terms are 110 array
    operations, though: traced by XLA, a (4096, 1024) layer_norm + gelu training step compiled to
    1,480 jaxpr lines and ran 908 ms against 378 ms with ``jax.nn.gelu`` (2-core Zen 3) — hence
    the native erf where the namespace is one that has it (the array API standard has none).
    """
    native = _native_erf(xp)
    if native is not None:
        return native(x)
    a = xp.clip(xp.abs(x), 0.0, _ERF_CLIP)
    a2 = a * a
    term = a
    total = a
    for n in range(1, _ERF_TERMS):
        term = term * (2.0 * a2) / (2.0 * n + 1.0)
        total = total + term
    result = (2.0 / math.sqrt(math.pi)) * xp.exp(-a2) * total
    result = xp.minimum(result, xp.ones_like(result))
    return xp.where(x < 0, -result, result)


def _native_erf(xp: Any) -> Any:
    """The erf of namespace ``xp``'s library, for JAX and PyTorch (whose erf is accurate to a few ulp
    and differentiable by their autodiff), else ``None``."""
    name = getattr(xp, "__name__", "")
    if name.startswith("jax"):
        from jax.scipy.special import erf as jax_erf

        return jax_erf
    if name.startswith("array_api_compat.torch") or name == "torch":
        import torch

        return torch.special.erf
    return None


def sigmoid(xp: Any, z: Any) -> Any:
    """1 / (1 + e^{-z}) without overflow for large |z|."""
    e = xp.exp(-xp.abs(z))
    return xp.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def apply(xp: Any, z: Any, act: Activation) -> Any:
    """act(z)."""
    name = act.name
    if name == "identity":
        return z
    if name == "relu":
        return xp.where(z > 0, z, xp.zeros_like(z))
    if name == "sigmoid":
        return sigmoid(xp, z)
    if name == "tanh":
        return xp.tanh(z)
    if name == "gelu":
        return 0.5 * z * (1.0 + erf(xp, z / _SQRT_2))
    if name == "gelu_tanh":
        return 0.5 * z * (1.0 + xp.tanh(_TANH_GELU_K * (z + _TANH_GELU_C * z * z * z)))
    if name == "silu":
        return z * sigmoid(xp, z)
    if name == "leaky_relu":
        return xp.where(z > 0, z, act.slope * z)
    if name == "hardswish":
        return z * _clip06(xp, z + 3.0) / 6.0
    if name == "hardsigmoid":
        return _clip06(xp, z + 3.0) / 6.0
    if name == "relu6":
        return _clip06(xp, z)
    if name == "mish":
        return z * _tanh_softplus(xp, z)[0]
    if name == "elu":
        return xp.where(z <= 0, act.slope * xp.expm1(xp.minimum(z, xp.zeros_like(z))), z)
    raise AssertionError(name)  # pragma: no cover - parse_activation rules this out


def _clip06(xp: Any, v: Any) -> Any:
    """min(max(v, 0), 6), NaN kept (a select on ``v < 0`` and ``v > 6``, not ``minimum``/``maximum``,
    whose NaN handling the array API leaves open)."""
    v = xp.where(v < 0, xp.zeros_like(v), v)
    return xp.where(v > 6, xp.full_like(v, 6.0), v)


# From z = 40, tanh(softplus(z)) = 1 and z · (1 − tanh²) < 1e-32 in double precision; clipping there
# keeps e^(2z) finite (the 1 − tanh² of the clipped z is then taken as 0: mish'(∞) = 1 + ∞ · 0 = NaN,
# as in PyTorch).
_MISH_CLIP = 40.0


def _tanh_softplus(xp: Any, z: Any) -> tuple[Any, Any]:
    """(tanh(softplus(z)), 1 − tanh²(softplus(z))) from n = e^z alone: with u = n(n + 2),
    tanh(log(1 + n)) = u / (u + 2) and 1 − tanh² = 4(u + 1) / (u + 2)², neither a difference."""
    below = z < _MISH_CLIP
    n = xp.exp(xp.where(below, z, xp.full_like(z, _MISH_CLIP)))
    u = n * (n + 2.0)
    d = u + 2.0
    return u / d, xp.where(below, 4.0 * (u + 1.0) / (d * d), xp.zeros_like(z))


def derivative(xp: Any, z: Any, act: Activation) -> Any:
    """act'(z), matching PyTorch's choice at kinks (relu'(0) = 0, leaky_relu'(0) = slope; the others
    are listed at :data:`portable_nn.ACTIVATIONS`)."""
    name = act.name
    if name == "identity":
        return xp.ones_like(z)
    if name == "relu":
        return xp.astype(z > 0, z.dtype)
    if name == "sigmoid":
        s = sigmoid(xp, z)
        return s * (1.0 - s)
    if name == "tanh":
        t = xp.tanh(z)
        return 1.0 - t * t
    if name == "gelu":
        cdf = 0.5 * (1.0 + erf(xp, z / _SQRT_2))
        return cdf + z * _INV_SQRT_2PI * xp.exp(-0.5 * z * z)
    if name == "gelu_tanh":
        inner = _TANH_GELU_K * (z + _TANH_GELU_C * z * z * z)
        t = xp.tanh(inner)
        dinner = _TANH_GELU_K * (1.0 + 3.0 * _TANH_GELU_C * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * dinner
    if name == "silu":
        s = sigmoid(xp, z)
        return s * (1.0 + z * (1.0 - s))
    if name == "leaky_relu":
        return xp.where(z > 0, xp.ones_like(z), xp.full_like(z, act.slope))
    zeros = xp.zeros_like(z)
    # The pieces below are PyTorch's, NaN included (its backward passes the gradient where no
    # comparison holds).
    if name == "hardswish":  # 0 up to −3 included, z/3 + ½ below 3, 1 from 3
        middle = z / 3.0 + 0.5
        return xp.where(z <= -3.0, zeros, xp.where(z < 3.0, middle, xp.ones_like(z)))
    if name == "hardsigmoid":  # 1/6 of the dtype (PyTorch multiplies by 1/6 rounded to float32)
        inside = (z > -3.0) & (z < 3.0)
        return xp.where(inside, xp.full_like(z, 1.0 / 6.0), zeros)
    if name == "relu6":
        return xp.where((z <= 0) | (z >= 6), zeros, xp.ones_like(z))
    if name == "mish":
        t, dt = _tanh_softplus(xp, z)
        return t + z * sigmoid(xp, z) * dt
    if name == "elu":
        return xp.where(z <= 0, act.slope * xp.exp(xp.minimum(z, zeros)), xp.ones_like(z))
    raise AssertionError(name)  # pragma: no cover


def derivative_from_output(xp: Any, y: Any, act: Activation) -> Any:
    """act'(z) written in terms of y = act(z), for :data:`OUTPUT_DERIVATIVE` activations.

    (leaky_relu with a positive slope also qualifies: y > 0 exactly when z > 0.)
    """
    name = act.name
    if name == "identity":
        return xp.ones_like(y)
    if name == "relu":
        return xp.astype(y > 0, y.dtype)
    if name == "sigmoid":
        return y * (1.0 - y)
    if name == "tanh":
        return 1.0 - y * y
    if name == "leaky_relu" and act.slope > 0:
        return xp.where(y > 0, xp.ones_like(y), xp.full_like(y, act.slope))
    raise ValueError(f"the derivative of {name} is not a function of its output")
