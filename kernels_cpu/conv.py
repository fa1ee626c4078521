"""Numba kernels for convolution, forward and backward (backend ``"numba"``).

Supported: everything the api accepts for NumPy (and CPU torch) float32/float64 C-contiguous
data — 1-, 2- and 3-D, any stride, dilation, int/per-axis/(low, high)/"same"/"valid" padding,
groups (depthwise included), channels first and channels last, unbatched input, every fused
activation.  One canonical form serves all of it: spatial axes are padded on the left to three
``(D, H, W)``, an unbatched input is a batch of one, and the input is zero-padded once per call
(no copy when there is no padding).

With ``G`` groups of ``Cg = C/G`` input and ``Og = O/G`` output channels, ``K`` kernel taps and
``Q`` output positions of a stretch ("chunk") of the batch, each group is one BLAS product
(``np.dot`` inside ``@njit`` on contiguous 2-D blocks) over a position-major im2col buffer::

    cols[q, j] = x_padded[the element that column j = (channel c, tap t) meets at position q]
    Z (Q, Og)  = cols (Q, Cg·K) @ W[g]ᵀ                      W[g] = weight as (Og, Cg·K)
    y          = act(Z + bias)                               (the epilogue, one pass)

Columns run (c, t) for channels first — the weight's own order — and (t, c) for channels last
(the weight is permuted once, a small copy), so the channels-last gather copies contiguous
channel runs.  ``Z`` is tall and narrow on purpose: that is the orientation in which this BLAS
is fastest for these shapes (about twice the throughput of ``W @ colsᵀ`` measured).

Why chunks rather than one im2col of the whole batch: LeNet-sized layers have few channels, so
``cols`` is 10-25 times larger than ``x``; writing it to memory and reading it back (in the
forward, and again for the weight gradient) would cost more than the products.  A chunk's
``cols`` (≤ ``CHUNK_ELEMENTS``, 2 MiB) is written, multiplied and discarded while in L2; the
epilogue reads ``Z`` from cache; chunks run as parallel tasks, each product on one BLAS thread
(the runtime limits BLAS to one thread for the duration of our calls, so concurrent products
never oversubscribe the cores).  Nothing of ``cols`` is kept for the backward
(residuals: the padded input — ``x`` itself without padding —, the weight matrix, and ``y``
or, for gelu/silu/..., the pre-activation ``z``): recomputing a chunk's ``cols`` costs less
than a whole-batch buffer would in memory.

Forward chunks are stretches of output *lines* (the ``W`` positions of one ``(n, d, h)``), so
one large image still splits into parallel tasks.  Backward chunks are whole images, with
``g = dy · act'`` (from ``y`` when the activation allows, else from ``z``)::

    g         = dy · act'(kept)  and  dbias += Σ g   (one pass over dy, sums in float64)
    dW[chunk] = gᵀ @ cols                            (per-chunk partials, summed in chunk order)
    dcols     = g @ W[g]
    dx        = col2im(dcols)                        (scatter-add into the padded dx; whole
                                                      images per chunk: no two tasks write
                                                      the same element)

Layers with many channels per group and large images run as shifted products instead
(:mod:`kernels_cpu._conv_shifted`, which needs no column buffer at all), and stride-1 layers with
very few input channels per group (LeNet's first) as direct loops (:mod:`kernels_cpu._conv_direct`);
see their ``applies``.

Chunking depends on the shape only and partial sums are reduced in chunk order, so results
are bitwise identical for any thread count (serial and parallel paths included).  Limits:
a backward chunk is at least one image, so one very large image runs its backward as one
task with a whole-image im2col buffer.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from portable_nn.api.activations import parse_activation
from portable_nn.kernel_codes import IDENTITY, LEAKY_RELU, RELU, keeps_output_only

from . import _conv_direct, _conv_shifted, _runtime
from ._conv_common import Geometry, Outputs, cotangent, padded_input
from ._runtime import into as _into
from .activations import (
    act_grad_from_output_row,
    act_grad_row,
    act_row,
    apply_kind,
    deriv_kind,
    is_rectifier,
    rectifier_slope,
)

LANES = 16
_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}
# Below this many multiply-adds the thread pool costs more than it saves (measured: it pays only above ~50 us of work).
PARALLEL_MIN_MACS = 1 << 21
# A forward chunk's im2col buffer holds at most this many elements (2 MiB of float32: it stays in L2
# and the chunk's product is large enough for BLAS), a backward chunk's (whole images) this many;
# each pass has at least MIN_CHUNKS chunks where the shape allows, so two threads share the work.
# Measured on 3x3 convs, 2 threads, Xeon with AVX-512 (fwd+bwd ms, chunks of 32K / 256K / 1M
# elements): (8,256,14,14)->256 41.7 / 27.0 / 25.5, (8,512,7,7)->512 78 / 64 / 33.
CHUNK_ELEMENTS = 1 << 19
BACKWARD_CHUNK_ELEMENTS = 1 << 20
MIN_CHUNKS = 4


# --------------------------------------------------------------------------- layout of the work
#
# Arrays reach the kernels flat.  The input is zero-padded once per call into ``xp`` (no copy
# when there is no padding), so every tap reads inside it and one table serves every output
# line: for output line (n, od, oh) of group g, the im2col row block of that line is
#
#     cols[(ln − l0)·OW + ow, j] = xp[base(n, od, oh) + g·gstep + omap[ow·width + j]]
#
# with ``omap`` (OW·width offsets, made once per call) encoding kernel size, stride, dilation
# and layout.  A line's gather is thus one flat loop of OW·width elements: per-row work on
# 8-element rows (LeNet's second layer) cost more than the rows themselves, and integer
# division (~4 ns here) appears in no loop.  ``lg`` = [OD, OH, OW, stride_d·step_d,
# stride_h·step_h, padded image size, gstep] locates the lines; ``yst`` are the element
# strides of the (n, o, p) output (p the flat output position), so one loop nest writes
# either layout.


@njit(inline="always", **_OPTS)
def _line(ln, lg):
    """(n, od, oh) of output line ln (lines are the batch's (n, d, h), row-major)."""
    per_image = lg[0] * lg[1]
    n = ln // per_image
    r = ln - n * per_image
    od = r // lg[1]
    return n, od, r - od * lg[1]


@njit(inline="always", **_OPTS)
def _next_line(n, od, oh, lg):
    oh += 1
    if oh == lg[1]:
        oh = 0
        od += 1
        if od == lg[0]:
            od = 0
            n += 1
    return n, od, oh


@njit(inline="always", **_OPTS)
def _base(n, od, oh, lg):
    return n * lg[5] + od * lg[3] + oh * lg[4]


# --------------------------------------------------------------------------- im2col / col2im


@njit(**_OPTS)
def _im2col(xp, cols, omap, lg, g, l0, l1):
    """cols (flat (Q, width)) = the im2col rows of output lines [l0, l1), group g."""
    row = omap.shape[0]
    n, od, oh = _line(l0, lg)
    for k in range(l1 - l0):
        base = _base(n, od, oh, lg) + g * lg[6]
        dst = cols[k * row : (k + 1) * row]
        for j in range(row):
            dst[j] = xp[base + omap[j]]
        n, od, oh = _next_line(n, od, oh, lg)


@njit(**_OPTS)
def _col2im(dcols, dxp, omap, lg, g, l0, l1):
    """dxp += the column gradient dcols (flat (Q, width)) of lines [l0, l1), where its taps read.
    In order: overlapping taps add into the same element one after the other."""
    row = omap.shape[0]
    n, od, oh = _line(l0, lg)
    for k in range(l1 - l0):
        base = _base(n, od, oh, lg) + g * lg[6]
        src = dcols[k * row : (k + 1) * row]
        for j in range(row):
            dxp[base + omap[j]] += src[j]
        n, od, oh = _next_line(n, od, oh, lg)


# --------------------------------------------------------------------------- epilogues (bias, activation, act')
#
# Loop nests take an activation *kind* (see ``kernels_cpu.activations``): 0 identity, 1 rectifier,
# 2 any other activation.


@njit(inline="always", **_OPTS)
def _epilogue_loops(z, b, yf, yst, lg, g, l0, l1, last, kind, code, slope):
    og = z.shape[1]
    ow_n = lg[2]
    per = lg[0] * lg[1]
    n_first = l0 // per
    r_first = l0 - n_first * per
    bg = b[g * og : (g + 1) * og]
    if last:
        n, r, q = n_first, r_first, 0
        for _ in range(l0, l1):
            for ow in range(ow_n):
                at = n * yst[0] + (r * ow_n + ow) * yst[2] + g * og
                for o in range(og):
                    yf[at + o] = apply_kind(np.float64(z[q, o] + bg[o]), kind, code, slope)
                q += 1
            r += 1
            if r == per:
                r = 0
                n += 1
        return
    for o in range(og):
        bo = bg[o]
        zc = z[:, o]
        n, r, q = n_first, r_first, 0
        for _ in range(l0, l1):
            at = n * yst[0] + (g * og + o) * yst[1] + r * ow_n
            for ow in range(ow_n):
                yf[at + ow] = apply_kind(np.float64(zc[q + ow] + bo), kind, code, slope)
            q += ow_n
            r += 1
            if r == per:
                r = 0
                n += 1


@njit(**_OPTS)
def _epilogue(z, b, yf, yst, lg, g, l0, l1, last, code, slope):
    """Group g's output channels of lines [l0, l1): y = act(Z + bias), Z (Q, Og) the chunk's product.
    Channels first writes runs along the positions (reading a column of Z, in cache)."""
    if code == IDENTITY:
        _epilogue_loops(z, b, yf, yst, lg, g, l0, l1, last, 0, code, slope)
    else:  # a rectifier: conv_forward applies the others as a pass of their own (Activated)
        _epilogue_loops(z, b, yf, yst, lg, g, l0, l1, last, 1, code, rectifier_slope(code, slope))


@njit(inline="always", **_OPTS)
def _grad_values(dyf, kf, yst, gm, n0, n1, last, kind, code, slope, from_output):
    """gm = dy · act'(kept) for images [n0, n1): (G, Og, Q) channels first, (G, Q, Og) channels last."""
    groups = gm.shape[0]
    if last:
        og = gm.shape[2]
        p_n = gm.shape[1] // max(1, n1 - n0)
        qi = 0
        for n in range(n0, n1):
            for p in range(p_n):
                at = n * yst[0] + p * yst[2]
                for g in range(groups):
                    dst = gm[g, qi]
                    d = dyf[at + g * og : at + (g + 1) * og]
                    kv = kf[at + g * og : at + (g + 1) * og]
                    for o in range(og):
                        dst[o] = d[o] * deriv_kind(np.float64(kv[o]), kind, code, slope, from_output)
                qi += 1
        return
    og = gm.shape[1]
    p_n = gm.shape[2] // max(1, n1 - n0)
    for g in range(groups):
        for o in range(og):
            row = gm[g, o]
            for n in range(n0, n1):
                at = n * yst[0] + (g * og + o) * yst[1]
                d = dyf[at : at + p_n]
                kv = kf[at : at + p_n]
                dst = row[(n - n0) * p_n : (n - n0 + 1) * p_n]
                for j in range(p_n):
                    dst[j] = d[j] * deriv_kind(np.float64(kv[j]), kind, code, slope, from_output)


@njit(**_OPTS)
def _bias_sums(gm, dbk, last):
    """dbk[o] += Σ of channel o of gm, in float64, in a fixed order: channels first along each
    row in lanes; channels last position by position (vectorised across channels)."""
    groups = gm.shape[0]
    if last:
        og = gm.shape[2]
        for g in range(groups):
            db = dbk[g * og : (g + 1) * og]
            for q in range(gm.shape[1]):
                src = gm[g, q]
                for o in range(og):
                    db[o] += src[o]
        return
    og, q_n = gm.shape[1], gm.shape[2]
    qv = q_n - q_n % LANES
    lanes = np.zeros(LANES)
    for g in range(groups):
        for o in range(og):
            row = gm[g, o]
            lanes[:] = 0.0
            for j0 in range(0, qv, LANES):
                for lane in range(LANES):
                    lanes[lane] += row[j0 + lane]
            for j in range(qv, q_n):
                lanes[0] += row[j]
            dbk[g * og + o] += lanes.sum()


@njit(**_OPTS)
def _grad(dyf, kf, yst, gm, dbk, n0, n1, last, code, slope, from_output):
    """g = dy · act'(kept) for images [n0, n1) into gm — (G, Og, Q) channels first, (G, Q, Og)
    channels last, the order dy is read in — then dbk[o] += Σ g over the chunk, read back while
    gm is in cache (a separate loop: stores and running sums in one loop serialise each other)."""
    if code == IDENTITY:
        _grad_values(dyf, kf, yst, gm, n0, n1, last, 0, code, slope, from_output)
    elif is_rectifier(code) and from_output:
        _grad_values(dyf, kf, yst, gm, n0, n1, last, 1, code, rectifier_slope(code, slope), from_output)
    else:
        _grad_values(dyf, kf, yst, gm, n0, n1, last, 2, code, slope, from_output)
    _bias_sums(gm, dbk, last)


# --------------------------------------------------------------------------- chunks and drivers


@njit(**_OPTS)
def _forward_chunk(xp, omap, lg, w3, b, yf, zf, yst, last, l0, l1, code, slope, keep_z):
    """Output lines [l0, l1): per group, im2col, Z = cols @ Wᵀ (tall and narrow: BLAS's fast
    orientation here), then the epilogue (and the pre-activation, when it is kept)."""
    groups, og, width = w3.shape
    q = (l1 - l0) * lg[2]
    buf = np.empty(q * width, xp.dtype)
    cols = buf.reshape((q, width))
    z = np.empty((q, og), xp.dtype)
    for g in range(groups):
        _im2col(xp, buf, omap, lg, g, l0, l1)
        np.dot(cols, w3[g].T, z)
        _epilogue(z, b, yf, yst, lg, g, l0, l1, last, code, slope)
        if keep_z:  # the pre-activation: the identity's code, as a typed int (a literal 0 compiles anew)
            _epilogue(z, b, zf, yst, lg, g, l0, l1, last, np.int64(0), slope)


@njit(**_OPTS)
def _backward_chunk(xp, omap, lg, w3, dyf, kf, yst, dxp, dwp, dbp, last, k, n0, n1, code, slope, from_output,
                    need_x, need_w):
    """Images [n0, n1): g and its bias sum, the partial weight gradient dwp[k] = gᵀ @ cols per group,
    and dx: dcols = g @ W scattered back (col2im) into the padded dx."""
    groups, og, width = w3.shape
    per = lg[0] * lg[1]
    l0 = n0 * per
    l1 = n1 * per
    q = (l1 - l0) * lg[2]
    gm = np.empty((groups, q, og) if last else (groups, og, q), xp.dtype)
    _grad(dyf, kf, yst, gm, dbp[k], n0, n1, last, code, slope, from_output)
    buf = np.empty(q * width if need_x or need_w else 0, xp.dtype)
    cols = buf.reshape((q if need_x or need_w else 0, width))
    if need_x:
        dxp[n0 * lg[5] : n1 * lg[5]] = 0.0
    for g in range(groups):
        if need_w:
            _im2col(xp, buf, omap, lg, g, l0, l1)
            if last:
                np.dot(gm[g].T, cols, dwp[k, g])
            else:
                np.dot(gm[g], cols, dwp[k, g])
        if need_x:
            if last:
                np.dot(gm[g], w3[g], cols)
            else:
                np.dot(gm[g].T, w3[g], cols)
            _col2im(buf, dxp, omap, lg, g, l0, l1)


@njit(inline="always", **_OPTS)
def _chunk(backward, k, count, step, xp, omap, lg, w3, b, yf, zf, yst, dxp, dwp, dbp, last, code, slope, keep_z,
           from_output, need_x, need_w):
    """Chunk k: output lines (forward) or images (backward) [k·step, min(count, (k + 1)·step)).
    In the backward, yf and zf carry dy and the kept y or z."""
    start = k * step
    stop = min(count, start + step)
    if backward:
        _backward_chunk(xp, omap, lg, w3, yf, zf, yst, dxp, dwp, dbp, last, k, start, stop, code, slope,
                        from_output, need_x, need_w)
    else:
        _forward_chunk(xp, omap, lg, w3, b, yf, zf, yst, last, start, stop, code, slope, keep_z)


# One driver for both passes, serial and parallel: each driver compiled is a few seconds of CI.


@njit(parallel=True, **_OPTS)
def _parallel(backward, count, step, xp, omap, lg, w3, b, yf, zf, yst, dxp, dwp, dbp, last, code, slope, keep_z,
              from_output, need_x, need_w):
    for t in prange((count + step - 1) // step):
        k = np.int64(t)  # prange indices are unsigned: keep the chunks' signatures the serial ones
        _chunk(backward, k, count, step, xp, omap, lg, w3, b, yf, zf, yst, dxp, dwp, dbp, last, code, slope, keep_z,
               from_output, need_x, need_w)


@njit(**_OPTS)
def _serial(backward, count, step, xp, omap, lg, w3, b, yf, zf, yst, dxp, dwp, dbp, last, code, slope, keep_z,
            from_output, need_x, need_w):
    for k in range((count + step - 1) // step):
        _chunk(backward, k, count, step, xp, omap, lg, w3, b, yf, zf, yst, dxp, dwp, dbp, last, code, slope, keep_z,
               from_output, need_x, need_w)


# --------------------------------------------------------------------------- plans and entry points


class _Plan:
    """The canonical form of one call: padded input, offset map, line geometry, chunking."""

    __slots__ = (
        "groups",
        "images",
        "interior",
        "last",
        "lg",
        "lines",
        "macs",
        "n",
        "o",
        "omap",
        "out_shape",
        "padded",
        "padded_shape",
        "taps",
        "width",
        "x_shape",
        "yst",
    )

    def __init__(self, call, weight_shape):
        geo = Geometry(call, weight_shape)
        stride, out = geo.stride, geo.out
        self.x_shape, self.last, self.n, self.o, self.groups = geo.x_shape, geo.last, geo.n, geo.o, geo.groups
        last, n, o, channels, cg = geo.last, geo.n, geo.o, geo.channels, geo.cg
        self.taps = geo.taps
        self.width = width = cg * geo.taps
        # The zero-padded input (N, C, Dp, Hp, Wp) or (N, Dp, Hp, Wp, C), and where x sits in it.
        self.padded, self.padded_shape, self.interior = geo.padded, geo.padded_shape, geo.interior
        sp = geo.padded_shape[1:-1] if last else geo.padded_shape[2:]
        plane = sp[0] * sp[1] * sp[2]
        if last:
            pc, pd, ph, pw = 1, sp[1] * sp[2] * channels, sp[2] * channels, channels
        else:
            pc, pd, ph, pw = plane, sp[1] * sp[2], sp[2], 1
        self.lg = np.array([out[0], out[1], out[2], stride[0] * pd, stride[1] * ph, plane * channels, cg * pc],
                           dtype=np.int64)
        self.omap = _offset_map(geo.tap_reach(), stride, out[2], cg, last, (pc, pd, ph, pw))
        positions = math.prod(out)
        self.yst = np.array((positions * o, 1, o) if last else (o * positions, positions, 1), dtype=np.int64)
        self.out_shape, self.macs = geo.out_shape, geo.macs
        # Chunk sizes (see the module docstring): bounded im2col buffer and single-threaded BLAS products.
        line = max(1, width * out[2])  # (no channels: width 0)
        lines = n * out[0] * out[1]
        self.lines = max(1, min(CHUNK_ELEMENTS // line, -(-lines // MIN_CHUNKS)))
        image = max(1, width * positions)
        self.images = max(1, min(BACKWARD_CHUNK_ELEMENTS // image, -(-n // MIN_CHUNKS)))


_PLANS: dict = {}
_PLANS_KEPT = 64


_PLAN_KINDS = {"im2col": None, "shifted": _conv_shifted.ShiftedPlan, "direct": _conv_direct.DirectPlan}


def _plan(call, weight_shape, kind="im2col"):
    """The call's plan (im2col, shifted products or direct loops), cached by geometry: building one
    costs ~0.1 ms, which small layers notice."""
    p = call.params
    key = (tuple(call.arrays["x"].shape), tuple(weight_shape), call.layout, p["batched"], p["kernel"], p["stride"],
           p["dilation"], p["pad_lo"], p["pad_hi"], p["groups"], CHUNK_ELEMENTS, BACKWARD_CHUNK_ELEMENTS, MIN_CHUNKS,
           kind,
           _conv_shifted.BLOCK_ELEMENTS, _conv_shifted.WEIGHT_TASKS, _conv_shifted.WEIGHT_BLOCK_BYTES,
           _conv_shifted.WEIGHT_PARTIAL_BYTES)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.clear()
        plan = _PLANS[key] = (_PLAN_KINDS[kind] or _Plan)(call, weight_shape)
    return plan


def _offset_map(reach, stride, ow_n, cg, last, strides):
    """omap[ow·width + column]: offset, from a line's base, of the padded input element that
    column (channel c, tap t) meets at output column ow (``reach``: each tap's (D, H, W) reach, see
    ``Geometry.tap_reach``).  Columns run (c, t) channels first — weight's own order — and (t, c)
    channels last, where channels are contiguous."""
    pc, pd, ph, pw = strides
    tap = reach[:, 0] * pd + reach[:, 1] * ph + reach[:, 2] * pw  # (K,)
    chan = np.arange(cg) * pc
    col = (tap[:, None] + chan[None, :]) if last else (chan[:, None] + tap[None, :])
    return (np.arange(ow_n)[:, None] * (stride[2] * pw) + col.reshape(1, -1)).reshape(-1).astype(np.int64)


def _weight_matrix(weight, plan):
    """weight (O, Cg, *k) as (G, Og, Cg·K), or for channels last (G, Og, K·Cg) (taps before channels)."""
    o, groups = plan.o, plan.groups
    w = weight.reshape(o, plan.width // plan.taps, plan.taps)
    if plan.last:
        w = np.ascontiguousarray(w.transpose(0, 2, 1))
    return w.reshape(groups, o // groups, plan.width)


def _run(plan, *args):
    """The serial driver below PARALLEL_MIN_MACS, else the parallel one under the threading policy."""
    _runtime.run_sized(_parallel, _serial, plan.macs >= PARALLEL_MIN_MACS, *args)


def conv_forward(call):
    """y = act(conv(x, weight) + bias); residuals (padded x, weight matrix, kept y or z, plan, call).

    Stride-1 layers with very few input channels per group run as direct loops
    (:mod:`._conv_direct`), layers with many channels and large images as shifted products
    (:mod:`._conv_shifted`); their residuals are their own classes.  The identity and the
    rectifiers are applied in the paths' epilogues; every other activation in a vector pass of
    its own over the output (:class:`Activated`).
    """
    act_ = call.activation
    if _vector_activation(act_):
        return _activated_forward(call, act_)
    return _fused_forward(call)


# Activations other than the identity and the rectifiers run as a pass of their own over the whole
# output, forward (y = act(z)) and backward (g = dy · act'), in activations.act_row's vector loops;
# per element in the three paths' epilogues they went through a called float64 function (libm):
# (32, 32, 32, 32) -> 32 channels 3x3 float32 forward and backward, 2 threads, AMD Zen 5: silu
# 44.5 ms, gelu 51.3, mish 46.4 against the identity's 24.6; as a pass: 23.2, 23.8, 23.5 against
# 22.8.  The pass reads and writes the output once more, in parallel spans.  The rectifiers stay in
# the epilogues, where they cost less than the pass: relu forward and backward, LeNet's first layer
# (128, 1, 28, 28) -> 6 channels 5x5 1.62 ms fused, 2.61 ms as a pass; (8, 64, 56, 56) 3x3 47.8 vs
# 52.5 ms.


def _vector_activation(act_):
    """Whether activation ``act_`` runs as its own vector pass (every one but identity, relu, leaky_relu)."""
    return act_.code not in (IDENTITY, RELU, LEAKY_RELU)


class Activated:
    """Residuals of a convolution whose activation ran as a pass of its own: the identity
    convolution's residuals (``inner``), what act' reads (``kept``: y or z) and the activation."""

    __slots__ = ("activation", "inner", "kept")

    def __init__(self, inner, kept, activation):
        self.inner, self.kept, self.activation = inner, kept, activation


def _activated_forward(call, act_):
    """y = act(z), z the identity convolution (with bias) of the call; z is kept when act' needs it."""
    (z,), inner = _fused_forward(call.replace(params={**call.params, "activation": IDENTITY_ACTIVATION}))
    from_output = keeps_output_only(act_)
    y = _runtime.empty(z.shape, z.dtype) if call.save and not from_output else z
    _runtime.run_sized(_activate_parallel, _activate_serial, y.size >= PARALLEL_MIN_ELEMENTS, z.reshape(-1),
                       y.reshape(-1), _ELEMENTWISE_STEP, y is not z, act_.code, act_.slope)
    residuals = Activated(inner, y if from_output else z, act_) if call.save else None
    return (y,), residuals


def _activated_backward(residuals, cotangents, needs, out):
    """g = dy · act'(kept) in one vector pass, then the identity convolution's backward at g."""
    kept, act_ = residuals.kept, residuals.activation
    dy = cotangent(cotangents, kept.dtype, kept.shape)
    g = _runtime.empty(kept.shape, kept.dtype)
    _runtime.run_sized(_times_derivative_parallel, _times_derivative_serial, g.size >= PARALLEL_MIN_ELEMENTS,
                       dy.reshape(-1), kept.reshape(-1), g.reshape(-1), _ELEMENTWISE_STEP, act_.code, act_.slope,
                       keeps_output_only(act_))
    return conv_backward(residuals.inner, (g,), needs, out)


def _fused_forward(call):
    """conv_forward on one of the three paths, the activation (the identity or a rectifier: their
    epilogues compile no other) in its epilogue."""
    if _vector_activation(call.activation):
        raise AssertionError(f"{call.activation} runs as a pass of its own (conv_forward)")  # pragma: no cover
    x, weight = call.x, call.weight
    if _conv_direct.applies(call, weight.shape):
        plan = _plan(call, weight.shape, "direct")
        return _conv_direct.conv_forward(call, plan, plan.macs >= PARALLEL_MIN_MACS, padded_input(x, plan))
    if _conv_shifted.applies(call, weight.shape):
        plan = _plan(call, weight.shape, "shifted")
        return _conv_shifted.conv_forward(call, plan, plan.macs >= PARALLEL_MIN_MACS)
    plan = _plan(call, weight.shape)
    dtype = x.dtype
    xp = padded_input(x, plan)
    w3 = _weight_matrix(weight, plan)
    b = np.zeros(plan.o, dtype) if call.bias is None else call.bias
    act_ = call.activation
    out = Outputs(call, plan.out_shape, dtype)
    zf = out.z.reshape(-1) if out.keep_z else np.empty(0, dtype)
    if plan.n:
        _run(plan, False, plan.n * int(plan.lg[0] * plan.lg[1]), plan.lines, xp.reshape(-1), plan.omap, plan.lg, w3,
             b, out.y.reshape(-1), zf, plan.yst, np.empty(0, dtype), np.empty((0, 0, 0, 0), dtype), np.empty((0, 0)),
             plan.last, act_.code, act_.slope, out.keep_z, out.from_output, False, False)
    y = out.y
    residuals = None
    if call.save:
        residuals = (xp, w3, out.kept(), plan, call.replace(arrays={}))
    return (y,), residuals


def conv_backward(residuals, cotangents, needs, out=None):
    """dx, dweight, dbias from one pass per image chunk (see the module docstring)."""
    if isinstance(residuals, Activated):
        return _activated_backward(residuals, cotangents, needs, out)
    if isinstance(residuals, _conv_shifted.Residuals):
        return _conv_shifted.conv_backward(residuals, cotangents, needs, out)
    if isinstance(residuals, _conv_direct.Residuals):
        return _conv_direct.conv_backward(residuals, cotangents, needs, out)
    xp, w3, kept, plan, call = residuals
    out = out or {}
    dtype = xp.dtype
    dyf = cotangent(cotangents, dtype, -1)
    kf = dyf if kept is None else kept.reshape(-1)
    act_ = call.activation
    need_x, need_w = "x" in needs, "weight" in needs
    chunks = -(-plan.n // plan.images)
    groups, og, width = w3.shape
    dwp = np.empty((chunks if need_w else 1, groups, og, width), dtype)
    dbp = np.zeros((max(chunks, 1), plan.o))
    dx = out.get("x") if need_x else None
    if need_x and (dx is None or not dx.flags.c_contiguous or dx.dtype != dtype):
        dx = np.empty(plan.x_shape, dtype)
    if not need_x:
        dxp = np.empty(0, dtype)
    elif plan.padded:
        dxp = np.empty(plan.padded_shape, dtype)
    else:
        dxp = dx.reshape(plan.padded_shape)
    if plan.n:
        _run(plan, True, plan.n, plan.images, xp.reshape(-1), plan.omap, plan.lg, w3, np.empty(0, dtype), dyf, kf,
             plan.yst, dxp.reshape(-1), dwp, dbp, plan.last, act_.code, act_.slope, False, keeps_output_only(act_),
             need_x, need_w)
    grads = {}
    if need_x:
        if plan.padded:
            dx.reshape(dxp[plan.interior].shape)[...] = dxp[plan.interior]
        grads["x"] = _into(out, "x", dx)
    if need_w:
        grads["weight"] = _into(out, "weight", _weight_gradient(dwp[:chunks], plan, call))
    if "bias" in needs:
        grads["bias"] = _into(out, "bias", dbp[:chunks].sum(axis=0).astype(dtype))
    return grads


def _weight_gradient(dwp, plan, call):
    """Σ over chunks (in chunk order, float64) of the partial gradients, in weight's layout."""
    total = dwp.sum(axis=0, dtype=np.float64)  # (G, Og, Cg·K)
    o, taps = plan.o, plan.taps
    cg = plan.width // taps
    if plan.last:
        total = total.reshape(o, taps, cg).transpose(0, 2, 1)
    return np.ascontiguousarray(total.reshape((o, cg, *call.kernel)), dtype=dwp.dtype)



# --------------------------------------------------------------------------- transposed convolution
#
# conv_transpose's call carries the geometry of the convolution C it transposes (C's input is
# conv_transpose's output).  The products are C's own: the forward is C's input gradient at the
# cotangent x (column products, then the col2im scatter), followed by one bias + activation pass;
# the backward is C's forward of g = dy · act' (dx, on whichever of the three paths suits C) and
# C's weight gradient with input g and output gradient x (dweight).


@njit(inline="always", **_OPTS)
def _transpose_rows(z, y, b, r0, r1, last, kind, code, slope):
    """y = act(z + bias) for images [r0, r1) of (N, O, P) channels first or (N, P, O) channels last
    (kind 2: z + bias per element, then act_row's vector loop along the row)."""
    each = 0 if kind == 2 else kind
    for r in range(r0, r1):
        for a in range(z.shape[1]):
            zr, yr = z[r, a], y[r, a]
            if last:
                for j in range(zr.shape[0]):
                    yr[j] = apply_kind(np.float64(zr[j] + b[j]), each, code, slope)
            else:
                bo = b[a]
                for j in range(zr.shape[0]):
                    yr[j] = apply_kind(np.float64(zr[j] + bo), each, code, slope)
            if kind == 2:
                act_row(yr, code, slope)


@njit(**_OPTS)
def _transpose_epilogue(z, y, b, r0, r1, last, code, slope):
    if code == IDENTITY:
        _transpose_rows(z, y, b, r0, r1, last, 0, code, slope)
    elif is_rectifier(code):
        _transpose_rows(z, y, b, r0, r1, last, 1, code, rectifier_slope(code, slope))
    else:
        _transpose_rows(z, y, b, r0, r1, last, 2, code, slope)


@njit(parallel=True, **_OPTS)
def _transpose_epilogue_parallel(z, y, b, step, last, code, slope):
    rows = z.shape[0]
    for k in prange(-(-rows // step)):
        _transpose_epilogue(z, y, b, k * step, min(rows, (k + 1) * step), last, code, slope)


@njit(**_OPTS)
def _transpose_epilogue_serial(z, y, b, step, last, code, slope):
    _transpose_epilogue(z, y, b, 0, z.shape[0], last, code, slope)


@njit(inline="always", **_OPTS)
def _times_derivative_kind(dy, kept, g, i0, i1, kind, code, slope, from_output):
    for i in range(i0, i1):
        g[i] = dy[i] * deriv_kind(np.float64(kept[i]), kind, code, slope, from_output)


@njit(**_OPTS)
def _times_derivative(dy, kept, g, i0, i1, code, slope, from_output):
    """g = dy · act'(kept) over flat elements [i0, i1) (the rectifiers per element, the others in
    act_grad_row's vector loops)."""
    if is_rectifier(code) and from_output:
        _times_derivative_kind(dy, kept, g, i0, i1, 1, code, rectifier_slope(code, slope), from_output)
        return
    gs = g[i0:i1]
    ds = dy[i0:i1]
    for i in range(gs.shape[0]):
        gs[i] = ds[i]
    if from_output:
        act_grad_from_output_row(kept[i0:i1], gs, code, slope)
    else:
        act_grad_row(kept[i0:i1], gs, code, slope)


@njit(**_OPTS)
def _activate_span(z, y, i0, i1, copy, code, slope):
    """y = act(z) over flat elements [i0, i1), in place when not ``copy`` (y is z)."""
    ys = y[i0:i1]
    if copy:
        zs = z[i0:i1]
        for i in range(ys.shape[0]):
            ys[i] = zs[i]
    act_row(ys, code, slope)


@njit(parallel=True, **_OPTS)
def _activate_parallel(z, y, step, copy, code, slope):
    for k in prange(-(-y.size // step)):
        _activate_span(z, y, k * step, min(y.size, (k + 1) * step), copy, code, slope)


@njit(**_OPTS)
def _activate_serial(z, y, step, copy, code, slope):
    _activate_span(z, y, 0, y.size, copy, code, slope)


@njit(parallel=True, **_OPTS)
def _times_derivative_parallel(dy, kept, g, step, code, slope, from_output):
    for k in prange(-(-dy.size // step)):
        _times_derivative(dy, kept, g, k * step, min(dy.size, (k + 1) * step), code, slope, from_output)


@njit(**_OPTS)
def _times_derivative_serial(dy, kept, g, step, code, slope, from_output):
    _times_derivative(dy, kept, g, 0, dy.size, code, slope, from_output)


#: Elements per parallel task of the elementwise passes (64K: a few tens of microseconds each);
#: below PARALLEL_MIN_ELEMENTS such a pass runs serially (the thread pool's ~50 us would dominate).
_ELEMENTWISE_STEP = 1 << 16
PARALLEL_MIN_ELEMENTS = 1 << 17
IDENTITY_ACTIVATION = parse_activation("identity")


def _transposed_call(call, x, save):
    """The call of the convolution conv_transpose's ``call`` transposes, for input ``x`` (identity,
    no bias); ``x`` may be a stand-in of the right shape when only C's input gradient is computed."""
    params = {**call.params, "activation": IDENTITY_ACTIVATION}
    return call.replace(arrays={"x": x, "weight": call.weight, "bias": None}, params=params, save=save)


def _transposed_shape(call, weight):
    """conv_transpose's output shape (C's input), in the caller's layout, batched or not."""
    o = call.groups * int(weight.shape[1])
    shape = (*call.in_size, o) if call.layout == "channels_last" else (o, *call.in_size)
    return (int(call.x.shape[0]), *shape) if call.batched else shape


def conv_transpose_forward(call):
    """y = act(Cᵀ x + bias): C's input gradient at the cotangent x (im2col path: column products
    ``dcols = x @ W`` per image chunk, then the scatter), then one bias + activation pass."""
    x, weight, dtype = call.x, call.weight, call.x.dtype
    shape = _transposed_shape(call, weight)
    standin = np.broadcast_to(np.empty((), dtype), shape)  # C's input: only its shape is read
    c_call = _transposed_call(call, standin, False)
    plan = _plan(c_call, weight.shape)
    residuals = (np.empty(0, dtype), _weight_matrix(weight, plan), None, plan, c_call)
    z = conv_backward(residuals, (x,), frozenset({"x"}))["x"]
    act_ = call.activation
    if call.bias is None and act_.is_identity:
        y, kept = z, None
    else:
        o = call.groups * int(weight.shape[1])
        b = np.zeros(o, dtype) if call.bias is None else np.ascontiguousarray(call.bias, dtype)
        y = _runtime.empty(shape, dtype)
        keep_z = call.save and not act_.is_identity and not keeps_output_only(act_)
        per = math.prod(call.in_size)
        rows_z = z.reshape(plan.n, per, o) if plan.last else z.reshape(plan.n, o, per)
        if keep_z and call.bias is not None:
            # The backward reads act' from the pre-activation z + bias: add the bias in place
            # (one more pass, for the activations that keep z only).
            rows_z += b if plan.last else b[:, None]
            b = np.zeros(o, dtype)
        rows_y = y.reshape(rows_z.shape)
        step = max(1, _ELEMENTWISE_STEP // max(1, rows_z[0].size if plan.n else 1))
        _runtime.run_sized(_transpose_epilogue_parallel, _transpose_epilogue_serial, y.size >= PARALLEL_MIN_ELEMENTS,
                           rows_z, rows_y, b, step, plan.last, act_.code, act_.slope)
        kept = None if act_.is_identity else (z if keep_z else y)
    residuals = (x, weight, kept, call.replace(arrays={})) if call.save else None
    return (y,), residuals


def conv_transpose_backward(residuals, cotangents, needs, out=None):
    """dbias = Σ g, dx = C g (C's forward: im2col, shifted or direct), dweight = C's weight
    gradient of (g, x), with g = dy · act'(kept)."""
    x, weight, kept, call = residuals
    out = out or {}
    dtype = x.dtype
    shape = _transposed_shape(call.replace(arrays={"x": x}), weight)
    dy = cotangent(cotangents, dtype, shape)
    act_ = call.activation
    if act_.is_identity:
        g = dy
    else:
        g = _runtime.empty(shape, dtype)
        _runtime.run_sized(_times_derivative_parallel, _times_derivative_serial, g.size >= PARALLEL_MIN_ELEMENTS,
                           dy.reshape(-1), kept.reshape(-1), g.reshape(-1), _ELEMENTWISE_STEP, act_.code, act_.slope,
                           keeps_output_only(act_))
    grads = {}
    if "bias" in needs:
        last = call.layout == "channels_last"
        axes = tuple(a for a in range(g.ndim) if a != (g.ndim - 1 if last else (1 if call.batched else 0)))
        grads["bias"] = _into(out, "bias", g.sum(axis=axes, dtype=np.float64).astype(dtype))
    need_x, need_w = "x" in needs, "weight" in needs
    if not (need_x or need_w):
        return grads
    c_call = _transposed_call(call.replace(arrays={"x": x, "weight": weight}), g, need_w)
    if need_x:
        (dx,), c_residuals = conv_forward(c_call)
        grads["x"] = _into(out, "x", dx)
    else:
        plan = _plan(c_call, weight.shape)
        c_residuals = (padded_input(g, plan), _weight_matrix(weight, plan), None, plan, c_call)
    if need_w:
        grads["weight"] = _into(out, "weight", conv_backward(c_residuals, (x,), frozenset({"weight"}))["weight"])
    return grads
