"""Softmax losses in the array API: forward and hand-written backward (reference and oracle).

``log_softmax``: y = x − m − log Σ exp(x − m) with m the maximum along the
axis; the backward dx = dy − exp(y) · Σ dy needs only y.

``cross_entropy`` (PyTorch's semantics; see :func:`portable_nn.api.loss.cross_entropy`):
with p = log_softmax(z) along the class axis and per-position target weights
a_{n,c} (one-hot or probabilities, class weights, label smoothing, ignored
positions zeroed), ℓ_n = −Σ_c a_{n,c} p_{n,c}.  The backward is the fused

    dz = g_n · (softmax · A_n − a_{n,c}),   A_n = Σ_c a_{n,c},

with g_n the cotangent scaled by the reduction, and for probability targets
dt = −g_n (1 − ε) w_c p_{n,c}.  The forward keeps p (the compute dtype) and the
mean's denominator; one-hot masks are rebuilt from the integer target.

For integer targets the target's own term is picked with ``where`` rather than
multiplied by a one-hot, and the smoothing term is added only when ε > 0, so
−∞ logits of other classes give the finite loss PyTorch gives.
Half-precision logits are computed in float32.
"""

from __future__ import annotations

import math
from typing import Any

from ..dispatch import Call
from ._common import compute_dtype, device, index_dtype, store

__all__ = ["cross_entropy_backward", "cross_entropy_forward", "log_softmax_backward", "log_softmax_forward"]



def _log_softmax(xp: Any, z: Any, axis: int) -> Any:
    """Max-shifted log-softmax of ``z`` along ``axis`` (empty input: empty output)."""
    if math.prod(z.shape) == 0:
        return xp.zeros_like(z)
    m = xp.max(z, axis=axis, keepdims=True)
    shifted = z - m
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))


# --------------------------------------------------------------------------- log_softmax


def log_softmax_forward(call: Call) -> tuple[tuple[Any], Any]:
    xp, x = call.xp, call.x
    cdt = compute_dtype(xp, x)
    z = xp.astype(x, cdt)
    if call.scalar:
        z = xp.reshape(z, (1,))
    y = _log_softmax(xp, z, call.axis)
    if call.scalar:
        y = xp.reshape(y, ())
    residuals = (y, x.dtype, call.replace(arrays={})) if call.save else None
    return (xp.astype(y, x.dtype),), residuals


def log_softmax_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dx = dy − softmax · Σ_axis dy, from the saved output."""
    if "x" not in needs:
        return {}
    y, x_dtype, call = residuals
    xp = call.xp
    dy = xp.astype(cotangents[0], y.dtype)
    if call.scalar:
        y, dy = xp.reshape(y, (1,)), xp.reshape(dy, (1,))
    dx = dy - xp.exp(y) * xp.sum(dy, axis=call.axis, keepdims=True)
    if call.scalar:
        dx = xp.reshape(dx, ())
    return {"x": store(out, "x", xp.astype(dx, x_dtype))}


# --------------------------------------------------------------------------- cross_entropy


class _Targets:
    """The per-position target weights of one call, in the compute dtype.

    ``a`` is a_{n,c} (logits' shape), ``total`` is A_n = Σ_c a_{n,c} (positions
    shape, keeping the class axis), built only as far as the caller needs.
    """

    def __init__(self, xp: Any, call: Call, like: Any) -> None:
        self.xp, self.call = xp, call
        axis, classes = call.axis, call.classes
        self.dtype, self.device = like.dtype, device(like)
        ndim = like.ndim
        self.bshape = tuple(classes if i == axis else 1 for i in range(ndim))
        self.w = None
        if call.weight is not None:
            self.w = xp.reshape(xp.astype(call.weight, self.dtype), self.bshape)
        self.eps = call.label_smoothing
        if call.probabilities:
            t = xp.astype(call.target, self.dtype)
            if self.eps > 0:
                t = t * (1.0 - self.eps) + self.eps / classes
            self.t = t
        else:
            target = xp.astype(call.target, index_dtype(xp))
            expanded = xp.expand_dims(target, axis=axis)
            self.valid = expanded != call.ignore_index  # keeps the class axis (size 1)
            cls = xp.reshape(xp.arange(classes, dtype=target.dtype, device=self.device), self.bshape)
            self.onehot = xp.logical_and(cls == expanded, self.valid)

    def picked_weight(self) -> Any:
        """w_{y_n} (0 where ignored), keeping the class axis."""
        xp = self.xp
        if self.w is None:
            return xp.astype(self.valid, self.dtype)
        return xp.sum(xp.where(self.onehot, self.w, 0.0), axis=self.call.axis, keepdims=True)

    def weights(self) -> Any:
        """a_{n,c}."""
        xp = self.xp
        if self.call.probabilities:
            return self.t if self.w is None else self.t * self.w
        w = self.w if self.w is not None else xp.ones(self.bshape, dtype=self.dtype, device=self.device)
        a = xp.where(self.onehot, (1.0 - self.eps) * w, 0.0)
        if self.eps > 0:
            a = a + xp.where(self.valid, (self.eps / self.call.classes) * w, 0.0)
        return a

    def weight_sums(self, a: Any) -> Any:
        """A_n = Σ_c a_{n,c}, keeping the class axis."""
        xp = self.xp
        if self.call.probabilities or self.eps > 0:
            return xp.sum(a, axis=self.call.axis, keepdims=True)
        return self.picked_weight()


def cross_entropy_forward(call: Call) -> tuple[tuple[Any], Any]:
    xp, z = call.xp, call.logits
    cdt = compute_dtype(xp, z)
    p = _log_softmax(xp, xp.astype(z, cdt), call.axis)
    targets = _Targets(xp, call, p)
    axis, eps = call.axis, call.label_smoothing
    denominator = None
    if call.probabilities:
        a = targets.weights()
        loss = -xp.sum(a * p, axis=axis)
    else:
        wy = targets.picked_weight()
        picked = xp.sum(xp.where(targets.onehot, p, 0.0), axis=axis, keepdims=True)
        loss = -(wy * picked)
        if eps > 0:
            wp = p if targets.w is None else p * targets.w
            smooth = xp.where(targets.valid, -xp.sum(wp, axis=axis, keepdims=True), 0.0)
            loss = (1.0 - eps) * loss + (eps / call.classes) * smooth
        loss = xp.squeeze(loss, axis=axis)
        if call.reduction == "mean":
            denominator = xp.sum(wy)
    if call.reduction == "none":
        result = loss
    elif call.reduction == "sum":
        result = xp.sum(loss)
    elif call.probabilities:
        n = call.positions
        result = xp.sum(loss) / n if n else xp.full((), math.nan, dtype=cdt, device=device(p))
    else:
        empty = denominator == 0
        safe = xp.where(empty, 1.0, denominator)
        result = xp.where(empty, math.nan, xp.sum(loss) / safe)
        denominator = safe
    residuals = None
    if call.save:
        residuals = (p, denominator, z.dtype, call.replace(arrays={**call.arrays, "logits": None}))
    # A NumPy reduction gives a scalar; hand back a 0-d array like every other library.
    result = xp.asarray(xp.astype(result, z.dtype))
    return (result,), residuals


def cross_entropy_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dz = g · (softmax · A − a); dt = −g (1 − ε) w p (probability targets)."""
    p, denominator, z_dtype, call = residuals
    xp = call.xp
    axis = call.axis
    g = xp.astype(cotangents[0], p.dtype)
    if call.reduction == "none":
        g = xp.expand_dims(g, axis=axis)
    elif call.reduction == "mean":
        g = g / (denominator if denominator is not None else max(call.positions, 1))
    targets = _Targets(xp, call, p)
    grads: dict[str, Any] = {}
    if "logits" in needs:
        a = targets.weights()
        dz = g * (xp.exp(p) * targets.weight_sums(a) - a)
        grads["logits"] = store(out, "logits", xp.astype(dz, z_dtype))
    if "target" in needs:
        scale = -(1.0 - call.label_smoothing)
        dt = g * p if targets.w is None else g * targets.w * p
        dt = scale * dt
        grads["target"] = store(out, "target", xp.astype(dt, call.target.dtype))
    return grads
