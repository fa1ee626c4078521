"""Numba-CUDA kernels for every norm and ``moments``, forward and backward (backend ``"numba_cuda"``).

All five norms share one view of a C-contiguous ``x`` (the CPU kernels' canonical form)::

    x4 = x.reshape(Nn, P, C, Q)      statistics group (i, c) = x4[i, :, c, :], n = P·Q elements
    x3 = x.reshape(R, J, S)          parameter j of element (r, j, s);  R = Nn·P, J = C·Cg, Q = Cg·S

so a flat index f has row r = f // (C·Q), column col = f % (C·Q), group (r // P, col // Q) and
parameter col // S (layer norm: (M, 1, 1, D), Cg = D, S = 1; batch norm NC…: (1, N, C, L),
Cg = 1, S = L; see ``kernels_cpu.norm`` for every norm).

Forward, training (statistics from the data), one of three paths by shape:

* ``row``: one block per group (layer/rms norm rows, many groups): shifted sums of the group
  (shift = its first element, float64 lanes), a shared-memory tree reduction, then the same
  block writes ``y`` while the group is still in cache.
* ``seg``: few large groups (batch norm NC…): each group is split into K chunks, one block per
  (group, chunk) writes partial sums, a second kernel adds the K partials in a fixed order,
  a third turns them into mean/rstd, and an elementwise kernel writes ``y``.
* ``column``: short contiguous runs (channels-last data, (N, C) batch norm): 2-D blocks of
  consecutive columns × row lanes write per-(row chunk, column) partial sums, folded per group
  by the second pass.

Backward: the group sums Σ g·w and Σ g·w·x̂ (g = dy·act'(z)) by the same three paths (the ``row``
path writes dx in the same kernel), then dx elementwise; dweight/dbias are per-parameter sums
Σ g·x̂ and Σ g by column reduction (S = 1) or chunked segment reduction (S > 1), always partials
plus a fixed-order second pass: no atomics, results are deterministic.

Statistics and gradient sums accumulate in float64; elementwise work runs in the compute type
(float32 for float16/bfloat16/float32 data, with the mean split into two float32 halves so
data far from zero keeps its precision).

``moments`` (any axes) has its own plan and kernels at the end of the module.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from portable_nn.kernel_codes import IDENTITY
from portable_nn.kernel_plans import canonical, moments_plan, moments_shape, momentum_update, pow2_at_most, row_splits

from . import _runtime as rt
from ._runtime import compute_cast, device, kernel, load, store
from .activations import act, act_grad

#: Shared-memory lanes per reduction: the largest block the kernels accept.
MAX_THREADS = 1024

_MODE_STATS = 0  # (x − shift, (x − shift)²)
_MODE_GROUP_GRADS = 1  # (g·w, g·w·x̂)
_MODE_PARAM_GRADS = 2  # (g, g·x̂)

_I = "int64"
_FWD_ROW = (f"void({{x}}[::1], {{c}}[::1], {{c}}[::1], {{x}}[::1], float64[::1], float64[::1], float64[::1], "
            f"{_I}, {_I}, {_I}, {_I}, {_I}, boolean, float64, {_I}, {{c}})")
_BWD_ROW = (f"void({{x}}[::1], {{x}}[::1], {{c}}[::1], {{c}}[::1], {{x}}[::1], float64[::1], float64[::1], "
            f"{_I}, {_I}, {_I}, {_I}, boolean, {_I}, {{c}})")
_SEG = (f"void({{x}}[::1], {{x}}[::1], {{c}}[::1], {{c}}[::1], float64[::1], float64[::1], float64[::1], "
        f"float64[::1], {_I}, {_I}, {_I}, {_I}, {_I}, {_I}, {_I}, boolean, {_I}, {{c}})")
_COL = _SEG.replace(f"{_I}, boolean", f"{_I}, {_I}, boolean", 1)
_SUM = f"void(float64[::1], float64[::1], float64[::1], float64[::1], {_I}, {_I}, {_I}, {_I})"
_FIN = (f"void(float64[::1], float64[::1], {{x}}[::1], float64[::1], float64[::1], float64[::1], "
        f"{_I}, {_I}, {_I}, boolean, float64)")
_APPLY_F = (f"void({{x}}[::1], {{c}}[::1], {{c}}[::1], {{x}}[::1], float64[::1], float64[::1], "
            f"{_I}, {_I}, {_I}, {_I}, {_I}, {{c}})")
_APPLY_B = (f"void({{x}}[::1], {{x}}[::1], {{c}}[::1], {{c}}[::1], {{x}}[::1], float64[::1], float64[::1], "
            f"float64[::1], float64[::1], {_I}, {_I}, {_I}, {_I}, {_I}, boolean, boolean, {_I}, {{c}})")


# --------------------------------------------------------------------------- device helpers


@device
def _block_sum2(sh1, sh2, a, b):
    """(Σ a, Σ b) over the block's threads (1-D block, power-of-two size), by a shared-memory tree."""
    t = cuda.threadIdx.x
    cuda.syncthreads()  # earlier readers of sh1[0]/sh2[0] are done
    sh1[t] = a
    sh2[t] = b
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            sh1[t] += sh1[t + step]
            sh2[t] += sh2[t + step]
        cuda.syncthreads()
        step //= 2
    return sh1[0], sh2[0]


@device
def _stats(s1, s2, shift, n, center, eps):
    """(mean, var, rstd) from shifted sums: var = (Σd² − (Σd)²/n)/n, never E[x²] − E[x]²."""
    if n == 0:
        return 0.0, 0.0, 1.0 / math.sqrt(eps)
    if center:
        cm = s1 / n
        v = max((s2 - s1 * cm) / n, 0.0)
        return shift + cm, v, 1.0 / math.sqrt(v + eps)
    v = s2 / n
    return 0.0, v, 1.0 / math.sqrt(v + eps)


@device
def _xhat(xv, w, m, r):
    """x̂ = (x − m)·r in the compute type, with m split into hi + lo so an offset costs no digits."""
    mh = compute_cast(w, m)
    ml = compute_cast(w, m - np.float64(mh))
    return ((xv - mh) - ml) * compute_cast(w, r)


@device
def _grad_pair(mode, xv, dyv, w, j, b, m, r, code, slope):
    """The two float64 quantities mode 1 (g·w, g·w·x̂) or mode 2 (g, g·x̂) sums at one element."""
    xh = (np.float64(xv) - m) * r
    g = np.float64(dyv)
    if code != IDENTITY:
        g *= np.float64(act_grad(compute_cast(w, xh) * w[j] + b[j], code, slope))
    if mode == 1:
        gw = g * np.float64(w[j])
        return gw, gw * xh
    return g, g * xh


@device
def _pair(mode, x, dy, w, b, mean, rstd, f, grp, j, shift, code, slope):
    """The pair of sums of ``mode`` at flat element ``f`` (group ``grp``, parameter ``j``)."""
    if mode == 0:
        d = np.float64(load(x, f)) - shift
        return d, d * d
    return _grad_pair(mode, load(x, f), load(dy, f), w, j, b, mean[grp], rstd[grp], code, slope)


@device
def _group_shift(x, grp, P, C, Q, center):
    """The group's first element (its shift), 0 for uncentred (rms) statistics."""
    if not center:
        return 0.0
    i = grp // C
    c = grp - i * C
    return np.float64(load(x, (i * P * C + c) * Q))


# --------------------------------------------------------------------------- row path


@kernel(_FWD_ROW)
def _row_forward(x, w, b, y, mean, rstd, var, P, C, Q, Cg, S, center, eps, code, slope):
    """One block per group: statistics, then y = act(x̂·w + b) (Cg unused: parameters are col // S)."""
    sh1 = cuda.shared.array(MAX_THREADS, float64)
    sh2 = cuda.shared.array(MAX_THREADS, float64)
    g = cuda.blockIdx.x
    i = g // C
    c = g - i * C
    n = P * Q
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    shift = _group_shift(x, g, P, C, Q, center) if n > 0 else 0.0
    s1 = 0.0
    s2 = 0.0
    e = t
    while e < n:
        p = e // Q
        f = ((i * P + p) * C + c) * Q + (e - p * Q)
        d = np.float64(load(x, f)) - shift
        s1 += d
        s2 += d * d
        e += nt
    s1, s2 = _block_sum2(sh1, sh2, s1, s2)
    m, v, r = _stats(s1, s2, shift, n, center, eps)
    if t == 0:
        mean[g] = m
        var[g] = v
        rstd[g] = r
    e = t
    while e < n:
        p = e // Q
        q = e - p * Q
        f = ((i * P + p) * C + c) * Q + q
        j = c * Cg + q // S
        store(y, f, act(_xhat(load(x, f), w, m, r) * w[j] + b[j], code, slope))
        e += nt


@kernel(_BWD_ROW)
def _row_backward(x, dy, w, b, dx, mean, rstd, P, C, Q, S, center, code, slope):
    """One block per group (training): Σ g·w and Σ g·w·x̂, then dx = r·(g·w − mean(g·w) − x̂·mean(g·w·x̂))."""
    sh1 = cuda.shared.array(MAX_THREADS, float64)
    sh2 = cuda.shared.array(MAX_THREADS, float64)
    g = cuda.blockIdx.x
    i = g // C
    c = g - i * C
    n = P * Q
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    m = mean[g]
    r = rstd[g]
    sa = 0.0
    sb = 0.0
    e = t
    while e < n:
        p = e // Q
        q = e - p * Q
        f = ((i * P + p) * C + c) * Q + q
        a, bb = _grad_pair(1, load(x, f), load(dy, f), w, (c * Q + q) // S, b, m, r, code, slope)
        sa += a
        sb += bb
        e += nt
    sa, sb = _block_sum2(sh1, sh2, sa, sb)
    mgx = compute_cast(w, sa / n if center and n > 0 else 0.0)
    mgxh = compute_cast(w, sb / n if n > 0 else 0.0)
    rr = compute_cast(w, r)
    e = t
    while e < n:
        p = e // Q
        q = e - p * Q
        f = ((i * P + p) * C + c) * Q + q
        j = (c * Q + q) // S
        xh = _xhat(load(x, f), w, m, r)
        gg = load(dy, f)
        if code != IDENTITY:
            gg = gg * act_grad(xh * w[j] + b[j], code, slope)
        store(dx, f, rr * (gg * w[j] - mgx - xh * mgxh))
        e += nt


# --------------------------------------------------------------------------- partial sums + second pass


@kernel(_SEG)
def _seg_partials(x, dy, w, b, mean, rstd, p1, p2, R, P, C, Q, S, K, mode, center, code, slope):
    """Block (unit u, chunk k): partial sums of ``mode`` over chunk k of unit u's elements.

    Units are groups (modes 0, 1: P rows × the Q contiguous columns c·Q…) or parameters (mode 2:
    R rows × the S contiguous columns j·S…).  Writes p1/p2[u·K + k].
    """
    sh1 = cuda.shared.array(MAX_THREADS, float64)
    sh2 = cuda.shared.array(MAX_THREADS, float64)
    blk = cuda.blockIdx.x
    u = blk // K
    k = blk - u * K
    W = C * Q
    if mode == 2:
        row0 = 0
        nrows = R
        off = u * S
        ln = S
    else:
        i = u // C
        row0 = i * P
        nrows = P
        off = (u - i * C) * Q
        ln = Q
    n = nrows * ln
    chunk = (n + K - 1) // K
    e1 = min(n, (k + 1) * chunk)
    shift = _group_shift(x, u, P, C, Q, center) if mode == 0 and n > 0 else 0.0
    s1 = 0.0
    s2 = 0.0
    e = k * chunk + cuda.threadIdx.x
    while e < e1:
        rl = e // ln
        r = row0 + rl
        col = off + (e - rl * ln)
        a, bb = _pair(mode, x, dy, w, b, mean, rstd, r * W + col, (r // P) * C + col // Q, col // S, shift,
                      code, slope)
        s1 += a
        s2 += bb
        e += cuda.blockDim.x
    s1, s2 = _block_sum2(sh1, sh2, s1, s2)
    if cuda.threadIdx.x == 0:
        p1[blk] = s1
        p2[blk] = s2


@kernel(_COL)
def _col_partials(x, dy, w, b, mean, rstd, p1, p2, R, P, C, Q, S, rows, KP, mode, center, code, slope):
    """2-D block (tile of columns, row lanes): per-column partial sums over one chunk of rows.

    Rows come in outer blocks of ``rows`` (P for group sums, R for parameter sums), each split
    into KP chunks; block (column tile, outer·KP + kp) writes p1/p2[(outer·KP + kp)·W + col].
    """
    sh1 = cuda.shared.array(MAX_THREADS, float64)
    sh2 = cuda.shared.array(MAX_THREADS, float64)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    TX = cuda.blockDim.x
    W = C * Q
    col = cuda.blockIdx.x * TX + tx
    o = cuda.blockIdx.y // KP
    kp = cuda.blockIdx.y - o * KP
    per = (rows + KP - 1) // KP
    r0 = o * rows + kp * per
    r1 = min(r0 + per, (o + 1) * rows)
    s1 = 0.0
    s2 = 0.0
    if col < W:
        c = col // Q
        grp0 = (r0 // P) * C + c
        shift = _group_shift(x, grp0, P, C, Q, center) if mode == 0 else 0.0
        r = r0 + ty
        while r < r1:
            a, bb = _pair(mode, x, dy, w, b, mean, rstd, r * W + col, (r // P) * C + c, col // S, shift,
                          code, slope)
            s1 += a
            s2 += bb
            r += cuda.blockDim.y
    lane = ty * TX + tx
    sh1[lane] = s1
    sh2[lane] = s2
    cuda.syncthreads()
    step = cuda.blockDim.y // 2
    while step > 0:
        if ty < step:
            sh1[lane] += sh1[lane + step * TX]
            sh2[lane] += sh2[lane + step * TX]
        cuda.syncthreads()
        step //= 2
    if ty == 0 and col < W:
        p1[cuda.blockIdx.y * W + col] = sh1[tx]
        p2[cuda.blockIdx.y * W + col] = sh2[tx]


@kernel(_SUM, dtypes=("float64",))
def _sum_partials(p1, p2, o1, o2, G2, A, B, total):
    """Second pass: partials viewed as (G1, A, G2, B) summed over A and B in a fixed order."""
    t = cuda.grid(1)
    if t >= total:
        return
    g1 = t // G2
    g2 = t - g1 * G2
    s1 = 0.0
    s2 = 0.0
    for a in range(A):
        base = ((g1 * A + a) * G2 + g2) * B
        for k in range(B):
            s1 += p1[base + k]
            s2 += p2[base + k]
    o1[t] = s1
    o2[t] = s2


@kernel(_FIN)
def _finalize_stats(s1, s2, x, mean, rstd, var, P, C, Q, center, eps):
    """mean, var, rstd of every group from its summed shifted sums."""
    g = cuda.grid(1)
    if g >= mean.shape[0]:
        return
    n = P * Q
    shift = _group_shift(x, g, P, C, Q, center) if n > 0 else 0.0
    m, v, r = _stats(s1[g], s2[g], shift, n, center, eps)
    mean[g] = m
    var[g] = v
    rstd[g] = r


# --------------------------------------------------------------------------- elementwise passes


@kernel(_APPLY_F)
def _apply_forward(x, w, b, y, mean, rstd, P, C, Q, S, code, slope):
    """y = act(x̂·w + b) elementwise with per-group mean/rstd (grid-stride)."""
    W = C * Q
    f = cuda.grid(1)
    while f < x.shape[0]:
        r = f // W
        col = f - r * W
        grp = (r // P) * C + col // Q
        j = col // S
        store(y, f, act(_xhat(load(x, f), w, mean[grp], rstd[grp]) * w[j] + b[j], code, slope))
        f += cuda.gridsize(1)


@kernel(_APPLY_B)
def _apply_backward(x, dy, w, b, dx, mean, rstd, sa, sb, P, C, Q, S, n, train, center, code, slope):
    """dx elementwise: r·(g·w − Σg·w/n − x̂·Σg·w·x̂/n) in training, r·g·w with fixed statistics."""
    W = C * Q
    f = cuda.grid(1)
    while f < x.shape[0]:
        r = f // W
        col = f - r * W
        grp = (r // P) * C + col // Q
        j = col // S
        rr = compute_cast(w, rstd[grp])
        xh = _xhat(load(x, f), w, mean[grp], rstd[grp])
        gg = load(dy, f)
        if code != IDENTITY:
            gg = gg * act_grad(xh * w[j] + b[j], code, slope)
        if train:
            mgx = compute_cast(w, sa[grp] / n if center else 0.0)
            store(dx, f, rr * (gg * w[j] - mgx - xh * compute_cast(w, sb[grp] / n)))
        else:
            store(dx, f, rr * gg * w[j])
        f += cuda.gridsize(1)


# --------------------------------------------------------------------------- host plans


class _Shape:
    """The canonical view of one norm call (see the module docstring)."""

    def __init__(self, call):
        (self.nn, self.p, self.c, self.q), self.cg, self.s = canonical(call)
        self.groups = self.nn * self.c
        self.n = self.p * self.q
        self.rows = self.nn * self.p
        self.width = self.c * self.q
        self.params = self.c * self.cg

    def group_path(self) -> str:
        """``row``, ``seg`` or ``column`` for the group reductions (see the module docstring)."""
        s = rt.settings()
        if self.q < s.column_below and self.p > 1:
            return "column"
        if self.groups >= s.target_blocks or self.n <= s.row_max:
            return "row"
        return "seg" if rt.chunks(self.groups, self.n, s.min_chunk) > 1 else "row"


def _reduce(xp, shape, mode, x, dy, w, b, mean, rstd, center, code, slope, units_are_params=False):
    """Summed (Σa, Σb) of ``mode`` per group (or per parameter) by partials and a second pass."""
    s = rt.settings()
    if units_are_params:
        units, rows, use_columns = shape.params, shape.rows, shape.s == 1
    else:
        units, rows, use_columns = shape.groups, shape.p, shape.group_path() == "column"
    o1 = xp.empty(units, np.float64)
    o2 = xp.empty(units, np.float64)
    args = (x, dy, w, b, mean, rstd)
    dims = (shape.rows, shape.p, shape.c, shape.q, shape.s)
    if use_columns:
        outer = 1 if units_are_params else shape.nn
        tiles = -(-shape.width // s.tile_x)
        kp = max(1, min(-(-s.target_blocks // max(1, outer * tiles)), -(-rows // max(1, s.min_chunk // s.tile_x))))
        p1 = xp.empty(outer * kp * shape.width, np.float64)
        p2 = xp.empty_like(p1)
        rt.launch(_col_partials, (tiles, outer * kp), (s.tile_x, s.tile_y), *args, p1, p2, *dims, rows, kp, mode,
                  center, code, slope)
        g2, a, bsz = (shape.params, kp, 1) if units_are_params else (shape.c, kp, shape.q)
    else:
        n = rows * (shape.s if units_are_params else shape.q)
        k = rt.chunks(units, n, s.min_chunk)
        p1 = xp.empty(units * k, np.float64)
        p2 = xp.empty_like(p1)
        rt.launch(_seg_partials, units * k, s.block, *args, p1, p2, *dims, k, mode, center, code, slope)
        g2, a, bsz = 1, 1, k
    rt.launch(_sum_partials, rt.blocks_for(units, s.block), s.block, p1, p2, o1, o2, g2, a, bsz, units)
    return o1, o2


def _param(p, fill, size, ctype, xp):
    """A parameter flat in the compute type; ones/zeros when absent, so kernels never branch on it."""
    if p is None:
        return xp.full(size, fill, dtype=ctype)
    return xp.ascontiguousarray(rt.cast(p, ctype)).reshape(-1)


def norm_forward(call):
    """Forward of every norm on CuPy (or, in the simulator, NumPy) arrays.

    Returns ``((y, new_running_mean, new_running_var), residuals)``; the running statistics are
    ``None`` unless this call updates them.
    """
    x = call.x
    xp = rt.array_module(x)
    shape = _Shape(call)
    ctype = rt.compute_dtype(rt.dtype_name(x))
    w = _param(call.weight, 1.0, shape.params, ctype, xp)
    b = _param(call.bias, 0.0, shape.params, ctype, xp)
    y = xp.empty_like(x)
    xf, yf = x.reshape(-1), y.reshape(-1)
    code, slope = call.activation.code, rt.scalar(call.activation.slope, ctype)
    center, eps, s = bool(call.center), float(call.eps), rt.settings()
    mean = xp.empty(shape.groups, np.float64)
    rstd = xp.empty_like(mean)
    var = xp.empty_like(mean)
    dims = (shape.p, shape.c, shape.q)
    if call.use_batch_stats:
        if shape.group_path() == "row":
            rt.launch(_row_forward, shape.groups, s.block, xf, w, b, yf, mean, rstd, var, *dims, shape.cg, shape.s,
                      center, eps, code, slope)
        else:
            s1, s2 = _reduce(xp, shape, _MODE_STATS, xf, xf, w, b, mean, rstd, center, code, slope)
            rt.launch(_finalize_stats, rt.blocks_for(shape.groups, s.block), s.block, s1, s2, xf, mean, rstd, var,
                      *dims, center, eps)
            rt.launch(_apply_forward, rt.blocks_for(x.size, s.block), s.block, xf, w, b, yf, mean, rstd, *dims,
                      shape.s, code, slope)
    else:
        rm = rt.cast(call.running_mean, np.float64)
        rv = rt.cast(call.running_var, np.float64)
        mean[...] = xp.broadcast_to(rm.reshape(1, -1), (shape.nn, shape.c)).reshape(-1)
        rstd[...] = xp.broadcast_to((1.0 / xp.sqrt(rv + eps)).reshape(1, -1), (shape.nn, shape.c)).reshape(-1)
        rt.launch(_apply_forward, rt.blocks_for(x.size, s.block), s.block, xf, w, b, yf, mean, rstd, *dims,
                  shape.s, code, slope)
    new_rm = new_rv = None
    if call.use_batch_stats and call.update_running and x.size > 0:
        new_rm, new_rv = _updated_running(call, xp, mean.reshape(shape.nn, shape.c), var.reshape(shape.nn, shape.c),
                                          shape.n)
    residuals = (x, mean, rstd, w, b, call) if call.save else None
    return (y, new_rm, new_rv), residuals


def _updated_running(call, xp, mean, var, n):
    """PyTorch's momentum update (``kernel_plans.momentum_update``) in float64."""
    rm, rv = call.running_mean, call.running_var
    new_rm, new_rv = momentum_update(xp, rt.cast(rm, np.float64), rt.cast(rv, np.float64), mean, var,
                                     call.momentum, n)
    return rt.cast(new_rm, _dtype_of(rm)), rt.cast(new_rv, _dtype_of(rv))


def _dtype_of(a):
    """The array's dtype object (bfloat16 included: the library's own)."""
    return a.dtype


def norm_backward(residuals, cotangents, needs, out=None):
    """dx, dweight and dbias (see the module docstring); skips what ``needs`` leaves out."""
    x, mean, rstd, w, b, call = residuals
    out = out or {}
    xp = rt.array_module(x)
    shape = _Shape(call)
    ctype = rt.compute_dtype(rt.dtype_name(x))
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], _dtype_of(x)))
    xf, dyf = x.reshape(-1), dy.reshape(-1)
    code, slope = call.activation.code, rt.scalar(call.activation.slope, ctype)
    center, train, s = bool(call.center), bool(call.use_batch_stats), rt.settings()
    dims = (shape.p, shape.c, shape.q)
    grads = {}
    if "x" in needs:
        dx = _out_buffer(out.get("x"), x, xp)
        dxf = dx.reshape(-1)
        if train and shape.group_path() == "row":
            rt.launch(_row_backward, shape.groups, s.block, xf, dyf, w, b, dxf, mean, rstd, *dims, shape.s, center,
                      code, slope)
        else:
            if train:
                sa, sb = _reduce(xp, shape, _MODE_GROUP_GRADS, xf, dyf, w, b, mean, rstd, center, code, slope)
            else:
                sa = sb = mean
            rt.launch(_apply_backward, rt.blocks_for(x.size, s.block), s.block, xf, dyf, w, b, dxf, mean, rstd, sa,
                      sb, *dims, shape.s, max(shape.n, 1), train, center, code, slope)
        grads["x"] = rt.into(out, "x", dx)
    if "weight" in needs or "bias" in needs:
        db, dw = _reduce(xp, shape, _MODE_PARAM_GRADS, xf, dyf, w, b, mean, rstd, center, code, slope,
                         units_are_params=True)
        for name, value, like in (("weight", dw, call.weight), ("bias", db, call.bias)):
            if name in needs:
                grads[name] = rt.into(out, name, rt.cast(value, _dtype_of(like)).reshape(like.shape))
    return grads


def _out_buffer(buffer, like, xp):
    """The caller's dx buffer when the kernel can write it directly, else a new array."""
    if (buffer is not None and buffer.dtype == like.dtype and tuple(buffer.shape) == tuple(like.shape)
            and buffer.flags.c_contiguous and rt.array_module(buffer) is xp):
        return buffer
    return xp.empty_like(like)


# --------------------------------------------------------------------------- moments
#
# moments over any axes, on the plan of portable_nn.kernel_plans.moments_plan: x is rows of length L and
# row(kk, rr) = off_k(kk) + off_r(rr) (a table when non-empty, else idx · stride); row mode (lk = 1):
# group g = kk holds its rows whole; column mode (lk = L): group g = kk·L + j holds column j of its
# rows.  Groups are in the output's order.  A group's first element is its shift, shared by all of
# its partial sums (float64), so partials add exactly; the backward keeps the shift and the centred
# mean apart, so (x − shift) − cm keeps the data's offset out of the rounding.  Paths:
#
# * ``small``: groups under ``column_below`` elements (either mode), one thread per group;
# * ``rows``: row mode, a block per (group, chunk), its threads a tile along and across rows;
# * ``cols``: column mode, 2-D blocks (columns × row lanes) per (kk, row chunk);
#
# split groups leave partial sums that a second kernel adds in a fixed order: deterministic.

_MOM_OUT = "{c}[::1], {c}[::1], float64[::1], float64[::1]"  # mean, var, shift, centred mean
_MOM_TAB = f"{_I}, {_I}[::1], {_I}, {_I}[::1]"  # kstride, ktab, rstride, rtab
_MOM_ROWS = (f"void({{x}}[::1], float64[::1], float64[::1], {_MOM_OUT}, {_I}, {_MOM_TAB}, {_I}, {_I}, {_I}, {_I}, "
             f"{_I}, float64)")
_MOM_SMALL = f"void({{x}}[::1], {_MOM_OUT}, {_I}, {_I}, {_MOM_TAB}, {_I}, {_I}, float64)"
_MOM_COLS = (f"void({{x}}[::1], float64[::1], float64[::1], {_MOM_OUT}, {_I}, {_MOM_TAB}, {_I}, {_I}, {_I}, {_I}, "
             f"float64)")
_MOM_FIN = f"void({{x}}[::1], float64[::1], float64[::1], {_MOM_OUT}, {_I}, {_I}, {_I}, {_I}[::1], {_I}, {_I}, float64)"
_MOM_DX = (f"void({{x}}[::1], {{c}}[::1], {{c}}[::1], float64[::1], float64[::1], {{x}}[::1], {_I}, {_I}, "
           f"{_MOM_TAB}, {_I}, {_I}, float64, float64)")


@device
def _mom_row(kk, rr, kstride, ktab, rstride, rtab):
    """row(kk, rr) = off_k(kk) + off_r(rr)."""
    a = ktab[kk] if ktab.shape[0] > 0 else kk * kstride
    b = rtab[rr] if rtab.shape[0] > 0 else rr * rstride
    return a + b


@device
def _mom_store(g, shift, s1, s2, n, correction, mean, var, sh, cm):
    """mean = shift + cm, var = (Σd² − Σd·cm)/(n − correction), NaN when n <= correction."""
    c = s1 / n
    v = math.nan
    if n - correction > 0:
        v = (s2 - s1 * c) / (n - correction)
        if v < 0.0:  # rounding only: NaN data keeps a NaN variance
            v = 0.0
    mean[g] = shift + c
    var[g] = v
    sh[g] = shift
    cm[g] = c


@kernel(_MOM_ROWS)
def _mom_rows(x, p1, p2, mean, var, sh, cm, L, kstride, ktab, rstride, rtab, rout, rper, qper, qsplits, tx,
              correction):
    """Block (g, k): chunk k of group g (rows rc·rper…, columns q0…q0+qper); the 1-D block is a tile of
    tx lanes along the rows × blockDim/tx across them.  One chunk: results stored, else partials."""
    s1sh = cuda.shared.array(MAX_THREADS, float64)
    s2sh = cuda.shared.array(MAX_THREADS, float64)
    g = cuda.blockIdx.x
    k = cuda.blockIdx.y
    splits = cuda.gridDim.y
    rc = k // qsplits
    q0 = (k - rc * qsplits) * qper
    q1 = min(L, q0 + qper)
    r1 = min(rout, (rc + 1) * rper)
    t = cuda.threadIdx.x
    lane = t % tx
    shift = np.float64(load(x, _mom_row(g, 0, kstride, ktab, rstride, rtab) * L))
    a = 0.0
    b = 0.0
    rr = rc * rper + t // tx
    while rr < r1:
        base = _mom_row(g, rr, kstride, ktab, rstride, rtab) * L
        q = q0 + lane
        while q < q1:
            d = np.float64(load(x, base + q)) - shift
            a += d
            b += d * d
            q += tx
        rr += cuda.blockDim.x // tx
    a, b = _block_sum2(s1sh, s2sh, a, b)
    if t == 0:
        if splits == 1:
            _mom_store(g, shift, a, b, rout * L, correction, mean, var, sh, cm)
        else:
            p1[g * splits + k] = a
            p2[g * splits + k] = b


@kernel(_MOM_SMALL)
def _mom_small(x, mean, var, sh, cm, L, lk, kstride, ktab, rstride, rtab, rout, groups, correction):
    """Groups of few elements (either mode): one thread per group g = kk·lk + j, grid-strided, results stored."""
    g = cuda.grid(1)
    lr = L // lk
    while g < groups:
        kk = g // lk
        j = g - kk * lk
        shift = np.float64(load(x, _mom_row(kk, 0, kstride, ktab, rstride, rtab) * L + j))
        a = 0.0
        b = 0.0
        for rr in range(rout):
            base = _mom_row(kk, rr, kstride, ktab, rstride, rtab) * L + j
            for q in range(lr):
                d = np.float64(load(x, base + q)) - shift
                a += d
                b += d * d
        _mom_store(g, shift, a, b, rout * lr, correction, mean, var, sh, cm)
        g += cuda.gridsize(1)


@kernel(_MOM_COLS)
def _mom_cols(x, p1, p2, mean, var, sh, cm, L, kstride, ktab, rstride, rtab, kout, rout, rper, rsplits, correction):
    """Column mode: 2-D block (column tile × row lanes); block row u = kk·rsplits + k (grid-strided) sums
    column j of the rows k·rper… of kk.  rsplits == 1: results stored, else partials p[u·L + j]."""
    s1sh = cuda.shared.array(MAX_THREADS, float64)
    s2sh = cuda.shared.array(MAX_THREADS, float64)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    TX = cuda.blockDim.x
    j = cuda.blockIdx.x * TX + tx
    lane = ty * TX + tx
    u = cuda.blockIdx.y
    while u < kout * rsplits:
        kk = u // rsplits
        k = u - kk * rsplits
        shift = 0.0
        a = 0.0
        b = 0.0
        if j < L:
            shift = np.float64(load(x, _mom_row(kk, 0, kstride, ktab, rstride, rtab) * L + j))
            r1 = min(rout, (k + 1) * rper)
            rr = k * rper + ty
            while rr < r1:
                d = np.float64(load(x, _mom_row(kk, rr, kstride, ktab, rstride, rtab) * L + j)) - shift
                a += d
                b += d * d
                rr += cuda.blockDim.y
        s1sh[lane] = a
        s2sh[lane] = b
        cuda.syncthreads()
        step = cuda.blockDim.y // 2
        while step > 0:
            if ty < step:
                s1sh[lane] += s1sh[lane + step * TX]
                s2sh[lane] += s2sh[lane + step * TX]
            cuda.syncthreads()
            step //= 2
        if ty == 0 and j < L:
            if rsplits == 1:
                _mom_store(kk * L + j, shift, s1sh[tx], s2sh[tx], rout, correction, mean, var, sh, cm)
            else:
                p1[u * L + j] = s1sh[tx]
                p2[u * L + j] = s2sh[tx]
        cuda.syncthreads()  # the next block row reuses the shared arrays
        u += cuda.gridDim.y


@kernel(_MOM_FIN)
def _mom_finalize(x, p1, p2, mean, var, sh, cm, L, lk, kstride, ktab, splits, n, correction):
    """Second pass, one thread per group g = kk·lk + j: Σ_k p[(kk·splits + k)·lk + j] in order, results."""
    g = cuda.grid(1)
    if g >= mean.shape[0]:
        return
    kk = g // lk
    j = g - kk * lk
    a = 0.0
    b = 0.0
    for k in range(splits):
        a += p1[(kk * splits + k) * lk + j]
        b += p2[(kk * splits + k) * lk + j]
    first = (ktab[kk] if ktab.shape[0] > 0 else kk * kstride) * L + j
    _mom_store(g, np.float64(load(x, first)), a, b, n, correction, mean, var, sh, cm)


@kernel(_MOM_DX)
def _mom_dx(x, dmean, dvar, sh, cm, dx, L, lk, kstride, ktab, rstride, rtab, kout, rout, inv_n, two_over_denom):
    """dx = dmean·inv_n + dvar·two_over_denom·((x − shift) − cm) in the compute type (an empty dmean or
    dvar contributes nothing).  2-D blocks: threadIdx.x along the row, threadIdx.y over the rows in
    (kk, rr) order (grid-strided), so short rows still fill the block; every element once."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= L:
        return
    r = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    while r < kout * rout:
        kk = r // rout
        rr = r - kk * rout
        g = kk * lk + (i if lk > 1 else 0)
        ca = compute_cast(dmean, dmean[g] * inv_n if dmean.shape[0] > 0 else 0.0)
        cb = compute_cast(dmean, dvar[g] * two_over_denom if dvar.shape[0] > 0 else 0.0)
        o = _mom_row(kk, rr, kstride, ktab, rstride, rtab) * L + i
        store(dx, o, ca + cb * ((load(x, o) - compute_cast(dmean, sh[g])) - compute_cast(dmean, cm[g])))
        r += cuda.gridDim.y * cuda.blockDim.y


def _mom_tables(plan, xp):
    """(kstride, ktab, rstride, rtab) as kernel arguments (empty tables: idx · stride).

    Copies: the plan's tables are read-only, and the simulator writes every array argument back.
    """
    return plan.kstride, xp.array(plan.ktab), plan.rstride, xp.array(plan.rtab)


def _unit_splits(units: int, rows: int, width: int) -> tuple[int, int]:
    """(rows per split, splits) of ``units`` column tiles of ``width`` × ``rows`` elements each."""
    s = rt.settings()
    want = max(1, -(-s.target_blocks // max(units, 1)))
    most = max(1, -(-(rows * width) // max(s.min_chunk, 1)))
    splits = max(1, min(want, most, rows))
    rper = -(-rows // splits)
    return rper, -(-rows // rper)


def moments_path(plan) -> str:
    """``small``, ``cols`` or ``rows`` (see the section comment)."""
    if plan.n < rt.settings().column_below:
        return "small"
    return "cols" if plan.column else "rows"


def _moments_sums(call, plan, x, xp, outs, tables):
    """Launch the reduction of the plan's path, and the second pass when groups were split."""
    s = rt.settings()
    corr = float(call.correction)
    path = moments_path(plan)
    if path == "small":
        rt.launch(_mom_small, rt.blocks_for(plan.groups, s.block), s.block, x, *outs, plan.L, plan.lk, *tables,
                  plan.rout, plan.groups, corr)
        return
    if path == "rows":
        want = 1 if plan.groups >= s.target_blocks else rt.chunks(plan.groups, plan.n, s.min_chunk)
        rper, rsplits, qper, qsplits = row_splits(plan, want)
        splits = rsplits * qsplits
        p1 = xp.empty(plan.groups * splits if splits > 1 else 0, np.float64)
        p2 = xp.empty_like(p1)
        # A block no larger than the group (and at least a warp): short groups keep every thread busy.
        block = pow2_at_most(max(plan.n, 32), s.block)
        rt.launch(_mom_rows, (plan.groups, splits), block, x, p1, p2, *outs, plan.L, *tables, plan.rout, rper,
                  qper, qsplits, pow2_at_most(plan.L, block), corr)
    else:
        bx = pow2_at_most(plan.L, s.tile_x)
        by = s.tile_y * max(1, s.tile_x // bx)  # a power of two, as the shared-memory tree needs
        tiles = -(-plan.L // bx)
        rper, splits = _unit_splits(tiles * plan.kout, plan.rout, min(plan.L, bx))
        p1 = xp.empty(plan.kout * splits * plan.L if splits > 1 else 0, np.float64)
        p2 = xp.empty_like(p1)
        rt.launch(_mom_cols, (tiles, min(plan.kout * splits, 65535)), (bx, by), x, p1, p2, *outs, plan.L, *tables,
                  plan.kout, plan.rout, rper, splits, corr)
    if splits > 1:
        rt.launch(_mom_finalize, rt.blocks_for(plan.groups, s.block), s.block, x, p1, p2, *outs, plan.L, plan.lk,
                  *tables[:2], splits, plan.n, corr)


def moments_forward(call):
    """``moments`` on CuPy (or, in the simulator, NumPy) arrays: ``(mean, var)`` in the compute type.

    Residuals: ``(x, shift, centred mean, plan, call)`` (float64 per group).
    """
    x = call.x
    xp = rt.array_module(x)
    plan = moments_plan(tuple(x.shape), call.axes)
    shape = moments_shape(tuple(x.shape), call.axes, call.keepdims)
    ctype = rt.compute_dtype(rt.dtype_name(x))
    if x.size == 0:  # an empty reduction is undefined (NaN, as in NumPy); otherwise there are no groups
        return (xp.full(shape, math.nan, ctype), xp.full(shape, math.nan, ctype)), (
            (x, None, None, plan, call) if call.save else None)
    outs = (xp.empty(plan.groups, ctype), xp.empty(plan.groups, ctype), xp.empty(plan.groups, np.float64),
            xp.empty(plan.groups, np.float64))
    _moments_sums(call, plan, x.reshape(-1), xp, outs, _mom_tables(plan, xp))
    mean, var, shift, cm = outs
    residuals = (x, shift, cm, plan, call) if call.save else None
    return (mean.reshape(shape), var.reshape(shape)), residuals


def moments_backward(residuals, cotangents, needs, out=None):
    """dx = dmean / n + dvar · 2 (x − mean) / (n − correction), one elementwise kernel."""
    x, shift, cm, plan, call = residuals
    if "x" not in needs:
        return {}
    out = out or {}
    xp = rt.array_module(x)
    dx = _out_buffer(out.get("x"), x, xp)
    dmean, dvar = cotangents
    denom = plan.n - call.correction
    if denom <= 0:
        dvar = None  # var is NaN: it has no gradient (as in the reference)
    if x.size == 0 or (dmean is None and dvar is None):
        dx.reshape(-1).view(xp.uint8).fill(0)  # byte-wise: bfloat16 arrays need no arithmetic support
        return {"x": rt.into(out, "x", dx)}
    ctype = rt.compute_dtype(rt.dtype_name(x))
    dmean, dvar = (xp.zeros(0, ctype) if c is None else xp.ascontiguousarray(rt.cast(c, ctype)).reshape(-1)
                   for c in (dmean, dvar))
    s = rt.settings()
    bx = pow2_at_most(plan.L, s.block)
    by = s.block // bx
    rows = plan.kout * plan.rout
    rt.launch(_mom_dx, (-(-plan.L // bx), min(-(-rows // by), 65535)), (bx, by), x.reshape(-1), dmean, dvar, shift,
              cm, dx.reshape(-1), plan.L, plan.lk, *_mom_tables(plan, xp), plan.kout, plan.rout, 1.0 / plan.n,
              2.0 / denom if denom > 0 else 0.0)
    return {"x": rt.into(out, "x", dx)}
