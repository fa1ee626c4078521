"""Normalisation layers in the array API: forward and hand-written backward.

This is both the implementation every array library can run and the oracle the
kernels are tested against.  All five norms are one computation on a *view* of
``x`` chosen by :mod:`portable_nn.api.norm`::

    view   = reshape(x, plan.view_shape)            # group_norm splits channels
    mean   = mean_R(view),  var = mean_R((view - mean)²)      (R = plan.axes)
    x̂      = (view - mean) · rstd,    rstd = 1 / sqrt(var + eps)
    y      = act(x̂ · w + b)           (w, b reshaped to plan.param_shape)

``rms_norm`` skips the centring (x̂ = view · rstd, rstd = 1/sqrt(mean_R(view²)+eps));
inference uses running statistics instead of batch ones.  The backward, with
g = dy · act'(z) and gx = g · w, is

    training:  dx = rstd · (gx − mean_R(gx) − x̂ · mean_R(gx · x̂))
    rms:       dx = rstd · (gx − x̂ · mean_R(gx · x̂))
    inference: dx = rstd · gx
    dw = Σ g · x̂,   db = Σ g    (over the axes the parameters broadcast along)

and keeps only ``x``, ``mean`` and ``rstd`` from the forward.

Statistics are shifted two-pass sums: a sample of each reduction group is
subtracted first, so float32 data with a large offset (mean 1e4, std 1) keeps
its precision; E[x²] − E[x]² is never used.  Half-precision data is computed in
float32.
"""

from __future__ import annotations

from typing import Any

from ..dispatch import Call
from ..kernel_plans import momentum_update
from . import activations
from ._common import compute_dtype, device, store

__all__ = [
    "compute_dtype",
    "moments_backward",
    "moments_forward",
    "norm_backward",
    "norm_forward",
    "shifted_moments",
]


# --------------------------------------------------------------------------- helpers


def _count(shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
    n = 1
    for a in axes:
        n *= shape[a]
    return n


def _keep_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else s for i, s in enumerate(shape))


def shifted_moments(xp: Any, x: Any, axes: tuple[int, ...], correction: float = 0.0) -> tuple[Any, Any, Any]:
    """(shift, mean of x − shift, variance) over ``axes``, all keeping dims.

    The shift is the first element of each reduction group, so the sums run over
    values of the size of the spread rather than of the offset.  ``mean`` of
    ``x`` is ``shift + centred_mean``; keeping the two apart lets the forward
    form ``(x − shift) − centred_mean`` without rounding the offset.
    """
    shape = tuple(x.shape)
    n = _count(shape, axes)
    keep = _keep_shape(shape, axes)
    if n == 0:
        zeros = xp.zeros(keep, dtype=x.dtype, device=device(x))
        return zeros, zeros, zeros
    first = tuple(slice(0, 1) if i in axes else slice(None) for i in range(len(shape)))
    shift = x[first]
    d = x - shift
    centred_mean = xp.sum(d, axis=axes, keepdims=True) / n
    dev = d - centred_mean
    # Second-order correction (sum of deviations is ~0 but not exactly in floating point).
    s1 = xp.sum(dev, axis=axes, keepdims=True)
    s2 = xp.sum(dev * dev, axis=axes, keepdims=True)
    denom = max(n - correction, 0)
    var = (s2 - s1 * s1 / n) / denom if denom > 0 else xp.full_like(s2, float("nan"))
    var = xp.maximum(var, xp.zeros_like(var))
    return shift, centred_mean, var


# --------------------------------------------------------------------------- moments


def moments_forward(call: Call) -> tuple[tuple[Any, Any], Any]:
    """``moments``: mean and variance (with ``correction``) over ``call.axes``."""
    xp, x = call.xp, call.x
    xc = xp.astype(x, compute_dtype(xp, x))
    shift, centred, var = shifted_moments(xp, xc, call.axes, call.correction)
    mean = shift + centred
    if _count(tuple(xc.shape), call.axes) == 0:  # the mean of nothing is undefined, as in NumPy
        mean = xp.full_like(mean, float("nan"))
        var = xp.full_like(var, float("nan"))
    residuals = (xc, mean, call) if call.save else None
    if not call.keepdims:
        mean = _squeeze(xp, mean, call.axes)
        var = _squeeze(xp, var, call.axes)
    # NumPy turns 0-d results into scalars; the caller gets 0-d arrays of its library, as from the kernels.
    return (xp.asarray(mean), xp.asarray(var)), residuals


def _squeeze(xp: Any, a: Any, axes: tuple[int, ...]) -> Any:
    shape = tuple(s for i, s in enumerate(a.shape) if i not in axes)
    return xp.reshape(a, shape)


def moments_backward(residuals: Any, cotangents: tuple[Any, Any], needs: frozenset[str], out: dict) -> dict:
    """dx = dmean / n + dvar · 2 (x − mean) / (n − correction)."""
    xc, mean, call = residuals
    xp = call.xp
    if "x" not in needs:
        return {}
    dmean, dvar = cotangents
    keep = tuple(mean.shape)
    dmean = xp.reshape(xp.astype(dmean, xc.dtype), keep)
    dvar = xp.reshape(xp.astype(dvar, xc.dtype), keep)
    n = _count(tuple(xc.shape), call.axes)
    denom = max(n - call.correction, 0)
    dx = xp.zeros_like(xc) + dmean / max(n, 1)
    if denom > 0:
        dx = dx + dvar * (2.0 / denom) * (xc - mean)
    # (xp.asarray: NumPy's arithmetic on 0-d arrays gives scalars; the gradient is an array like x.)
    return {"x": store(out, "x", xp.asarray(xp.astype(dx, call.x.dtype)))}


# --------------------------------------------------------------------------- norms


def _params_view(xp: Any, p: Any, shape: tuple[int, ...] | None, dtype: Any) -> Any:
    if p is None:
        return None
    return xp.reshape(xp.astype(p, dtype), shape)


def _batch_statistics(xp: Any, v: Any, call: Call) -> tuple[Any, Any, Any, Any]:
    """(mean, rstd, centred view, var) from the data, for training-mode norms."""
    axes = call.axes
    if not call.center:
        n = _count(tuple(v.shape), axes)
        ms = xp.sum(v * v, axis=axes, keepdims=True) / max(n, 1)
        return None, 1.0 / xp.sqrt(ms + call.eps), v, None
    shift, centred_mean, var = shifted_moments(xp, v, axes)
    rstd = 1.0 / xp.sqrt(var + call.eps)
    return shift + centred_mean, rstd, (v - shift) - centred_mean, var


def _running_statistics(xp: Any, call: Call, dtype: Any) -> tuple[Any, Any]:
    mean = xp.reshape(xp.astype(call.running_mean, dtype), call.stat_param_shape)
    var = xp.reshape(xp.astype(call.running_var, dtype), call.stat_param_shape)
    return mean, 1.0 / xp.sqrt(var + call.eps)


def _updated_running_stats(xp: Any, call: Call, mean: Any, var: Any, v_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """PyTorch's update (``kernel_plans.momentum_update``), in the statistics' compute dtype."""
    rm, rv = call.running_mean, call.running_var
    n = _count(v_shape, call.axes)
    channels = rm.shape[0]
    # Nothing to average (no element per channel, no channel, no instance): the statistics stay, as
    # in PyTorch, which leaves them alone for empty input.
    if n == 0 or channels == 0 or mean is None or (call.stats_batch_axis is not None and v_shape[0] == 0):
        return rm, rv
    new_mean, new_var = momentum_update(
        xp, xp.astype(rm, mean.dtype), xp.astype(rv, var.dtype), xp.reshape(mean, (-1, channels)),
        xp.reshape(var, (-1, channels)), call.momentum, n)
    return xp.astype(new_mean, rm.dtype), xp.astype(new_var, rv.dtype)


def norm_forward(call: Call) -> tuple[tuple[Any, Any, Any], Any]:
    """Forward of every norm; outputs ``(y, new_running_mean, new_running_var)``.

    The running statistics are ``None`` unless tracked and updated by this call.
    Residuals for the backward: ``(x, mean, rstd, weight, bias, call)``.
    """
    xp, x = call.xp, call.x
    cdt = compute_dtype(xp, x)
    v = xp.astype(xp.reshape(x, call.view_shape), cdt)
    w = _params_view(xp, call.weight, call.param_shape, cdt)
    b = _params_view(xp, call.bias, call.param_shape, cdt)

    new_rm = new_rv = None
    if call.use_batch_stats:
        mean, rstd, centred, var = _batch_statistics(xp, v, call)
        xhat = centred * rstd
        if call.update_running:
            new_rm, new_rv = _updated_running_stats(xp, call, mean, var, tuple(v.shape))
    else:
        mean, rstd = _running_statistics(xp, call, cdt)
        xhat = (v - mean) * rstd

    z = xhat
    if w is not None:
        z = z * w
    if b is not None:
        z = z + b
    y = activations.apply(xp, z, call.activation)
    y = xp.reshape(xp.astype(y, x.dtype), tuple(x.shape))
    residuals = (x, mean, rstd, call.weight, call.bias, call) if call.save else None
    return (y, new_rm, new_rv), residuals


def norm_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    """Backward of every norm (see the module docstring for the formulas)."""
    x, mean, rstd, weight, bias, call = residuals
    xp = call.xp
    dy = cotangents[0]
    cdt = compute_dtype(xp, x)
    v = xp.astype(xp.reshape(x, call.view_shape), cdt)
    w = _params_view(xp, weight, call.param_shape, cdt)
    b = _params_view(xp, bias, call.param_shape, cdt)
    xhat = (v - mean) * rstd if mean is not None else v * rstd

    g = xp.astype(xp.reshape(dy, call.view_shape), cdt)
    if not call.activation.is_identity:
        z = xhat * w if w is not None else xhat
        if b is not None:
            z = z + b
        g = g * activations.derivative(xp, z, call.activation)

    grads: dict[str, Any] = {}
    param_axes = tuple(i for i, s in enumerate(call.param_shape) if s == 1)
    if "weight" in needs:
        dw = xp.sum(g * xhat, axis=param_axes, keepdims=True)
        grads["weight"] = store(out, "weight", xp.astype(xp.reshape(dw, tuple(weight.shape)), weight.dtype))
    if "bias" in needs:
        db = xp.sum(g, axis=param_axes, keepdims=True)
        grads["bias"] = store(out, "bias", xp.astype(xp.reshape(db, tuple(bias.shape)), bias.dtype))
    if "x" in needs:
        gx = g * w if w is not None else g
        if call.use_batch_stats:
            n = max(_count(tuple(v.shape), call.axes), 1)
            proj = xp.sum(gx * xhat, axis=call.axes, keepdims=True) / n
            inner = gx - xhat * proj
            if mean is not None:
                inner = inner - xp.sum(gx, axis=call.axes, keepdims=True) / n
            dx = rstd * inner
        else:
            dx = rstd * gx
        grads["x"] = store(out, "x", xp.reshape(xp.astype(dx, x.dtype), tuple(x.shape)))
    return grads


# One kernel pair serves the five normalisations (the call's ``kind`` and axes tell them apart); these
# are the names the reference's naming rule looks up (``<op>_forward``/``<op>_backward``).
batch_norm_forward = layer_norm_forward = group_norm_forward = instance_norm_forward = rms_norm_forward = (
    norm_forward
)
batch_norm_backward = layer_norm_backward = group_norm_backward = instance_norm_backward = rms_norm_backward = (
    norm_backward
)
