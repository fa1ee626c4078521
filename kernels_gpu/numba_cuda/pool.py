"""Numba-CUDA kernels for ``max_pool`` and ``avg_pool``, forward and backward (backend ``"numba_cuda"``).

Every call (1-D to 3-D, channels first or last, batched or not) runs on one canonical view of
the C-contiguous ``x``: ``B`` planes of ``D·H·W`` spatial positions holding ``K`` contiguous
channels each — ``B = N·C, K = 1`` channels first, ``B = N, K = C`` channels last (``N = 1``
unbatched).  1-D and 2-D pools are 3-D pools with leading spatial axes of size 1 (window 1,
stride 1, no padding), so one kernel per dtype serves every case.  The geometry travels as one
tuple of 22 int64 (:func:`_geometry`).

* forward: one thread per output element walks its window in row-major order over the
  positions inside ``x``.  Max starts at −∞ on the window's first real position and takes
  ``v > best or v is NaN`` (ties keep the first maximum; NaN propagates and the last NaN wins,
  as in the reference and PyTorch's CPU kernels); the winning spatial position is kept as an
  int32 per output (−1 for a window of padding only, which outputs −∞).  Average sums in
  float64 and divides by the product of the per-axis divisors, computed with the api's rule
  (``count_include_pad``; positions beyond the padded input, created by ``ceil_mode``, never count).
* backward: gather, not scatter — one thread per input element visits the outputs whose window
  covers it (per axis, offsets ``t`` with ``i + padding − t·dilation`` a non-negative multiple of
  the stride below the output size) in window order and sums their contributions in float64
  (``dy`` where the kept position is this one, for max; ``dy / divisor`` for average).  No
  atomics: the result is deterministic.

max_unpool: ``_unpool_claim`` gives each output position the largest x position whose index
names it (``cuda.atomic.max`` on an int32 buffer of −1), ``_unpool_fill`` copies the winners into
a zeroed ``y``: duplicates resolve to the last entry in x's order, deterministically.  The
backward gives each entry ``dy`` at its index if it holds the claim (else 0).

Supported (declared in ``__init__.py``): float16, bfloat16 (float32 comparisons, float64 sums),
float32, float64; layouts channels first and last; every window/stride/padding/dilation/
ceil_mode/count_include_pad the api accepts; planes below 2**31 positions (int32 positions).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from . import _runtime as rt
from ._runtime import cast_as, device, kernel, load, store
from .conv import tap_output

#: Entries of the geometry tuple: in (3), out (3), window (3), stride (3), padding (3),
#: dilation (3), K, count_include_pad, B, divisor_override (0: none).
_G = "UniTuple(int64, 22)"
_FWD = f"void({{x}}[::1], {{x}}[::1], int32[::1], {_G}, boolean)"
_MAX_BWD = f"void({{x}}[::1], int32[::1], {{x}}[::1], {_G})"
_AVG_BWD = f"void({{x}}[::1], {{x}}[::1], {_G})"


@device
def _axis_divisor(o, n, k, s, p, cip):
    """Window positions counted along one axis by output ``o`` (the api's ``_avg_divisors`` rule)."""
    start = o * s - p
    end = min(start + k, n + p)
    count = end - start if cip else min(end, n) - max(start, 0)
    return max(count, 1)


@device
def _divisor(od, oh, ow, g):
    """The avg divisor of output (od, oh, ow): ``divisor_override``, or the product of the per-axis counts."""
    if g[21] != 0:
        return np.float64(g[21])
    a = _axis_divisor(od, g[0], g[6], g[9], g[12], g[19])
    b = _axis_divisor(oh, g[1], g[7], g[10], g[13], g[19])
    c = _axis_divisor(ow, g[2], g[8], g[11], g[14], g[19])
    return np.float64(a * b * c)


@device
def _split_out(i, g):
    """(plane, od, oh, ow, channel) of flat output index ``i``."""
    K = g[18]
    ch = i % K
    r = i // K
    ow = r % g[5]
    r //= g[5]
    oh = r % g[4]
    r //= g[4]
    od = r % g[3]
    return r // g[3], od, oh, ow, ch


@kernel(_FWD)
def _forward(x, y, idx, g, is_max):
    """max_pool (``is_max``): y = window maximum (first max wins ties, NaN propagates) and idx = its
    spatial position or −1; avg_pool: y = Σ_window x / divisor (float64 sum in window order)."""
    total = g[20] * g[3] * g[4] * g[5] * g[18]
    plane = g[0] * g[1] * g[2] * g[18]
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < total:
        b, od, oh, ow, ch = _split_out(i, g)
        base = b * plane + ch
        best = cast_as(load(x, base), -math.inf)
        bi = -1
        acc = 0.0
        for a in range(g[6]):
            zd = od * g[9] - g[12] + a * g[15]
            if zd < 0 or zd >= g[0]:
                continue
            for c in range(g[7]):
                zh = oh * g[10] - g[13] + c * g[16]
                if zh < 0 or zh >= g[1]:
                    continue
                for e in range(g[8]):
                    zw = ow * g[11] - g[14] + e * g[17]
                    if zw < 0 or zw >= g[2]:
                        continue
                    p = (zd * g[1] + zh) * g[2] + zw
                    v = load(x, base + p * g[18])
                    if not is_max:
                        acc += np.float64(v)
                        continue
                    if bi < 0:
                        bi = p
                    if v > best or v != v:
                        best = v
                        bi = p
        if is_max:
            store(y, i, best)
            idx[i] = bi
        else:
            store(y, i, cast_as(load(x, base), acc / _divisor(od, oh, ow, g)))
        i += stride


@device
def _gather(dy, idx, g, i, use_idx):
    """Σ of the contributions to input element ``i`` over the windows covering it (float64)."""
    K = g[18]
    ch = i % K
    r = i // K
    zw = r % g[2]
    r //= g[2]
    zh = r % g[1]
    r //= g[1]
    zd = r % g[0]
    b = r // g[0]
    pos = (zd * g[1] + zh) * g[2] + zw
    acc = 0.0
    for a in range(g[6]):
        od = tap_output(zd, a, g[3], g[9], g[12], g[15])
        if od < 0:
            continue
        for c in range(g[7]):
            oh = tap_output(zh, c, g[4], g[10], g[13], g[16])
            if oh < 0:
                continue
            for e in range(g[8]):
                ow = tap_output(zw, e, g[5], g[11], g[14], g[17])
                if ow < 0:
                    continue
                j = (((b * g[3] + od) * g[4] + oh) * g[5] + ow) * K + ch
                if use_idx:
                    if idx[j] == pos:
                        acc += np.float64(load(dy, j))
                else:
                    acc += np.float64(load(dy, j)) / _divisor(od, oh, ow, g)
    return acc


@kernel(_MAX_BWD)
def _max_backward(dy, idx, dx, g):
    """dx[i] = Σ dy over the windows whose kept maximum is position i."""
    total = g[20] * g[0] * g[1] * g[2] * g[18]
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < total:
        store(dx, i, _gather(dy, idx, g, i, True))
        i += stride


@kernel(_AVG_BWD)
def _avg_backward(dy, dx, g):
    """dx[i] = Σ dy / divisor over the windows covering position i."""
    total = g[20] * g[0] * g[1] * g[2] * g[18]
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < total:
        store(dx, i, _gather(dy, dy, g, i, False))
        i += stride


# --------------------------------------------------------------------------- host side


def _geometry(call, shape) -> tuple[int, ...]:
    """The 22-int geometry tuple of a call (1-D/2-D padded to 3-D with unit leading axes)."""
    d = len(call.window)
    lead = 3 - d

    def three(values, fill):
        return (fill,) * lead + tuple(int(v) for v in values)

    spatial = set(call.spatial_axes)
    other = [int(s) for a, s in enumerate(shape) if a not in spatial]
    if call.layout == "channels_last":
        k, b = other[-1], math.prod(other[:-1])
    else:
        k, b = 1, math.prod(other)
    return (*three(call.in_size, 1), *three(call.out_size, 1), *three(call.window, 1), *three(call.stride, 1),
            *three(call.padding, 0), *three(call.dilation, 1), k,
            int(bool(call.params.get("count_include_pad", True))), b, int(call.params.get("divisor_override") or 0))


def _out_shape(call, shape) -> tuple[int, ...]:
    out = list(shape)
    for a, o in zip(call.spatial_axes, call.out_size):
        out[a] = int(o)
    return tuple(out)


def pool_forward(call):
    """y = max_pool(x) or avg_pool(x); keeps the int32 argmax positions (max) and the geometry."""
    x = call.x
    xp = rt.array_module(x)
    shape = tuple(int(s) for s in x.shape)
    g = _geometry(call, shape)
    y = xp.empty(_out_shape(call, shape), dtype=x.dtype)
    n, block = rt.prod(y.shape), rt.settings().block
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    is_max = call.op == "max_pool"
    idx = xp.empty(n if is_max else 0, np.int32)  # avg_pool keeps no positions
    rt.launch(_forward, rt.blocks_for(n, block), block, flat_x, flat_y, idx, g, is_max)
    residuals = (idx if is_max else None, g, shape, x.dtype) if call.save else None
    if is_max and call.params.get("return_indices"):
        # The kept positions are flat in the spatial plane whatever the layout: PyTorch's indices.
        return (y, idx.astype(np.int64).reshape(y.shape)), residuals
    return (y,), residuals


def pool_backward(residuals, cotangents, needs, out=None):
    """dx by gathering, per input element, the contributions of the windows that cover it."""
    if "x" not in needs:
        return {}
    idx, g, shape, dtype = residuals
    xp = rt.array_module(cotangents[0])
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], dtype)).reshape(-1)
    dx = xp.empty(shape, dtype=dtype)
    n, block = rt.prod(shape), rt.settings().block
    if idx is not None:
        rt.launch(_max_backward, rt.blocks_for(n, block), block, dy, idx, dx.reshape(-1), g)
    else:
        rt.launch(_avg_backward, rt.blocks_for(n, block), block, dy, dx.reshape(-1), g)
    return {"x": rt.into(out or {}, "x", dx)}


# --------------------------------------------------------------------------- max_unpool
#
# x, indices: B planes of P_in positions of K channels; y: B planes of P_out positions.
# sizes = (B, K, P_in, P_out).

_SIZES = "UniTuple(int64, 4)"


@kernel(f"void(int64[::1], int32[::1], {_SIZES})", dtypes=("float32",))
def _unpool_claim(idx, winner, sizes):
    """winner[b, q, k] = the largest position p in the plane with idx[b, p, k] == q."""
    K, p_in, p_out = sizes[1], sizes[2], sizes[3]
    total = sizes[0] * p_in * K
    e = cuda.grid(1)
    while e < total:
        q = idx[e]
        if q >= 0 and q < p_out:
            b = e // K // p_in
            p = (e // K) % p_in
            cuda.atomic.max(winner, ((b * p_out + q) * K + e % K), np.int32(p))
        e += cuda.gridsize(1)


@kernel(f"void({{x}}[::1], int32[::1], {{x}}[::1], {_SIZES})")
def _unpool_fill(x, winner, y, sizes):
    """y[e] = x at the winning position (y arrives zeroed)."""
    K, p_in, p_out = sizes[1], sizes[2], sizes[3]
    total = sizes[0] * p_out * K
    e = cuda.grid(1)
    while e < total:
        w = winner[e]
        if w >= 0:
            y[e] = x[((e // K // p_out) * p_in + w) * K + e % K]
        e += cuda.gridsize(1)


@kernel(f"void({{x}}[::1], int64[::1], int32[::1], {{x}}[::1], {_SIZES})")
def _unpool_gather(dy, idx, winner, dx, sizes):
    """dx[e] = dy at entry e's index where entry e holds the claim (dx arrives zeroed)."""
    K, p_in, p_out = sizes[1], sizes[2], sizes[3]
    total = sizes[0] * p_in * K
    e = cuda.grid(1)
    while e < total:
        q = idx[e]
        if q >= 0 and q < p_out:
            o = ((e // K // p_in) * p_out + q) * K + e % K
            if winner[o] == (e // K) % p_in:
                dx[e] = dy[o]
        e += cuda.gridsize(1)


def _unpool_sizes(call, shape) -> tuple[int, int, int, int]:
    k = shape[-1] if call.layout == "channels_last" else 1
    return math.prod(shape[: call.spatial_axes[0]]), k, math.prod(call.in_size), math.prod(call.out_size)


def unpool_forward(call):
    """y of max_unpool: the last entry naming each position (claimed with an atomic max), zero elsewhere."""
    x = call.x
    xp = rt.array_module(x)
    shape = tuple(int(s) for s in x.shape)
    sizes = _unpool_sizes(call, shape)
    idx = xp.ascontiguousarray(call.indices).astype(np.int64, copy=False).reshape(-1)
    y = xp.zeros(_out_shape(call, shape), dtype=x.dtype)
    winner = xp.full(rt.prod(y.shape), -1, dtype=np.int32)
    block = rt.settings().block
    rt.launch(_unpool_claim, rt.blocks_for(rt.prod(shape), block), block, idx, winner, sizes)
    rt.launch(_unpool_fill, rt.blocks_for(rt.prod(y.shape), block), block, x.reshape(-1), winner, y.reshape(-1),
              sizes)
    return (y,), ((idx, winner, sizes, shape, x.dtype) if call.save else None)


def unpool_backward(residuals, cotangents, needs, out=None):
    """dx of max_unpool: dy at each entry's index where that entry holds the claim, else 0."""
    if "x" not in needs:
        return {}
    idx, winner, sizes, shape, dtype = residuals
    xp = rt.array_module(cotangents[0])
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], dtype)).reshape(-1)
    dx = xp.zeros(shape, dtype=dtype)
    block = rt.settings().block
    rt.launch(_unpool_gather, rt.blocks_for(rt.prod(shape), block), block, dy, idx, winner, dx.reshape(-1), sizes)
    return {"x": rt.into(out or {}, "x", dx)}
