"""float16/bfloat16 calls of the kernels that compute in float32 throughout: widened on entry, rounded on exit.

Convolution, dense layers, pooling and the losses are compute-bound or run whole float32 passes
(BLAS products, im2col buffers), so their half-precision calls convert rather than read half
data in every loop: the half arrays (NumPy float16, ml_dtypes bfloat16, a torch tensor's
``uint16`` bits) are widened to float32 by :func:`kernels_cpu._half.widen` (a vectorised,
parallel pass: O(data), against the kernels' O(data · channels · taps)), the float32 kernel runs
as for float32 data, and each result is rounded once, to nearest even, to its argument's dtype:
outputs to the data's, gradients to their argument's (float32 parameters of a mixed-precision
call stay float32), as the reference returns them.  float32/float64 calls go straight to the
kernel.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

from . import _half
from ._runtime import into as _into


class Residuals:
    """What a widened forward keeps: the float32 kernel's residuals, the half type, and the
    caller's arrays (their dtypes say what each gradient is rounded to)."""

    __slots__ = ("inner", "kind", "likes", "param_names")

    def __init__(self, inner, kind, likes, param_names=()):
        self.inner = inner
        self.kind = kind
        self.likes = likes
        self.param_names = param_names  # the sequence ops' per layer and direction array names


def _param_like(value, like, h):
    """A float32 gradient in its argument's dtype (rounded once for a half-precision argument)."""
    if value is None or like is None:
        return value
    return _half.like_param(value, like, h).reshape(like.shape)


def _into_params(buffers, value):
    """The sequence ops' ``params`` gradient written into the caller's buffers where given
    (``None`` buffers, and ``None`` gradients of absent biases, are left as they are)."""
    result = []
    for grad, bufs in zip(value, buffers):
        bufs = tuple(bufs or ()) + (None,) * (len(grad) - len(bufs or ()))
        row = []
        for g, buf in zip(grad, bufs):
            if g is not None and buf is not None:
                buf[...] = g
                g = buf
            row.append(g)
        result.append(tuple(row))
    return result


@functools.cache  # (an import_module per call cost ~2 us of a small call)
def _kernel(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _floating(call, floats):
    """The names of the call's floating arrays: ``floats``, or ``floats(call)`` when it decides per call."""
    return floats(call) if callable(floats) else floats


def _widened_call(call, h, floats):
    """The call as the float32 kernel takes it: the floating arrays (``floats``) widened."""
    arrays = {
        name: _half.widen(a, h) if name in floats and a is not None and _half.is_half(a) else a
        for name, a in call.arrays.items()
    }
    params = {**call.params, "mixed_precision": False} if "mixed_precision" in call.params else call.params
    return call.replace(arrays=arrays, params=params, dtype="float32")


def _rounded(value, h, like):
    """A float32 output rounded to the half type (viewed as ``like``'s dtype); others as they are."""
    if isinstance(value, np.ndarray) and value.dtype == np.float32:
        return _half.narrow(value, h, like)
    return value


def make(module: str, forward: str, backward: str, floats: tuple[str, ...] = ("x", "weight", "bias"),
         main: str = "x"):
    """(forward, backward) around the float32 kernels ``module:forward``/``module:backward``.

    ``floats`` names the floating arrays of the op (widened on entry; the gradients of the
    others are returned as the kernel gives them), ``main`` the data array whose dtype outputs
    take.
    """

    def widened_forward(call):
        h = _half.kind(call.dtype)
        if h is None:
            return _kernel(module, forward)(call)
        names = _floating(call, floats)
        outputs, residuals = _kernel(module, forward)(_widened_call(call, h, names))
        like = call.arrays[main]
        outputs = tuple(_rounded(o, h, like) for o in outputs)
        if residuals is not None:
            residuals = Residuals(residuals, h, {k: v for k, v in call.arrays.items() if k in names},
                                  call.params.get("param_names", ()))
        return outputs, residuals

    def widened_backward(residuals, cotangents, needs, out=None):
        if not isinstance(residuals, Residuals):
            return _kernel(module, backward)(residuals, cotangents, needs, out)
        h = residuals.kind
        cts = tuple(_half.widen(c, h) if c is not None and _half.is_half(c) else c for c in cotangents)
        grads = _kernel(module, backward)(residuals.inner, cts, needs, {})
        out = out or {}
        result = {}
        for name, value in grads.items():
            if name == "params":  # the sequence ops: per layer and direction, a tuple in param_names' order
                value = [tuple(_param_like(g, residuals.likes.get(n), h) for g, n in zip(grad, names))
                         for grad, names in zip(value, residuals.param_names)]
                result[name] = value if not out.get(name) else _into_params(out[name], value)
                continue
            result[name] = _into(out, name, _param_like(value, residuals.likes.get(name), h))
        return result

    widened_forward.__name__ = forward
    widened_backward.__name__ = backward
    widened_forward.__doc__ = f"``{module}:{forward}``, float16/bfloat16 calls widened to float32 (module docstring)."
    widened_backward.__doc__ = f"``{module}:{backward}`` for the calls widened by :func:`{forward}`."
    return widened_forward, widened_backward


def _every_array(call):
    """Every array of the call is floating (the recurrences: data, states, weights)."""
    return tuple(call.arrays)


def _loss_arrays(call):
    """cross_entropy: logits and class weights; the target only when it holds probabilities."""
    return ("logits", "weight", "target") if call.params.get("probabilities") else ("logits", "weight")


conv_forward, conv_backward = make("kernels_cpu.conv", "conv_forward", "conv_backward")
conv_transpose_forward, conv_transpose_backward = make("kernels_cpu.conv", "conv_transpose_forward",
                                                       "conv_transpose_backward")
dense_forward, dense_backward = make("kernels_cpu.dense", "dense_forward", "dense_backward")
pool_forward, pool_backward = make("kernels_cpu.pool", "pool_forward", "pool_backward", ("x",))
unpool_forward, unpool_backward = make("kernels_cpu.pool", "unpool_forward", "unpool_backward", ("x",))
log_softmax_forward, log_softmax_backward = make("kernels_cpu.loss", "log_softmax_forward", "log_softmax_backward",
                                                 ("x",))
cross_entropy_forward, cross_entropy_backward = make("kernels_cpu.loss", "cross_entropy_forward",
                                                     "cross_entropy_backward", _loss_arrays, main="logits")
cell_forward, cell_backward = make("kernels_cpu.rnn", "cell_forward", "cell_backward", _every_array)
sequence_forward, sequence_backward = make("kernels_cpu.rnn", "sequence_forward", "sequence_backward",
                                           _every_array)
