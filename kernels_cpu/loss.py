"""Numba kernels for ``log_softmax`` and ``cross_entropy``, forward and backward (backend ``"numba"``).

Both ops reduce over one axis of a C-contiguous array, seen as ``(M, C, Q)``:
``C`` is the class (softmax) axis, ``M`` the product of the axes before it and
``Q`` of those after it (``Q = 1`` for the usual last-axis / ``(N, C)`` case; a
0-d ``x`` is ``(1, 1, 1)``).  Per position ``(m, q)`` the forward computes

    m = max_c z_c,   ℓs = log Σ_c exp(z_c − m),   p_c = (z_c − m) − ℓs

with the maximum over eight float64 accumulators (element c in lane c mod 8, folded
pairwise) and the row sums in blocks of the data's dtype folded into float64, both in a
fixed order (deterministic; a NaN anywhere in a row gives a NaN row, like the reference).  It keeps ``(m, ℓs)``
— two float64 per position — instead of the log-probabilities; the backward
recomputes ``softmax_c = exp(p_c)`` from the input it reads anyway, so forward
and backward each read the big array once and write at most one.

* ``log_softmax``: y = p; dx = dy − softmax · Σ_c dy.
* ``cross_entropy`` (PyTorch's semantics, as :mod:`portable_nn.reference.loss`):
  with target weights a_c (one-hot or probabilities, class weights w, label
  smoothing ε, ignored positions zeroed) and A = Σ_c a_c, the position's loss is
  ℓ = −Σ_c a_c p_c (for integer targets −(1 − ε) w_y p_y − (ε/C) Σ_c w_c p_c, the
  smoothing sum only when ε > 0, so −∞ logits of other classes stay finite), and
  dz_c = g (softmax_c · A − a_c), dt_c = −g (1 − ε) w_c p_c, with g the
  cotangent scaled by the reduction.  The reduction over positions (``sum``,
  ``mean`` and its denominator Σ w_y) is a NumPy pairwise sum of the per-position
  float64 values: fixed order, independent of the thread count.

**exp.**  PyPI's Numba has no vector math library, so ``math.exp`` is a scalar
libm call (PyPI's numba has no SVML).  :func:`kernels_cpu._vmath.exp` is the package's
branch-free exponential (Cody–Waite reduction by ln 2, a fitted polynomial, 2^k put into the
exponent bits) that LLVM vectorizes: float64 to 2.3e-16 relative error (the
tests hold float64 results to 1e-12 of the reference), float32 to 1.2e-7, eight
lanes per AVX2 vector; 0 below −708 (float32: −87), ∞ above 709 (88), NaN for NaN.
Float32 data gets float32 exponentials (as the reference
and PyTorch compute them) and float64 sums; the exponentials of a row go through
a scratch row (the output itself for log_softmax) before they are summed, so the
exp loop stays eight lanes wide.

**Tasks.**  ``Q = 1``: rows, vectorized along the contiguous class axis
(cross_entropy's forward takes blocks of :data:`ROW_TASKS`-th of the rows, each
with a scratch row).  ``Q > 1`` (class axis not last, e.g. ``(N, C, H, W)``
logits): one task per ``(m, tile of TILE positions q)``, vectorized along q.
Calls below :data:`PARALLEL_MIN_ELEMENTS` run serially.

**Supported** (declared in ``kernels_cpu/__init__.py``): NumPy and CPU torch,
float32/float64 data (C-contiguous; dispatch copies strided input), any class
axis, integer targets of any integer dtype, probability targets, class weights,
``ignore_index``, label smoothing, the three reductions, zero-size inputs.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from portable_nn.kernel_plans import split_axis

from . import _runtime
from ._runtime import into as _into
from ._vmath import exp as _vexp

# FMA contraction only: results stay deterministic (same code, same order), and the
# polynomial and the Cody–Waite reduction get both faster and more accurate.
_OPTS = {"cache": True, "error_model": "numpy", "nogil": True, "fastmath": {"contract"}}
#: Positions of the q axis per task when the class axis is not the last one.
TILE = 64
#: Row blocks (tasks) of the cross_entropy forward when the class axis is last.
ROW_TASKS = 64
#: Below this many elements the thread pool costs more than it saves (measured: it pays only above ~50 us of work).
PARALLEL_MIN_ELEMENTS = 1 << 15

# --------------------------------------------------------------------------- exp (see _vmath)


def _as(v, like):
    """``v`` converted to the type of the data value ``like`` (compiled by the overload below)."""
    raise NotImplementedError


def _exp(d, like):
    """e^d in the precision of the data value ``like`` (compiled by the overload below)."""
    raise NotImplementedError


@overload(_as)
def _as_impl(v, like):
    if like == types.float32:
        return lambda v, like: np.float32(v)
    return lambda v, like: np.float64(v)


@overload(_exp)
def _exp_impl(d, like):
    if like == types.float32:
        return lambda d, like: _vexp(np.float32(d))
    return lambda d, like: _vexp(np.float64(d))


# --------------------------------------------------------------------------- row statistics (Q = 1)


@njit(**_OPTS)
def _u(i):
    """An index Numba treats as non-negative (no wraparound code in the loops)."""
    return np.uint64(i)


@njit(**_OPTS)
def _fold(s0, s1, s2, s3, s4, s5, s6, s7):
    """The eight lane sums in a fixed pairwise order."""
    return ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))


# The row maximum keeps eight scalar accumulators, element c going to lane c mod 8: LLVM holds
# them in two AVX2 registers (an accumulator *array* is reloaded and stored on every step; a flat
# select loop was not vectorised: 4.5 vs 1.3 ms for a (4096, 1000) float32 pass) and the order is
# fixed, so results are reproducible.  Sums go by blocks (see _row_sum).


@njit(**_OPTS)
def _row_max(z, base, C):
    """max over z[base : base + C] (a NaN row gives NaN statistics whichever way max treats NaN)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = -np.inf
    cv = C - C % 8
    for c0 in range(0, cv, 8):
        i = base + c0
        s0 = max(s0, np.float64(z[_u(i)]))
        s1 = max(s1, np.float64(z[_u(i + 1)]))
        s2 = max(s2, np.float64(z[_u(i + 2)]))
        s3 = max(s3, np.float64(z[_u(i + 3)]))
        s4 = max(s4, np.float64(z[_u(i + 4)]))
        s5 = max(s5, np.float64(z[_u(i + 5)]))
        s6 = max(s6, np.float64(z[_u(i + 6)]))
        s7 = max(s7, np.float64(z[_u(i + 7)]))
    m = max(max(max(s0, s1), max(s2, s3)), max(max(s4, s5), max(s6, s7)))
    for c in range(cv, C):
        m = max(m, np.float64(z[_u(base + c)]))
    return m


@njit(**{**_OPTS, "fastmath": {"contract", "reassoc"}})
def _run_sum(run):
    """Σ of a short run in its own dtype, vectorised (reassociation allowed: the compiled order is fixed)."""
    total = run.dtype.type(0.0)
    for i in range(run.shape[0]):
        total += run[i]
    return total


#: Block length of the data-dtype partial sums of :func:`_row_sum` (folded into float64).
SUM_BLOCK = 512


@njit(**_OPTS)
def _row_sum(a, base, C):
    """Σ a[base : base + C] in float64: blocks of SUM_BLOCK summed in the data's dtype (a flat loop
    LLVM vectorises: a float32 (4096, 1000) pass 2.1 -> 0.5 ms on one thread, Xeon AVX-512, against
    eight float64 scalar lanes), the block sums folded into float64 in order."""
    total = 0.0
    for b0 in range(0, C, SUM_BLOCK):
        total += np.float64(_run_sum(a[base + b0 : base + min(C, b0 + SUM_BLOCK)]))
    return total


@njit(**_OPTS)
def _row_stats(z, base, C, buf, boff):
    """(m, log Σ exp(z − m)) of one contiguous row.

    The exponentials go through ``buf[boff : boff + C]`` (the data dtype) and are then
    summed in float64: computing and accumulating in one loop would make LLVM vectorize
    the exponentials at the float64 width (half the float32 lanes).
    """
    m = _row_max(z, base, C)
    like = z[_u(base)]
    mz = _as(m, like)
    for c in range(C):
        buf[_u(boff + c)] = _exp(z[_u(base + c)] - mz, like)
    return m, math.log(_row_sum(buf, boff, C))


@njit(**_OPTS)
def _wp(z, w, base, c, m, ls):
    """w_c · p_c."""
    return w[c] * ((np.float64(z[_u(base + c)]) - m) - ls)


@njit(**_OPTS)
def _row_dot_p(z, w, base, C, m, ls):
    """Σ_c w_c · p_c over one row (w: class weights, C entries)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    cv = C - C % 8
    for c0 in range(0, cv, 8):
        s0 += _wp(z, w, base, c0, m, ls)
        s1 += _wp(z, w, base, c0 + 1, m, ls)
        s2 += _wp(z, w, base, c0 + 2, m, ls)
        s3 += _wp(z, w, base, c0 + 3, m, ls)
        s4 += _wp(z, w, base, c0 + 4, m, ls)
        s5 += _wp(z, w, base, c0 + 5, m, ls)
        s6 += _wp(z, w, base, c0 + 6, m, ls)
        s7 += _wp(z, w, base, c0 + 7, m, ls)
    for c in range(cv, C):
        s0 += _wp(z, w, base, c, m, ls)
    return _fold(s0, s1, s2, s3, s4, s5, s6, s7)


@njit(**_OPTS)
def _row_target_dot_p(z, t, w, base, C, m, ls, keep, smooth):
    """(Σ_c a_c p_c, Σ_c a_c) for probability targets: a_c = w_c (keep · t_c + smooth).

    Sequential float64 sums (a fixed order): one pass per row, next to the exponentials.
    """
    sap = 0.0
    tot = 0.0
    for c in range(C):
        a = w[c] * (keep * np.float64(t[_u(base + c)]) + smooth)
        sap += a * ((np.float64(z[_u(base + c)]) - m) - ls)
        tot += a
    return sap, tot


# --------------------------------------------------------------------------- tile statistics (Q > 1)


@njit(**_OPTS)
def _tile_stats(z, C, Q, m, q0, n, mx, ls):
    """mx[i], ls[i] for the positions (m, q0 + i), i < n: max and log Σ exp over the class axis."""
    for i in range(n):
        mx[i] = -np.inf
        ls[i] = 0.0
    for c in range(C):
        row = _u((m * C + c) * Q + q0)
        for i in range(n):
            mx[i] = np.maximum(mx[i], np.float64(z[_u(row + i)]))
    like = z[_u(m * C * Q + q0)]
    for c in range(C):
        row = _u((m * C + c) * Q + q0)
        for i in range(n):
            ls[i] += _exp(z[_u(row + i)] - _as(mx[i], like), like)
    for i in range(n):
        ls[i] = math.log(ls[i])


@njit(**_OPTS)
def _tile_task(t, M, Q):
    """(m, q0, n) of tile task t."""
    tiles = -(-Q // TILE)
    m = t // tiles
    q0 = (t % tiles) * TILE
    return m, q0, min(TILE, Q - q0)


# --------------------------------------------------------------------------- log_softmax


@njit(**_OPTS)
def _lsm_forward_task(x, y, mx, ls, C, Q, t):
    """Row t (Q = 1) or tile t (Q > 1) of y = log_softmax(x); saves (m, ℓs) per position."""
    if Q == 1:
        base = t * C
        m, s = _row_stats(x, base, C, y, base)  # y holds the exponentials until overwritten
        mx[t] = m
        ls[t] = s
        for c in range(C):
            y[_u(base + c)] = (np.float64(x[_u(base + c)]) - m) - s
        return
    m, q0, n = _tile_task(t, x.shape[0] // (C * Q), Q)
    tm = mx[m * Q + q0 : m * Q + q0 + n]
    tl = ls[m * Q + q0 : m * Q + q0 + n]
    _tile_stats(x, C, Q, m, q0, n, tm, tl)
    for c in range(C):
        row = _u((m * C + c) * Q + q0)
        for i in range(n):
            y[_u(row + i)] = (np.float64(x[_u(row + i)]) - tm[i]) - tl[i]


@njit(parallel=True, **_OPTS)
def _lsm_forward_parallel(x, y, mx, ls, C, Q, tasks):
    for t in prange(tasks):
        _lsm_forward_task(x, y, mx, ls, C, Q, t)


@njit(**_OPTS)
def _lsm_forward_serial(x, y, mx, ls, C, Q, tasks):
    for t in range(tasks):
        _lsm_forward_task(x, y, mx, ls, C, Q, t)


@njit(**_OPTS)
def _lsm_backward_task(x, dy, dx, mx, ls, C, Q, t, scratch):
    """dx = dy − softmax · Σ_c dy, softmax recomputed from x and the saved (m, ℓs)."""
    if Q == 1:
        base = t * C
        like = x[_u(base)]
        # Elementwise work in the data dtype (as the reference): the float32 path stays
        # eight lanes wide; the sums and the saved statistics are float64.
        sdy = _as(_row_sum(dy, base, C), like)
        m = _as(mx[t], like)
        s = _as(ls[t], like)
        for c in range(C):
            i = _u(base + c)
            dx[i] = dy[i] - _exp((x[i] - m) - s, like) * sdy
        return
    m, q0, n = _tile_task(t, x.shape[0] // (C * Q), Q)
    sdy = scratch[t]
    for i in range(n):
        sdy[i] = 0.0
    for c in range(C):
        row = _u((m * C + c) * Q + q0)
        for i in range(n):
            sdy[i] += dy[_u(row + i)]
    tm = mx[m * Q + q0 : m * Q + q0 + n]
    tl = ls[m * Q + q0 : m * Q + q0 + n]
    like = x[_u(m * C * Q + q0)]
    for c in range(C):
        row = _u((m * C + c) * Q + q0)
        for i in range(n):
            soft = _exp((x[_u(row + i)] - _as(tm[i], like)) - _as(tl[i], like), like)
            dx[_u(row + i)] = dy[_u(row + i)] - soft * _as(sdy[i], like)


@njit(parallel=True, **_OPTS)
def _lsm_backward_parallel(x, dy, dx, mx, ls, C, Q, tasks, scratch):
    for t in prange(tasks):
        _lsm_backward_task(x, dy, dx, mx, ls, C, Q, t, scratch)


@njit(**_OPTS)
def _lsm_backward_serial(x, dy, dx, mx, ls, C, Q, tasks, scratch):
    for t in range(tasks):
        _lsm_backward_task(x, dy, dx, mx, ls, C, Q, t, scratch)


# --------------------------------------------------------------------------- cross_entropy
#
# Shared arguments: z (M·C·Q logits, flat), lab (M·Q int64 labels) or tp (M·C·Q probabilities),
# w (C float64 class weights, ones when absent), mx/ls (M·Q saved statistics), ε, ignore_index,
# prob (probability targets), and per position loss/wy/tot (M·Q float64): the loss, w_y
# (0 where ignored) and A = Σ_c a_c.


@njit(**_OPTS)
def _ce_position(z, lab, tp, w, base, C, pos, m, s, eps, ignore, prob, wsum, loss, wy, tot):
    """Loss, w_y and A of the position whose classes are the contiguous z[base : base + C]."""
    if prob:
        sap, a = _row_target_dot_p(z, tp, w, base, C, m, s, 1.0 - eps, eps / C)
        loss[pos] = -sap
        wy[pos] = 1.0
        tot[pos] = a
        return
    label = lab[pos]
    if label == ignore:
        loss[pos] = 0.0
        wy[pos] = 0.0
        tot[pos] = 0.0
        return
    wl = w[label]
    ell = -(wl * ((np.float64(z[_u(base + label)]) - m) - s))
    if eps > 0.0:
        ell = (1.0 - eps) * ell + (eps / C) * -_row_dot_p(z, w, base, C, m, s)
    loss[pos] = ell
    wy[pos] = wl
    tot[pos] = (1.0 - eps) * wl + (eps / C) * wsum


@njit(**_OPTS)
def _ce_forward_tile(z, lab, tp, w, C, Q, m, q0, n, tm, tl, eps, ignore, prob, wsum, loss, wy, tot):
    """Q > 1: the same for n positions (m, q0 + i) at once, vectorized along q.

    Integer targets read p_y directly and accumulate Σ_c w_c p_c (in ``tot``, only when ε > 0),
    combined as the reference does, so −∞ logits of other classes stay harmless.
    """
    _tile_stats(z, C, Q, m, q0, n, tm, tl)
    p0 = m * Q + q0
    for i in range(n):
        loss[_u(p0 + i)] = 0.0
        tot[_u(p0 + i)] = 0.0
    for c in range(C):
        row = _u((m * C + c) * Q + q0)
        wc = w[c]
        if prob:
            for i in range(n):
                a = wc * ((1.0 - eps) * np.float64(tp[_u(row + i)]) + eps / C)
                loss[_u(p0 + i)] -= a * ((np.float64(z[_u(row + i)]) - tm[i]) - tl[i])
                tot[_u(p0 + i)] += a
        else:
            if eps > 0.0:
                for i in range(n):
                    tot[_u(p0 + i)] += wc * ((np.float64(z[_u(row + i)]) - tm[i]) - tl[i])
    for i in range(n):
        pos = p0 + i
        if prob:
            wy[pos] = 1.0
            continue
        label = lab[pos]
        if label == ignore:
            loss[pos] = 0.0
            wy[pos] = 0.0
            tot[pos] = 0.0
            continue
        wl = w[label]
        ell = -(wl * ((np.float64(z[_u((m * C + label) * Q + q0 + i)]) - tm[i]) - tl[i]))
        if eps > 0.0:
            ell = (1.0 - eps) * ell + (eps / C) * -tot[pos]
        loss[pos] = ell
        wy[pos] = wl
        tot[pos] = (1.0 - eps) * wl + (eps / C) * wsum


@njit(**_OPTS)
def _ce_forward_task(z, lab, tp, w, mx, ls, C, Q, tk, per, scratch, eps, ignore, prob, wsum, loss, wy, tot):
    """Q = 1: rows [tk·per, (tk + 1)·per) with the task's scratch row; Q > 1: tile tk.

    Writes the saved statistics and, per position, the loss, w_y and A.
    """
    if Q == 1:
        buf = scratch[tk]
        for r in range(tk * per, min(z.shape[0] // C, (tk + 1) * per)):
            m, s = _row_stats(z, r * C, C, buf, 0)
            mx[r] = m
            ls[r] = s
            _ce_position(z, lab, tp, w, r * C, C, r, m, s, eps, ignore, prob, wsum, loss, wy, tot)
        return
    m, q0, n = _tile_task(tk, z.shape[0] // (C * Q), Q)
    p0 = m * Q + q0
    _ce_forward_tile(z, lab, tp, w, C, Q, m, q0, n, mx[p0 : p0 + n], ls[p0 : p0 + n], eps, ignore, prob, wsum,
                     loss, wy, tot)


@njit(parallel=True, **_OPTS)
def _ce_forward_parallel(z, lab, tp, w, mx, ls, C, Q, per, scratch, eps, ignore, prob, wsum, loss, wy, tot):
    for tk in prange(scratch.shape[0]):
        _ce_forward_task(z, lab, tp, w, mx, ls, C, Q, tk, per, scratch, eps, ignore, prob, wsum, loss, wy, tot)


@njit(**_OPTS)
def _ce_forward_serial(z, lab, tp, w, mx, ls, C, Q, per, scratch, eps, ignore, prob, wsum, loss, wy, tot):
    for tk in range(scratch.shape[0]):
        _ce_forward_task(z, lab, tp, w, mx, ls, C, Q, tk, per, scratch, eps, ignore, prob, wsum, loss, wy, tot)


@njit(**_OPTS)
def _ce_grad_row(z, lab, tp, w, wd, base, C, pos, m, s, g, a_total, valid, eps, prob, need_z, need_t, dz, dt):
    """dz, dt over the C contiguous classes z[base : base + C] of one position.

    Each output is one branch-free loop in the data dtype (the reference's precision; the
    float32 path stays eight lanes wide) with ``wd`` the weights in that dtype; for integer
    targets the target's own element is then recomputed in float64 with its full weight.
    """
    like = z[_u(base)]
    mz, sz, gz = _as(m, like), _as(s, like), _as(g, like)
    if need_z:
        az = _as(a_total, like)
        if prob:
            keep, share = _as(1.0 - eps, like), _as(eps / C, like)
            for c in range(C):
                i = _u(base + c)
                a = wd[c] * (keep * tp[i] + share)
                dz[i] = gz * (_exp((z[i] - mz) - sz, like) * az - a)
        else:
            smooth = _as(valid * (eps / C), like)
            for c in range(C):
                i = _u(base + c)
                dz[i] = gz * (_exp((z[i] - mz) - sz, like) * az - smooth * wd[c])
            if valid != 0.0:
                label = lab[pos]
                i = _u(base + label)
                a = (1.0 - eps) * w[label] + valid * (eps / C) * w[label]
                dz[i] = g * (_vexp((np.float64(z[i]) - m) - s) * a_total - a)
    if need_t:
        scale = _as(-g * (1.0 - eps), like)
        for c in range(C):
            i = _u(base + c)
            dt[i] = scale * wd[c] * ((z[i] - mz) - sz)


@njit(**_OPTS)
def _ce_backward_task(z, lab, tp, w, wd, mx, ls, C, Q, tk, eps, ignore, prob, g, tot, need_z, need_t,
                      dz, dt):
    """Row tk (Q = 1) or tile tk (Q > 1): dz and/or dt, g being the per-position cotangent."""
    if Q == 1:
        valid = 1.0 if prob or lab[tk] != ignore else 0.0
        _ce_grad_row(z, lab, tp, w, wd, tk * C, C, tk, mx[tk], ls[tk], g[tk], tot[tk], valid, eps,
                     prob, need_z, need_t, dz, dt)
        return
    # Q > 1: class by class over the tile's positions, one branch-free loop per output
    # (vectorized along q).
    m_, q0, n = _tile_task(tk, z.shape[0] // (C * Q), Q)
    p0 = m_ * Q + q0
    for c in range(C):
        row = _u((m_ * C + c) * Q + q0)
        wc = w[c]
        if need_z and prob:
            for i in range(n):
                pc = (np.float64(z[_u(row + i)]) - mx[_u(p0 + i)]) - ls[_u(p0 + i)]
                a = wc * ((1.0 - eps) * np.float64(tp[_u(row + i)]) + eps / C)
                dz[_u(row + i)] = g[_u(p0 + i)] * (_vexp(pc) * tot[_u(p0 + i)] - a)
        elif need_z:
            for i in range(n):
                pc = (np.float64(z[_u(row + i)]) - mx[_u(p0 + i)]) - ls[_u(p0 + i)]
                label = lab[_u(p0 + i)]
                a = (1.0 - eps) * wc if label == c else 0.0
                a = a + (eps / C) * wc if label != ignore else 0.0
                dz[_u(row + i)] = g[_u(p0 + i)] * (_vexp(pc) * tot[_u(p0 + i)] - a)
        if need_t:
            for i in range(n):
                pc = (np.float64(z[_u(row + i)]) - mx[_u(p0 + i)]) - ls[_u(p0 + i)]
                dt[_u(row + i)] = -g[_u(p0 + i)] * (1.0 - eps) * wc * pc


@njit(parallel=True, **_OPTS)
def _ce_backward_parallel(z, lab, tp, w, wd, mx, ls, C, Q, tasks, eps, ignore, prob, g, tot, need_z, need_t,
                          dz, dt):
    for tk in prange(tasks):
        _ce_backward_task(z, lab, tp, w, wd, mx, ls, C, Q, tk, eps, ignore, prob, g, tot, need_z, need_t,
                          dz, dt)


@njit(**_OPTS)
def _ce_backward_serial(z, lab, tp, w, wd, mx, ls, C, Q, tasks, eps, ignore, prob, g, tot, need_z, need_t,
                        dz, dt):
    for tk in range(tasks):
        _ce_backward_task(z, lab, tp, w, wd, mx, ls, C, Q, tk, eps, ignore, prob, g, tot, need_z, need_t,
                          dz, dt)


# --------------------------------------------------------------------------- plans and entry points


def _tasks(M, Q):
    return M if Q == 1 else M * -(-Q // TILE)


def _run(parallel_kernel, serial_kernel, size, *args):
    """Serial below PARALLEL_MIN_ELEMENTS (read at call time, so tests can move it), else parallel."""
    _runtime.run_sized(parallel_kernel, serial_kernel, size >= PARALLEL_MIN_ELEMENTS, *args)


#: ``a.sum()`` without ndarray.sum's Python wrapper (the same pairwise sum, the same bits): the
#: cross_entropy forward's three sums cost ~6 µs of a ~40 µs (4, 64) call on a Zen 3 through it.
_sum = np.add.reduce


def _flat(a, dtype):
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1)


def _buffer(out, name, shape, dtype):
    """The caller's buffer when the kernel can write into it directly, else a new array."""
    buffer = out.get(name)
    if buffer is not None and buffer.flags.c_contiguous and buffer.dtype == dtype:
        return buffer
    return np.empty(shape, dtype)



def log_softmax_forward(call):
    """y = log_softmax(x) along ``call.axis``; keeps x and two float64 statistics per position."""
    x = call.x
    shape = tuple(int(s) for s in x.shape) or (1,)
    M, C, Q = split_axis(shape, 0 if call.scalar else call.axis)
    y = np.empty(x.shape, x.dtype)
    mx = np.empty(M * Q)
    ls = np.empty(M * Q)
    if x.size:
        tasks = _tasks(M, Q)
        _run(_lsm_forward_parallel, _lsm_forward_serial, x.size,
             x.reshape(-1), y.reshape(-1), mx, ls, C, Q, tasks)
    residuals = (x, mx, ls, (M, C, Q)) if call.save else None
    return (y,), residuals


def log_softmax_backward(residuals, cotangents, needs, out=None):
    """dx = dy − softmax · Σ_axis dy."""
    if "x" not in needs:
        return {}
    x, mx, ls, (M, C, Q) = residuals
    out = out or {}
    dy = _flat(cotangents[0], x.dtype)
    dx = _buffer(out, "x", x.shape, x.dtype)
    if x.size:
        tasks = _tasks(M, Q)
        scratch = np.empty((tasks, TILE)) if Q > 1 else np.empty((1, 1))
        _run(_lsm_backward_parallel, _lsm_backward_serial, x.size,
             x.reshape(-1), dy, dx.reshape(-1), mx, ls, C, Q, tasks, scratch)
    return {"x": _into(out, "x", dx)}


class _CEState:
    """What the cross_entropy backward needs besides the arrays."""

    __slots__ = ("C", "M", "Q", "denominator", "flags", "reduction", "target_dtype", "z_shape")


def cross_entropy_forward(call):
    """Per-position losses in one kernel, then the reduction (NumPy pairwise sums)."""
    z = call.logits
    axis = call.axis
    shape = tuple(int(s) for s in z.shape)
    M, C, Q = split_axis(shape, axis)
    prob = bool(call.probabilities)
    # Labels and probabilities travel in separate arguments (the unused one a 1-element
    # placeholder), so each kernel has one signature per logits dtype.
    lab = np.zeros(1, np.int64) if prob else _flat(call.target, np.int64)
    tp = _flat(call.target, z.dtype) if prob else np.zeros(1, z.dtype)
    w = np.ones(C) if call.weight is None else _flat(call.weight, np.float64)
    flags = (float(call.label_smoothing), int(call.ignore_index), prob)
    n = M * Q
    mx, ls = np.empty(n), np.empty(n)
    loss, wy, tot = np.empty(n), np.empty(n), np.empty(n)
    zf = z.reshape(-1)
    if z.size:
        if Q == 1:  # blocks of rows, each with a scratch row for the exponentials
            per = -(-M // ROW_TASKS)
            scratch = np.empty((-(-M // per), C), z.dtype)
        else:
            per, scratch = 1, np.empty((_tasks(M, Q), 1), z.dtype)
        _run(_ce_forward_parallel, _ce_forward_serial, z.size,
             zf, lab, tp, w, mx, ls, C, Q, per, scratch, *flags, float(C) if call.weight is None else float(_sum(w)),
             loss, wy, tot)
    denominator = None
    if call.reduction == "none":
        result = loss.astype(z.dtype).reshape(shape[:axis] + shape[axis + 1 :])
    elif call.reduction == "sum":
        result = np.asarray(_sum(loss), z.dtype)
    elif prob:
        result = np.asarray(_sum(loss) / n if n else math.nan, z.dtype)
        denominator = float(max(n, 1))
    else:
        total = float(_sum(wy))
        denominator = total if total != 0.0 else 1.0
        result = np.asarray(_sum(loss) / total if total != 0.0 else math.nan, z.dtype)
    residuals = None
    if call.save:
        state = _CEState()
        state.M, state.C, state.Q, state.flags = M, C, Q, flags
        state.reduction, state.denominator = call.reduction, denominator
        state.z_shape, state.target_dtype = z.shape, call.target.dtype
        residuals = (zf, lab, tp, w, mx, ls, tot, state)
    return (result,), residuals


def cross_entropy_backward(residuals, cotangents, needs, out=None):
    """dlogits = g (softmax · A − a); dtarget = −g (1 − ε) w p (probability targets)."""
    zf, lab, tp, w, mx, ls, tot, st = residuals
    out = out or {}
    dtype = zf.dtype
    gy = np.asarray(cotangents[0], np.float64).reshape(-1)
    if st.reduction == "mean":
        gy = gy / st.denominator
    if gy.size != st.M * st.Q:  # one g per position, so the kernels read it contiguously
        gy = np.full(st.M * st.Q, gy[0] if gy.size else 0.0)
    need_z, need_t = "logits" in needs, "target" in needs
    dz = _buffer(out, "logits", st.z_shape, dtype) if need_z else np.empty(1, dtype)
    dt = _buffer(out, "target", st.z_shape, st.target_dtype) if need_t else np.empty(1, dtype)
    if zf.size and (need_z or need_t):
        _run(_ce_backward_parallel, _ce_backward_serial, zf.size,
             zf, lab, tp, w, w.astype(dtype), mx, ls, st.C, st.Q, _tasks(st.M, st.Q), *st.flags, gy, tot,
             need_z, need_t, dz.reshape(-1), dt.reshape(-1))
    grads = {}
    if need_z:
        grads["logits"] = _into(out, "logits", dz)
    if need_t:
        grads["target"] = _into(out, "target", dt)
    return grads
