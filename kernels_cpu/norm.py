"""Numba kernels for every norm, forward and backward (backend ``"numba"``).

All five norms run through one canonical view of a C-contiguous ``x``::

    x4 = x.reshape(Nn, P, C, Q)        statistics per (n, c) over (p, q)
    parameter of element (c, q)  =  c · Cg + q // S

=================  ==============  ===================  =========
norm / layout      (Nn, P, C, Q)   Cg                   S
=================  ==============  ===================  =========
layer, rms         (M, 1, 1, D)    D                    1
batch, NC…         (1, N, C, L)    1                    L
batch, N…C         (1, N·L, C, 1)  1                    1
instance, NC…      (N, 1, C, L)    1                    L
instance, N…C      (N, L, C, 1)    1                    1
group, NC…         (N, 1, G, k·L)  k = C/G              L
group, N…C         (N, L, G, k)    k                    1
=================  ==============  ===================  =========

(L is the product of the spatial sizes.)  The forward runs one parallel task
per statistics group: a pass for the shifted sums (the group's first element is
the shift, sums accumulate in float64 lanes in a fixed order), then a pass that
writes ``y`` while the group is still in cache.  The backward runs one task per
(chunk of n, c): one pass for the group sums Σ gx and Σ gx·x̂ plus the
chunk's partial dweight/dbias, one pass writing dx; the partials are reduced in
a fixed order afterwards, so results do not depend on the thread count.

Statistics are float64 whatever the data (float32 data with a 1e4 offset keeps
its precision); outputs have the data's dtype.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import _runtime
from .activations import act, act_grad

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}
# Reductions may be reassociated so LLVM vectorises them (a plain `s += v` loop is latency-bound and
# a lane-buffer array did not vectorise here: 2.1 ms vs 0.8 ms for the sums of a (4096, 1024)
# float32 array).  The order is fixed by the compiled code, so results stay bitwise reproducible
# run to run and independent of the thread count (each group is reduced by one thread).  These
# functions are deliberately *not* inlined at the Numba level: inlining would compile them with
# the caller's (strict) flags; LLVM still inlines them, keeping the per-instruction flags.
_REDUCE = {**_OPTS, "fastmath": {"reassoc"}}
# Below this many elements the thread pool costs more than it saves (PERFORMANCE.md §6).
PARALLEL_MIN_ELEMENTS = 1 << 15


# --------------------------------------------------------------------------- forward


@njit(**_REDUCE)
def _shifted_sums(row, shift):
    """(Σ (x − shift), Σ (x − shift)²) along one contiguous row, in float64."""
    s1 = 0.0
    s2 = 0.0
    for q in range(row.shape[0]):
        d = np.float64(row[q]) - shift
        s1 += d
        s2 += d * d
    return s1, s2


@njit(inline="always", **_OPTS)
def _group_sums(x, i, c, shift):
    """(Σ (x − shift), Σ (x − shift)²) over group (i, c), row by row in a fixed order."""
    s1 = 0.0
    s2 = 0.0
    for p in range(x.shape[1]):
        a, b = _shifted_sums(x[i, p, c], shift)
        s1 += a
        s2 += b
    return s1, s2


@njit(inline="always", **_OPTS)
def _split(arr, v):
    """``v`` (float64) as a pair (hi, lo) in ``arr``'s dtype with hi + lo ≈ v to twice its precision.

    Elementwise passes run in the data's dtype (float32 arithmetic is twice as wide per vector and
    needs no conversions); ``(x − hi) − lo`` keeps the centring exact enough for data whose mean is
    far from zero (x − hi is exact when x is near the mean), so float32 data with a 1e4 offset
    normalises as accurately as centred data.
    """
    hi = arr.dtype.type(v)
    return hi, arr.dtype.type(v - np.float64(hi))


@njit(inline="always", **_OPTS)
def _activate(yr, code, slope):
    for q in range(yr.shape[0]):
        yr[q] = act(np.float64(yr[q]), code, slope)


@njit(inline="always", **_OPTS)
def _write_row(xr, yr, wv, bv, m, r, code, slope):
    """y = act((x − m) · r · w + b) along one contiguous row with per-element parameters."""
    mh, ml = _split(xr, m)
    rr = xr.dtype.type(r)
    for q in range(xr.shape[0]):
        yr[q] = ((xr[q] - mh) - ml) * rr * wv[q] + bv[q]
    if code != 0:
        _activate(yr, code, slope)


@njit(inline="always", **_OPTS)
def _write_segment(xr, yr, wj, bj, m, r, code, slope):
    """The same along a segment whose elements share one parameter (one channel)."""
    mh, ml = _split(xr, m)
    scale = xr.dtype.type(r * wj)
    for q in range(xr.shape[0]):
        yr[q] = ((xr[q] - mh) - ml) * scale + bj
    if code != 0:
        _activate(yr, code, slope)


@njit(inline="always", **_OPTS)
def _forward_group(x, w, b, y, mean, rstd, var, i, c, cg, s, train, center, eps, code, slope):
    P, Q = x.shape[1], x.shape[3]
    n = P * Q
    if train:
        if n == 0:
            mean[i, c] = 0.0
            var[i, c] = 0.0
        elif center:
            shift = np.float64(x[i, 0, c, 0])
            s1, s2 = _group_sums(x, i, c, shift)
            cm = s1 / n
            mean[i, c] = shift + cm
            var[i, c] = max((s2 - s1 * cm) / n, 0.0)
        else:
            s1, s2 = _group_sums(x, i, c, 0.0)
            mean[i, c] = 0.0
            var[i, c] = s2 / n
        rstd[i, c] = 1.0 / math.sqrt(var[i, c] + eps)
    m = mean[i, c]
    r = rstd[i, c]
    base = c * cg
    for p in range(P):
        xr = x[i, p, c]
        yr = y[i, p, c]
        if s == 1:
            _write_row(xr, yr, w[base : base + Q], b[base : base + Q], m, r, code, slope)
        else:
            for j in range(Q // s):
                _write_segment(xr[j * s : (j + 1) * s], yr[j * s : (j + 1) * s], w[base + j], b[base + j],
                               m, r, code, slope)


@njit(parallel=True, **_OPTS)
def _forward_parallel(x, w, b, y, mean, rstd, var, cg, s, train, center, eps, code, slope):
    Nn, C = x.shape[0], x.shape[2]
    for g in prange(Nn * C):
        _forward_group(x, w, b, y, mean, rstd, var, g // C, g % C, cg, s, train, center, eps, code, slope)


@njit(**_OPTS)
def _forward_serial(x, w, b, y, mean, rstd, var, cg, s, train, center, eps, code, slope):
    Nn, C = x.shape[0], x.shape[2]
    for g in range(Nn * C):
        _forward_group(x, w, b, y, mean, rstd, var, g // C, g % C, cg, s, train, center, eps, code, slope)


# --------------------------------------------------------------------------- backward


@njit(inline="always", **_OPTS)
def _g_at(xv, dyv, m, r, wq, bq, code, slope):
    """(g, x̂) at one element: g = dy · act'(x̂ · w + b)."""
    xhat = (np.float64(xv) - m) * r
    g = np.float64(dyv)
    if code != 0:
        g *= act_grad(xhat * wq + bq, code, slope)
    return g, xhat


@njit(**_REDUCE)
def _row_sums(xr, dyr, wv, bv, m, r, code, slope):
    """Per-element parameters: (Σ g·w, Σ g·w·x̂) along the row.

    A pure reduction: with stores in the same loop LLVM needs more runtime alias checks than it
    allows and gives up vectorising; the parameter gradients get their own loop (_row_params).
    """
    sa = 0.0
    sb = 0.0
    if code == 0:  # the common case gets a loop without the activation call, which vectorises
        for q in range(xr.shape[0]):
            gw = np.float64(dyr[q]) * wv[q]
            sa += gw
            sb += gw * ((np.float64(xr[q]) - m) * r)
        return sa, sb
    for q in range(xr.shape[0]):
        g, xhat = _g_at(xr[q], dyr[q], m, r, wv[q], bv[q], code, slope)
        gw = g * wv[q]
        sa += gw
        sb += gw * xhat
    return sa, sb


@njit(inline="always", **_OPTS)
def _row_params(xr, dyr, wv, bv, dwr, dbr, m, r, code, slope):
    """dw += g·x̂ and db += g along the row (this chunk's partial rows)."""
    if code == 0:
        for q in range(xr.shape[0]):
            g = np.float64(dyr[q])
            dwr[q] += g * ((np.float64(xr[q]) - m) * r)
            dbr[q] += g
        return
    for q in range(xr.shape[0]):
        g, xhat = _g_at(xr[q], dyr[q], m, r, wv[q], bv[q], code, slope)
        dwr[q] += g * xhat
        dbr[q] += g


@njit(**_REDUCE)
def _segment_sums(xr, dyr, wj, bj, m, r, code, slope):
    """One shared parameter along the segment: (Σ g, Σ g·x̂) (w is applied once, by the caller)."""
    sa = 0.0
    sb = 0.0
    if code == 0:
        for q in range(xr.shape[0]):
            g = np.float64(dyr[q])
            sa += g
            sb += g * ((np.float64(xr[q]) - m) * r)
        return sa, sb
    for q in range(xr.shape[0]):
        g, xhat = _g_at(xr[q], dyr[q], m, r, wj, bj, code, slope)
        sa += g
        sb += g * xhat
    return sa, sb


@njit(inline="always", **_OPTS)
def _dx_row(xr, dyr, dxr, wv, bv, m, r, mean_gx, mean_gxh, train, code, slope):
    """dx = r·(g·w − mean(g·w) − x̂·mean(g·w·x̂)) along a row (inference: dx = r·g·w)."""
    if code == 0 and train:  # the common case, in the data's dtype (see _split)
        mh, ml = _split(xr, m)
        dt = xr.dtype.type
        rr, a, c0 = dt(r), dt(mean_gxh), dt(mean_gx)
        for q in range(xr.shape[0]):
            dxr[q] = rr * (dyr[q] * wv[q] - c0 - ((xr[q] - mh) - ml) * rr * a)
        return
    for q in range(xr.shape[0]):
        g, xhat = _g_at(xr[q], dyr[q], m, r, wv[q], bv[q], code, slope)
        if train:
            dxr[q] = r * (g * wv[q] - mean_gx - xhat * mean_gxh)
        else:
            dxr[q] = r * g * wv[q]


@njit(inline="always", **_OPTS)
def _dx_segment(xr, dyr, dxr, wj, bj, m, r, mean_gx, mean_gxh, train, code, slope):
    """The same along a segment sharing one parameter (w, r and the means folded into three constants)."""
    if code == 0 and train:
        mh, ml = _split(xr, m)
        dt = xr.dtype.type
        a, bx, c0 = dt(r * wj), dt(r * r * mean_gxh), dt(r * mean_gx)
        for q in range(xr.shape[0]):
            dxr[q] = a * dyr[q] - bx * ((xr[q] - mh) - ml) - c0
        return
    for q in range(xr.shape[0]):
        g, xhat = _g_at(xr[q], dyr[q], m, r, wj, bj, code, slope)
        if train:
            dxr[q] = r * (g * wj - mean_gx - xhat * mean_gxh)
        else:
            dxr[q] = r * g * wj


@njit(inline="always", **_OPTS)
def _backward_group(x, dy, w, b, dx, mean, rstd, dwp, dbp, k, i, c, cg, s, train, center, need_x, code, slope):
    """Group (i, c): partial dweight/dbias into row k, and dx when ``need_x``."""
    P, Q = x.shape[1], x.shape[3]
    n = P * Q
    m = mean[i, c]
    r = rstd[i, c]
    base = c * cg
    sum_gx = 0.0
    sum_gxh = 0.0
    for p in range(P):
        xr = x[i, p, c]
        dyr = dy[i, p, c]
        if s == 1:
            wv = w[base : base + Q]
            bv = b[base : base + Q]
            sa, sb = _row_sums(xr, dyr, wv, bv, m, r, code, slope)
            _row_params(xr, dyr, wv, bv, dwp[k, base : base + Q], dbp[k, base : base + Q], m, r, code, slope)
            sum_gx += sa
            sum_gxh += sb
        else:
            for j in range(Q // s):
                sg, sgh = _segment_sums(xr[j * s : (j + 1) * s], dyr[j * s : (j + 1) * s], w[base + j],
                                        b[base + j], m, r, code, slope)
                dwp[k, base + j] += sgh
                dbp[k, base + j] += sg
                sum_gx += sg * w[base + j]
                sum_gxh += sgh * w[base + j]
    if not need_x or n == 0:
        return
    mean_gx = sum_gx / n if center else 0.0
    mean_gxh = sum_gxh / n
    for p in range(P):
        xr = x[i, p, c]
        dyr = dy[i, p, c]
        dxr = dx[i, p, c]
        if s == 1:
            _dx_row(xr, dyr, dxr, w[base : base + Q], b[base : base + Q], m, r, mean_gx, mean_gxh, train,
                    code, slope)
        else:
            for j in range(Q // s):
                _dx_segment(xr[j * s : (j + 1) * s], dyr[j * s : (j + 1) * s], dxr[j * s : (j + 1) * s],
                            w[base + j], b[base + j], m, r, mean_gx, mean_gxh, train, code, slope)


@njit(inline="always", **_OPTS)
def _backward_task(t, x, dy, w, b, dx, mean, rstd, dwp, dbp, chunk, cg, s, train, center, need_x, code, slope):
    """Task t = (chunk k of the Nn axis, group c): its groups and partial-parameter row k."""
    Nn, C = x.shape[0], x.shape[2]
    k = t // C
    c = t % C
    for i in range(k * chunk, min(Nn, (k + 1) * chunk)):
        _backward_group(x, dy, w, b, dx, mean, rstd, dwp, dbp, k, i, c, cg, s, train, center, need_x, code, slope)


@njit(parallel=True, **_OPTS)
def _backward_parallel(x, dy, w, b, dx, mean, rstd, dwp, dbp, chunk, cg, s, train, center, need_x, code, slope):
    for t in prange(dwp.shape[0] * x.shape[2]):
        _backward_task(t, x, dy, w, b, dx, mean, rstd, dwp, dbp, chunk, cg, s, train, center, need_x, code, slope)


@njit(**_OPTS)
def _backward_serial(x, dy, w, b, dx, mean, rstd, dwp, dbp, chunk, cg, s, train, center, need_x, code, slope):
    for t in range(dwp.shape[0] * x.shape[2]):
        _backward_task(t, x, dy, w, b, dx, mean, rstd, dwp, dbp, chunk, cg, s, train, center, need_x, code, slope)


# --------------------------------------------------------------------------- plans and entry points


def canonical(call):
    """(Nn, P, C, Q), Cg, S for the call's norm (channel axis 1 or -1, as declared)."""
    shape = tuple(int(v) for v in call.x.shape)
    kind = call.kind
    if kind in ("layer_norm", "rms_norm"):
        lead = len(shape) - len(call.axes)
        d = math.prod(shape[lead:])
        return (math.prod(shape[:lead]), 1, 1, d), d, 1
    n, first = shape[0], call.layout == "channels_first"
    ch = shape[1] if first else shape[-1]
    spatial = math.prod(shape[2:]) if first else math.prod(shape[1:-1])
    if kind == "batch_norm":
        return ((1, n, ch, spatial), 1, spatial) if first else ((1, n * spatial, ch, 1), 1, 1)
    if kind == "instance_norm":
        return ((n, 1, ch, spatial), 1, spatial) if first else ((n, spatial, ch, 1), 1, 1)
    groups = call.num_groups
    per = ch // groups
    return ((n, 1, groups, per * spatial), per, spatial) if first else ((n, spatial, groups, per), per, 1)


def _flat_param(p, fill, size, dtype):
    """The parameter as a flat array; ones/zeros when absent, so kernels never branch on it."""
    if p is None:
        return np.full(size, fill, dtype)
    return np.ascontiguousarray(p, dtype=dtype).reshape(-1)


def _run(parallel_kernel, serial_kernel, size, *args):
    """Serial below PARALLEL_MIN_ELEMENTS, else the parallel kernel under the threading policy."""
    if size < PARALLEL_MIN_ELEMENTS:
        serial_kernel(*args)
        return
    with _runtime.parallel_section():
        parallel_kernel(*args)


def norm_forward(call):
    """Forward of every norm on NumPy arrays; outputs ``(y, new_running_mean, new_running_var)``."""
    x = call.x
    (nn, p, c, q), cg, s = canonical(call)
    x4 = x.reshape(nn, p, c, q)
    y = np.empty_like(x)
    y4 = y.reshape(nn, p, c, q)
    w = _flat_param(call.weight, 1.0, c * cg, x.dtype)
    b = _flat_param(call.bias, 0.0, c * cg, x.dtype)
    train = bool(call.use_batch_stats)
    if train:
        mean = np.empty((nn, c))
        rstd = np.empty((nn, c))
    else:
        # Fresh writable float64 arrays: the kernel's signature must not depend on whether the
        # caller's running statistics are read-only (a broadcast view or a frozen array is).
        mean = np.empty((nn, c))
        rstd = np.empty((nn, c))
        mean[...] = np.asarray(call.running_mean, np.float64)
        rstd[...] = 1.0 / np.sqrt(np.asarray(call.running_var, np.float64) + call.eps)
    var = np.empty((nn, c))
    act_ = call.activation
    _run(_forward_parallel, _forward_serial, x.size,
         x4, w, b, y4, mean, rstd, var, cg, s, train, bool(call.center), call.eps, act_.code, act_.slope)
    new_rm = new_rv = None
    if train and call.update_running and x.size > 0:
        new_rm, new_rv = _updated_running(call, mean, var, p * q)
    residuals = (x, mean, rstd, call) if call.save else None
    return (y, new_rm, new_rv), residuals


def _updated_running(call, mean, var, n):
    """PyTorch's momentum update with the unbiased variance (batch-averaged for instance norm)."""
    m = call.momentum
    rm, rv = call.running_mean, call.running_var
    batch_mean = mean.mean(axis=0)
    batch_var = (var * (n / (n - 1))).mean(axis=0)
    return ((1.0 - m) * rm + m * batch_mean).astype(rm.dtype), ((1.0 - m) * rv + m * batch_var).astype(rv.dtype)


def norm_backward(residuals, cotangents, needs, out=None):
    """dx, dweight, dbias in one kernel (see the module docstring)."""
    x, mean, rstd, call = residuals
    out = out or {}
    (nn, p, c, q), cg, s = canonical(call)
    dy = np.ascontiguousarray(cotangents[0], dtype=x.dtype)
    w = _flat_param(call.weight, 1.0, c * cg, x.dtype)
    b = _flat_param(call.bias, 0.0, c * cg, x.dtype)
    need_x = "x" in needs
    dx = out.get("x") if need_x else None
    if need_x and (dx is None or not dx.flags.c_contiguous):
        dx = np.empty_like(x)
    dx4 = dx.reshape(nn, p, c, q) if need_x else np.empty((1, 1, 1, 1), x.dtype)
    chunk = max(1, -(-nn // 64))
    k = -(-nn // chunk) if nn else 1
    nparams = c * cg
    dwp = np.zeros((k, nparams))
    dbp = np.zeros((k, nparams))
    act_ = call.activation
    _run(_backward_parallel, _backward_serial, x.size,
         x.reshape(nn, p, c, q), dy.reshape(nn, p, c, q), w, b, dx4, mean, rstd, dwp, dbp, chunk, cg, s,
         bool(call.use_batch_stats), bool(call.center), need_x, act_.code, act_.slope)
    grads = {}
    if need_x:
        grads["x"] = _into(out, "x", dx)
    if "weight" in needs:
        grads["weight"] = _into(out, "weight", dwp.sum(axis=0).astype(x.dtype).reshape(call.weight.shape))
    if "bias" in needs:
        grads["bias"] = _into(out, "bias", dbp.sum(axis=0).astype(x.dtype).reshape(call.bias.shape))
    return grads


def _into(out, name, value):
    buffer = out.get(name)
    if buffer is None or buffer is value:
        return value
    buffer[...] = value
    return buffer
