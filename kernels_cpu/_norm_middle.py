"""Layer and RMS norm over a block of middle axes (the channels of NCHW data), forward and backward.

A layer norm whose normalised axes are followed by kept ones — ``axis=1`` of ``(N, C, H, W)``,
ConvNeXt's ``LayerNorm2d`` — reads a C-contiguous ``x`` as ``x3 = x.reshape(O, R, I)``: the
normalised block ``R`` between ``O`` outer and ``I`` inner positions.  Statistics are per
``(o, i)``, over ``r``; the parameters are per ``r``::

    mean[o, i] = Σ_r x[o, r, i] / R,   var[o, i] = Σ_r (x − mean)² / R       (rms: mean = 0)
    y[o, r, i] = act((x[o, r, i] − mean[o, i]) · rstd[o, i] · w[r] + b[r])

Each row ``x3[o, r]`` is contiguous along ``i``, so one pass down the rows of a block of
columns serves every column's statistics at once, in unit-stride vector loops — no transpose
(PyTorch users permute to channels-last and back: two copies).  One parallel task per ``(o,
block of columns)``; a column block is at most ``COLUMNS`` wide so that its rows stay in cache
between the statistics pass and the output pass (``R · COLUMNS`` elements).

Statistics are shifted sums in float64 (each column's shift its first element: var =
(Σd² − (Σd)²/R)/R with d = x − shift, never E[x²] − E[x]²).  The backward, with
``g = dy · act'(z)``, ``z = x̂ · w + b``::

    A[o, i] = Σ_r g · w[r],   B[o, i] = Σ_r g · w[r] · x̂
    dx = rstd · (g · w − A / R − x̂ · B / R)          (rms: no A term)
    dweight[r] = Σ_{o, i} g · x̂,   dbias[r] = Σ_{o, i} g

one pass for A, B and the task's partial dweight/dbias, one writing dx; the partials are added
in task order afterwards, so results do not depend on the thread count.  float32 and float64
data (the half types take the trailing-axes layout or the reference).  The entry points, which
allocate and launch these kernels, are ``kernels_cpu.norm``'s (beside the other layouts').
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from portable_nn.kernel_codes import IDENTITY

from .activations import act_grad, act_row, is_rectifier, rectifier_slope

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}

#: Widest column block of a task: its rows (R × COLUMNS elements; 96 × 512 float32 = 192 KiB at
#: ConvNeXt's channel count) are read twice, so the second read should find them in L2.  At
#: (64, 96, 56, 56) float32, 2 threads, Zen 3 (forward / backward ms): 512 → 26 / 14-17, 256 → 25-27
#: / 15-18, 128 → 18-29 / 19-22.
COLUMNS = 512


def column_blocks(inner: int) -> tuple[int, int]:
    """(blocks per outer index, block width) for ``inner`` columns: equal blocks of at most COLUMNS."""
    blocks = max(1, -(-inner // COLUMNS))
    return blocks, -(-inner // blocks) if inner else 1


@njit(inline="always", **_OPTS)
def _block(t, blocks, width, inner):
    """Task ``t``'s outer index and columns ``[j0, j1)``: ``blocks`` column blocks of ``width`` per outer index."""
    o, k = t // blocks, t % blocks
    j0 = k * width
    return o, j0, min(inner, j0 + width)


@njit(inline="always", **_OPTS)
def _forward_task(t, x3, w, b, y3, mean, rstd, blocks, width, center, eps, code, slope):
    o, j0, j1 = _block(t, blocks, width, x3.shape[2])
    n = j1 - j0
    rows = x3.shape[1]
    xo, yo = x3[o], y3[o]
    shift = np.zeros(n)
    if center and rows > 0:
        for j in range(n):
            shift[j] = xo[0, j0 + j]
    s1 = np.zeros(n)
    s2 = np.zeros(n)
    # Four rows a step: the column sums are loaded and stored once per four elements, not per element.
    r = 0
    while r + 4 <= rows:
        x0, x1, x2, x3_ = xo[r], xo[r + 1], xo[r + 2], xo[r + 3]
        for j in range(n):
            c = shift[j]
            d0 = np.float64(x0[j0 + j]) - c
            d1 = np.float64(x1[j0 + j]) - c
            d2 = np.float64(x2[j0 + j]) - c
            d3 = np.float64(x3_[j0 + j]) - c
            s1[j] += (d0 + d1) + (d2 + d3)
            s2[j] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)
        r += 4
    while r < rows:
        xr = xo[r]
        for j in range(n):
            d = np.float64(xr[j0 + j]) - shift[j]
            s1[j] += d
            s2[j] += d * d
        r += 1
    # Per column: the mean split into a data-dtype high part and the rounding left over (so x − mean
    # loses nothing to the cast), and rstd in the data's dtype.
    dt = x3.dtype.type
    mh = np.empty(n, x3.dtype)
    ml = np.empty(n, x3.dtype)
    rs = np.empty(n, x3.dtype)
    count = max(rows, 1)
    for j in range(n):
        if center:
            cm = s1[j] / count
            m = shift[j] + cm
            var = max((s2[j] - s1[j] * cm) / count, 0.0)
        else:
            m = 0.0
            var = s2[j] / count
        r_ = 1.0 / np.sqrt(var + eps)
        mean[o, j0 + j] = m
        rstd[o, j0 + j] = r_
        mh[j] = dt(m)
        ml[j] = dt(m - np.float64(mh[j]))
        rs[j] = dt(r_)
    for r in range(rows):
        xr, yr = xo[r], yo[r]
        wr, br = w[r], b[r]
        for j in range(n):
            yr[j0 + j] = ((xr[j0 + j] - mh[j]) - ml[j]) * rs[j] * wr + br
        if code != IDENTITY:
            act_row(yr[j0:j1], code, slope)  # (the trailing-axes kernels' vector loops)


@njit(parallel=True, **_OPTS)
def _forward_parallel(x3, w, b, y3, mean, rstd, blocks, width, center, eps, code, slope):
    for t in prange(x3.shape[0] * blocks):
        _forward_task(t, x3, w, b, y3, mean, rstd, blocks, width, center, eps, code, slope)


@njit(**_OPTS)
def _forward_serial(x3, w, b, y3, mean, rstd, blocks, width, center, eps, code, slope):
    for t in range(x3.shape[0] * blocks):
        _forward_task(t, x3, w, b, y3, mean, rstd, blocks, width, center, eps, code, slope)


@njit(inline="always", **_OPTS)
def _g_at(x, dy, m, r, w, b, kind, code, slope):
    """(g, x̂) at one element, g = dy · act'(x̂ · w + b), for a loop of the given kind (a literal:
    0 identity, 1 rectifier with its slope, 2 any other activation — see ``kernels_cpu.activations``)."""
    xhat = (np.float64(x) - m) * r
    g = np.float64(dy)
    if kind == 1:
        g = g if xhat * w + b > 0.0 else g * slope
    elif kind == 2:
        g *= act_grad(xhat * w + b, code, slope)
    return g, xhat


@njit(inline="always", **_OPTS)
def _backward_task(t, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, kind, code, slope):
    o, j0, j1 = _block(t, blocks, width, x3.shape[2])
    n = j1 - j0
    rows = x3.shape[1]
    xo, dyo = x3[o], dy3[o]
    mo, ro = mean[o, j0:j1], rstd[o, j0:j1]
    sa = np.zeros(n)
    sb = np.zeros(n)
    # Four rows a step, as in the forward: sa and sb loaded and stored once per four elements.
    r = 0
    while r + 4 <= rows:
        x0, x1, x2, x3_ = xo[r, j0:j1], xo[r + 1, j0:j1], xo[r + 2, j0:j1], xo[r + 3, j0:j1]
        d0, d1, d2, d3 = dyo[r, j0:j1], dyo[r + 1, j0:j1], dyo[r + 2, j0:j1], dyo[r + 3, j0:j1]
        w0, w1, w2, w3 = np.float64(w[r]), np.float64(w[r + 1]), np.float64(w[r + 2]), np.float64(w[r + 3])
        b0, b1, b2, b3 = np.float64(b[r]), np.float64(b[r + 1]), np.float64(b[r + 2]), np.float64(b[r + 3])
        dw0 = dw1 = dw2 = dw3 = 0.0
        db0 = db1 = db2 = db3 = 0.0
        for j in range(n):
            m, rs = mo[j], ro[j]
            a0, h0 = _g_at(x0[j], d0[j], m, rs, w0, b0, kind, code, slope)
            a1, h1 = _g_at(x1[j], d1[j], m, rs, w1, b1, kind, code, slope)
            a2, h2 = _g_at(x2[j], d2[j], m, rs, w2, b2, kind, code, slope)
            a3, h3 = _g_at(x3_[j], d3[j], m, rs, w3, b3, kind, code, slope)
            p0, p1, p2, p3 = a0 * h0, a1 * h1, a2 * h2, a3 * h3
            dw0 += p0
            dw1 += p1
            dw2 += p2
            dw3 += p3
            db0 += a0
            db1 += a1
            db2 += a2
            db3 += a3
            sa[j] += (a0 * w0 + a1 * w1) + (a2 * w2 + a3 * w3)
            sb[j] += (p0 * w0 + p1 * w1) + (p2 * w2 + p3 * w3)
        pdw[t, r], pdw[t, r + 1], pdw[t, r + 2], pdw[t, r + 3] = dw0, dw1, dw2, dw3
        pdb[t, r], pdb[t, r + 1], pdb[t, r + 2], pdb[t, r + 3] = db0, db1, db2, db3
        r += 4
    while r < rows:
        xr, dyr = xo[r, j0:j1], dyo[r, j0:j1]
        wr, br = np.float64(w[r]), np.float64(b[r])
        dw = 0.0
        db = 0.0
        for j in range(n):
            a, h = _g_at(xr[j], dyr[j], mo[j], ro[j], wr, br, kind, code, slope)
            dw += a * h
            db += a
            sa[j] += a * wr
            sb[j] += a * h * wr
        pdw[t, r] = dw
        pdb[t, r] = db
        r += 1
    if not need_x:
        return
    inv = 1.0 / max(rows, 1)
    for j in range(n):
        sa[j] = sa[j] * inv if center else 0.0
        sb[j] *= inv
    dxo = dx3[o]
    for r in range(rows):
        xr, dyr, dxr = xo[r, j0:j1], dyo[r, j0:j1], dxo[r, j0:j1]
        wr, br = np.float64(w[r]), np.float64(b[r])
        for j in range(n):
            a, h = _g_at(xr[j], dyr[j], mo[j], ro[j], wr, br, kind, code, slope)
            dxr[j] = ro[j] * (a * wr - sa[j] - h * sb[j])


@njit(inline="always", **_OPTS)
def _backward_tasks(t0, t1, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, code, slope):
    """Tasks [t0, t1) serially; the activation's kind chosen once (one loop nest per kind)."""
    if code == IDENTITY:
        for t in range(t0, t1):
            _backward_task(t, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, 0, code, slope)
    elif is_rectifier(code):
        neg = rectifier_slope(code, slope)
        for t in range(t0, t1):
            _backward_task(t, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, 1, code, neg)
    else:
        for t in range(t0, t1):
            _backward_task(t, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, 2, code, slope)


# The row sums dweight[r] and dbias[r] are reductions along a row: reassociated (lanes of the
# vector width, a fixed order on one machine whatever the thread count), they vectorise with
# the column sums beside them.
_BACKWARD_OPTS = {**_OPTS, "fastmath": {"reassoc"}}


@njit(**_BACKWARD_OPTS)
def _backward_range(t0, t1, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, code, slope):
    _backward_tasks(t0, t1, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, code, slope)


@njit(parallel=True, **_OPTS)
def _backward_parallel(x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, code, slope):
    for t in prange(x3.shape[0] * blocks):
        _backward_range(t, t + 1, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, code,
                        slope)


@njit(**_OPTS)
def _backward_serial(x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center, need_x, code, slope):
    _backward_range(0, x3.shape[0] * blocks, x3, dy3, dx3, w, b, mean, rstd, pdw, pdb, blocks, width, center,
                    need_x, code, slope)
