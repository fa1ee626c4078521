"""Convolution in the array API: forward and hand-written backward (reference and oracle).

The geometry comes resolved from :mod:`portable_nn.api.conv`: per spatial axis
the kernel size ``k``, stride ``s``, dilation ``δ``, low/high zero padding and
output size ``O``; and the number of groups ``G``.  ``x`` is handled batched
(an unbatched input gets a leading axis of 1, removed again at the end).

Forward (im2col).  With ``x_pad`` the zero-padded input, the kernel offset
``t`` (one index per spatial axis, row-major over the kernel) reads the
strided slice

    x_pad[..., tδ : tδ + s(O − 1) + 1 : s, ...]             (the output's spatial shape)

and stacking the ``K = Πk`` slices next to the channel axis gives the columns
``cols[n, c, t, p]`` = the input value that kernel tap ``t`` of channel ``c``
meets at output position ``p``.  Splitting the channels into ``G`` groups of
``C/G`` and flattening ``(c, t)`` — the same order as ``weight``'s
``(C/G, *k)`` axes — every group is one matrix product::

    z[n, g, o, p] = Σ_j W[g, o, j] · cols[n, g, j, p] + bias      W = weight reshaped (G, O/G, C/G·K)
    y = act(z)

Channels-first data stacks the slices to ``(N, C, K, *O)``, so ``cols`` is
``(N, G, C/G·K, P)`` and ``z = W @ cols`` comes out channels-first; channels-last
data stacks to ``(N, *O, C, K)``, so ``cols`` is ``(N·P, G, C/G·K)`` and
``z = cols @ Wᵀ`` (batched over groups) comes out channels-last: neither layout
is transposed as a whole.

Backward, with ``g = dy · act'`` (from ``y`` alone when the activation allows,
see :func:`~portable_nn.kernel_codes.keeps_output_only`, else from the
kept pre-activation ``z``)::

    dbias[o]      = Σ_{n,p} g[n, o, p]                     (reduced right after act')
    dweight[g]    = Σ_n g[n, g] @ cols[n, g]ᵀ                (the correlation of g with x)
    dcols[n, g]   = W[g]ᵀ @ g[n, g]
    dx            = Σ_t scatter of dcols[..., t, ...] to the positions tδ + s·p, cropped

The last line is the transposed convolution: each kernel offset's column
gradient is added into a zero buffer of the padded input's shape at that
offset's strided window (slice assignment ``+=``), and the padding is cropped.
For arrays that cannot be written in place (JAX) each offset's contribution is
instead spread to the padded grid functionally (interleaved with zeros to the
stride, then zero-padded to the offset) and summed.

The forward keeps ``x``, ``weight`` and the activation residual (``y`` or ``z``;
nothing for the identity); the backward rebuilds ``cols`` from ``x``.
Half-precision data (or half data with float32 parameters) is computed in float32,
and the kept ``y`` is then its float32 value: the derivative from a rounded half
output (``1 − y²`` near saturation) would lose most of its digits.
"""

from __future__ import annotations

from typing import Any

from .. import _arrays
from ..dispatch import Call
from . import activations
from ._common import compute_dtype, device, store
from ._windows import window_offsets, window_slice

__all__ = ["conv_backward", "conv_forward"]


# --------------------------------------------------------------------------- geometry


class _Geometry:
    """The resolved geometry of one call, for the batched input (plain Python values)."""

    __slots__ = (
        "axes", "channels_last", "dilation", "groups", "hi", "in_size", "kernel", "lo", "ndim", "out_size", "stride",
    )

    def __init__(self, call: Call) -> None:
        shift = 0 if call.batched else 1
        self.axes = tuple(a + shift for a in call.spatial_axes)
        self.ndim = len(self.axes) + 2
        self.channels_last = call.layout == "channels_last"
        self.kernel = call.kernel
        self.stride = call.stride
        self.dilation = call.dilation
        self.lo = call.pad_lo
        self.hi = call.pad_hi
        self.in_size = call.in_size
        self.out_size = call.out_size
        self.groups = call.groups

    @property
    def channel_axis(self) -> int:
        return self.ndim - 1 if self.channels_last else 1

    def offsets(self) -> list[tuple[int, ...]]:
        """Kernel offsets in row-major order (the order of ``weight``'s kernel axes)."""
        return window_offsets(self.kernel)

    def window_slice(self, offset: tuple[int, ...]) -> tuple[slice, ...]:
        """Index of the padded input that offset ``offset`` meets at every output position."""
        return window_slice(self.ndim, self.axes, offset, self.stride, self.dilation, self.out_size)

    def interior(self) -> tuple[slice, ...]:
        """Index of the unpadded input inside the padded one."""
        index = [slice(None)] * self.ndim
        for i, a in enumerate(self.axes):
            index[a] = slice(self.lo[i], self.lo[i] + self.in_size[i])
        return tuple(index)

    def padded_shape(self, like_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(like_shape)
        for i, a in enumerate(self.axes):
            shape[a] = self.lo[i] + self.in_size[i] + self.hi[i]
        return tuple(shape)

    def padded(self) -> bool:
        return any(self.lo) or any(self.hi)

    def positions(self) -> int:
        p = 1
        for o in self.out_size:
            p *= o
        return p

    def taps(self) -> int:
        k = 1
        for n in self.kernel:
            k *= n
        return k



def _writable(a: Any) -> bool:
    return _arrays.is_writeable(a)


def _zero_block(xp: Any, a: Any, axis: int, n: int) -> Any:
    shape = list(a.shape)
    shape[axis] = n
    return xp.zeros(tuple(shape), dtype=a.dtype, device=device(a))


def _pad_axis(xp: Any, a: Any, axis: int, lo: int, hi: int) -> Any:
    """``a`` with ``lo`` and ``hi`` zeros added along ``axis`` (functional)."""
    if lo == 0 and hi == 0:
        return a
    pieces = ([_zero_block(xp, a, axis, lo)] if lo else []) + [a] + ([_zero_block(xp, a, axis, hi)] if hi else [])
    return xp.concat(pieces, axis=axis)


def _pad(xp: Any, x: Any, geo: _Geometry) -> Any:
    """The zero-padded input: one buffer with the input assigned to its interior
    (or, for immutable arrays, concatenated zero blocks axis by axis)."""
    if not geo.padded():
        return x
    buffer = xp.zeros(geo.padded_shape(tuple(x.shape)), dtype=x.dtype, device=device(x))
    if _writable(buffer):
        buffer[geo.interior()] = x
        return buffer
    for i, a in enumerate(geo.axes):
        x = _pad_axis(xp, x, a, geo.lo[i], geo.hi[i])
    return x


# --------------------------------------------------------------------------- im2col and products


def _columns(xp: Any, x: Any, geo: _Geometry) -> Any:
    """im2col of the (batched, compute-dtype) input, grouped for the products.

    Channels first: ``(N, G, C/G·K, P)``; channels last: ``(N·P, G, C/G·K)``;
    the flattened ``(c, t)`` index runs over channels, then kernel offsets.
    """
    xpad = _pad(xp, x, geo)
    slices = [xpad[geo.window_slice(t)] for t in geo.offsets()]
    n, c, g = int(x.shape[0]), int(x.shape[geo.channel_axis]), geo.groups
    width = (c // g) * geo.taps()
    if geo.channels_last:
        cols = xp.stack(slices, axis=-1)  # (N, *O, C, K)
        return xp.reshape(cols, (n * geo.positions(), g, width))
    cols = xp.stack(slices, axis=2)  # (N, C, K, *O)
    return xp.reshape(cols, (n, g, width, geo.positions()))


def _grouped_weight(xp: Any, w: Any, geo: _Geometry) -> Any:
    """``weight`` ``(O, C/G, *k)`` as ``(G, O/G, C/G·K)``."""
    out_channels = int(w.shape[0])
    g = geo.groups
    return xp.reshape(w, (g, out_channels // g, int(w.shape[1]) * geo.taps()))


def _output_shape(n: int, out_channels: int, geo: _Geometry) -> tuple[int, ...]:
    if geo.channels_last:
        return (n, *geo.out_size, out_channels)
    return (n, out_channels, *geo.out_size)


def _bias_shape(out_channels: int, geo: _Geometry) -> tuple[int, ...]:
    return tuple(out_channels if a == geo.channel_axis else 1 for a in range(geo.ndim))


def _batched(xp: Any, a: Any, call: Call) -> Any:
    return a if call.batched else xp.reshape(a, (1, *a.shape))


def _unbatched(xp: Any, a: Any, call: Call) -> Any:
    return a if call.batched else xp.reshape(a, tuple(a.shape[1:]))


# --------------------------------------------------------------------------- forward


def conv_forward(call: Call) -> tuple[tuple[Any], Any]:
    """im2col, one grouped matrix product, then bias and activation in the epilogue."""
    xp = call.xp
    x, weight, bias = call.x, call.weight, call.bias
    geo = _Geometry(call)
    cdt = compute_dtype(xp, x)
    xb = xp.astype(_batched(xp, x, call), cdt, copy=False)
    w = _grouped_weight(xp, xp.astype(weight, cdt, copy=False), geo)
    cols = _columns(xp, xb, geo)
    n, out_channels = int(xb.shape[0]), int(weight.shape[0])
    if geo.channels_last:
        # (G, N·P, C/G·K) @ (G, C/G·K, O/G) -> (G, N·P, O/G) -> (N·P, G, O/G)
        z = xp.matmul(xp.permute_dims(cols, (1, 0, 2)), xp.matrix_transpose(w))
        z = xp.permute_dims(z, (1, 0, 2))
    else:
        # (G, O/G, C/G·K) @ (N, G, C/G·K, P) -> (N, G, O/G, P)
        z = xp.matmul(w, cols)
    z = xp.reshape(z, _output_shape(n, out_channels, geo))
    if bias is not None:
        z = z + xp.reshape(xp.astype(bias, cdt, copy=False), _bias_shape(out_channels, geo))
    act = call.activation
    a = activations.apply(xp, z, act)
    y = _unbatched(xp, xp.astype(a, x.dtype, copy=False), call)
    residuals = None
    if call.save:
        if act.is_identity:
            kept = None  # the derivative is 1: nothing to keep
        elif activations.keeps_output_only(act):
            kept = a  # act' is a function of y: the output (itself, unless half data: then its float32 value)
        else:
            kept = z  # the pre-activation
        residuals = (x, weight, bias, kept, call.replace(arrays={}))
    return (y,), residuals


# --------------------------------------------------------------------------- backward


def _activation_gradient(xp: Any, dy: Any, kept: Any, call: Call, cdt: Any) -> Any:
    """g = dy · act'(z), batched, in the compute dtype."""
    g = xp.astype(_batched(xp, dy, call), cdt, copy=False)
    act = call.activation
    if act.is_identity:
        return g
    if activations.keeps_output_only(act):
        return g * activations.derivative_from_output(xp, kept, act)
    return g * activations.derivative(xp, kept, act)


def _place(xp: Any, c: Any, axis: int, start: int, step: int, total: int) -> Any:
    """``c``'s entries ``j`` moved to ``start + step·j`` along ``axis`` of a zero array of length ``total``."""
    n = int(c.shape[axis])
    if step > 1:
        zeros = xp.zeros_like(c)
        c = xp.stack([c] + [zeros] * (step - 1), axis=axis + 1)  # each entry followed by step − 1 zeros
        shape = list(c.shape)
        del shape[axis + 1]
        shape[axis] = n * step
        c = xp.reshape(c, tuple(shape))
        index = [slice(None)] * c.ndim
        index[axis] = slice(0, (n - 1) * step + 1)
        c = c[tuple(index)]
    length = (n - 1) * step + 1
    return _pad_axis(xp, c, axis, start, total - start - length)


def _scatter(xp: Any, dcols: list[tuple[tuple[int, ...], Any]], geo: _Geometry, shape: tuple[int, ...]) -> Any:
    """Σ over kernel offsets of the column gradients at their strided windows, padding cropped.

    ``shape`` is the batched input's shape; the contributions have the output's
    spatial shape and the input's channels.
    """
    padded = geo.padded_shape(shape)
    first = dcols[0][1]
    buffer = xp.zeros(padded, dtype=first.dtype, device=device(first))
    if _writable(buffer):
        for offset, c in dcols:
            index = geo.window_slice(offset)
            buffer[index] += c
    else:
        total = None
        for offset, c in dcols:
            for i, a in enumerate(geo.axes):
                c = _place(xp, c, a, offset[i] * geo.dilation[i], geo.stride[i], padded[a])
            total = c if total is None else total + c
        buffer = total
    return buffer[geo.interior()] if geo.padded() else buffer


def conv_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dbias, dweight and dx (the transposed convolution); see the module docstring."""
    x, weight, bias, kept, call = residuals
    xp = call.xp
    geo = _Geometry(call)
    cdt = compute_dtype(xp, x)
    g = _activation_gradient(xp, cotangents[0], kept, call, cdt)
    grads: dict[str, Any] = {}
    if "bias" in needs:
        axes = tuple(a for a in range(geo.ndim) if a != geo.channel_axis)
        grads["bias"] = store(out, "bias", xp.astype(xp.sum(g, axis=axes), bias.dtype, copy=False))
    if "weight" not in needs and "x" not in needs:
        return grads

    n, out_channels, groups = int(g.shape[0]), int(weight.shape[0]), geo.groups
    og, positions = out_channels // groups, geo.positions()
    if geo.channels_last:
        g = xp.permute_dims(xp.reshape(g, (n * positions, groups, og)), (1, 0, 2))  # (G, N·P, O/G)
    else:
        g = xp.reshape(g, (n, groups, og, positions))  # (N, G, O/G, P)

    if "weight" in needs:
        xb = xp.astype(_batched(xp, x, call), cdt, copy=False)
        cols = _columns(xp, xb, geo)
        if geo.channels_last:
            # (G, O/G, N·P) @ (G, N·P, C/G·K) -> (G, O/G, C/G·K)
            dw = xp.matmul(xp.matrix_transpose(g), xp.permute_dims(cols, (1, 0, 2)))
        else:
            # Σ_n (N, G, O/G, P) @ (N, G, P, C/G·K) -> (G, O/G, C/G·K)
            dw = xp.sum(xp.matmul(g, xp.matrix_transpose(cols)), axis=0)
        dw = xp.reshape(dw, tuple(weight.shape))
        grads["weight"] = store(out, "weight", xp.astype(dw, weight.dtype, copy=False))

    if "x" in needs:
        w = _grouped_weight(xp, xp.astype(weight, cdt, copy=False), geo)
        x_shape = (n, *x.shape) if not call.batched else tuple(x.shape)
        channels, taps = int(x_shape[geo.channel_axis]), geo.taps()
        if geo.channels_last:
            # (G, N·P, O/G) @ (G, O/G, C/G·K) -> (G, N·P, C/G·K) -> (N, *O, C, K)
            dcols = xp.permute_dims(xp.matmul(g, w), (1, 0, 2))
            dcols = xp.reshape(dcols, (n, *geo.out_size, channels, taps))
            parts = [(t, dcols[..., j]) for j, t in enumerate(geo.offsets())]
        else:
            # (G, C/G·K, O/G) @ (N, G, O/G, P) -> (N, G, C/G·K, P) -> (N, C, K, *O)
            dcols = xp.reshape(xp.matmul(xp.matrix_transpose(w), g), (n, channels, taps, *geo.out_size))
            parts = [(t, dcols[:, :, j, ...]) for j, t in enumerate(geo.offsets())]
        dx = _scatter(xp, parts, geo, x_shape)
        dx = _unbatched(xp, xp.astype(dx, x.dtype, copy=False), call)
        grads["x"] = store(out, "x", dx)
    return grads
