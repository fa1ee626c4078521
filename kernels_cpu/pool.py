"""Numba kernels for ``max_pool`` and ``avg_pool``, forward and backward (backend ``"numba"``).

Every call (1-D to 3-D, channels first or last, batched or not) runs on one
canonical view of the C-contiguous ``x``: ``B`` flat planes of ``S·K`` values,
``S = D·H·W`` spatial positions of ``K`` contiguous channels each

=================  ==========  =====
layout             B           K
=================  ==========  =====
channels first     N·C (or C)  1
channels last      N (or 1)    C
=================  ==========  =====

1-D and 2-D pools are 3-D pools with leading spatial axes of size 1 (window 1,
stride 1, no padding), so one compiled kernel per dtype and op serves every
case: the op travels in an argument's type (avg_pool's scratch rows, ``None``
for max_pool), so a call compiles its own op's paths only; the layout and
whether indices are kept are runtime flags tested once per task, outside the
loops.

**Windows as boxes.**  Along one axis, output ``o`` reads input positions
``o·stride − padding + t·dilation``; the offsets ``t`` that land inside ``x``
form a range (padding and the extra room of ``ceil_mode`` fall outside it).  Per
axis and output, a small table (cached per geometry) holds that range's length
and the flat position of its first element, so every window is a box of
positions inside ``x``: the loops carry no bounds checks and no divisions.

**max_pool.**  A window's maximum starts at the box's first position and is
replaced when ``v > best`` (a register select: ties keep the earlier position,
so the gradient goes to the first maximum in row-major window order, as in
PyTorch and the reference).  A window holding NaN must output NaN with the
*last* NaN's position: NaN is tracked as a flag, and only such windows are
recomputed with the exact rule ``v > best or v is NaN`` from −∞.  A window of
padding only outputs −∞ and index −1 (no gradient).  With a backward to come,
the winning flat position per output is kept (``int32``, the output's size);
the backward zeroes each plane of ``dx`` and adds every ``dy`` at its index.

**avg_pool.**  Window sums accumulate in float64 in window order and are divided
by the divisor the api computed (the product of the per-axis divisors that
encode ``count_include_pad`` and ``ceil_mode``).  The backward adds
``dy / divisor`` over each box.

**Fast rows.**  The dominant pooling — channels first, windows 2 wide with
stride 2 along W, fully inside ``x`` — has row kernels with constant strides
that LLVM vectorizes (2x2 windows: one straight-line pass per output row).
Their stores are unconditional: LLVM turns a store that may rewrite the loaded
value into an AVX2 masked store, which is microcoded on AMD cores.

**Parallelism.**  Forward tasks are (plane, block of output rows); backward
tasks are (plane, channel chunk), so that each task owns the ``dx`` it scatters
into and every element's summation order is fixed: results do not depend on the
thread count.  Calls below :data:`PARALLEL_MIN_WORK` element visits run serially.

**max_unpool.**  Each task owns one plane (and channel chunk) of ``y``: every position is
claimed by the last entry (in ``x``'s order) that names it, so the last of duplicate indices
wins on every thread count, then ``y`` gathers from the claims.  The backward gives each entry
``dy`` at its index if it holds the claim, else 0 (an overwritten entry does not reach ``y``).

**Supported** (declared in ``kernels_cpu/__init__.py``): NumPy and CPU torch
float32/float64, C-contiguous (dispatch copies strided input), layouts
``channels_first`` and ``channels_last``, batched or unbatched, 1-D to 3-D, every
window/stride/padding/dilation/ceil_mode/count_include_pad the api accepts.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import njit, prange

from . import _runtime
from ._runtime import into as _into

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}
#: Element visits (output size × window size + input size) below which a call runs serially:
#: the thread pool's start-up cost exceeds the gain under ~50 us of work (measured on 2 cores).
PARALLEL_MIN_WORK = 1 << 16
#: Channels per backward task in the channels-last layout (bounds the task's scatter region).
CHANNEL_CHUNK = 64
#: Forward tasks wanted per call: planes are split into blocks of output rows when there are fewer.
MIN_TASKS = 64


# --------------------------------------------------------------------------- forward
#
# Geometry arguments of every kernel (see _Plan):
#   box   int64 (3, Omax, 2): per axis (d, h, w) and output index, the number of window offsets
#         inside x and the flat position (in S) contributed by the first of them;
#   steps int64 (3,): the flat distance between consecutive window offsets per axis
#         (dilation · H·W, dilation · W, dilation);
#   outs  int64 (3,): OD, OH, OW;
#   div   float64 (3, Omax): the per-axis avg divisors (their product divides each window).
# Every index is converted to unsigned at the access (_u): Numba then drops the negative-index
# wraparound code, which otherwise blocks vectorization and doubles the cost of short loops.
#
# Compile time: the row kernels are called once per output row, not inlined (Numba inlines by
# copying a function's IR into every caller before typing: both drivers, both ops, every
# branch), except the 2x2 rows, whose short rows lost 2x (avg) as calls.  With the op in a type
# (see _op_scratch), the pool family's every-variant compile, float32, 2 cores: 30.0 s for both
# ops -> 7.4 s max_pool, 8.7 s avg_pool; run times unchanged within 2% (max 2x2 NHWC
# (32, 56, 56, 64) 1.25 vs 1.27 ms, medians of 101).


@njit(inline="always", **_OPTS)
def _u(i):
    """The final index of an access, unsigned (int arithmetic on it turns it back into int64)."""
    return np.uint64(i)


@njit(**_OPTS)
def _max_exact(xp, K, k, first, nd, nh, nw, steps):
    """The reference rule on one window: take when v > best or v is NaN, from −∞.

    Only windows that hold a NaN come here (the last NaN wins, as in PyTorch's CPU kernels).
    Called, not inlined: inlined into its four callers it made max_pool's first compilation
    41.8 s instead of 29.3 s, for a path no NaN-free window takes (forward speed the same within
    3%, A/B in one process).
    """
    best = -np.inf
    bi = first
    for a in range(nd):
        for c in range(nh):
            q = first + a * steps[0] + c * steps[1]
            for e in range(nw):
                p = q + e * steps[2]
                v = np.float64(xp[_u(p * K + k)])
                if v > best or v != v:
                    best = v
                    bi = p
    return best, bi


@njit(inline="always", **_OPTS)
def _max_scalar(xp, first, nd, nh, nw, steps):
    """(max, flat position of the first max) over one window of a channels-first plane."""
    best = xp[_u(first)]
    bi = first
    nan = 0
    for a in range(nd):
        for c in range(nh):
            q = first + a * steps[0] + c * steps[1]
            for e in range(nw):
                p = q + e * steps[2]
                v = xp[_u(p)]
                take = v > best
                best = v if take else best
                bi = p if take else bi
                nan |= np.int32(v != v)
    if nan:
        return _max_exact(xp, 1, 0, first, nd, nh, nw, steps)
    return np.float64(best), bi


@njit(inline="always", **_OPTS)
def _avg_scalar(xp, first, nd, nh, nw, steps):
    """Σ over one window of a channels-first plane, in row-major window order."""
    acc = 0.0
    for a in range(nd):
        for c in range(nh):
            q = first + a * steps[0] + c * steps[1]
            for e in range(nw):
                acc += xp[_u(q + e * steps[2])]
    return acc


@njit(inline="always", **_OPTS)
def _max_vector(xp, yp, yo, jp, jo, K, first, nd, nh, nw, steps):
    """Max over one window for all K channels at once (channels last), into yp[yo:] and jp[jo:]."""
    yo = _u(yo)
    jo = _u(jo)
    xf = _u(first * K)
    for k in range(K):
        yp[_u(yo + k)] = xp[_u(xf + k)]
        jp[_u(jo + k)] = first
    nan = 0
    for a in range(nd):
        for c in range(nh):
            q = first + a * steps[0] + c * steps[1]
            for e in range(nw):
                p = q + e * steps[2]
                pi = np.int32(p)
                xr = _u(p * K)
                for k in range(K):
                    # Unconditional stores (np.maximum, an integer blend): a conditional
                    # store becomes an AVX2 masked store, which is microcoded on AMD cores.
                    v = xp[_u(xr + k)]
                    cur = yp[_u(yo + k)]
                    jc = jp[_u(jo + k)]
                    yp[_u(yo + k)] = np.maximum(v, cur)
                    jp[_u(jo + k)] = jc + np.int32(v > cur) * (pi - jc)
                    nan |= np.int32(v != v)
    if nan:
        for k in range(K):
            best, bi = _max_exact(xp, K, k, first, nd, nh, nw, steps)
            yp[_u(yo + k)] = best
            jp[_u(jo + k)] = bi


@njit(inline="always", **_OPTS)
def _avg_vector(xp, acc, K, first, nd, nh, nw, steps):
    """Σ over one window into the float64 row ``acc`` (all K channels)."""
    acc[:] = 0.0
    for a in range(nd):
        for c in range(nh):
            q = first + a * steps[0] + c * steps[1]
            for e in range(nw):
                xr = _u((q + e * steps[2]) * K)
                for k in range(K):
                    acc[k] += xp[_u(xr + k)]


@njit(inline="always", **_OPTS)
def _row_geometry(box, div, outs, od, oh):
    """(nd, nh, first position of the d and h offsets, d·h divisor, first output) of row (od, oh)."""
    base = box[0, od, 1] + box[1, oh, 1]
    return box[0, od, 0], box[1, oh, 0], base, div[0, od] * div[1, oh], (od * outs[1] + oh) * outs[2]


@njit(**_OPTS)
def _max_row_cf(xp, yp, jp, box, div, steps, outs, od, oh, save):
    """Max over every window of output row (od, oh) of a channels-first plane (any geometry)."""
    nd, nh, base, _, row = _row_geometry(box, div, outs, od, oh)
    for ow in range(outs[2]):
        nw = box[2, ow, 0]
        o = _u(row + ow)
        if nd * nh * nw == 0:
            yp[o] = -np.inf
            bi = -1
        else:
            best, bi = _max_scalar(xp, base + box[2, ow, 1], nd, nh, nw, steps)
            yp[o] = best
        if save:
            jp[o] = bi


@njit(**_OPTS)
def _avg_row_cf(xp, yp, box, div, steps, outs, od, oh):
    """Average over every window of output row (od, oh) of a channels-first plane."""
    nd, nh, base, dh_div, row = _row_geometry(box, div, outs, od, oh)
    for ow in range(outs[2]):
        nw = box[2, ow, 0]
        total = 0.0
        if nd * nh * nw != 0:
            total = _avg_scalar(xp, base + box[2, ow, 1], nd, nh, nw, steps)
        yp[_u(row + ow)] = total / (dh_div * div[2, ow])


@njit(**_OPTS)
def _max_row_cl(xp, yp, jp, K, box, div, steps, outs, od, oh, jscratch, save):
    """Max over output row (od, oh) of a channels-last plane; indices go to jscratch unless saved."""
    nd, nh, base, _, row = _row_geometry(box, div, outs, od, oh)
    for ow in range(outs[2]):
        nw = box[2, ow, 0]
        o = (row + ow) * K
        if nd * nh * nw == 0:
            for k in range(K):
                yp[_u(o + k)] = -np.inf
                if save:
                    jp[_u(o + k)] = -1
        elif save:
            _max_vector(xp, yp, o, jp, o, K, base + box[2, ow, 1], nd, nh, nw, steps)
        else:
            _max_vector(xp, yp, o, jscratch, 0, K, base + box[2, ow, 1], nd, nh, nw, steps)


@njit(**_OPTS)
def _avg_row_cl(xp, yp, K, box, div, steps, outs, od, oh, acc):
    """Average over output row (od, oh) of a channels-last plane (float64 channel row ``acc``)."""
    nd, nh, base, dh_div, row = _row_geometry(box, div, outs, od, oh)
    for ow in range(outs[2]):
        nw = box[2, ow, 0]
        if nd * nh * nw == 0:
            acc[:] = 0.0
        else:
            _avg_vector(xp, acc, K, base + box[2, ow, 1], nd, nh, nw, steps)
        divisor = dh_div * div[2, ow]
        o = (row + ow) * K
        for k in range(K):
            yp[_u(o + k)] = acc[k] / divisor


@njit(**_OPTS)
def _avg_row_pairs(xp, yp, box, div, steps, outs, od, oh, acc):
    """_avg_row_cf for full width-2, stride-2 windows along W (``_Plan.pairs``).

    The constant stride lets LLVM vectorize the row with interleaved loads.
    """
    nd, nh, base, dh_div, row = _row_geometry(box, div, outs, od, oh)
    OW = outs[2]
    src0 = base + box[2, 0, 1]
    for i in range(OW):
        acc[i] = 0.0
    for a in range(nd):
        for c in range(nh):
            src = _u(src0 + a * steps[0] + c * steps[1])
            for i in range(OW):
                acc[i] += np.float64(xp[_u(src + 2 * i)]) + np.float64(xp[_u(src + 2 * i + 1)])
    for i in range(OW):
        yp[_u(row + i)] = acc[i] / (dh_div * div[2, i])


@njit(inline="always", **_OPTS)
def _avg_row_2x2(xp, yp, box, div, steps, outs, od, oh):
    """_avg_row_cf for a row of full 2x2, stride-2 windows: one vectorized pass."""
    _, _, base, dh_div, row = _row_geometry(box, div, outs, od, oh)
    r0 = base + box[2, 0, 1]
    r1 = r0 + steps[1]
    for i in range(outs[2]):
        p0 = r0 + 2 * i
        p2 = r1 + 2 * i
        top = np.float64(xp[_u(p0)]) + np.float64(xp[_u(p0 + 1)])
        bottom = np.float64(xp[_u(p2)]) + np.float64(xp[_u(p2 + 1)])
        yp[_u(row + i)] = (top + bottom) / (dh_div * div[2, i])


@njit(inline="always", **_OPTS)
def _max_row_2x2(xp, yp, jp, box, div, steps, outs, od, oh, save, jscratch):
    """_max_row_cf for a row of full 2x2, stride-2 windows (``pairs`` and two window rows).

    Each window is straight-line code with register selects and one unconditional store per
    output, so LLVM vectorizes along the row: the maximum by ``v > best`` in window order,
    then the first position holding it (the first maximum, as the sequential rule gives).
    A conditional store would become an AVX2 masked store (microcoded on AMD cores).  Rows
    holding a NaN are redone by the exact per-window path.
    """
    _, _, base, _, row = _row_geometry(box, div, outs, od, oh)
    OW = outs[2]
    r0 = base + box[2, 0, 1]
    r1 = r0 + steps[1]
    jo = jp if save else jscratch
    jrow = row if save else 0
    nan = 0
    for i in range(OW):
        p0 = r0 + 2 * i
        p2 = r1 + 2 * i
        v0, v1 = xp[_u(p0)], xp[_u(p0 + 1)]
        v2, v3 = xp[_u(p2)], xp[_u(p2 + 1)]
        b = v0
        b = v1 if v1 > b else b
        b = v2 if v2 > b else b
        b = v3 if v3 > b else b
        k = p2 + 1
        k = p2 if v2 == b else k
        k = p0 + 1 if v1 == b else k
        k = p0 if v0 == b else k
        yp[_u(row + i)] = b
        jo[_u(jrow + i)] = k
        nan |= np.int32(v0 != v0) | np.int32(v1 != v1) | np.int32(v2 != v2) | np.int32(v3 != v3)
    if nan:
        _max_row_cf(xp, yp, jp, box, div, steps, outs, od, oh, save)


@njit(inline="always", **_OPTS)
def _forward_task(x, y, j, K, box, div, steps, outs, t, blocks, accs, jscratch, save, pairs):
    """Task t = (plane b, block of its output rows); plane views are taken once per task.

    ``accs`` is ``None`` for max_pool (see :func:`_op_scratch`), so each op compiles its own paths only.
    """
    b = t // blocks
    rows = outs[0] * outs[1]
    per = -(-rows // blocks)
    steps = (steps[0], steps[1], steps[2])
    outs = (outs[0], outs[1], outs[2])
    xp = x[b]
    yp = y[b]
    jp = j[b] if save else j[0]
    r0 = (t % blocks) * per
    r1 = min(rows, r0 + per)
    OH = outs[1]
    if accs is None:
        if K == 1:
            for r in range(r0, r1):
                od, oh = r // OH, r % OH
                if pairs and box[0, od, 0] == 1 and box[1, oh, 0] == 2:
                    _max_row_2x2(xp, yp, jp, box, div, steps, outs, od, oh, save, jscratch[t])
                else:
                    _max_row_cf(xp, yp, jp, box, div, steps, outs, od, oh, save)
        else:
            for r in range(r0, r1):
                _max_row_cl(xp, yp, jp, K, box, div, steps, outs, r // OH, r % OH, jscratch[t], save)
    elif pairs:
        for r in range(r0, r1):
            od, oh = r // OH, r % OH
            if box[0, od, 0] == 1 and box[1, oh, 0] == 2:
                _avg_row_2x2(xp, yp, box, div, steps, outs, od, oh)
            else:
                _avg_row_pairs(xp, yp, box, div, steps, outs, od, oh, accs[t])
    elif K == 1:
        for r in range(r0, r1):
            _avg_row_cf(xp, yp, box, div, steps, outs, r // OH, r % OH)
    else:
        for r in range(r0, r1):
            _avg_row_cl(xp, yp, K, box, div, steps, outs, r // OH, r % OH, accs[t])


@njit(parallel=True, **_OPTS)
def _forward_parallel(x, y, j, K, box, div, steps, outs, blocks, accs, jscratch, save, pairs):
    for t in prange(x.shape[0] * blocks):
        _forward_task(x, y, j, K, box, div, steps, outs, t, blocks, accs, jscratch, save, pairs)


@njit(**_OPTS)
def _forward_serial(x, y, j, K, box, div, steps, outs, blocks, accs, jscratch, save, pairs):
    for t in range(x.shape[0] * blocks):
        _forward_task(x, y, j, K, box, div, steps, outs, t, blocks, accs, jscratch, save, pairs)


# --------------------------------------------------------------------------- backward


@njit(**_OPTS)
def _max_scatter_cf(dyp, dxp, jp):
    """dx[j[o]] += dy[o] over one channels-first plane (dx zeroed)."""
    for o in range(dyp.shape[0]):
        p = jp[_u(o)]
        if p >= 0:
            dxp[_u(p)] += dyp[_u(o)]


@njit(**_OPTS)
def _max_scatter_cl(dyp, dxp, jp, K, k0, k1):
    """dx[j[o, k], k] += dy[o, k] over the channels [k0, k1) of one channels-last plane."""
    for o in range(dyp.shape[0] // K):
        for k in range(k0, k1):
            p = jp[_u(o * K + k)]
            if p >= 0:
                dxp[_u(p * K + k)] += dyp[_u(o * K + k)]


@njit(**_OPTS)
def _avg_scatter_cf(dyp, dxp, box, div, steps, outs):
    """dx += dy / divisor over every window of one channels-first plane (dx zeroed)."""
    for od in range(outs[0]):
        for oh in range(outs[1]):
            nd, nh, base, dh_div, row = _row_geometry(box, div, outs, od, oh)
            for ow in range(outs[2]):
                g = np.float64(dyp[_u(row + ow)]) / (dh_div * div[2, ow])
                first = base + box[2, ow, 1]
                for a in range(nd):
                    for c in range(nh):
                        q = first + a * steps[0] + c * steps[1]
                        for e in range(box[2, ow, 0]):
                            dxp[_u(q + e * steps[2])] += g


@njit(**_OPTS)
def _avg_scatter_pairs(dyp, dxp, box, div, steps, outs, g):
    """_avg_scatter_cf for full width-2, stride-2 windows along W, vectorized along rows."""
    OW = outs[2]
    for od in range(outs[0]):
        for oh in range(outs[1]):
            nd, nh, base, dh_div, row = _row_geometry(box, div, outs, od, oh)
            for i in range(OW):
                g[i] = np.float64(dyp[_u(row + i)]) / (dh_div * div[2, i])
            src0 = base + box[2, 0, 1]
            for a in range(nd):
                for c in range(nh):
                    dst = _u(src0 + a * steps[0] + c * steps[1])
                    for i in range(OW):
                        dxp[_u(dst + 2 * i)] += g[i]
                        dxp[_u(dst + 2 * i + 1)] += g[i]


@njit(**_OPTS)
def _avg_scatter_cl(dyp, dxp, K, box, div, steps, outs, k0, k1, g):
    """The same over the channels [k0, k1) of one channels-last plane; ``g`` is a scratch row."""
    n = k1 - k0
    for od in range(outs[0]):
        for oh in range(outs[1]):
            nd, nh, base, dh_div, row = _row_geometry(box, div, outs, od, oh)
            for ow in range(outs[2]):
                divisor = dh_div * div[2, ow]
                o = _u((row + ow) * K + k0)
                for k in range(n):
                    g[k] = np.float64(dyp[_u(o + k)]) / divisor
                first = base + box[2, ow, 1]
                for a in range(nd):
                    for c in range(nh):
                        q = first + a * steps[0] + c * steps[1]
                        for e in range(box[2, ow, 0]):
                            p = _u((q + e * steps[2]) * K + k0)
                            for k in range(n):
                                dxp[_u(p + k)] += g[k]


@njit(inline="always", **_OPTS)
def _backward_task(dy, dx, j, K, box, div, steps, outs, t, chunks, chunk, scratch, pairs):
    """Task t = (plane b, channel chunk): zero its part of dx, then scatter into it.

    ``scratch`` is ``None`` for max_pool (see :func:`_op_scratch`).
    """
    b = t // chunks
    k0 = (t % chunks) * chunk
    k1 = min(K, k0 + chunk)
    steps = (steps[0], steps[1], steps[2])
    outs = (outs[0], outs[1], outs[2])
    dxp = dx[b]
    dyp = dy[b]
    if K == 1:
        dxp[:] = 0.0
        if scratch is None:
            _max_scatter_cf(dyp, dxp, j[b])
        elif pairs:
            _avg_scatter_pairs(dyp, dxp, box, div, steps, outs, scratch[t])
        else:
            _avg_scatter_cf(dyp, dxp, box, div, steps, outs)
        return
    for p in range(dxp.shape[0] // K):
        for k in range(k0, k1):
            dxp[_u(p * K + k)] = 0.0
    if scratch is None:
        _max_scatter_cl(dyp, dxp, j[b], K, k0, k1)
    else:
        _avg_scatter_cl(dyp, dxp, K, box, div, steps, outs, k0, k1, scratch[t])


@njit(parallel=True, **_OPTS)
def _backward_parallel(dy, dx, j, K, box, div, steps, outs, chunks, chunk, scratch, pairs):
    for t in prange(dx.shape[0] * chunks):
        _backward_task(dy, dx, j, K, box, div, steps, outs, t, chunks, chunk, scratch, pairs)


@njit(**_OPTS)
def _backward_serial(dy, dx, j, K, box, div, steps, outs, chunks, chunk, scratch, pairs):
    for t in range(dx.shape[0] * chunks):
        _backward_task(dy, dx, j, K, box, div, steps, outs, t, chunks, chunk, scratch, pairs)


# --------------------------------------------------------------------------- plans and entry points


class _Plan:
    """The canonical (B, S, K) view and the window tables of one pooling call (see the module docstring)."""

    __slots__ = ("B", "K", "box", "div", "outs", "pairs", "spatial", "steps", "window")

    def __init__(self, call, shape):
        pad = 3 - len(call.spatial_axes)

        def padded(values, fill):
            return (fill,) * pad + tuple(int(v) for v in values)

        # Everything before the first spatial axis is (N, C), (C,), (N,) or nothing.
        self.B = math.prod(shape[: call.spatial_axes[0]])
        self.K = shape[-1] if call.layout == "channels_last" else 1
        in_size, out_size = padded(call.in_size, 1), padded(call.out_size, 1)
        window, stride = padded(call.window, 1), padded(call.stride, 1)
        dilation, lo = padded(call.dilation, 1), padded(call.pad_lo, 0)
        self.spatial, self.window = in_size, window
        self.outs = np.asarray(out_size, np.int64)
        axis_step = (in_size[1] * in_size[2], in_size[2], 1)
        self.steps = np.asarray([dilation[a] * axis_step[a] for a in range(3)], np.int64)
        box = np.zeros((3, max(out_size), 2), np.int64)
        for a in range(3):
            start = np.arange(out_size[a]) * stride[a] - lo[a]
            # the window offsets t with 0 <= start + t·dilation < in_size: [t_lo, t_hi)
            t_lo = np.maximum(0, -(start // dilation[a]))
            t_hi = np.minimum(window[a], -((start - in_size[a]) // dilation[a]))
            box[a, : out_size[a], 0] = np.maximum(0, t_hi - t_lo)
            box[a, : out_size[a], 1] = (start + t_lo * dilation[a]) * axis_step[a]
        self.box = box
        # avg_pool's dominant case (2-wide, stride-2 windows along W, channels first, every
        # window fully inside x along W) has vectorized row kernels.  (The same for max_pool,
        # with the index blend, measured slower than the scalar windows, so it has none.)
        self.pairs = bool(
            self.K == 1 and window[2] == 2 and stride[2] == 2 and dilation[2] == 1
            and np.all(box[2, : out_size[2], 0] == 2)
        )
        self.div = np.ones((3, max(out_size)))
        if call.op == "avg_pool":
            for a, values in enumerate(((1,),) * pad + tuple(call.divisors)):
                self.div[a, : len(values)] = values

    def views(self, x, y):
        """x and y (or dx and dy) as flat planes (B, S·K) and (B, OS·K)."""
        return (x.reshape(self.B, math.prod(self.spatial) * self.K),
                y.reshape(self.B, math.prod(self.outs.tolist()) * self.K))

    def blocks(self):
        """Row blocks per plane: enough tasks for the threads when there are few planes."""
        rows = int(self.outs[0] * self.outs[1])
        return max(1, min(rows, -(-MIN_TASKS // max(self.B, 1))))


def _run(parallel_kernel, serial_kernel, work, *args):
    """Serial below PARALLEL_MIN_WORK (read at call time, so tests can move it), else parallel."""
    _runtime.run_sized(parallel_kernel, serial_kernel, work >= PARALLEL_MIN_WORK, *args)


def _op_scratch(is_max, shape):
    """avg_pool's float64 scratch rows, or ``None`` for max_pool, which needs none.

    The op travels in this argument's type: Numba compiles a kernel per argument type and drops
    the branches a ``None`` rules out, so max_pool's first call compiles the max paths only.
    """
    return None if is_max else np.empty(shape)


def _work(plan, x_size, y_size):
    return y_size * math.prod(plan.window) + x_size


@functools.lru_cache(maxsize=256)
def _cached_plan(op, layout, shape, axes, in_size, out_size, window, stride, dilation, pad_lo, divisors):
    """Plans are rebuilt from hashable geometry only; a training loop meets the same few."""
    call = SimpleNamespace(op=op, layout=layout, spatial_axes=axes, in_size=in_size, out_size=out_size,
                           window=window, stride=stride, dilation=dilation, pad_lo=pad_lo, divisors=divisors)
    return _Plan(call, shape)


def _plan(call, shape):
    divisors = call.divisors if call.op == "avg_pool" else None
    return _cached_plan(call.op, call.layout, shape, tuple(call.spatial_axes), tuple(call.in_size),
                        tuple(call.out_size), tuple(call.window), tuple(call.stride), tuple(call.dilation),
                        tuple(call.pad_lo), divisors)


def pool_forward(call):
    """Forward of ``max_pool`` and ``avg_pool``; keeps the argmax indices when saving (max)."""
    x = call.x
    is_max = call.op == "max_pool"
    plan = _plan(call, tuple(int(s) for s in x.shape))
    out_shape = list(x.shape)
    for a, o in zip(call.spatial_axes, call.out_size):
        out_shape[a] = o
    y = np.empty(tuple(out_shape), x.dtype)
    x3, y3 = plan.views(x, y)
    indices = is_max and bool(call.params.get("return_indices"))
    save = (bool(call.save) or indices) and is_max
    j3 = np.empty(y3.shape, np.int32) if save else np.empty((1, 1), np.int32)
    if y.size:
        blocks = plan.blocks()
        width = max(plan.K, int(plan.outs[2]))  # a channel row, or an output row (pairs)
        accs = _op_scratch(is_max, (plan.B * blocks, width))
        jscratch = np.empty((plan.B * blocks, width) if is_max else (1, 1), np.int32)
        _run(_forward_parallel, _forward_serial, _work(plan, x.size, y.size),
             x3, y3, j3, plan.K, plan.box, plan.div, plan.steps, plan.outs, blocks, accs, jscratch, save,
             plan.pairs)
    residuals = None
    if call.save:
        residuals = (plan, j3 if is_max else None, tuple(x.shape), x.dtype, is_max)
    if indices:
        # The kept positions are already PyTorch's indices (flat in the spatial plane, whatever the layout).
        return (y, j3.reshape(y.shape).astype(np.int64)), residuals
    return (y,), residuals


def pool_backward(residuals, cotangents, needs, out=None):
    """dx of ``max_pool`` (scatter to the argmax) and ``avg_pool`` (dy / divisor over each window)."""
    if "x" not in needs:
        return {}
    plan, j3, x_shape, dtype, is_max = residuals
    out = out or {}
    dy = np.ascontiguousarray(cotangents[0], dtype=dtype)
    dx = out.get("x")
    if dx is None or not dx.flags.c_contiguous or dx.dtype != dtype:
        dx = np.empty(x_shape, dtype)
    dx3, dy3 = plan.views(dx, dy)
    if j3 is None:
        j3 = np.empty((1, 1), np.int32)
    chunk = min(plan.K, CHANNEL_CHUNK) or 1
    chunks = -(-plan.K // chunk)
    if dx.size:
        scratch = _op_scratch(is_max, (plan.B * chunks, max(chunk, int(plan.outs[2]))))
        _run(_backward_parallel, _backward_serial, _work(plan, dx.size, dy.size),
             dy3, dx3, j3, plan.K, plan.box, plan.div, plan.steps, plan.outs, chunks, chunk, scratch, plan.pairs)
    return {"x": _into(out, "x", dx)}



# --------------------------------------------------------------------------- max_unpool
#
# x, idx: (B, P_in·K); y: (B, P_out·K) — the canonical planes of the pooling kernels above.


@njit(inline="always", **_OPTS)
def _unpool_task(x, idx, y, w, K, plane_out, t, chunks, chunk):
    """Task t = (plane b, channel chunk): each position of y claimed by the last entry naming it
    (in x's order; w holds the entry's position, −1 for none), then y gathered from the claims."""
    b = t // chunks
    k0 = (t % chunks) * chunk
    k1 = min(K, k0 + chunk)
    xb, ib, yb, wb = x[b], idx[b], y[b], w[b]
    for q in range(plane_out):
        for k in range(k0, k1):
            wb[_u(q * K + k)] = -1
    for p in range(xb.shape[0] // K):
        for k in range(k0, k1):
            q = ib[_u(p * K + k)]
            if 0 <= q < plane_out:  # the api checked the range; never write outside y
                wb[_u(q * K + k)] = p
    for q in range(plane_out):
        for k in range(k0, k1):
            p = wb[_u(q * K + k)]
            yb[_u(q * K + k)] = xb[_u(p * K + k)] if p >= 0 else 0.0


@njit(parallel=True, **_OPTS)
def _unpool_parallel(x, idx, y, w, K, plane_out, chunks, chunk):
    for t in prange(x.shape[0] * chunks):
        _unpool_task(x, idx, y, w, K, plane_out, t, chunks, chunk)


@njit(**_OPTS)
def _unpool_serial(x, idx, y, w, K, plane_out, chunks, chunk):
    for t in range(x.shape[0] * chunks):
        _unpool_task(x, idx, y, w, K, plane_out, t, chunks, chunk)


@njit(parallel=True, **_OPTS)
def _unpool_gather_parallel(dy, idx, w, dx, K, plane_out):
    for b in prange(dx.shape[0]):
        _unpool_gather_plane(dy[b], idx[b], w[b], dx[b], K, plane_out)


@njit(**_OPTS)
def _unpool_gather_serial(dy, idx, w, dx, K, plane_out):
    for b in range(dx.shape[0]):
        _unpool_gather_plane(dy[b], idx[b], w[b], dx[b], K, plane_out)


@njit(inline="always", **_OPTS)
def _unpool_gather_plane(dyb, ib, wb, dxb, K, plane_out):
    """dx[p, k] = dy[idx[p, k], k] where entry (p, k) was written, else 0, over one plane."""
    for p in range(dxb.shape[0] // K):
        for k in range(K):
            q = ib[_u(p * K + k)]
            won = 0 <= q < plane_out and wb[_u(q * K + k)] == p
            dxb[_u(p * K + k)] = dyb[_u(q * K + k)] if won else 0.0


def _unpool_planes(call, shape):
    """(B, K, P_in, P_out) of a max_unpool call."""
    axes = call.spatial_axes
    K = shape[-1] if call.layout == "channels_last" else 1
    return math.prod(shape[: axes[0]]), K, math.prod(call.in_size), math.prod(call.out_size)


def unpool_forward(call):
    """Forward of ``max_unpool``: each value at its index (the last of duplicates), zero elsewhere."""
    x = call.x
    shape = tuple(int(s) for s in x.shape)
    B, K, plane_in, plane_out = _unpool_planes(call, shape)
    idx = np.ascontiguousarray(call.indices, dtype=np.int64).reshape(B, plane_in * K)
    out_shape = list(shape)
    for a, o in zip(call.spatial_axes, call.out_size):
        out_shape[a] = o
    y = np.empty(tuple(out_shape), x.dtype)
    w = np.empty((B, plane_out * K), np.int64)
    if y.size:
        chunk = min(K, CHANNEL_CHUNK)
        chunks = -(-K // chunk)
        _run(_unpool_parallel, _unpool_serial, y.size + x.size,
             x.reshape(B, plane_in * K), idx, y.reshape(B, plane_out * K), w, K, plane_out, chunks, chunk)
    residuals = (idx, w, shape, x.dtype, B, K, plane_out) if call.save else None
    return (y,), residuals


def unpool_backward(residuals, cotangents, needs, out=None):
    """dx of ``max_unpool``: dy at each entry's index where that entry was written, else 0."""
    if "x" not in needs:
        return {}
    idx, w, shape, dtype, B, K, plane_out = residuals
    out = out or {}
    dy = np.ascontiguousarray(cotangents[0], dtype=dtype)
    dx = out.get("x")
    if dx is None or not dx.flags.c_contiguous or dx.dtype != dtype:
        dx = np.empty(shape, dtype)
    if dx.size:
        _run(_unpool_gather_parallel, _unpool_gather_serial, dx.size,
             dy.reshape(B, plane_out * K), idx, w, dx.reshape(B, -1), K, plane_out)
    return {"x": _into(out, "x", dx)}
