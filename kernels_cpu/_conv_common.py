"""What the three convolution paths (im2col in ``conv``, ``_conv_shifted``, ``_conv_direct``) share
around their kernels: the canonical geometry of a call, the outputs a forward allocates and keeps,
the padded input, the cotangent."""

from __future__ import annotations

import math

import numpy as np

from portable_nn.kernel_codes import keeps_output_only

from . import _runtime


class Geometry:
    """A conv call in canonical form: 1-D and 2-D calls padded on the left to three spatial axes
    ``(D, H, W)`` (size 1, kernel 1, stride 1, dilation 1, no padding), an unbatched input a batch
    of one.

    Attributes: ``kernel``, ``stride``, ``dilation``, ``lo``, ``hi`` (padding), ``size`` (input)
    and ``out`` (output), each three ints; ``x_shape``; ``last`` (channels last); ``n``;
    ``channels``; ``o``, ``groups``, ``cg`` (input channels per group), ``og``; ``taps``; the
    zero-padded input's ``padded_shape`` and the ``interior`` slice where x sits in it,
    ``padded`` (whether any padding is there); ``out_shape`` (the output as the caller gets it);
    ``macs``.
    """

    def __init__(self, call, weight_shape):
        d = len(call.kernel)
        one, zero = (1,) * (3 - d), (0,) * (3 - d)
        self.kernel = one + tuple(call.kernel)
        self.stride = one + tuple(call.stride)
        self.dilation = one + tuple(call.dilation)
        self.lo, self.hi = zero + tuple(call.pad_lo), zero + tuple(call.pad_hi)
        self.size, self.out = one + tuple(call.in_size), one + tuple(call.out_size)
        self.x_shape = x_shape = tuple(int(s) for s in call.x.shape)
        self.last = last = call.layout == "channels_last"
        self.n = n = x_shape[0] if call.batched else 1
        self.channels = channels = x_shape[-1] if last else x_shape[1 if call.batched else 0]
        self.o = o = int(weight_shape[0])
        self.groups = int(call.groups)
        self.cg = cg = int(weight_shape[1])
        self.og = o // self.groups
        self.taps = math.prod(self.kernel)
        padded = tuple(s + a + b for s, a, b in zip(self.size, self.lo, self.hi))
        self.padded = any(self.lo) or any(self.hi)
        self.padded_shape = (n, *padded, channels) if last else (n, channels, *padded)
        inner = tuple(slice(a, a + s) for a, s in zip(self.lo, self.size))
        self.interior = (slice(None), *inner, slice(None)) if last else (slice(None), slice(None), *inner)
        spatial = tuple(call.out_size)
        shape = (*spatial, o) if last else (o, *spatial)
        self.out_shape = (n, *shape) if call.batched else shape
        self.macs = n * math.prod(self.out) * o * cg * self.taps

    def tap_reach(self):
        """(K, 3): how far each tap (row-major over the kernel, the weight's order) reaches along
        (D, H, W) of the padded input: tap index times dilation."""
        grid = np.stack(np.meshgrid(*(np.arange(k) for k in self.kernel), indexing="ij"), -1).reshape(-1, 3)
        return grid * np.array(self.dilation)


class Outputs:
    """A forward's output ``y`` and, when the backward needs the pre-activation, ``z``.

    ``y`` and ``z`` come from the runtime's pool (no page faults per call); ``z`` is ``y`` itself
    when nothing keeps it.  :meth:`kept` is what the backward reads act' from: nothing for the
    identity, ``y`` when act' is a function of the output (relu, sigmoid, tanh, leaky_relu with
    a positive slope), else ``z``.
    """

    __slots__ = ("activation", "from_output", "keep_z", "y", "z")

    def __init__(self, call, shape, dtype):
        self.activation = call.activation
        self.from_output = keeps_output_only(self.activation)
        self.keep_z = bool(call.save) and not self.from_output
        self.y = _runtime.empty(shape, dtype)
        self.z = _runtime.empty(shape, dtype) if self.keep_z else self.y

    def kept(self):
        if self.activation.is_identity:
            return None
        return self.y if self.from_output else self.z


def padded_input(x, plan):
    """x zero-padded to ``plan.padded_shape`` (x itself, reshaped, when ``plan.padded`` is false);
    ``plan.interior`` is where x sits in it."""
    if not plan.padded:
        return x.reshape(plan.padded_shape)
    xp = np.zeros(plan.padded_shape, x.dtype)
    xp[plan.interior] = x.reshape(xp[plan.interior].shape)
    return xp


def cotangent(cotangents, dtype, shape):
    """The output's cotangent as a C-contiguous, writable array of ``shape`` (the kernels serve every
    pass with one compiled function, typed for writable arrays: a read-only cotangent is copied)."""
    dy = np.ascontiguousarray(cotangents[0], dtype=dtype).reshape(shape)
    return dy if dy.flags.writeable else dy.copy()
