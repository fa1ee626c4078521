"""Numba-CUDA kernels for ``log_softmax`` (backend ``"numba_cuda"``); ``cross_entropy`` is not here yet.

``x`` (C-contiguous) is viewed as (M, C, Q) with C the class axis, so position (m, q) has its C
values at stride Q.  One block per position:

* forward: a shared-memory tree reduction for the maximum, then one for Σ exp(x − max) (float64
  lanes), then y = (x − max) − log Σ; the maximum and the log-sum are kept (float64, two per
  position) with ``x`` for the backward, so half-precision data keeps an exact softmax;
* backward: a tree reduction for Σ dy, then dx = dy − softmax · Σ dy with softmax recomputed
  from x and the two saved statistics.

NaN anywhere in a position makes its whole output NaN (the maximum propagates NaN).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from . import _runtime as rt
from ._runtime import cast_as, device, kernel, load, store

MAX_THREADS = 1024

_I = "int64"
_FWD = f"void({{x}}[::1], {{x}}[::1], float64[::1], float64[::1], {_I}, {_I}, {{c}})"
_BWD = f"void({{x}}[::1], {{x}}[::1], {{x}}[::1], float64[::1], float64[::1], {_I}, {_I}, {{c}})"


@device
def _block_reduce(sh, v, is_max):
    """Σ v (or max v, NaN-propagating) over the block's threads by a shared-memory tree."""
    t = cuda.threadIdx.x
    cuda.syncthreads()
    sh[t] = v
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            a = sh[t]
            b = sh[t + step]
            if is_max:
                sh[t] = b if (b > a or b != b) else a
            else:
                sh[t] = a + b
        cuda.syncthreads()
        step //= 2
    return sh[0]


@kernel(_FWD)
def _lsm_forward(x, y, mx, ls, C, Q, like):
    """Block per position (m, q): y = x − max − log Σ exp(x − max); saves max and log Σ."""
    sh = cuda.shared.array(MAX_THREADS, float64)
    pos = cuda.blockIdx.x
    m = pos // Q
    base = m * C * Q + (pos - m * Q)
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    top = -math.inf
    c = t
    while c < C:
        v = np.float64(load(x, base + c * Q))
        if v > top or v != v:
            top = v
        c += nt
    top = _block_reduce(sh, top, True)
    s = 0.0
    topc = cast_as(like, top)
    c = t
    while c < C:
        s += np.float64(math.exp(load(x, base + c * Q) - topc))
        c += nt
    s = _block_reduce(sh, s, False)
    lse = math.log(s)
    if t == 0:
        mx[pos] = top
        ls[pos] = lse
    lsec = cast_as(like, lse)
    c = t
    while c < C:
        i = base + c * Q
        store(y, i, (load(x, i) - topc) - lsec)
        c += nt


@kernel(_BWD)
def _lsm_backward(x, dy, dx, mx, ls, C, Q, like):
    """Block per position: dx = dy − softmax · Σ dy (softmax from x and the saved statistics)."""
    sh = cuda.shared.array(MAX_THREADS, float64)
    pos = cuda.blockIdx.x
    m = pos // Q
    base = m * C * Q + (pos - m * Q)
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    s = 0.0
    c = t
    while c < C:
        s += np.float64(load(dy, base + c * Q))
        c += nt
    s = _block_reduce(sh, s, False)
    topc = cast_as(like, mx[pos])
    lsec = cast_as(like, ls[pos])
    sc = cast_as(like, s)
    c = t
    while c < C:
        i = base + c * Q
        store(dx, i, load(dy, i) - math.exp((load(x, i) - topc) - lsec) * sc)
        c += nt


def _mcq(shape, axis):
    """(M, C, Q): the sizes before, along and after ``axis``."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def log_softmax_forward(call):
    """y = log_softmax(x) along ``call.axis``; keeps x, the maxima and the log-sums."""
    x = call.x
    xp = rt.array_module(x)
    shape = tuple(int(s) for s in x.shape) or (1,)
    m, c, q = _mcq(shape, 0 if call.scalar else call.axis)
    like = rt.scalar(0.0, rt.compute_dtype(rt.dtype_name(x)))
    y = xp.empty_like(x)
    mx = xp.empty(m * q, np.float64)
    ls = xp.empty_like(mx)
    if x.size:
        rt.launch(_lsm_forward, m * q, rt.settings().block, x.reshape(-1), y.reshape(-1), mx, ls, c, q, like)
    return (y,), ((x, mx, ls, (m, c, q), like) if call.save else None)


def log_softmax_backward(residuals, cotangents, needs, out=None):
    """dx = dy − softmax · Σ_axis dy."""
    if "x" not in needs:
        return {}
    x, mx, ls, (m, c, q), like = residuals
    xp = rt.array_module(x)
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], x.dtype))
    dx = xp.empty_like(x)
    if x.size:
        rt.launch(_lsm_backward, m * q, rt.settings().block, x.reshape(-1), dy.reshape(-1), dx.reshape(-1), mx, ls,
                  c, q, like)
    return {"x": rt.into(out or {}, "x", dx)}
