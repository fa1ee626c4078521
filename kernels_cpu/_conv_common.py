"""What the three convolution paths (im2col in ``conv``, ``_conv_shifted``, ``_conv_direct``) share
around their kernels: the outputs a forward allocates and keeps, the padded input, the cotangent."""

from __future__ import annotations

import numpy as np

from portable_nn.reference.activations import keeps_output_only

from . import _runtime


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
