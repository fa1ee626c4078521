"""Pooling in the array API: forward and hand-written backward (reference and oracle).

The geometry comes resolved from :mod:`portable_nn.api.pool`: the spatial axes
of ``x``, per-axis window ``k``, stride ``s``, dilation ``δ``, output size
``O``, and low/high padding (the high side includes the room ``ceil_mode``
needs).  With ``x`` padded to ``xp_`` (−∞ for max, 0 for average), the window
offset ``t`` (one per axis, row-major) reads the strided slice

    xp_[..., tδ : tδ + s(O − 1) + 1 : s, ...]          (an array of the output's shape)

so the forward is a loop over the ``Πk`` offsets of elementwise operations:

* max: a running maximum and the offset where it was reached, updated when
  ``v > best`` (the first maximum wins ties) or when ``v`` is NaN (NaN
  propagates; the last NaN wins, as in PyTorch's CPU kernels).  With padding
  the maximum starts at −∞ on each window's first real position, so padded
  positions (−∞) never win and a window of −∞ values points at a real one;
* average: the sum of the slices divided by the per-position divisor, the
  outer product of the per-axis divisors the api computed.

The backward scatters each offset's contribution (``dy`` where that offset won,
for max; ``dy / divisor`` for average) back to the padded input without
in-place updates: positions ``tδ + s·j`` fall on the residue class ``tδ mod s``
of the stride, shifted by ``tδ // s``; contributions are summed per residue
class on the coarse grid, the classes are interleaved with ``stack`` and
``reshape``, and the padding is cropped.  Max keeps only the winning offsets
(``int32``, the output's shape); average keeps nothing but the geometry.
"""

from __future__ import annotations

import math
from typing import Any

from ..dispatch import Call
from ._common import compute_dtype, device, index_dtype, store
from ._windows import window_offsets, window_slice

__all__ = [
    "avg_pool_backward", "avg_pool_forward", "max_pool_backward", "max_pool_forward", "max_unpool_backward",
    "max_unpool_forward",
]


# --------------------------------------------------------------------------- geometry helpers


class _Geometry:
    """The resolved pooling geometry of one call (plain Python values)."""

    __slots__ = ("axes", "dilation", "hi", "in_size", "lo", "ndim", "out_size", "stride", "window")

    def __init__(self, call: Call, ndim: int) -> None:
        self.ndim = ndim
        self.axes = call.spatial_axes
        self.window = call.window
        self.stride = call.stride
        self.dilation = call.dilation
        self.in_size = call.in_size
        self.out_size = call.out_size
        self.lo = call.pad_lo
        self.hi = call.pad_hi

    def offsets(self) -> list[tuple[int, ...]]:
        """Window offsets in row-major order (the first axis varies slowest)."""
        return window_offsets(self.window)

    def window_slice(self, offset: tuple[int, ...]) -> tuple[slice, ...]:
        """Index of the padded input that offset ``offset`` meets at every output position."""
        return window_slice(self.ndim, self.axes, offset, self.stride, self.dilation, self.out_size)

    def padded(self) -> bool:
        return any(self.lo) or any(self.hi)

    def broadcast_shape(self, i: int, n: int) -> tuple[int, ...]:
        """Shape with ``n`` on spatial axis ``i`` and 1 elsewhere."""
        return tuple(n if a == self.axes[i] else 1 for a in range(self.ndim))



def _pad(xp: Any, a: Any, axis: int, lo: int, hi: int, value: float) -> Any:
    """``a`` extended by ``lo`` and ``hi`` entries of ``value`` along ``axis``."""
    if lo == 0 and hi == 0:
        return a

    def block(n: int) -> Any:
        shape = list(a.shape)
        shape[axis] = n
        return xp.full(tuple(shape), value, dtype=a.dtype, device=device(a))

    pieces = ([block(lo)] if lo else []) + [a] + ([block(hi)] if hi else [])
    return xp.concat(pieces, axis=axis)


def _pad_all(xp: Any, a: Any, geo: _Geometry, value: float) -> Any:
    for i, axis in enumerate(geo.axes):
        a = _pad(xp, a, axis, geo.lo[i], geo.hi[i], value)
    return a


def _first_valid(xp: Any, geo: _Geometry, device: Any) -> Any:
    """Per output position, the row-major index of the first window offset inside ``x``.

    Validity is a product over the axes, so that offset combines each axis's first
    valid offset.  ``-1`` where a window sees only padding.  The result is small:
    it broadcasts against the output (size 1 on the non-spatial axes).
    """
    total = invalid = None
    multiplier = 1
    for i in reversed(range(len(geo.axes))):
        firsts = []
        for j in range(geo.out_size[i]):
            start = geo.stride[i] * j
            valid = [
                t for t in range(geo.window[i])
                if geo.lo[i] <= start + t * geo.dilation[i] < geo.lo[i] + geo.in_size[i]
            ]
            firsts.append(valid[0] if valid else -1)
        shape = geo.broadcast_shape(i, len(firsts))
        a = xp.reshape(xp.asarray(firsts, dtype=xp.int32, device=device), shape)
        bad = a < 0
        term = a * multiplier
        total = term if total is None else total + term
        invalid = bad if invalid is None else xp.logical_or(invalid, bad)
        multiplier *= geo.window[i]
    return xp.where(invalid, xp.asarray(-1, dtype=xp.int32, device=device), total)


def _scatter(xp: Any, contributions: Any, geo: _Geometry, like: Any) -> Any:
    """Σ over ``(offset, c)`` of ``c`` placed at the offset's strided window positions.

    Returns the gradient of the *unpadded* input (padding cropped).  ``like``
    gives the non-spatial sizes, dtype and device (an output-shaped array).
    """
    d = len(geo.axes)
    padded = [geo.lo[i] + geo.in_size[i] + geo.hi[i] for i in range(d)]
    coarse = [-(-padded[i] // geo.stride[i]) for i in range(d)]  # ceil(P / s)
    per_class: dict[tuple[int, ...], Any] = {}
    for offset, c in contributions:
        residue = []
        for i, t in enumerate(offset):
            start = t * geo.dilation[i]
            s = geo.stride[i]
            shift = start // s
            residue.append(start % s)
            c = _pad(xp, c, geo.axes[i], shift, coarse[i] - shift - geo.out_size[i], 0.0)
        key = tuple(residue)
        per_class[key] = c if key not in per_class else per_class[key] + c

    base_shape = list(like.shape)
    for i, a in enumerate(geo.axes):
        base_shape[a] = coarse[i]
    zeros = None

    def build(prefix: tuple[int, ...]) -> Any:
        nonlocal zeros
        i = len(prefix)
        if i == d:
            got = per_class.get(prefix)
            if got is None:
                if zeros is None:
                    zeros = xp.zeros(tuple(base_shape), dtype=like.dtype, device=device(like))
                got = zeros
            return got
        s = geo.stride[i]
        parts = [build((*prefix, r)) for r in range(s)]
        if s == 1:
            return parts[0]
        a = geo.axes[i]
        stacked = xp.stack(parts, axis=a + 1)
        shape = list(parts[0].shape)
        shape[a] *= s
        return xp.reshape(stacked, tuple(shape))

    full = build(())
    index = [slice(None)] * geo.ndim
    for i, a in enumerate(geo.axes):
        index[a] = slice(geo.lo[i], geo.lo[i] + geo.in_size[i])
    return full[tuple(index)]


# --------------------------------------------------------------------------- max_pool


def max_pool_forward(call: Call) -> tuple[tuple[Any], Any]:
    """Running maximum over the window offsets; keeps the winning offset per output."""
    xp, x = call.xp, call.x
    geo = _Geometry(call, x.ndim)
    dev = device(x)
    offsets = geo.offsets()
    if geo.padded():
        # Start from −∞ at each window's first real position (PyTorch's choice when
        # every real value is −∞); padded positions hold −∞ and can never win.
        xpad = _pad_all(xp, x, geo, -math.inf)
        out_shape = tuple(xpad[geo.window_slice(offsets[0])].shape)
        best = xp.full(out_shape, -math.inf, dtype=x.dtype, device=dev)
        idx = _first_valid(xp, geo, dev)
        rest = list(enumerate(offsets))
    else:
        xpad = x
        best = xpad[geo.window_slice(offsets[0])]
        idx = xp.zeros(tuple(best.shape), dtype=xp.int32, device=dev)
        rest = list(enumerate(offsets))[1:]
        if not rest:
            best = xp.asarray(best, copy=True)  # a 1-element window: never hand back a view of x
    for t, offset in rest:
        v = xpad[geo.window_slice(offset)]
        take = xp.logical_or(v > best, xp.isnan(v))
        best = xp.where(take, v, best)
        idx = xp.where(take, xp.asarray(t, dtype=xp.int32, device=dev), idx)
    residuals = (idx, tuple(x.shape), x.dtype, call.replace(arrays={})) if call.save else None
    if call.params.get("return_indices"):
        return (best, _flat_positions(xp, idx, geo, dev)), residuals
    return (best,), residuals


def _flat_positions(xp: Any, idx: Any, geo: _Geometry, dev: Any) -> Any:
    """The winning window offsets ``idx`` as flat positions in the input's spatial plane (−1 stays).

    Offset ``t`` splits row-major into per-axis offsets ``t_i``; output ``o`` then reads
    position ``o_i·s_i − lo_i + t_i·δ_i`` along axis ``i``, and the plane is row-major.
    """
    itype = index_dtype(xp)
    t = xp.astype(idx, itype)
    flat = None
    inner_window, inner_plane = 1, 1
    for i in reversed(range(len(geo.axes))):
        t_i = (t // inner_window) % geo.window[i]
        o_i = xp.reshape(xp.arange(geo.out_size[i], dtype=itype, device=dev), geo.broadcast_shape(i, geo.out_size[i]))
        term = (o_i * geo.stride[i] - geo.lo[i] + t_i * geo.dilation[i]) * inner_plane
        flat = term if flat is None else flat + term
        inner_window *= geo.window[i]
        inner_plane *= geo.in_size[i]
    return xp.where(idx < 0, xp.asarray(-1, dtype=itype, device=dev), flat)


def max_pool_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dx: each window's cotangent scattered to the position of its maximum."""
    if "x" not in needs:
        return {}
    idx, x_shape, x_dtype, call = residuals
    xp = call.xp
    geo = _Geometry(call, len(x_shape))
    dy = xp.astype(cotangents[0], x_dtype)
    zero = xp.zeros_like(dy)

    def contributions() -> Any:
        for t, offset in enumerate(geo.offsets()):
            yield offset, xp.where(idx == t, dy, zero)

    dx = _scatter(xp, contributions(), geo, dy)
    return {"x": store(out, "x", dx)}


# --------------------------------------------------------------------------- avg_pool


def _divisor(xp: Any, geo: _Geometry, divisors: tuple[tuple[int, ...], ...], dtype: Any, device: Any) -> Any:
    """The outer product of the per-axis divisors, broadcastable to the output."""
    total = None
    for i, values in enumerate(divisors):
        a = xp.reshape(
            xp.asarray([float(v) for v in values], dtype=dtype, device=device), geo.broadcast_shape(i, len(values))
        )
        total = a if total is None else total * a
    return total


def avg_pool_forward(call: Call) -> tuple[tuple[Any], Any]:
    """Σ over the window offsets of the strided slices, divided by PyTorch's divisor."""
    xp, x = call.xp, call.x
    geo = _Geometry(call, x.ndim)
    cdt = compute_dtype(xp, x)
    xpad = _pad_all(xp, xp.astype(x, cdt), geo, 0.0)
    total = None
    for offset in geo.offsets():
        v = xpad[geo.window_slice(offset)]
        total = v if total is None else total + v
    y = xp.astype(total / _divisor(xp, geo, call.divisors, cdt, device(x)), x.dtype)
    residuals = (tuple(x.shape), x.dtype, call.replace(arrays={})) if call.save else None
    return (y,), residuals


def avg_pool_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dx: dy / divisor spread over every window position."""
    if "x" not in needs:
        return {}
    x_shape, x_dtype, call = residuals
    xp = call.xp
    geo = _Geometry(call, len(x_shape))
    dy = cotangents[0]
    cdt = compute_dtype(xp, dy)
    g = xp.astype(dy, cdt) / _divisor(xp, geo, call.divisors, cdt, device(dy))
    dx = _scatter(xp, ((offset, g) for offset in geo.offsets()), geo, g)
    return {"x": store(out, "x", xp.astype(dx, x_dtype))}


# --------------------------------------------------------------------------- max_unpool


def _unpool_keys(xp: Any, call: Call, x_shape: tuple[int, ...], indices: Any) -> tuple[Any, int]:
    """Each entry's flat position in ``y`` (−1 where its index is out of range), and ``y.size``.

    ``x`` is viewed as ``(B, P_in, K)`` and ``y`` as ``(B, P_out, K)`` (channels first: B = N·C,
    K = 1; channels last: B = N, K = C), so entry ``(b, p, k)`` goes to ``(b·P_out + index)·K + k``.
    """
    first, last = call.spatial_axes[0], call.spatial_axes[-1]
    batch = math.prod(x_shape[:first])
    plane_in = math.prod(call.in_size)
    plane_out = math.prod(call.out_size)
    channels = math.prod(x_shape[last + 1:])
    itype = index_dtype(xp)
    dev = device(indices)
    idx = xp.reshape(xp.astype(indices, itype), (batch, plane_in, channels))
    b = xp.reshape(xp.arange(batch, dtype=itype, device=dev), (batch, 1, 1))
    k = xp.reshape(xp.arange(channels, dtype=itype, device=dev), (1, 1, channels))
    keys = (b * plane_out + idx) * channels + k
    # Checked by the api on concrete values; traced (JAX) out-of-range entries are dropped.
    keys = xp.where(xp.logical_or(idx < 0, idx >= plane_out), xp.asarray(-1, dtype=itype, device=dev), keys)
    return xp.reshape(keys, (-1,)), batch * plane_out * channels


def _unpool_shape(call: Call, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = list(x_shape)
    for a, o in zip(call.spatial_axes, call.out_size):
        shape[a] = o
    return tuple(shape)


def max_unpool_forward(call: Call) -> tuple[tuple[Any], Any]:
    """y: each x value at its index, zero elsewhere; duplicates: the last entry in x's order wins.

    Without a scatter in the array API, the assignment is inverted into a gather: the entries'
    keys (flat positions in ``y``) are sorted stably, and each position of ``y`` finds the last
    entry with its key by binary search.  The backward needs, per entry, whether it won.
    """
    xp, x = call.xp, call.x
    x_shape = tuple(x.shape)
    keys, size = _unpool_keys(xp, call, x_shape, call.indices)
    dev = device(x)
    n = keys.shape[0]
    if n == 0:
        y = xp.zeros(_unpool_shape(call, x_shape), dtype=x.dtype, device=dev)
        wins = keys >= 0
    else:
        order = xp.argsort(keys, stable=True)
        sorted_keys = xp.take(keys, order)
        wanted = xp.arange(size, dtype=keys.dtype, device=dev)
        last = xp.astype(xp.searchsorted(sorted_keys, wanted, side="right"), keys.dtype) - 1
        found = xp.where(last < 0, xp.zeros_like(last), last)
        hit = xp.logical_and(last >= 0, xp.take(sorted_keys, found) == wanted)
        winner = xp.where(hit, xp.take(order, found), xp.full_like(found, -1))  # per y position: its entry
        values = xp.take(xp.reshape(x, (-1,)), xp.where(hit, winner, xp.zeros_like(winner)))
        y = xp.reshape(xp.where(hit, values, xp.zeros_like(values)), _unpool_shape(call, x_shape))
        valid = keys >= 0
        entries = xp.arange(n, dtype=keys.dtype, device=dev)
        wins = xp.logical_and(valid, xp.take(winner, xp.where(valid, keys, xp.zeros_like(keys))) == entries)
    residuals = (keys, wins, x_shape, x.dtype, xp) if call.save else None
    return (y,), residuals


def max_unpool_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dx: dy at each entry's index for the entry that was written, zero for the overwritten ones."""
    if "x" not in needs:
        return {}
    keys, wins, x_shape, x_dtype, xp = residuals
    dy = xp.reshape(xp.astype(cotangents[0], x_dtype), (-1,))
    if keys.shape[0] == 0 or dy.shape[0] == 0:
        return {"x": store(out, "x", xp.zeros(x_shape, dtype=x_dtype, device=device(dy)))}
    gathered = xp.take(dy, xp.where(wins, keys, xp.zeros_like(keys)))
    dx = xp.where(wins, gathered, xp.zeros_like(gathered))
    return {"x": store(out, "x", xp.reshape(dx, x_shape))}
