"""Numba-CUDA kernels for ``log_softmax`` and ``cross_entropy`` (backend ``"numba_cuda"``).

``x`` (C-contiguous) is viewed as (M, C, Q) with C the class axis, so position (m, q) has its C
values at stride Q.  One block per position:

* forward: a shared-memory tree reduction for the maximum, then one for Σ exp(x − max) (float64
  lanes), then y = (x − max) − log Σ; the maximum and the log-sum are kept (float64, two per
  position) with ``x`` for the backward, so half-precision data keeps an exact softmax;
* backward: a tree reduction for Σ dy, then dx = dy − softmax · Σ dy with softmax recomputed
  from x and the two saved statistics.

NaN anywhere in a position makes its whole output NaN (the maximum propagates NaN).

``cross_entropy`` uses the same (M, C, Q) view and one block per position.  Both target kinds
reduce to per-class target weights a_{n,c} — for integer targets
a_c = [y ≠ ignore] · w_c · ((1 − ε)[c = y] + ε / C), for probability targets
a_c = w_c · ((1 − ε) t_c + ε / C) — so that ℓ_n = −Σ_c a_c p_c with p = log_softmax:

* forward: tree reductions for the maximum, Σ exp, then Σ a·p and A_n = Σ a (float64), kept
  with the statistics; ``"sum"``/``"mean"`` reduce ℓ (and the picked weights w_{y_n}, the
  integer-target mean's denominator) deterministically: per-block partial sums, then a second
  pass over the partials (:func:`device_sum`), and a one-thread kernel forms the result (NaN for a
  zero denominator, as PyTorch);
* backward: g_n (dy, the scalar dy, or dy / denominator, read on the device: no host sync), then
  dlogits = g (softmax · A − a) and, for probability targets, dtarget = −g (1 − ε) w p.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64

from portable_nn.kernel_plans import split_axis

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


def log_softmax_forward(call):
    """y = log_softmax(x) along ``call.axis``; keeps x, the maxima and the log-sums."""
    x = call.x
    xp = rt.array_module(x)
    shape = tuple(int(s) for s in x.shape) or (1,)
    m, c, q = split_axis(shape, 0 if call.scalar else call.axis)
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


# --------------------------------------------------------------------------- deterministic sums


@kernel("void(float64[::1], float64[::1], int64, int64)", dtypes=("float64",))
def _partial_sums(src, dst, n, per):
    """dst[b] = Σ src[b·per : (b+1)·per] (a block per chunk, shared-memory tree)."""
    sh = cuda.shared.array(MAX_THREADS, float64)
    b = cuda.blockIdx.x
    start = b * per
    stop = min(start + per, n)
    s = 0.0
    i = start + cuda.threadIdx.x
    while i < stop:
        s += src[i]
        i += cuda.blockDim.x
    s = _block_reduce(sh, s, False)
    if cuda.threadIdx.x == 0:
        dst[b] = s


def device_sum(v):
    """Σ v of a float64 vector as a 1-element array, without leaving the device.

    Deterministic: a fixed split into per-block partial sums, then passes over the partials
    until one value is left (the split depends on the settings and the size only).
    """
    xp = rt.array_module(v)
    s = rt.settings()
    n = int(v.shape[0])
    while True:
        nb = rt.chunks(1, n, s.min_chunk) if n > 1 else 1
        per = -(-n // nb) if n else 0
        nb = -(-n // per) if n else 1
        dst = xp.zeros(nb, np.float64)
        if n:
            rt.launch(_partial_sums, nb, s.block, v, dst, n, per)
        if nb == 1:
            return dst
        v, n = dst, nb


# --------------------------------------------------------------------------- cross_entropy

_CE_FWD = (f"void({{x}}[::1], int64[::1], {{x}}[::1], float64[::1], float64[::1], float64[::1], float64[::1], "
           f"float64[::1], float64[::1], {_I}, {_I}, {_I}, {_I}, float64, {{c}})")
_CE_BWD = (f"void({{x}}[::1], int64[::1], {{x}}[::1], float64[::1], float64[::1], float64[::1], float64[::1], "
           f"{{x}}[::1], float64[::1], {{x}}[::1], {{x}}[::1], {_I}, {_I}, {_I}, {_I}, float64, {_I}, {_I}, {{c}})")
_CE_FINISH = "void(float64[::1], float64[::1], {x}[::1], int64, int64)"


@device
def _target_weight(ti, tp, w, pos, i, c, C, prob, ignore, eps):
    """a_{n,c}: the weight of class c's log-probability in position n's loss (float64)."""
    if prob:
        return w[c] * ((1.0 - eps) * np.float64(load(tp, i)) + eps / C)
    y = ti[pos]
    if y == ignore:
        return 0.0
    a = eps / C
    if y == c:
        a += 1.0 - eps
    return w[c] * a


@device
def _position(pos, C, Q):
    m = pos // Q
    return m * C * Q + (pos - m * Q)


@kernel(_CE_FWD)
def _ce_forward(x, ti, tp, w, loss, asum, wy, mx, ls, C, Q, prob, ignore, eps, like):
    """Block per position: ℓ = −Σ a·p, A = Σ a, the picked weight, and the softmax statistics."""
    sh = cuda.shared.array(MAX_THREADS, float64)
    pos = cuda.blockIdx.x
    base = _position(pos, C, Q)
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
    topc = cast_as(like, top)
    s = 0.0
    c = t
    while c < C:
        s += np.float64(math.exp(load(x, base + c * Q) - topc))
        c += nt
    lse = math.log(_block_reduce(sh, s, False))
    ap = 0.0
    aa = 0.0
    c = t
    while c < C:
        i = base + c * Q
        a = _target_weight(ti, tp, w, pos, i, c, C, prob, ignore, eps)
        if a != 0.0:
            ap += a * ((np.float64(load(x, i)) - top) - lse)
        aa += a
        c += nt
    ap = _block_reduce(sh, ap, False)
    aa = _block_reduce(sh, aa, False)
    if t == 0:
        loss[pos] = -ap
        asum[pos] = aa
        mx[pos] = top
        ls[pos] = lse
        if prob:
            wy[pos] = 1.0
        else:
            y = ti[pos]
            wy[pos] = 0.0 if y == ignore else w[y]


@kernel(_CE_BWD)
def _ce_backward(x, ti, tp, w, asum, mx, ls, dy, den, dz, dt, C, Q, prob, ignore, eps, mode, need_t, like):
    """Block per position: dz = g (softmax · A − a); dt = −g (1 − ε) w p for probability targets."""
    pos = cuda.blockIdx.x
    base = _position(pos, C, Q)
    if mode == 0:
        g = np.float64(load(dy, pos))
    elif mode == 1:
        g = np.float64(load(dy, 0))
    else:
        d = den[0]
        g = np.float64(load(dy, 0)) / (d if d != 0.0 else 1.0)
    top = mx[pos]
    lse = ls[pos]
    aa = asum[pos]
    c = cuda.threadIdx.x
    while c < C:
        i = base + c * Q
        p = (np.float64(load(x, i)) - top) - lse
        a = _target_weight(ti, tp, w, pos, i, c, C, prob, ignore, eps)
        store(dz, i, cast_as(like, g * (math.exp(p) * aa - a)))
        if need_t:
            store(dt, i, cast_as(like, -g * (1.0 - eps) * w[c] * p))
        c += cuda.blockDim.x


@kernel(_CE_FINISH)
def _ce_finish(total, den, out, mode, count):
    """out = Σℓ (mode 1), Σℓ / Σ w_y (2, NaN when 0), Σℓ / count (3, NaN when no positions)."""
    if cuda.grid(1) == 0:
        v = total[0]
        if mode == 2:
            v = v / den[0] if den[0] != 0.0 else math.nan
        elif mode == 3:
            v = v / count if count > 0 else math.nan
        store(out, 0, v)


def _ce_plan(call):
    """(M, C, Q) of the logits' class-axis view."""
    shape = tuple(int(s) for s in call.logits.shape)
    return split_axis(shape, call.axis)


def _ce_arrays(call, xp):
    """Kernel arguments for the targets and weights: int64 labels, probabilities, float64 weights."""
    logits = call.logits
    c = int(call.classes)
    if call.probabilities:
        ti = xp.zeros(1, np.int64)
        tp = xp.ascontiguousarray(call.target).reshape(-1)
    else:
        ti = xp.ascontiguousarray(call.target.astype(np.int64)).reshape(-1)
        tp = logits.reshape(-1)[:1] if logits.size else xp.zeros(1, logits.dtype)
    w = xp.ones(c, np.float64) if call.weight is None else rt.cast(call.weight, np.float64).reshape(-1)
    return ti, tp, xp.ascontiguousarray(w)


_REDUCTION_MODE = {"none": 0, "sum": 1, "mean": 2}


def cross_entropy_forward(call):
    """ℓ per position, or its sum/mean; keeps the logits, targets and per-position statistics."""
    x = call.logits
    xp = rt.array_module(x)
    m, c, q = _ce_plan(call)
    n = m * q
    like = rt.scalar(0.0, rt.compute_dtype(rt.dtype_name(x)))
    ti, tp, w = _ce_arrays(call, xp)
    prob = int(bool(call.probabilities))
    eps = float(call.label_smoothing)
    loss = xp.empty(n, np.float64)
    asum, wy, mx, ls = (xp.empty(n, np.float64) for _ in range(4))
    if n:
        rt.launch(_ce_forward, n, rt.settings().block, x.reshape(-1), ti, tp, w, loss, asum, wy, mx, ls, c, q,
                  prob, int(call.ignore_index), eps, like)
    den = None
    if call.reduction == "none":
        shape = tuple(int(s) for i, s in enumerate(x.shape) if i != call.axis)
        result = rt.cast(loss, x.dtype).reshape(shape)
    else:
        total = device_sum(loss)
        if call.reduction == "mean":
            den = device_sum(wy) if not prob else xp.full(1, float(n), np.float64)
        mode = 1 if call.reduction == "sum" else (3 if prob else 2)
        result = xp.empty(1, x.dtype)
        rt.launch(_ce_finish, 1, 1, total, den if den is not None else total, result, mode, n)
        result = result.reshape(())
    residuals = None
    if call.save:
        residuals = (x, ti, tp, w, asum, mx, ls, den, (m, c, q), prob, int(call.ignore_index), eps,
                     call.reduction, like, call.target.dtype if prob else None)
    return (result,), residuals


def cross_entropy_backward(residuals, cotangents, needs, out=None):
    """dlogits = g (softmax · A − a); dtarget = −g (1 − ε) w p (probability targets)."""
    x, ti, tp, w, asum, mx, ls, den, (m, c, q), prob, ignore, eps, reduction, like, t_dtype = residuals
    if not needs & {"logits", "target"}:
        return {}
    xp = rt.array_module(x)
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], x.dtype)).reshape(-1)
    dz = xp.empty_like(x)
    need_t = int(prob and "target" in needs)
    # A distinct dummy when unused: the simulator copies every argument back, aliases would clobber dz.
    dt = xp.empty(x.shape, t_dtype) if need_t else xp.empty(1, x.dtype)
    mode = _REDUCTION_MODE[reduction]
    if mode == 2 and den is None:
        den = xp.ones(1, np.float64)
    if m * q:
        rt.launch(_ce_backward, m * q, rt.settings().block, x.reshape(-1), ti, tp, w, asum, mx, ls, dy,
                  den if den is not None else asum, dz.reshape(-1), dt.reshape(-1), c, q, prob, ignore, eps, mode,
                  need_t, like)
    grads = {}
    if "logits" in needs:
        grads["logits"] = rt.into(out or {}, "logits", dz)
    if need_t:
        grads["target"] = rt.into(out or {}, "target", dt)
    return grads
