"""Convolution as shifted matrix products, no im2col (the numba conv path for layers with many channels).

For layers whose groups have at least ``SHIFTED_MIN_CHANNELS`` input channels (ResNet-style
3x3 convs), ``kernels_cpu.conv`` hands the call to this module.  The input is copied once per
call into a zero-padded, channels-last, *phase-split* buffer; each kernel tap is then one BLAS
product over a shifted block of that buffer's rows, accumulated in place (``beta = 1``)::

    stride s = (sd, sh, sw): the padded input (Dp, Hp, Wp) splits into sd·sh·sw phases
        P_φ[a, b, c, :] = Xp[a·sd + φd, b·sh + φh, c·sw + φw, :]      (Dq, Hq, Wq) = ⌈(Dp, Hp, Wp) / s⌉
    tap t = (td, th, tw), dilation dl:  phase φ(t) = (td·dld mod sd, …),  shift (ad, ah, aw) = (td·dld div sd, …)
    output row p = (od·Hq + oh)·Wq + ow of the phase grid meets row p + off_t of P_φ(t),
        off_t = (ad·Hq + ah)·Wq + aw, so for each group g:
    Z[p, :] = Σ_t P_φ(t)[p + off_t, g·Cg : (g+1)·Cg] @ W_t[g]            W_t[g]: (Cg, Og)
    y       = act(Z + bias) on the rows with oh < OH and ow < OW

The rows in between (ow ≥ OW: (Wq − OW)/Wq of the work, 7% for a 3x3 conv on 28x28) are
computed and dropped.  The phase buffer is phase-major, ``(phases, N, Rq, C)``: within a phase the
images follow each other every ``Rq`` rows (``Rq`` ≥ an image's last row + the largest shift), so
a block of rows may span images and the weight gradient of a tap is *one* product over the whole
batch (inner dimension N·Rq instead of one image's rows).

Against im2col this removes the column buffer (9x the input for a 3x3 kernel) and its copy.
With few channels the products' inner dimension (Cg) is too short for BLAS to be efficient, so
LeNet-sized layers keep the im2col path (see ``kernels_cpu.conv`` for which layers go where).

The backward reuses the phase buffer (kept as the residual instead of ``x``) and a gradient on
the batch's output grid, ``G[margin + n·Rq + p] = dy · act'`` (zero on the dropped rows, between
images and in a front frame of ``margin`` = the largest tap shift)::

    dW_t[g]            = P_φ(t)[off_t + r, g]ᵀ @ G[margin + r, g]   over all rows r   (one product)
    dP_φ[q, g]         = Σ_{t: φ(t) = φ} G[margin + q − off_t, g] @ W_t[g]ᵀ     (a gather: any row blocks)
    dx                 = the interior of the phases, back in x's layout
    dbias              = Σ G

Work is split by the shape only — row blocks of each image for the forward and dP, (tap, group,
output-channel block) for dW, images for the copies — and every sum runs in a fixed order, so
results are bitwise the same for any thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from portable_nn.kernel_codes import IDENTITY, keeps_output_only

from . import _runtime
from ._blas import gemm
from ._conv_common import Geometry, Outputs, cotangent
from ._runtime import into as _into
from .activations import apply_kind, deriv_kind, is_rectifier, rectifier_slope

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}

#: Groups with at least this many input channels take this path (the products' inner dimension;
#: LeNet's 1 and 6 channels stay with im2col, whose inner dimension is Cg·K) ...
SHIFTED_MIN_CHANNELS = 16
#: ... when at most this fraction of the phase grid's rows is dropped (the frame around small images
#: is computed for nothing: 40% of a 7x7 output's grid).  Measured fwd+bwd, 3x3 convs, batch 8,
#: 2 threads, Xeon with AVX-512, shifted / im2col (ms): 56x56 64->64 (7% dropped) 34 / 46,
#: 28x28 128->128 (13%) 31.6 / 31.0, 14x14 256->256 (23%) 35 / 26, 7x7 512->512 (40%) 82 / 34.
SHIFTED_MAX_DROPPED = 0.15
#: Output elements of one forward or dP row block (a block's Z stays in L2: 256 KiB for float32).
BLOCK_ELEMENTS = 1 << 16
#: The weight gradient runs in blocks of the batch's rows, each block for a group of taps, with a
#: partial gradient per row block (summed in block order).  A block's rows of P and G stay in L2
#: (this many bytes) while its taps' products read them: one product per tap over all the batch's
#: rows re-read both from memory for every tap and ran at half the speed (19 ms vs 8 ms for
#: (32,64,28,28) 3x3 64->64, 2 threads).
WEIGHT_BLOCK_BYTES = 1 << 20
#: At most this many bytes of partial weight gradients (512->512 3x3 weights are 9.4 MB each).
WEIGHT_PARTIAL_BYTES = 1 << 26
#: Tasks the weight gradient aims for (row blocks × tap groups).
WEIGHT_TASKS = 16

# The geometry travels to the kernels as one int64 vector; these name its entries.
(N_, C_, G_, CG_, OG_, O_, K_, OD_, OH_, OW_, HQ_, WQ_, RQ_, ROWS_, BLOCKS_, MARGIN_, NPH_, QROWS_, QBLOCKS_,
 KROWS_, KCH_, TPG_, TGRP_, SPAN_, LAST_, D_, H_, W_) = range(28)


# --------------------------------------------------------------------------- the plan


class ShiftedPlan:
    """Everything about one call's geometry that the kernels need (cached by conv.py's plan)."""

    def __init__(self, call, weight_shape):
        g = Geometry(call, weight_shape)
        stride, lo, size, out = g.stride, g.lo, g.size, g.out
        last, n, channels, o, groups, cg, og, taps = g.last, g.n, g.channels, g.o, g.groups, g.cg, g.og, g.taps
        padded = g.padded_shape[1:-1] if last else g.padded_shape[2:]
        q = [-(-p // s) for p, s in zip(padded, stride)]  # (Dq, Hq, Wq)
        nph = stride[0] * stride[1] * stride[2]
        # Each tap's phase and row shift within the phase grid.
        reach = g.tap_reach()
        phase3 = reach % np.array(stride)
        shift3 = reach // np.array(stride)
        self.tap_phase = ((phase3[:, 0] * stride[1] + phase3[:, 1]) * stride[2] + phase3[:, 2]).astype(np.int64)
        self.tap_off = ((shift3[:, 0] * q[1] + shift3[:, 1]) * q[2] + shift3[:, 2]).astype(np.int64)
        margin = int(self.tap_off.max()) if taps else 0
        m = ((out[0] - 1) * q[1] + (out[1] - 1)) * q[2] + out[2]  # the last output row + 1
        qn = q[0] * q[1] * q[2]
        rq = max(qn, m + margin)  # rows per phase: every tap's shifted block stays inside
        span = (n - 1) * rq + m  # the batch's output rows, first image's row 0 to the last image's last
        rows = max(1, min(span, BLOCK_ELEMENTS // max(og, 1)))
        qrows = max(1, min(n * rq, BLOCK_ELEMENTS // max(cg, 1)))
        itemsize = np.dtype(call.x.dtype).itemsize
        partial = taps * o * cg * itemsize
        kch = max(1, min(-(-span // max(1, WEIGHT_BLOCK_BYTES // ((channels + o) * itemsize))),
                         WEIGHT_PARTIAL_BYTES // max(partial, 1)))
        krows = -(-span // kch)
        kch = -(-span // krows)
        tpg = -(-taps // min(taps, max(1, -(-WEIGHT_TASKS // kch))))  # taps per group
        # Where each input element sits in the phase buffer (in rows): row = tab_d[d] + tab_h[h] + tab_w[w].
        tabs = []
        for axis in range(3):
            coord = np.arange(size[axis]) + lo[axis]
            phase, pos = coord % stride[axis], coord // stride[axis]
            phase_step = n * rq * math.prod(stride[axis + 1:])  # a phase index step along this axis
            pos_step = math.prod(q[axis + 1:])
            tabs.append((phase * phase_step + pos * pos_step).astype(np.int64))
        self.tab_d, self.tab_h, self.tab_w = tabs
        self.geo = np.array([n, channels, groups, cg, og, o, taps, out[0], out[1], out[2], q[1], q[2], rq, rows,
                             -(-span // rows), margin, nph, qrows, -(-(n * rq) // qrows), krows, kch, tpg,
                             -(-taps // tpg), span, int(last), size[0], size[1], size[2]], dtype=np.int64)
        self.xs_size = nph * n * rq * channels
        self.gx_size = (margin + n * rq) * o
        self.n, self.channels, self.groups, self.cg, self.og, self.o = n, channels, groups, cg, og, o
        self.taps, self.kernel, self.last, self.nph, self.margin, self.rq = taps, g.kernel, last, nph, margin, rq
        self.x5 = (n, *size, channels) if last else (n, channels, *size)
        self.y5 = (n, *out, o) if last else (n, o, *out)
        self.out_shape, self.x_shape, self.macs = g.out_shape, g.x_shape, g.macs


def applies(call, weight_shape) -> bool:
    """Whether a conv call takes this path: many channels per group, a large enough image, nothing empty."""
    if int(weight_shape[1]) < SHIFTED_MIN_CHANNELS or call.x.size == 0 or int(weight_shape[0]) == 0:
        return False
    if any(int(s) == 0 for s in call.out_size):
        return False
    return dropped_fraction(call) <= SHIFTED_MAX_DROPPED


def dropped_fraction(call) -> float:
    """The fraction of an image's phase-grid rows that are computed and dropped."""
    grid = 1
    for size, lo, hi, stride in zip(call.in_size, call.pad_lo, call.pad_hi, call.stride):
        grid *= -(-(size + lo + hi) // stride)
    return 1.0 - math.prod(call.out_size) / grid


# --------------------------------------------------------------------------- stage 0: the phase buffer


@njit(inline="always", **_OPTS)
def _build_image(n, x5, xs, geo, tab_d, tab_h, tab_w):
    """Image n's rows of every phase = zeros, then every element of x at its padded, phase-split,
    channels-last row (row tab_d[d] + tab_h[h] + tab_w[w] + n·Rq of the phase-major buffer)."""
    c_n, rq = geo[C_], geo[RQ_]
    for ph in range(geo[NPH_]):
        at = ((ph * geo[N_] + n) * rq) * c_n
        xs[at : at + rq * c_n] = 0.0
    base = n * rq * c_n
    if geo[LAST_]:
        for d in range(geo[D_]):
            for h in range(geo[H_]):
                row_dh = tab_d[d] + tab_h[h]
                for w in range(geo[W_]):
                    dst = xs[base + (row_dh + tab_w[w]) * c_n : base + (row_dh + tab_w[w] + 1) * c_n]
                    src = x5[n, d, h, w]
                    for c in range(c_n):
                        dst[c] = src[c]
        return
    for d in range(geo[D_]):  # line by line: a line's rows of xs (W·C elements) stay in L1 across channels
        for h in range(geo[H_]):
            line = base + (tab_d[d] + tab_h[h]) * c_n
            for c in range(c_n):
                src = x5[n, c, d, h]
                for w in range(geo[W_]):
                    xs[line + tab_w[w] * c_n + c] = src[w]


# --------------------------------------------------------------------------- stage 1: forward row blocks


@njit(inline="always", **_OPTS)
def _epilogue_lines(z, y5, b, g, p0, p1, geo, kind, code, slope):
    """y = act(Z + bias) for the valid rows of the batch's rows [p0, p1), group g (Z: (p1 − p0, Og))."""
    og, hq, wq, oh_n, ow_n, od_n, rq = geo[OG_], geo[HQ_], geo[WQ_], geo[OH_], geo[OW_], geo[OD_], geo[RQ_]
    bg = b[g * og : (g + 1) * og]
    n = p0 // rq
    while n * rq < p1:
        _epilogue_image(z, y5, bg, g * og, n, n * rq, p0, p1, og, hq, wq, oh_n, ow_n, od_n, kind, code, slope,
                        geo[LAST_])
        n += 1


@njit(inline="always", **_OPTS)
def _epilogue_image(z, y5, bg, c0, n, base, p0, p1, og, hq, wq, oh_n, ow_n, od_n, kind, code, slope, last):
    """The part of _epilogue_lines in image n, whose row 0 is the batch's row ``base`` (channels c0 + [0, Og))."""
    line = max(p0 - base, 0) // wq
    while base + line * wq < p1 and line < od_n * hq:
        od = line // hq
        oh = line - od * hq
        start = base + line * wq
        w0 = max(0, p0 - start)
        w1 = min(ow_n, p1 - start)
        if oh < oh_n and w1 > w0:
            r0 = start + w0 - p0
            if last:
                for k in range(w1 - w0):
                    zr = z[r0 + k]
                    yr = y5[n, od, oh, w0 + k, c0 : c0 + og]
                    for o in range(og):
                        yr[o] = apply_kind(np.float64(zr[o] + bg[o]), kind, code, slope)
            else:
                for o in range(og):
                    yr = y5[n, c0 + o, od, oh, w0:w1]
                    zc = z[r0 : r0 + (w1 - w0), o]
                    bo = bg[o]
                    for k in range(w1 - w0):
                        yr[k] = apply_kind(np.float64(zc[k] + bo), kind, code, slope)
        line += 1


@njit(**_OPTS)
def _epilogue(z, y5, b, g, p0, p1, geo, code, slope):
    """The identity or a rectifier (``kernels_cpu.conv`` applies every other activation as a pass
    of its own over the output, so only these two loop nests are compiled)."""
    if code == IDENTITY:
        _epilogue_lines(z, y5, b, g, p0, p1, geo, 0, code, slope)
    else:
        _epilogue_lines(z, y5, b, g, p0, p1, geo, 1, code, rectifier_slope(code, slope))


@njit(inline="always", **_OPTS)
def _forward_block(k, xs, wk, b, y5, z5, geo, tap_phase, tap_off, code, slope, keep_z):
    """Block k of the batch's output rows: per group, Σ_t one product per tap, then the epilogue."""
    p0 = k * geo[ROWS_]
    p1 = min(geo[SPAN_], p0 + geo[ROWS_])
    c_n, cg, og, phase_rows = geo[C_], geo[CG_], geo[OG_], geo[N_] * geo[RQ_]
    one = xs.dtype.type(1.0)
    z = np.empty((p1 - p0, og), xs.dtype)
    zf = z.reshape(-1)
    for g in range(geo[G_]):
        for t in range(geo[K_]):
            a_off = (tap_phase[t] * phase_rows + p0 + tap_off[t]) * c_n + g * cg
            gemm(0, 0, p1 - p0, og, cg, one, xs, a_off, c_n, wk, (t * geo[G_] + g) * cg * og, og,
                 xs.dtype.type(1.0 if t else 0.0), zf, 0, og)
        _epilogue(z, y5, b, g, p0, p1, geo, code, slope)
        if keep_z:  # the pre-activation: the identity's code, typed (a literal 0 would compile anew)
            _epilogue(z, z5, b, g, p0, p1, geo, np.int64(0), slope)


# --------------------------------------------------------------------------- stage 2: G and the bias sums


@njit(inline="always", **_OPTS)
def _grad_lines(dy5, k5, gx, dbp, n, geo, kind, code, slope, from_output):
    """Image n's rows of G (zero on dropped rows; image 0 also zeroes the front frame) = dy · act'(kept)
    on the valid rows, and dbp[n] = Σ G."""
    o_n, hq, wq, oh_n, ow_n, od_n, margin = geo[O_], geo[HQ_], geo[WQ_], geo[OH_], geo[OW_], geo[OD_], geo[MARGIN_]
    rq = geo[RQ_]
    g2 = gx.reshape((-1, o_n))
    first = 0 if n == 0 else margin + n * rq
    g2[first : margin + (n + 1) * rq] = 0.0
    top = margin + n * rq
    for od in range(od_n):
        for oh in range(oh_n):
            row0 = top + (od * hq + oh) * wq
            if geo[LAST_]:
                for ow in range(ow_n):
                    dst = g2[row0 + ow]
                    d = dy5[n, od, oh, ow]
                    kv = k5[n, od, oh, ow]
                    for o in range(o_n):
                        dst[o] = d[o] * deriv_kind(np.float64(kv[o]), kind, code, slope, from_output)
            else:
                for o in range(o_n):
                    d = dy5[n, o, od, oh]
                    kv = k5[n, o, od, oh]
                    for ow in range(ow_n):
                        g2[row0 + ow, o] = d[ow] * deriv_kind(np.float64(kv[ow]), kind, code, slope, from_output)
    acc = dbp[n]
    for od in range(od_n):
        for oh in range(oh_n):
            row0 = top + (od * hq + oh) * wq
            for ow in range(ow_n):
                src = g2[row0 + ow]
                for o in range(o_n):
                    acc[o] += src[o]


@njit(**_OPTS)
def _grad(dy5, k5, gx, dbp, n, geo, code, slope, from_output):
    if code == IDENTITY:
        _grad_lines(dy5, k5, gx, dbp, n, geo, 0, code, slope, from_output)
    elif is_rectifier(code) and from_output:
        _grad_lines(dy5, k5, gx, dbp, n, geo, 1, code, rectifier_slope(code, slope), from_output)
    else:
        _grad_lines(dy5, k5, gx, dbp, n, geo, 2, code, slope, from_output)


# --------------------------------------------------------------------------- stage 3: the weight gradient


@njit(inline="always", **_OPTS)
def _weight_task(k, xs, gx, dwp, geo, tap_phase, tap_off):
    """Task k = (row block, tap group): the block's partial dW_t[g] = P_φ(t)[rows + off_t, g]ᵀ @ G[rows, g]
    for the group's taps, into the block's partial dwp[block]."""
    kc = k // geo[TGRP_]
    t0 = (k % geo[TGRP_]) * geo[TPG_]
    r0 = kc * geo[KROWS_]
    r1 = min(geo[SPAN_], r0 + geo[KROWS_])
    c_n, cg, og, o_n, groups, taps = geo[C_], geo[CG_], geo[OG_], geo[O_], geo[G_], geo[K_]
    phase_rows = geo[N_] * geo[RQ_]
    for t in range(t0, min(taps, t0 + geo[TPG_])):
        for g in range(groups):
            a_off = (tap_phase[t] * phase_rows + tap_off[t] + r0) * c_n + g * cg
            b_off = (geo[MARGIN_] + r0) * o_n + g * og
            gemm(1, 0, cg, og, r1 - r0, xs.dtype.type(1.0), xs, a_off, c_n, gx, b_off, o_n, xs.dtype.type(0.0),
                 dwp, ((kc * taps + t) * groups + g) * cg * og, og)


# --------------------------------------------------------------------------- stage 4: the input gradient


@njit(inline="always", **_OPTS)
def _input_block(k, gx, wk, dxs, geo, tap_phase, tap_off):
    """Block k = (phase, block of the phase's rows, images included) of dP: Σ over the phase's taps of
    G (shifted back) @ W_tᵀ."""
    ph = k // geo[QBLOCKS_]
    q0 = (k % geo[QBLOCKS_]) * geo[QROWS_]
    phase_rows = geo[N_] * geo[RQ_]
    q1 = min(phase_rows, q0 + geo[QROWS_])
    c_n, cg, og, o_n, margin = geo[C_], geo[CG_], geo[OG_], geo[O_], geo[MARGIN_]
    one = gx.dtype.type(1.0)
    for g in range(geo[G_]):
        c_off = (ph * phase_rows + q0) * c_n + g * cg
        first = True
        for t in range(geo[K_]):
            if tap_phase[t] != ph:
                continue
            a_off = (margin + q0 - tap_off[t]) * o_n + g * og
            gemm(0, 1, q1 - q0, cg, og, one, gx, a_off, o_n, wk, (t * geo[G_] + g) * cg * og, og,
                 gx.dtype.type(0.0 if first else 1.0), dxs, c_off, c_n)
            first = False
        if first:  # a phase no tap reads (a strided 1x1 conv): its gradient is zero
            for q in range(q1 - q0):
                dxs[c_off + q * c_n : c_off + q * c_n + cg] = 0.0


@njit(inline="always", **_OPTS)
def _gather_image(n, dxs, dx5, geo, tab_d, tab_h, tab_w):
    """dx of image n = the phase buffer's rows at every input element (padding dropped)."""
    c_n = geo[C_]
    base = n * geo[RQ_] * c_n
    if geo[LAST_]:
        for d in range(geo[D_]):
            for h in range(geo[H_]):
                row_dh = tab_d[d] + tab_h[h]
                for w in range(geo[W_]):
                    src = dxs[base + (row_dh + tab_w[w]) * c_n : base + (row_dh + tab_w[w] + 1) * c_n]
                    dst = dx5[n, d, h, w]
                    for c in range(c_n):
                        dst[c] = src[c]
        return
    for c in range(c_n):  # channel by channel: dx is written in order (one write stream beats a cached source)
        for d in range(geo[D_]):
            for h in range(geo[H_]):
                dst = dx5[n, c, d, h]
                at = base + (tab_d[d] + tab_h[h]) * c_n + c
                for w in range(geo[W_]):
                    dst[w] = dxs[at + tab_w[w] * c_n]


# --------------------------------------------------------------------------- one driver for every stage
#
# Each parallel driver compiled costs seconds (CI compiles them cold), so one driver, serial and
# parallel, runs every stage over its task count.

_BUILD, _FORWARD, _GRAD, _WEIGHT, _INPUT, _GATHER = range(6)


@njit(inline="always", **_OPTS)
def _task(stage, k, x5, xs, wk, b, y5, z5, gx, dw, dxs, dbp, geo, tap_phase, tap_off, tab_d, tab_h, tab_w, code,
          slope, keep_z, from_output):
    if stage == _BUILD:
        _build_image(k, x5, xs, geo, tab_d, tab_h, tab_w)
    elif stage == _FORWARD:
        _forward_block(k, xs, wk, b, y5, z5, geo, tap_phase, tap_off, code, slope, keep_z)
    elif stage == _GRAD:
        _grad(y5, z5, gx, dbp, k, geo, code, slope, from_output)  # y5 carries dy, z5 the kept y or z
    elif stage == _WEIGHT:
        _weight_task(k, xs, gx, dw, geo, tap_phase, tap_off)  # dw: the partial gradients
    elif stage == _INPUT:
        _input_block(k, gx, wk, dxs, geo, tap_phase, tap_off)
    else:
        _gather_image(k, dxs, x5, geo, tab_d, tab_h, tab_w)  # x5 carries dx


@njit(parallel=True, **_OPTS)
def _parallel(stage, count, x5, xs, wk, b, y5, z5, gx, dw, dxs, dbp, geo, tap_phase, tap_off, tab_d, tab_h, tab_w,
              code, slope, keep_z, from_output):
    for t in prange(count):
        _task(stage, np.int64(t), x5, xs, wk, b, y5, z5, gx, dw, dxs, dbp, geo, tap_phase, tap_off, tab_d, tab_h,
              tab_w, code, slope, keep_z, from_output)


@njit(**_OPTS)
def _serial(stage, count, x5, xs, wk, b, y5, z5, gx, dw, dxs, dbp, geo, tap_phase, tap_off, tab_d, tab_h, tab_w,
            code, slope, keep_z, from_output):
    for t in range(count):
        _task(stage, t, x5, xs, wk, b, y5, z5, gx, dw, dxs, dbp, geo, tap_phase, tap_off, tab_d, tab_h, tab_w,
              code, slope, keep_z, from_output)


# --------------------------------------------------------------------------- entry points


class Residuals:
    """What the backward needs: the phase buffer, the tap weights, the kept y or z, the plan, the call,
    and whether the layer is large enough for the parallel kernels."""

    __slots__ = ("call", "kept", "parallel", "plan", "wk", "xs")

    def __init__(self, xs, wk, kept, plan, call, parallel):
        self.xs, self.wk, self.kept, self.plan, self.call, self.parallel = xs, wk, kept, plan, call, parallel


def _tap_weights(weight, plan):
    """weight (O, Cg, *k) as (K, G, Cg, Og): the (Cg, Og) matrix of each tap and group."""
    w = weight.reshape(plan.groups, plan.og, plan.cg, plan.taps)
    return np.ascontiguousarray(w.transpose(3, 0, 2, 1))


def _stage(plan, parallel, stage, count, x5, xs, wk, b, y5, z5, gx, dw, dxs, dbp, code=0, slope=0.0, keep_z=False,
           from_output=False):
    _runtime.run_sized(_parallel, _serial, parallel and count > 1, stage, count, x5, xs, wk, b, y5, z5, gx, dw, dxs,
                       dbp, plan.geo, plan.tap_phase, plan.tap_off, plan.tab_d, plan.tab_h, plan.tab_w, code, slope,
                       keep_z, from_output)


def conv_forward(call, plan, parallel):
    """y = act(conv(x, weight) + bias) by shifted products; residuals: :class:`Residuals` (when saving)."""
    x, weight = call.x, call.weight
    dtype = x.dtype
    geo = plan.geo
    x5 = x.reshape(plan.x5)
    xs = _runtime.empty(plan.xs_size, dtype)
    wk = _tap_weights(weight, plan)
    b = np.zeros(plan.o, dtype) if call.bias is None else call.bias
    act_ = call.activation
    out = Outputs(call, plan.out_shape, dtype)
    y5, z5 = out.y.reshape(plan.y5), out.z.reshape(plan.y5)
    none1, none5 = np.empty(0, dtype), np.empty((0, 0, 0, 0, 0), dtype)
    dbp = np.empty((0, 0))
    _stage(plan, parallel, _BUILD, plan.n, x5, xs, wk, b, y5, z5, none1, none1, none1, dbp)
    _stage(plan, parallel, _FORWARD, int(geo[BLOCKS_]), none5, xs, wk.reshape(-1), b, y5, z5, none1, none1,
           none1, dbp, act_.code, act_.slope, out.keep_z)
    residuals = None
    if call.save:
        residuals = Residuals(xs, wk, out.kept(), plan, call.replace(arrays={}), parallel)
    return (out.y,), residuals


def conv_backward(residuals: Residuals, cotangents, needs, out=None):
    """dx, dweight, dbias (see the module docstring); only what ``needs`` asks for."""
    xs, wk, kept, plan, call = residuals.xs, residuals.wk, residuals.kept, residuals.plan, residuals.call
    out = out or {}
    dtype = xs.dtype
    geo = plan.geo
    parallel = residuals.parallel
    dy5 = cotangent(cotangents, dtype, plan.y5)
    k5 = dy5 if kept is None else kept.reshape(plan.y5)
    act_ = call.activation
    need_x, need_w = "x" in needs, "weight" in needs
    none1, none5 = np.empty(0, dtype), np.empty((0, 0, 0, 0, 0), dtype)
    gx = _runtime.empty(plan.gx_size, dtype)
    dbp = np.zeros((plan.n, plan.o))
    _stage(plan, parallel, _GRAD, plan.n, none5, none1, none1, none1, dy5, k5, gx, none1, none1, dbp, act_.code,
           act_.slope, False, keeps_output_only(act_))
    grads = {}
    if need_w:
        dwp = np.empty((int(geo[KCH_]), plan.taps, plan.groups, plan.cg, plan.og), dtype)
        tasks = int(geo[KCH_] * geo[TGRP_])
        _stage(plan, parallel, _WEIGHT, tasks, none5, xs, none1, none1, none5, none5, gx, dwp.reshape(-1), none1, dbp)
        dw = dwp[0] if len(dwp) == 1 else dwp.sum(axis=0, dtype=np.float64).astype(dtype)
        weight = np.ascontiguousarray(dw.transpose(1, 3, 2, 0)).reshape(plan.o, plan.cg, *call.kernel)
        grads["weight"] = _into(out, "weight", weight)
    if need_x:
        dx = out.get("x")
        if dx is None or not dx.flags.c_contiguous or dx.dtype != dtype:
            dx = np.empty(plan.x_shape, dtype)
        dxs = _runtime.empty(plan.xs_size, dtype)
        blocks = plan.nph * int(geo[QBLOCKS_])
        _stage(plan, parallel, _INPUT, blocks, none5, none1, wk.reshape(-1), none1, none5, none5, gx, none1, dxs, dbp)
        _stage(plan, parallel, _GATHER, plan.n, dx.reshape(plan.x5), none1, none1, none1, none5, none5, none1, none1,
               dxs, dbp)
        grads["x"] = _into(out, "x", dx)
    if "bias" in needs:
        grads["bias"] = _into(out, "bias", dbp.sum(axis=0).astype(dtype))
    return grads

