"""Activations for Numba kernels, selected by a runtime code: per element and per row.

Codes are the names of :mod:`portable_nn.kernel_codes` (identity 0,
relu 1, sigmoid 2, tanh 3, gelu 4, gelu_tanh 5, silu 6, leaky_relu 7), so one
compiled kernel serves every activation.

Two forms:

* per element, :func:`act` / :func:`act_grad` (float64, libm): scalar code for the loops that
  are not hot enough to matter;
* per contiguous row, :func:`act_row` (y ← act(y) in place), :func:`act_grad_row`
  (g ← g · act'(z)) and :func:`act_grad_from_output_row` (g ← g · act'(from y)): the runtime
  ``code`` is branched on once, outside the loops, and each activation has its own loop of
  :mod:`._vmath`'s branch-free functions, which LLVM vectorises (8 float32 lanes per AVX2
  vector).  Kernels write the pre-activation z into a row (their output row, or a
  :func:`stack_row` block of :data:`ROW_BLOCK` elements) and call these.  A batch_norm + silu
  forward, (128, 64, 32, 32) float32, 2 threads, AMD Zen 3: 88 ms per element with libm, the
  identity's 6.9 ms plus ~2 ms per row.  float32 rows are computed in float32 (within a few ulp
  of the float64 libm value rounded once), float64 rows in float64.
"""

from __future__ import annotations

import math

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from portable_nn.kernel_codes import GELU, GELU_TANH, IDENTITY, LEAKY_RELU, RELU, SIGMOID, SILU, TANH

from . import _vmath as vm

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


@njit(inline="always", error_model="numpy", cache=True)
def sigmoid(z):
    if z >= 0.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


# ``act`` and ``act_grad`` are compiled once and called, not inlined at the Numba level: the norm
# kernels reach them from five loops (row and segment sums, parameters, dx), and inlining the eight
# branches at each made the first compilation twice as long (the README's layer_norm forward and
# gradient, empty cache: 16.3 s inlined, 7.7 s called; the loops of the common identity and
# rectifier cases do not call them, so their speed is unchanged: (4096, 1024) float32 backward
# 1.6 ms either way; gelu, the case that calls them, 100 ms either way).
@njit(error_model="numpy", cache=True)
def act(z, code, slope):
    """act(z) for the activation ``code``."""
    if code == IDENTITY:
        return z
    if code == RELU:
        return z if not (z <= 0.0) else 0.0  # +0.0 like PyTorch; NaN propagates
    if code == SIGMOID:
        return sigmoid(z)
    if code == TANH:
        return math.tanh(z)
    if code == GELU:
        return 0.5 * z * (1.0 + math.erf(z * _INV_SQRT_2))
    if code == GELU_TANH:
        return 0.5 * z * (1.0 + math.tanh(_K * (z + _C * z * z * z)))
    if code == SILU:
        return z * sigmoid(z)
    return z if z > 0.0 else slope * z


@njit(error_model="numpy", cache=True)
def act_grad(z, code, slope):
    """act'(z), with PyTorch's values at kinks (relu'(0) = 0, leaky_relu'(0) = slope)."""
    if code == IDENTITY:
        return 1.0
    if code == RELU:
        return 1.0 if z > 0.0 else 0.0
    if code == SIGMOID:
        s = sigmoid(z)
        return s * (1.0 - s)
    if code == TANH:
        t = math.tanh(z)
        return 1.0 - t * t
    if code == GELU:
        return 0.5 * (1.0 + math.erf(z * _INV_SQRT_2)) + z * _INV_SQRT_2PI * math.exp(-0.5 * z * z)
    if code == GELU_TANH:
        t = math.tanh(_K * (z + _C * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * z * z)
    if code == SILU:
        s = sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    return 1.0 if z > 0.0 else slope


_KIND_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}

# --------------------------------------------------------------------------- activation kinds of loop nests
#
# A loop calling act(v, code, slope) with a runtime code is neither unswitched nor vectorised
# by LLVM: relu then branches on the data's sign and mispredicts half the time (35x slower
# measured).  So the loop nests take a *kind*, passed as a literal by the entry points: 0
# identity, 1 rectifier (relu, or leaky_relu: max-like selects once the literal is folded; relu
# is the slope-0 case), 2 any other activation, whose libm calls dominate anyway and which goes
# through one called (not inlined) function, so that every activation's code is compiled once
# rather than into each loop nest.  Three copies of each loop nest, not one per activation,
# keeps the compile time down.


@njit(**_KIND_OPTS)
def _act_any(v, code, slope):
    return act(v, code, slope)


@njit(**_KIND_OPTS)
def _dact_any(v, code, slope, from_output):
    """act' at an element, from the output y (``from_output``) or from the pre-activation z."""
    if code == IDENTITY:
        return 1.0
    if from_output:
        if code == RELU:
            return 1.0 if v > 0.0 else 0.0
        if code == SIGMOID:
            return v * (1.0 - v)
        if code == TANH:
            return 1.0 - v * v
        return 1.0 if v > 0.0 else slope
    return act_grad(v, code, slope)


@njit(inline="always", **_KIND_OPTS)
def apply_kind(v, kind, code, slope):
    """act(v) for a loop of the given kind (see above); kind 1 takes the rectifier's slope."""
    if kind == 0:
        return v
    if kind == 1:
        return v if v > 0.0 else slope * v + 0.0  # + 0.0: relu gives +0.0, as PyTorch does, not -0.0
    return _act_any(v, code, slope)


@njit(inline="always", **_KIND_OPTS)
def deriv_kind(v, kind, code, slope, from_output):
    """act'(v) for a loop of the given kind; kind 1 reads it from the output y."""
    if kind == 0:
        return 1.0
    if kind == 1:
        return 1.0 if v > 0.0 else slope
    return _dact_any(v, code, slope, from_output)


@njit(inline="always", **_KIND_OPTS)
def is_rectifier(code):
    """relu (code 1) or leaky_relu (7): the activations whose loops get a branch-free select form."""
    return code == RELU or code == LEAKY_RELU


@njit(inline="always", **_KIND_OPTS)
def rectifier_slope(code, slope):
    """The negative-side slope of relu (0) or leaky_relu."""
    return 0.0 if code == RELU else slope


# --------------------------------------------------------------------------- rows
#
# One vector loop per activation, the runtime code branched on outside them.  The row functions
# are compiled once per dtype and *called* from the kernels' loop nests (norms: five of them,
# dense and conv epilogues: one per layout), not inlined at Numba's IR level, for the compile-time
# reason given at act() above.  A call per row (or per ROW_BLOCK) costs nothing measurable.

_ROW = {"cache": True, "error_model": "numpy", "nogil": True, "fastmath": {"contract"}}

#: Elements of a :func:`stack_row` block (a kernel takes rows in blocks of this many).
ROW_BLOCK = 256

_GELU_TANH_A = 2.0 * _K  # gelu_tanh(z) = z·σ(v), v = 2·tanh's argument = z·(A + B·z²)
_GELU_TANH_B = 2.0 * _K * _C


@intrinsic
def stack_row(typingctx, like):
    """A C-contiguous row of :data:`ROW_BLOCK` elements of ``like``'s type, on the stack.

    Scratch for the pre-activations and gradients of a block: no allocation (a heap scratch row per
    call would cost ~0.1 us each, a thousand times per call), and LLVM knows it aliases nothing, so
    the loops filling it need no runtime alias checks.  Valid until the calling function returns:
    never return it or keep it.
    """
    if like not in (types.float32, types.float64):
        return None
    arrty = types.Array(like, 1, "C")

    def codegen(context, builder, sig, args):
        lty = context.get_data_type(like)
        ptr = cgutils.alloca_once(builder, lty, size=ROW_BLOCK)  # in the entry block: once per call
        ptr.align = 32
        itemsize = context.get_abi_sizeof(lty)
        intp = context.get_value_type(types.intp)
        ary = context.make_array(arrty)(context, builder)
        context.populate_array(ary, data=ptr, shape=[ir.Constant(intp, ROW_BLOCK)],
                               strides=[ir.Constant(intp, itemsize)], itemsize=ir.Constant(intp, itemsize),
                               meminfo=None)
        return ary._getvalue()

    return arrty(like), codegen


@njit(inline="always", **_ROW)
def _sigmoid_parts(v, one):
    """(σ(v), σ'(v) = σ(v)·σ(−v)) from e = e^(−|v|) ∈ [0, 1]: neither 1 − σ (cancellation for large
    v) nor e^(−v) (∞ for v → −∞, then ∞·0) is formed."""
    e = vm.exp(-abs(v))
    sa = one / (one + e)  # σ(|v|)
    s = sa if v >= 0 else e * sa  # NaN: e·sa is NaN
    return s, e * sa * sa


@njit(**_ROW)
def act_row(y, code, slope):
    """y ← act(y) in place along a contiguous row, in its dtype."""
    f = y.dtype.type
    n = y.shape[0]
    if code == SIGMOID:
        for i in range(n):
            y[i] = vm.sigmoid(y[i])
    elif code == TANH:
        for i in range(n):
            y[i] = vm.tanh(y[i])
    elif code == GELU:
        for i in range(n):
            z = y[i]
            y[i] = z * vm.ndtr(z)
    elif code == GELU_TANH:
        # ½z(1 + tanh u) = z·σ(2u): no cancellation of 1 + tanh u for z < 0
        a, b = f(_GELU_TANH_A), f(_GELU_TANH_B)
        for i in range(n):
            z = y[i]
            y[i] = z * vm.sigmoid(z * (a + b * z * z))
    elif code == SILU:
        for i in range(n):
            z = y[i]
            y[i] = z * vm.sigmoid(z)
    elif code == RELU or code == LEAKY_RELU:
        neg = f(rectifier_slope(code, slope))
        zero = f(0.0)
        for i in range(n):
            v = y[i]
            y[i] = v if v > zero else neg * v + zero  # + 0: relu gives +0.0, as PyTorch does


@njit(**_ROW)
def act_grad_row(z, g, code, slope):
    """g ← g · act'(z) along contiguous rows (z the pre-activation), in their dtype; PyTorch's
    values at kinks (relu'(0) = 0, leaky_relu'(0) = slope)."""
    f = g.dtype.type
    one = f(1.0)
    n = g.shape[0]
    if code == SIGMOID:
        for i in range(n):
            g[i] *= _sigmoid_parts(z[i], one)[1]
    elif code == TANH:
        two = f(2.0)
        for i in range(n):
            e = vm.exp(-two * abs(z[i]))  # 1 − tanh² = 4e/(1 + e)², e = e^(−2|z|): no cancellation
            w = two / (one + e)
            g[i] *= e * w * w
    elif code == GELU:
        c = f(_INV_SQRT_2PI)
        for i in range(n):
            v = z[i]
            cdf, density = vm.ndtr_and_density(v)
            g[i] *= cdf + v * (c * density)
    elif code == GELU_TANH:
        a, b, b3 = f(_GELU_TANH_A), f(_GELU_TANH_B), f(3.0 * _GELU_TANH_B)
        for i in range(n):
            v = z[i]
            v2 = v * v
            s, ds = _sigmoid_parts(v * (a + b * v2), one)
            g[i] *= s + v * ds * (a + b3 * v2)
    elif code == SILU:
        for i in range(n):
            v = z[i]
            s, ds = _sigmoid_parts(v, one)
            g[i] *= s + v * ds
    elif code == RELU or code == LEAKY_RELU:
        neg = f(rectifier_slope(code, slope))
        zero = f(0.0)
        for i in range(n):
            g[i] *= one if z[i] > zero else neg


@njit(**_ROW)
def act_grad_from_output_row(y, g, code, slope):
    """g ← g · act'(z) read from the output y = act(z) (identity, rectifiers, sigmoid, tanh)."""
    f = g.dtype.type
    one = f(1.0)
    n = g.shape[0]
    if code == SIGMOID:
        for i in range(n):
            v = y[i]
            g[i] *= v * (one - v)
    elif code == TANH:
        for i in range(n):
            v = y[i]
            g[i] *= one - v * v
    elif code == RELU or code == LEAKY_RELU:
        neg = f(rectifier_slope(code, slope))
        zero = f(0.0)
        for i in range(n):
            g[i] *= one if y[i] > zero else neg
