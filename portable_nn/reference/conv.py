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

__all__ = ["conv_backward", "conv_forward", "conv_transpose_backward", "conv_transpose_forward"]


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


def _batched_shape(n: int, channels: int, spatial: tuple[int, ...], geo: _Geometry) -> tuple[int, ...]:
    """``(n, channels, *spatial)`` in the call's layout."""
    if geo.channels_last:
        return (n, *spatial, channels)
    return (n, channels, *spatial)


def _bias_shape(out_channels: int, geo: _Geometry) -> tuple[int, ...]:
    return tuple(out_channels if a == geo.channel_axis else 1 for a in range(geo.ndim))


def _batched(xp: Any, a: Any, call: Call) -> Any:
    return a if call.batched else xp.reshape(a, (1, *a.shape))


def _unbatched(xp: Any, a: Any, call: Call) -> Any:
    return a if call.batched else xp.reshape(a, tuple(a.shape[1:]))


# --------------------------------------------------------------------------- forward


def _correlate(xp: Any, xb: Any, w: Any, geo: _Geometry, out_channels: int) -> Any:
    """The convolution's linear part ``z`` (batched, compute dtype): im2col, one grouped product.

    ``xb`` is the batched input, ``w`` the grouped weight ``(G, O/G, C/G·K)``.
    """
    cols = _columns(xp, xb, geo)
    n = int(xb.shape[0])
    if geo.channels_last:
        # (G, N·P, C/G·K) @ (G, C/G·K, O/G) -> (G, N·P, O/G) -> (N·P, G, O/G)
        z = xp.matmul(xp.permute_dims(cols, (1, 0, 2)), xp.matrix_transpose(w))
        z = xp.permute_dims(z, (1, 0, 2))
    else:
        # (G, O/G, C/G·K) @ (N, G, C/G·K, P) -> (N, G, O/G, P)
        z = xp.matmul(w, cols)
    return xp.reshape(z, _batched_shape(n, out_channels, geo.out_size, geo))


def _kept(act: Any, a: Any, z: Any) -> Any:
    """What the backward reads act' from: nothing for the identity, the output when act' is a
    function of it (its float32 value for half data), else the pre-activation."""
    if act.is_identity:
        return None
    return a if activations.keeps_output_only(act) else z


def _bias_activation(xp: Any, z: Any, bias: Any, geo: _Geometry, cdt: Any, act: Any) -> tuple[Any, Any]:
    """``(act(z + bias), kept)`` for the batched compute-dtype ``z``."""
    if bias is not None:
        z = z + xp.reshape(xp.astype(bias, cdt, copy=False), _bias_shape(int(bias.shape[0]), geo))
    a = activations.apply(xp, z, act)
    return a, _kept(act, a, z)


def conv_forward(call: Call) -> tuple[tuple[Any], Any]:
    """im2col, one grouped matrix product, then bias and activation in the epilogue."""
    xp = call.xp
    x, weight, bias = call.x, call.weight, call.bias
    geo = _Geometry(call)
    cdt = compute_dtype(xp, x)
    xb = xp.astype(_batched(xp, x, call), cdt, copy=False)
    w = _grouped_weight(xp, xp.astype(weight, cdt, copy=False), geo)
    z = _correlate(xp, xb, w, geo, int(weight.shape[0]))
    a, kept = _bias_activation(xp, z, bias, geo, cdt, call.activation)
    y = _unbatched(xp, xp.astype(a, x.dtype, copy=False), call)
    residuals = (x, weight, bias, kept, call.replace(arrays={})) if call.save else None
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


def _grouped_gradient(xp: Any, g: Any, geo: _Geometry, out_channels: int) -> Any:
    """The batched output gradient grouped for the products: channels first ``(N, G, O/G, P)``,
    channels last ``(G, N·P, O/G)``."""
    n, groups = int(g.shape[0]), geo.groups
    og, positions = out_channels // groups, geo.positions()
    if geo.channels_last:
        return xp.permute_dims(xp.reshape(g, (n * positions, groups, og)), (1, 0, 2))
    return xp.reshape(g, (n, groups, og, positions))


def _weight_gradient(xp: Any, gg: Any, xb: Any, geo: _Geometry, weight_shape: tuple[int, ...]) -> Any:
    """dweight: the correlation of the grouped output gradient ``gg`` with the batched input ``xb``."""
    cols = _columns(xp, xb, geo)
    if geo.channels_last:
        # (G, O/G, N·P) @ (G, N·P, C/G·K) -> (G, O/G, C/G·K)
        dw = xp.matmul(xp.matrix_transpose(gg), xp.permute_dims(cols, (1, 0, 2)))
    else:
        # Σ_n (N, G, O/G, P) @ (N, G, P, C/G·K) -> (G, O/G, C/G·K)
        dw = xp.sum(xp.matmul(gg, xp.matrix_transpose(cols)), axis=0)
    return xp.reshape(dw, weight_shape)


def _input_gradient(xp: Any, gg: Any, w: Any, geo: _Geometry, x_shape: tuple[int, ...]) -> Any:
    """dx (batched, ``x_shape``): the transposed convolution of the grouped output gradient ``gg``
    with the grouped weight ``w`` — column gradients, then their scatter."""
    n = int(x_shape[0])
    channels, taps = int(x_shape[geo.channel_axis]), geo.taps()
    if geo.channels_last:
        # (G, N·P, O/G) @ (G, O/G, C/G·K) -> (G, N·P, C/G·K) -> (N, *O, C, K)
        dcols = xp.permute_dims(xp.matmul(gg, w), (1, 0, 2))
        dcols = xp.reshape(dcols, (n, *geo.out_size, channels, taps))
        parts = [(t, dcols[..., j]) for j, t in enumerate(geo.offsets())]
    else:
        # (G, C/G·K, O/G) @ (N, G, O/G, P) -> (N, G, C/G·K, P) -> (N, C, K, *O)
        dcols = xp.reshape(xp.matmul(xp.matrix_transpose(w), gg), (n, channels, taps, *geo.out_size))
        parts = [(t, dcols[:, :, j, ...]) for j, t in enumerate(geo.offsets())]
    return _scatter(xp, parts, geo, x_shape)


def _channel_sums(xp: Any, g: Any, geo: _Geometry) -> Any:
    return xp.sum(g, axis=tuple(a for a in range(geo.ndim) if a != geo.channel_axis))


def _output_gradient(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> tuple:
    """What conv's and conv_transpose's backward both start with: ``g = dy · act'`` (batched, in the
    compute dtype) and, when asked for, dbias ``Σ g``.

    Returns ``(x, weight, call, geometry, compute dtype, g, grads)``, ``grads`` holding the bias's.
    """
    x, weight, bias, kept, call = residuals
    xp = call.xp
    geo = _Geometry(call)
    cdt = compute_dtype(xp, x)
    g = _activation_gradient(xp, cotangents[0], kept, call, cdt)
    grads: dict[str, Any] = {}
    if "bias" in needs:
        grads["bias"] = store(out, "bias", xp.astype(_channel_sums(xp, g, geo), bias.dtype, copy=False))
    return x, weight, call, geo, cdt, g, grads


def conv_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dbias, dweight and dx (the transposed convolution); see the module docstring."""
    x, weight, call, geo, cdt, g, grads = _output_gradient(residuals, cotangents, needs, out)
    xp = call.xp
    if "weight" not in needs and "x" not in needs:
        return grads
    gg = _grouped_gradient(xp, g, geo, int(weight.shape[0]))
    if "weight" in needs:
        xb = xp.astype(_batched(xp, x, call), cdt, copy=False)
        dw = _weight_gradient(xp, gg, xb, geo, tuple(weight.shape))
        grads["weight"] = store(out, "weight", xp.astype(dw, weight.dtype, copy=False))
    if "x" in needs:
        w = _grouped_weight(xp, xp.astype(weight, cdt, copy=False), geo)
        x_shape = (int(g.shape[0]), *x.shape) if not call.batched else tuple(x.shape)
        dx = _input_gradient(xp, gg, w, geo, x_shape)
        grads["x"] = store(out, "x", _unbatched(xp, xp.astype(dx, x.dtype, copy=False), call))
    return grads


# --------------------------------------------------------------------------- transposed convolution
#
# conv_transpose's Call carries the geometry of the convolution it transposes (C): C's input is
# conv_transpose's output y, C's output its input x, and the weight is C's own.  So
#
#     y      = act(Cᵀ x + bias)            C's input gradient at the cotangent x
#     dx     = C g                         g = dy · act'; C's forward (no bias, identity)
#     dw     = C's weight gradient with input g and output gradient x
#     dbias  = Σ g


def conv_transpose_forward(call: Call) -> tuple[tuple[Any], Any]:
    """y = act(Cᵀ x + bias): the column products and scatter of C's input gradient, then the epilogue."""
    xp = call.xp
    x, weight, bias = call.x, call.weight, call.bias
    geo = _Geometry(call)
    cdt = compute_dtype(xp, x)
    xb = xp.astype(_batched(xp, x, call), cdt, copy=False)
    w = _grouped_weight(xp, xp.astype(weight, cdt, copy=False), geo)
    out_channels = geo.groups * int(weight.shape[1])
    z = _input_gradient(xp, _grouped_gradient(xp, xb, geo, int(weight.shape[0])), w, geo,
                        _batched_shape(int(xb.shape[0]), out_channels, geo.in_size, geo))
    a, kept = _bias_activation(xp, z, bias, geo, cdt, call.activation)
    y = _unbatched(xp, xp.astype(a, x.dtype, copy=False), call)
    residuals = (x, weight, bias, kept, call.replace(arrays={})) if call.save else None
    return (y,), residuals


def conv_transpose_backward(residuals: Any, cotangents: tuple[Any], needs: frozenset[str], out: dict) -> dict:
    """dbias = Σ g, dx = C g, dweight = C's weight gradient of (g, x); see above."""
    x, weight, call, geo, cdt, g, grads = _output_gradient(residuals, cotangents, needs, out)
    xp = call.xp
    if "x" in needs:
        w = _grouped_weight(xp, xp.astype(weight, cdt, copy=False), geo)
        dx = _correlate(xp, g, w, geo, int(weight.shape[0]))
        grads["x"] = store(out, "x", _unbatched(xp, xp.astype(dx, x.dtype, copy=False), call))
    if "weight" in needs:
        xb = xp.astype(_batched(xp, x, call), cdt, copy=False)
        dw = _weight_gradient(xp, _grouped_gradient(xp, xb, geo, int(weight.shape[0])), g, geo, tuple(weight.shape))
        grads["weight"] = store(out, "weight", xp.astype(dw, weight.dtype, copy=False))
    return grads
