"""Direct convolution for layers with very few input channels per group (LeNet's first layer).

With one or a few input channels per group, neither product form suits BLAS: im2col's products
are ``(positions, Cg·K) @ (Cg·K, Og)`` with an inner dimension of 25 and 6 output columns
(LeNet's first layer ran at ~10 GFLOP/s that way), the shifted products' inner dimension is
``Cg`` itself.  This path runs the multiply-adds as long vector loops instead, one input plane
and one output plane at a time, on the *padded grid*: for stride 1, output position
``(od, oh, ow)`` and tap ``t`` read the padded input at ``p + off_t`` with ``p = (od·Hp + oh)·Wp
+ ow`` and ``off_t = (td·dd·Hp + th·dh)·Wp + tw·dw``, so one tap of one input channel is::

    acc[p] += w[o, c, t] · xp[n, c].flat[p + off_t]        for p in [0, M)

a single loop over ``M`` (the last valid position + 1) that LLVM vectorises; positions with
``ow ≥ OW`` (the padding columns) are computed and dropped.  The backward uses the same
geometry: ``G`` (the gradient on the padded grid, zero on dropped positions) gives
``dW[o, c, t] = Σ_p G[p] · xp.flat[p + off_t]`` and ``dxp.flat[p + off_t] += w[o, c, t] · G[p]``.

Stride 1 and channels first only (see :func:`applies`); other small layers keep im2col.  The
forward runs one task per (image, output channel); the backward one task per block of images
(fixed by the shape), each with its own partial weight and bias gradients summed in order, so
results do not depend on the thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from portable_nn.kernel_codes import IDENTITY, keeps_output_only

from . import _runtime
from ._blas import span
from ._conv_common import Geometry, Outputs, cotangent
from ._runtime import into as _into
from .activations import apply_kind, deriv_kind, is_rectifier, rectifier_slope

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}

#: Groups whose im2col rows (input channels per group × taps) are at most this long take this path.
#: Measured fwd / bwd, 2 threads, Xeon with AVX-512: LeNet's first layer (128,1,28,28) 5x5 -> 6
#: (rows of 1 × 25, bwd for w and b) im2col 2.15 / 1.30 ms, direct 0.69 / 0.67 ms; its second
#: layer (128,6,12,12) 5x5 -> 16 (rows of 150) im2col 0.80 / 1.55 ms, direct 1.37 / 3.37 ms.
DIRECT_MAX_WIDTH = 32
#: Image blocks of the backward (each with a partial weight gradient).
BACKWARD_BLOCKS = 16


def applies(call, weight_shape) -> bool:
    """Stride 1, channels first, few input channels per group (see DIRECT_MAX_WIDTH), nothing empty."""
    if call.layout == "channels_last" or any(int(s) != 1 for s in call.stride):
        return False
    width = int(weight_shape[1]) * math.prod(int(k) for k in call.kernel)
    return (0 < width <= DIRECT_MAX_WIDTH and call.x.size > 0 and int(weight_shape[0]) > 0
            and all(int(s) > 0 for s in call.out_size))


class DirectPlan:
    """The canonical 3-D geometry of a stride-1 call on its padded input."""

    def __init__(self, call, weight_shape):
        g = Geometry(call, weight_shape)
        n, o, cg, out = g.n, g.o, g.cg, g.out
        hp, wp = g.padded_shape[3], g.padded_shape[4]
        reach = g.tap_reach()
        self.tap_off = ((reach[:, 0] * hp + reach[:, 1]) * wp + reach[:, 2]).astype(np.int64)
        m = ((out[0] - 1) * hp + (out[1] - 1)) * wp + out[2]
        self.geo = np.array([n, g.channels, g.groups, cg, g.og, o, g.taps, out[0], out[1], out[2], hp, wp, m],
                            dtype=np.int64)
        self.n, self.o, self.cg, self.taps, self.kernel = n, o, cg, g.taps, g.kernel
        self.padded_shape, self.padded, self.interior = g.padded_shape, g.padded, g.interior
        self.y5 = (n, o, *out)
        self.out_shape, self.x_shape, self.macs = g.out_shape, g.x_shape, g.macs


(N_, C_, G_, CG_, OG_, O_, K_, OD_, OH_, OW_, HP_, WP_, M_) = range(13)


# --------------------------------------------------------------------------- forward


@njit(inline="always", **_OPTS)
def _write_plane(acc, y5, z5, n, o, bo, geo, keep_z, kind, code, slope):
    """y[n, o] = act(acc + b) on the valid positions of the padded grid (z = acc + b when kept)."""
    hp, wp, ow_n = geo[HP_], geo[WP_], geo[OW_]
    for od in range(geo[OD_]):
        for oh in range(geo[OH_]):
            src = acc[(od * hp + oh) * wp : (od * hp + oh) * wp + ow_n]
            yr = y5[n, o, od, oh]
            if keep_z:
                zr = z5[n, o, od, oh]
                for ow in range(ow_n):
                    zr[ow] = src[ow] + bo
            for ow in range(ow_n):
                yr[ow] = apply_kind(np.float64(src[ow] + bo), kind, code, slope)


@njit(**_OPTS)
def _write(acc, y5, z5, n, o, bo, geo, keep_z, code, slope):
    """The identity or a rectifier (``kernels_cpu.conv`` applies every other activation as a pass
    of its own over the output, so only these two loop nests are compiled)."""
    if code == IDENTITY:
        _write_plane(acc, y5, z5, n, o, bo, geo, keep_z, 0, code, slope)
    else:
        _write_plane(acc, y5, z5, n, o, bo, geo, keep_z, 1, code, rectifier_slope(code, slope))


@njit(inline="always", **_OPTS)
def _forward_task(k, xf, w3, b, y5, z5, geo, tap_off, keep_z, code, slope):
    """Output plane k = (image n, output channel o): Σ over the group's channels and the taps."""
    n, o = k // geo[O_], k % geo[O_]
    cg, m = geo[CG_], geo[M_]
    plane = xf.shape[2]
    c0 = (o // geo[OG_]) * cg
    acc = np.zeros(m, xf.dtype)
    for ci in range(cg):
        src = xf[n, c0 + ci]
        for t in range(geo[K_]):
            wv = w3[o, ci, t]
            s = src[tap_off[t] : min(plane, tap_off[t] + m)]
            for p in range(m):
                acc[p] += wv * s[p]
    _write(acc, y5, z5, n, o, b[o], geo, keep_z, code, slope)


@njit(parallel=True, **_OPTS)
def _forward_parallel(xf, w3, b, y5, z5, geo, tap_off, keep_z, code, slope):
    for k in prange(geo[N_] * geo[O_]):
        _forward_task(np.int64(k), xf, w3, b, y5, z5, geo, tap_off, keep_z, code, slope)


@njit(**_OPTS)
def _forward_serial(xf, w3, b, y5, z5, geo, tap_off, keep_z, code, slope):
    for k in range(geo[N_] * geo[O_]):
        _forward_task(k, xf, w3, b, y5, z5, geo, tap_off, keep_z, code, slope)


# --------------------------------------------------------------------------- backward


@njit(inline="always", **_OPTS)
def _grad_plane(g, dy5, k5, n, o, geo, kind, code, slope, from_output):
    """g on the padded grid (zero on dropped positions) = dy · act'(kept) on the valid ones; returns Σ g."""
    hp, wp, ow_n = geo[HP_], geo[WP_], geo[OW_]
    g[:] = 0.0
    total = 0.0
    for od in range(geo[OD_]):
        for oh in range(geo[OH_]):
            dst = g[(od * hp + oh) * wp : (od * hp + oh) * wp + ow_n]
            d = dy5[n, o, od, oh]
            kv = k5[n, o, od, oh]
            for ow in range(ow_n):
                dst[ow] = d[ow] * deriv_kind(np.float64(kv[ow]), kind, code, slope, from_output)
            for ow in range(ow_n):
                total += dst[ow]
    return total


@njit(**_OPTS)
def _grad(g, dy5, k5, n, o, geo, code, slope, from_output):
    if code == IDENTITY:
        return _grad_plane(g, dy5, k5, n, o, geo, 0, code, slope, from_output)
    if is_rectifier(code) and from_output:
        return _grad_plane(g, dy5, k5, n, o, geo, 1, code, rectifier_slope(code, slope), from_output)
    return _grad_plane(g, dy5, k5, n, o, geo, 2, code, slope, from_output)


@njit(**{**_OPTS, "fastmath": {"reassoc"}})
def _dot(a, b):
    """Σ a·b in the data's dtype (vectorised: reassociation is allowed, the compiled order is fixed), as float64."""
    total = a.dtype.type(0.0)
    for p in range(a.shape[0]):
        total += a[p] * b[p]
    return np.float64(total)


@njit(inline="always", **_OPTS)
def _valid_dot(g, s, geo):
    """Σ g[p] · s[p] over the valid output positions only.  The padded grid's dropped columns hold
    G = 0, and 0 · ±inf is NaN: where an infinite input sits only under dropped positions of a tap,
    the whole-grid dot product is NaN while the tap's true sum (the reference's, PyTorch's) is not.
    Taken only when that dot product is not finite, so finite data keeps its bits."""
    hp, wp, ow = geo[HP_], geo[WP_], geo[OW_]
    end = min(g.shape[0], s.shape[0])
    total = 0.0
    for od in range(geo[OD_]):
        for oh in range(geo[OH_]):
            base = (od * hp + oh) * wp
            for p in range(base, min(base + ow, end)):
                total += g[p] * s[p]
    return total


@njit(inline="always", **_OPTS)
def _add_valid(dst, wv, g, geo):
    """dst[p] += wv · g[p] over the valid output positions only, for an infinite weight (see
    :func:`_valid_dot`: the dropped columns' zeros would write NaN where no real tap reaches)."""
    hp, wp, ow = geo[HP_], geo[WP_], geo[OW_]
    end = min(g.shape[0], dst.shape[0])
    for od in range(geo[OD_]):
        for oh in range(geo[OH_]):
            base = (od * hp + oh) * wp
            for p in range(base, min(base + ow, end)):
                dst[p] += wv * g[p]


@njit(inline="always", **_OPTS)
def _backward_task(k, blocks, xf, w3, dy5, k5, dxf, dwp, dbp, geo, tap_off, code, slope, from_output, need_x,
                   need_w):
    """Images [n0, n1) of block k: their G planes, the block's partial dW and dbias, and dx of its images."""
    n0, n1 = span(k, blocks, geo[N_])
    cg, m, taps = geo[CG_], geo[M_], geo[K_]
    plane = xf.shape[2]
    g = np.empty(m, xf.dtype)
    dw, db = dwp[k], dbp[k]
    for n in range(n0, n1):
        if need_x:
            dxf[n] = 0.0
        for o in range(geo[O_]):
            db[o] += _grad(g, dy5, k5, n, o, geo, code, slope, from_output)
            c0 = (o // geo[OG_]) * cg
            for ci in range(cg):
                src = xf[n, c0 + ci]
                for t in range(taps):
                    s = src[tap_off[t] : min(plane, tap_off[t] + m)]
                    if need_w:
                        d = _dot(g, s)
                        if not math.isfinite(d):  # (an infinite x: see _valid_dot)
                            d = _valid_dot(g, s, geo)
                        dw[o, ci, t] += d
                    if need_x:
                        wv = w3[o, ci, t]
                        dst = dxf[n, c0 + ci][tap_off[t] : min(plane, tap_off[t] + m)]
                        if math.isfinite(wv):
                            for p in range(m):
                                dst[p] += wv * g[p]
                        else:
                            _add_valid(dst, wv, g, geo)


@njit(parallel=True, **_OPTS)
def _backward_parallel(blocks, xf, w3, dy5, k5, dxf, dwp, dbp, geo, tap_off, code, slope, from_output, need_x,
                       need_w):
    for k in prange(blocks):
        _backward_task(np.int64(k), blocks, xf, w3, dy5, k5, dxf, dwp, dbp, geo, tap_off, code, slope, from_output,
                       need_x, need_w)


@njit(**_OPTS)
def _backward_serial(blocks, xf, w3, dy5, k5, dxf, dwp, dbp, geo, tap_off, code, slope, from_output, need_x,
                     need_w):
    for k in range(blocks):
        _backward_task(k, blocks, xf, w3, dy5, k5, dxf, dwp, dbp, geo, tap_off, code, slope, from_output, need_x,
                       need_w)


# --------------------------------------------------------------------------- entry points


class Residuals:
    """The padded input, the weights as (O, Cg, K), the kept y or z, the plan, the call, the size flag."""

    __slots__ = ("call", "kept", "parallel", "plan", "w3", "xp")

    def __init__(self, xp, w3, kept, plan, call, parallel):
        self.xp, self.w3, self.kept, self.plan, self.call, self.parallel = xp, w3, kept, plan, call, parallel


def conv_forward(call, plan, parallel, xp):
    """y = act(conv(x, weight) + bias) by direct loops on the padded input ``xp``; residuals:
    :class:`Residuals` (when saving)."""
    weight = call.weight
    dtype = xp.dtype
    xf = xp.reshape(plan.n, xp.shape[1], -1)
    w3 = np.ascontiguousarray(weight.reshape(plan.o, plan.cg, plan.taps))
    b = np.zeros(plan.o, dtype) if call.bias is None else call.bias
    act_ = call.activation
    out = Outputs(call, plan.out_shape, dtype)
    _runtime.run_sized(_forward_parallel, _forward_serial, parallel, xf, w3, b, out.y.reshape(plan.y5),
                       out.z.reshape(plan.y5), plan.geo, plan.tap_off, out.keep_z, act_.code, act_.slope)
    residuals = None
    if call.save:
        residuals = Residuals(xp, w3, out.kept(), plan, call.replace(arrays={}), parallel)
    return (out.y,), residuals


def conv_backward(residuals: Residuals, cotangents, needs, out=None):
    """dx, dweight, dbias by direct loops (see the module docstring); only what ``needs`` asks for."""
    xp, w3, kept, plan, call = residuals.xp, residuals.w3, residuals.kept, residuals.plan, residuals.call
    out = out or {}
    dtype = xp.dtype
    dy5 = cotangent(cotangents, dtype, plan.y5)
    k5 = dy5 if kept is None else kept.reshape(plan.y5)
    act_ = call.activation
    need_x, need_w = "x" in needs, "weight" in needs
    blocks = max(1, min(plan.n, BACKWARD_BLOCKS))
    dwp = np.zeros((blocks, plan.o, plan.cg, plan.taps))
    dbp = np.zeros((blocks, plan.o))
    dxp = _runtime.empty(plan.padded_shape, dtype) if need_x else np.empty((1, 1, 1, 1, 1), dtype)
    xf = xp.reshape(plan.n, xp.shape[1], -1)
    _runtime.run_sized(_backward_parallel, _backward_serial, residuals.parallel and blocks > 1, blocks, xf, w3, dy5,
                       k5, dxp.reshape(dxp.shape[0], dxp.shape[1], -1), dwp, dbp, plan.geo, plan.tap_off,
                       act_.code, act_.slope, keeps_output_only(act_), need_x, need_w)
    grads = {}
    if need_x:
        dx = np.ascontiguousarray(dxp[plan.interior]).reshape(plan.x_shape) if plan.padded else dxp.reshape(
            plan.x_shape)
        grads["x"] = _into(out, "x", dx)
    if need_w:
        dw = dwp.sum(axis=0).astype(dtype).reshape(plan.o, plan.cg, *call.kernel)
        grads["weight"] = _into(out, "weight", dw)
    if "bias" in needs:
        grads["bias"] = _into(out, "bias", dbp.sum(axis=0).astype(dtype))
    return grads
