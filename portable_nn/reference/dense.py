"""Dense layer in the array API: forward and hand-written backward (reference and oracle).

With ``x`` flattened to ``X`` of shape ``(M, in)`` (``M`` the product of the
leading axes; 1 for a 1-D ``x``) and ``W`` the ``(out, in)`` weight::

    z = X · Wᵀ + b,   y = act(z)                          (reshaped to (..., out))

and, with ``g = dy · act'`` (from ``y`` alone when the activation allows, see
:func:`~portable_nn.kernel_codes.keeps_output_only`, else from the
kept pre-activation ``z``)::

    db = Σ_rows g      (reduced right after the activation derivative)
    dW = gᵀ · X
    dX = g · W

The forward keeps ``x``, ``weight`` and the activation residual (``y`` or
``z``; nothing for the identity).  Half-precision data (or half data with
float32 parameters) is computed in float32, and the kept ``y`` is then its
float32 value: the derivative from a rounded half output (``1 − y²`` near
saturation) would lose most of its digits.
"""

from __future__ import annotations

from typing import Any

from ..dispatch import Call
from . import activations
from ._common import compute_dtype, store

__all__ = ["dense_backward", "dense_forward"]


def _rows(xp: Any, a: Any) -> Any:
    """``a`` as ``(M, features)``."""
    rows = 1
    for s in a.shape[:-1]:
        rows *= int(s)
    return xp.reshape(a, (rows, int(a.shape[-1])))


def dense_forward(call: Call) -> tuple[tuple[Any], Any]:
    """One matrix product, then bias and activation in the epilogue."""
    xp = call.xp
    x, weight, bias = call.x, call.weight, call.bias
    cdt = compute_dtype(xp, x)
    xr = _rows(xp, xp.astype(x, cdt, copy=False))
    w = xp.astype(weight, cdt, copy=False)
    z = xp.matmul(xr, xp.matrix_transpose(w))
    if bias is not None:
        z = z + xp.astype(bias, cdt, copy=False)
    act = call.activation
    a = activations.apply(xp, z, act)
    y = xp.reshape(xp.astype(a, x.dtype, copy=False), (*x.shape[:-1], int(weight.shape[0])))
    residuals = None
    if call.save:
        if act.is_identity:
            kept = None  # the derivative is 1: nothing to keep
        elif activations.keeps_output_only(act):
            kept = a  # act' is a function of y: the output (itself, unless half data: then its float32 value)
        else:
            kept = z  # the pre-activation, (M, out) in the compute dtype
        residuals = (x, weight, bias, kept, call.replace(arrays={}))
    return (y,), residuals


def dense_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dbias, dweight and dx from g = dy · act' (see the module docstring)."""
    x, weight, bias, kept, call = residuals
    xp = call.xp
    cdt = compute_dtype(xp, x)
    g = _rows(xp, xp.astype(cotangents[0], cdt, copy=False))
    act = call.activation
    if activations.keeps_output_only(act):
        if not act.is_identity:
            g = g * activations.derivative_from_output(xp, kept, act)
    else:
        g = g * activations.derivative(xp, kept, act)
    grads: dict[str, Any] = {}
    if "bias" in needs:
        grads["bias"] = store(out, "bias", xp.astype(xp.sum(g, axis=0), bias.dtype, copy=False))
    if "weight" in needs:
        xr = _rows(xp, xp.astype(x, cdt, copy=False))
        dw = xp.matmul(xp.matrix_transpose(g), xr)
        grads["weight"] = store(out, "weight", xp.astype(dw, weight.dtype, copy=False))
    if "x" in needs:
        dx = xp.matmul(g, xp.astype(weight, cdt, copy=False))
        grads["x"] = store(out, "x", xp.reshape(xp.astype(dx, x.dtype, copy=False), tuple(x.shape)))
    return grads
