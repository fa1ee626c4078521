"""Activations for Numba kernels, selected by a runtime code: per element and per row.

Codes are the names of :mod:`portable_nn.kernel_codes` (identity 0,
relu 1, sigmoid 2, tanh 3, gelu 4, gelu_tanh 5, silu 6, leaky_relu 7, hardswish 8,
hardsigmoid 9, relu6 10, mish 11, elu 12), so one compiled kernel serves every activation;
``slope`` is the one parameter (leaky_relu's slope, elu's alpha).

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

from portable_nn.kernel_codes import (
    ELU,
    GELU,
    GELU_TANH,
    HARDSIGMOID,
    HARDSWISH,
    IDENTITY,
    LEAKY_RELU,
    MISH,
    RELU,
    RELU6,
    SIGMOID,
    SILU,
    TANH,
)

from . import _vmath as vm

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715
# mish: from z = 40 on, tanh(softplus(z)) = 1 and z · (1 − tanh²) < 1e-32; clipping there keeps e^(2z) finite
# (see portable_nn/reference/activations.py, the same formulas).
_MISH_CLIP = 40.0


@njit(inline="always", error_model="numpy", cache=True)
def _clip06(v, zero, six):
    """min(max(v, 0), 6) with NaN kept (the constants in v's type, so float32 stays float32)."""
    v = zero if v < zero else v
    return six if v > six else v


@njit(inline="always", error_model="numpy", cache=True)
def _tanh_softplus(z, clip, zero, one, two, four):
    """(tanh(softplus(z)), 1 − tanh²(softplus(z))) from n = e^z: with u = n(n + 2), u / (u + 2) and
    4(u + 1) / (u + 2)², no difference formed; the second is 0 from the clip on."""
    below = z < clip
    n = vm.exp(z if below else clip)
    u = n * (n + two)
    d = u + two
    return u / d, four * (u + one) / (d * d) if below else zero


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
    if code == HARDSWISH:
        return z * _clip06(z + 3.0, 0.0, 6.0) / 6.0
    if code == HARDSIGMOID:
        return _clip06(z + 3.0, 0.0, 6.0) / 6.0
    if code == RELU6:
        return _clip06(z, 0.0, 6.0)
    if code == MISH:
        return z * _tanh_softplus(z, _MISH_CLIP, 0.0, 1.0, 2.0, 4.0)[0]
    if code == ELU:
        return slope * math.expm1(z) if z <= 0.0 else z
    return z if z > 0.0 else slope * z


@njit(error_model="numpy", cache=True)
def act_grad(z, code, slope):
    """act'(z), with PyTorch's values at kinks (relu'(0) = 0, leaky_relu'(0) = slope, the others as
    :data:`portable_nn.ACTIVATIONS` lists them; where no comparison holds, NaN, the gradient passes
    as PyTorch's backward lets it)."""
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
    if code == HARDSWISH:
        return 0.0 if z <= -3.0 else (z / 3.0 + 0.5 if z < 3.0 else 1.0)
    if code == HARDSIGMOID:
        return 1.0 / 6.0 if -3.0 < z < 3.0 else 0.0
    if code == RELU6:
        return 0.0 if z <= 0.0 or z >= 6.0 else 1.0
    if code == MISH:
        t, dt = _tanh_softplus(z, _MISH_CLIP, 0.0, 1.0, 2.0, 4.0)
        return t + z * sigmoid(z) * dt
    if code == ELU:
        return slope * math.exp(z) if z <= 0.0 else 1.0
    return 1.0 if z > 0.0 else slope


_KIND_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}

# --------------------------------------------------------------------------- activation kinds of loop nests
#
# A loop calling act(v, code, slope) with a runtime code is neither unswitched nor vectorised
# by LLVM: relu then branches on the data's sign and mispredicts half the time (35x slower
# measured).  So the loop nests take a *kind*, passed as a literal by the entry points: 0
# identity, 1 rectifier (relu, or leaky_relu: max-like selects once the literal is folded; relu
# is the slope-0 case), 2 any other activation.  A forward applies kind 2 in the row functions
# below (act_row on the written row, or a pass of its own), never per element, so apply_kind
# takes 0 and 1 only; a gradient loop of kind 2 (conv's, for leaky_relu with a negative slope)
# goes through one called (not inlined) function, compiled once rather than into each loop nest.


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
    """act(v) for a loop of kind 0 (identity) or 1 (a rectifier, with its slope): see above."""
    if kind == 0:
        return v
    return v if v > 0.0 else slope * v + 0.0  # + 0.0: relu gives +0.0, as PyTorch does, not -0.0


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
    elif code == HARDSWISH or code == HARDSIGMOID or code == RELU6:
        _hard_row(y, code)
    elif code == MISH:
        clip, zero, one, two, four = f(_MISH_CLIP), f(0.0), f(1.0), f(2.0), f(4.0)
        for i in range(n):
            z = y[i]
            y[i] = z * _tanh_softplus(z, clip, zero, one, two, four)[0]
    elif code == ELU:
        _elu_row(y, f(slope))


@njit(**_ROW)
def _elu_row(y, alpha):
    """elu in place.  e^z − 1 for z ≤ 0 as 2t / (1 − t), t = tanh(z/2): 1 − t ∈ [1, 2], so no
    cancellation near 0, where e^z − 1 loses its digits.  (A function of its own: inlined into
    act_row, its tanh met Numba's SSA check, which warned at compile time.)"""
    f = y.dtype.type
    zero, half, one, two = f(0.0), f(0.5), f(1.0), f(2.0)
    for i in range(y.shape[0]):
        z = y[i]
        h = zero if z > zero else z
        t = vm.tanh(h * half)
        y[i] = z if z > zero else alpha * (two * t / (one - t))


@njit(inline="always", **_ROW)
def _hard_row(y, code):
    """hardswish, hardsigmoid or relu6 in place: PyTorch's formulas (z · clip(z + 3, 0, 6) / 6 ...)."""
    f = y.dtype.type
    zero, three, six = f(0.0), f(3.0), f(6.0)
    n = y.shape[0]
    if code == RELU6:
        for i in range(n):
            y[i] = _clip06(y[i], zero, six)
    elif code == HARDSIGMOID:
        for i in range(n):
            y[i] = _clip06(y[i] + three, zero, six) / six
    else:
        for i in range(n):
            z = y[i]
            y[i] = z * _clip06(z + three, zero, six) / six


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
    elif code == HARDSWISH or code == HARDSIGMOID or code == RELU6:
        _hard_grad_row(z, g, code)
    elif code == MISH:
        clip, zero, two, four = f(_MISH_CLIP), f(0.0), f(2.0), f(4.0)
        for i in range(n):
            v = z[i]
            t, dt = _tanh_softplus(v, clip, zero, one, two, four)
            g[i] *= t + v * _sigmoid_parts(v, one)[0] * dt
    elif code == ELU:
        alpha, zero = f(slope), f(0.0)
        for i in range(n):
            v = z[i]
            e = alpha * vm.exp(zero if v > zero else v)  # (the select on its own line: one select in
            g[i] *= e if v <= zero else one  # the expression kept the loop scalar, 24 vs 2 ms per 4M)


@njit(inline="always", **_ROW)
def _hard_grad_row(z, g, code):
    """g ← g · act'(z) for hardswish, hardsigmoid or relu6, PyTorch's pieces (NaN passes the gradient
    where PyTorch's does: hardswish, relu6)."""
    f = g.dtype.type
    zero, one, three, six = f(0.0), f(1.0), f(3.0), f(6.0)
    n = g.shape[0]
    if code == RELU6:
        for i in range(n):
            v = z[i]
            w = zero if v <= zero else one
            g[i] *= zero if v >= six else w
    elif code == HARDSIGMOID:
        sixth = f(1.0 / 6.0)
        for i in range(n):
            v = z[i]
            w = sixth if v > -three else zero
            g[i] *= w if v < three else zero
    else:
        half = f(0.5)
        for i in range(n):
            v = z[i]
            w = v / three + half if v < three else one
            g[i] *= zero if v <= -three else w


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
