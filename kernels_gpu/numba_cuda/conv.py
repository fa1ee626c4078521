"""Numba-CUDA ``conv``: im2col/col2im kernels, array-module GEMMs and the dense epilogue (backend ``"numba_cuda"``).

Every call (1-D to 3-D, channels first or last, batched or not, any stride/padding/dilation/
groups) is a 3-D convolution of N (1 unbatched) images with C channels in G groups of Cg = C/G;
1-D and 2-D have leading spatial axes of size 1.  With P output positions per image, Kt kernel
taps and J = Cg·Kt:

* :func:`_im2col` writes ``cols[g, n·P + p, cg·Kt + t]`` (compute type; zero where tap t of
  output p falls in the padding) — rows of one group are output positions, columns follow
  ``weight``'s (Cg, *kernel) order, so with W = weight as (G, O/G, J) each group is one GEMM:
  z[g] = cols[g] · W[g]ᵀ, (G, N·P, O/G), by the array module's batched ``matmul``;
* z is laid out like the output (one array-module transpose: (N, O, P) channels first,
  (N·P, O) channels last) and the fused bias + activation epilogue of ``dense`` writes y;
* backward: g = dy · act' with the deterministic two-pass bias-gradient column sums
  (``dense.activation_grad`` on the output's (rows, channels, inner) view), g regrouped to
  (G, N·P, O/G), dW[g] = g[g]ᵀ · cols[g] (cols rebuilt from x), dcols = g · W, and
  :func:`_col2im` gathers dx: one thread per input element visits, per axis, the taps t whose
  output ``(i + pad − t·dilation) / stride`` is a whole in-range index, in a fixed order (no
  atomics).

``conv_transpose`` runs the same pieces for the convolution C it transposes (its call carries
C's geometry: C's input is conv_transpose's output y, C's weight is ``weight`` as given): y =
act(col2im(x · W) + b) — C's input gradient at the cotangent x, then the epilogue on y's layout —
and, with g = dy · act' (and dbias) from the same gradient kernel, dx = im2col(g) · Wᵀ (C's
forward, no bias or activation) and dW = xᵀ · im2col(g) (C's weight gradient, output gradient x).

Supported (declared in ``__init__.py``): float16/bfloat16 (float32 GEMMs, float32 params
allowed), float32, float64; channels first and last; everything the api accepts.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from . import _runtime as rt
from ._runtime import cast_as, device, kernel, load, store
from .dense import KEEP_NONE, KEEP_OUTPUT, activation_grad, epilogue, keep_mode

#: Geometry tuple: in (3), out (3), kernel (3), stride (3), pad_lo (3), dilation (3), N, C, G, last.
_G = "UniTuple(int64, 22)"
_IM2COL = f"void({{x}}[::1], {{c}}[::1], {_G})"
_COL2IM = f"void({{c}}[::1], {{x}}[::1], {_G})"


@device
def tap_output(z, t, n_out, s, p, dl):
    """The output index along one axis that tap ``t`` connects to input ``z``, or −1.

    With stride ``s``, padding ``p`` and dilation ``dl`` (``n_out`` outputs); pooling windows
    use it too (``pool.py``).
    """
    num = z + p - t * dl
    if num < 0 or num % s != 0:
        return -1
    o = num // s
    return o if o < n_out else -1


@kernel(_IM2COL)
def _im2col(x, cols, g):
    """cols[grp, n·P + p, cg·Kt + t] = x at tap t of output p (0 in the padding)."""
    C = g[19]
    G = g[20]
    Cg = C // G
    kt = g[6] * g[7] * g[8]
    J = Cg * kt
    P = g[3] * g[4] * g[5]
    L = g[0] * g[1] * g[2]
    NP = g[18] * P
    total = G * NP * J
    zero = cast_as(cols[0], 0.0)
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < total:
        j = i % J
        r = (i // J) % NP
        grp = i // (J * NP)
        cg = j // kt
        t = j - cg * kt
        n = r // P
        p = r - n * P
        ow = p % g[5]
        oh = (p // g[5]) % g[4]
        od = p // (g[5] * g[4])
        te = t % g[8]
        tc = (t // g[8]) % g[7]
        ta = t // (g[8] * g[7])
        zd = od * g[9] - g[12] + ta * g[15]
        zh = oh * g[10] - g[13] + tc * g[16]
        zw = ow * g[11] - g[14] + te * g[17]
        v = zero
        if 0 <= zd < g[0] and 0 <= zh < g[1] and 0 <= zw < g[2]:
            c = grp * Cg + cg
            pos = (zd * g[1] + zh) * g[2] + zw
            src = (n * L + pos) * C + c if g[21] else (n * C + c) * L + pos
            v = cast_as(zero, load(x, src))
        cols[i] = v
        i += stride


@kernel(_COL2IM)
def _col2im(dcols, dx, g):
    """dx at each input element = Σ of dcols over the (output, tap) pairs that read it."""
    C = g[19]
    G = g[20]
    Cg = C // G
    kt = g[6] * g[7] * g[8]
    J = Cg * kt
    P = g[3] * g[4] * g[5]
    L = g[0] * g[1] * g[2]
    NP = g[18] * P
    total = g[18] * C * L
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < total:
        if g[21]:
            c = i % C
            pos = (i // C) % L
            n = i // (C * L)
        else:
            pos = i % L
            c = (i // L) % C
            n = i // (C * L)
        zw = pos % g[2]
        zh = (pos // g[2]) % g[1]
        zd = pos // (g[2] * g[1])
        grp = c // Cg
        cg = c - grp * Cg
        row0 = grp * NP + n * P
        acc = 0.0
        for ta in range(g[6]):
            od = tap_output(zd, ta, g[3], g[9], g[12], g[15])
            if od < 0:
                continue
            for tc in range(g[7]):
                oh = tap_output(zh, tc, g[4], g[10], g[13], g[16])
                if oh < 0:
                    continue
                for te in range(g[8]):
                    ow = tap_output(zw, te, g[5], g[11], g[14], g[17])
                    if ow < 0:
                        continue
                    p = (od * g[4] + oh) * g[5] + ow
                    t = (ta * g[7] + tc) * g[8] + te
                    acc += np.float64(dcols[(row0 + p) * J + cg * kt + t])
        store(dx, i, cast_as(dcols[0], acc))
        i += stride


# --------------------------------------------------------------------------- host side


class _Plan:
    """The call's geometry as sizes and the kernels' 22-int tuple."""

    def __init__(self, call, x_shape, w_shape):
        d = len(call.kernel)
        lead = 3 - d

        def three(values, fill):
            return (fill,) * lead + tuple(int(v) for v in values)

        self.last = call.layout == "channels_last"
        self.batched = bool(call.batched)
        self.n = int(x_shape[0]) if self.batched else 1
        self.c = int(x_shape[call.channel_axis])
        self.o = int(w_shape[0])
        self.groups = int(call.groups)
        self.kt = rt.prod(tuple(call.kernel))
        self.j = (self.c // self.groups) * self.kt
        self.p = rt.prod(tuple(call.out_size))
        self.geo = (*three(call.in_size, 1), *three(call.out_size, 1), *three(call.kernel, 1),
                    *three(call.stride, 1), *three(call.pad_lo, 0), *three(call.dilation, 1),
                    self.n, self.c, self.groups, int(self.last))
        out = list(int(s) for s in x_shape)
        for a, s in zip(call.spatial_axes, call.out_size):
            out[a] = int(s)
        out[call.channel_axis] = self.o
        self.out_shape = tuple(out)

    def view(self) -> tuple[int, int, int]:
        """(rows, channels, inner) of the output for the epilogue and the bias gradient."""
        return (self.n * self.p, self.o, 1) if self.last else (self.n, self.o, self.p)

    def grouped(self, a):
        """An output-layout array regrouped as (G, N·P, O/G) (an array-module copy)."""
        xp = rt.array_module(a)
        og = self.o // self.groups
        if self.last:
            t = a.reshape(self.n * self.p, self.groups, og).transpose(1, 0, 2)
        else:
            t = a.reshape(self.n, self.groups, og, self.p).transpose(1, 0, 3, 2)
        return xp.ascontiguousarray(t).reshape(self.groups, self.n * self.p, og)

    def ungrouped(self, zg):
        """(G, N·P, O/G) back to the output layout: (N, O, P) or (N·P, O)."""
        xp = rt.array_module(zg)
        og = self.o // self.groups
        if self.last:
            return xp.ascontiguousarray(zg.transpose(1, 0, 2)).reshape(self.n * self.p, self.o)
        t = zg.reshape(self.groups, self.n, self.p, og).transpose(1, 0, 3, 2)
        return xp.ascontiguousarray(t).reshape(self.n, self.o, self.p)


def _cols(plan, x, cdt):
    xp = rt.array_module(x)
    cols = xp.empty((plan.groups, plan.n * plan.p, plan.j), dtype=cdt)
    n, block = int(cols.size), rt.settings().block
    rt.launch(_im2col, rt.blocks_for(n, block), block, x.reshape(-1), cols.reshape(-1), plan.geo)
    return cols


def _scatter(plan, dcols, dx):
    """col2im: ``dx`` (C's input, any float dtype) at each element = Σ of the (G, N·P, J) column
    gradients ``dcols`` that read it."""
    xp = rt.array_module(dcols)
    n, block = int(dx.size), rt.settings().block
    rt.launch(_col2im, rt.blocks_for(n, block), block, xp.ascontiguousarray(dcols).reshape(-1), dx.reshape(-1),
              plan.geo)
    return dx


def _weight_groups(plan, weight, cdt):
    return rt.cast(weight, cdt).reshape(plan.groups, plan.o // plan.groups, plan.j)


def conv_forward(call):
    """y = act(conv(x, W) + b): im2col, one batched GEMM over the groups, the fused epilogue."""
    x, weight, bias = call.x, call.weight, call.bias
    xp = rt.array_module(x)
    name = rt.dtype_name(x)
    cdt = rt.compute_dtype(name)
    plan = _Plan(call, tuple(x.shape), tuple(weight.shape))
    cols = _cols(plan, x, cdt)
    zg = xp.matmul(cols, _weight_groups(plan, weight, cdt).transpose(0, 2, 1))
    z = plan.ungrouped(zg)
    _, channels, inner = plan.view()
    act_ = call.activation
    y = epilogue(z, bias, x.dtype, channels, inner, act_).reshape(plan.out_shape)
    residuals = None
    if call.save:
        mode = keep_mode(act_, name)
        kept = None if mode == KEEP_NONE else (y if mode == KEEP_OUTPUT else z)
        residuals = (x, weight, None if bias is None else bias.dtype, kept, mode, act_, plan)
    return (y,), residuals


def conv_backward(residuals, cotangents, needs, out=None):
    """g = dy · act' (+ dbias, two passes), dW = gᵀ · cols per group, dx = col2im(g · W)."""
    x, weight, bias_dtype, kept, mode, act_, plan = residuals
    xp = rt.array_module(x)
    cdt = rt.compute_dtype(rt.dtype_name(x))
    rows, channels, inner = plan.view()
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], x.dtype)).reshape(-1)
    g, dbias = activation_grad(dy, kept, mode, act_, rows, channels, inner, cdt,
                               bias_dtype if "bias" in needs else None)
    gg = plan.grouped(g)
    grads = {}
    out = out or {}
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", dbias)
    if "weight" in needs:
        dw = xp.matmul(gg.transpose(0, 2, 1), _cols(plan, x, cdt))
        dw = rt.cast(xp.ascontiguousarray(dw), weight.dtype).reshape(weight.shape)
        grads["weight"] = rt.into(out, "weight", dw)
    if "x" in needs:
        dcols = xp.matmul(gg, _weight_groups(plan, weight, cdt))
        grads["x"] = rt.into(out, "x", _scatter(plan, dcols, xp.empty(x.shape, dtype=x.dtype)))
    return grads


# --------------------------------------------------------------------------- transposed convolution


def _transposed_shape(call, x_shape, w_shape):
    """conv_transpose's output shape (C's input: ``O = G · weight.shape[1]`` channels over
    ``call.in_size``) in x's layout, batched iff x is."""
    o, spatial = int(call.groups) * int(w_shape[1]), tuple(int(v) for v in call.in_size)
    shape = (*spatial, o) if call.layout == "channels_last" else (o, *spatial)
    return (int(x_shape[0]), *shape) if call.batched else shape


def _input_view(plan):
    """(rows, channels, inner) of C's input (conv_transpose's output) for the epilogue and the bias
    gradient: (N, C, L) channels first, (N·L, C, 1) channels last, L = C's input positions."""
    positions = plan.geo[0] * plan.geo[1] * plan.geo[2]
    return (plan.n * positions, plan.c, 1) if plan.last else (plan.n, plan.c, positions)


def conv_transpose_forward(call):
    """y = act(col2im(x · W) + b): one batched GEMM over the groups (C's column gradients at the
    cotangent x), the col2im gather in the compute type, then the fused epilogue."""
    x, weight, bias = call.x, call.weight, call.bias
    xp = rt.array_module(x)
    name = rt.dtype_name(x)
    cdt = rt.compute_dtype(name)
    y_shape = _transposed_shape(call, tuple(x.shape), tuple(weight.shape))
    plan = _Plan(call, y_shape, tuple(weight.shape))
    dcols = xp.matmul(plan.grouped(rt.cast(x, cdt)), _weight_groups(plan, weight, cdt))
    z = _scatter(plan, dcols, xp.empty(y_shape, dtype=cdt))
    _, channels, inner = _input_view(plan)
    act_ = call.activation
    if bias is None and act_.is_identity and z.dtype == x.dtype:
        y = z
    else:
        y = epilogue(z, bias, x.dtype, channels, inner, act_)
    residuals = None
    if call.save:
        mode = keep_mode(act_, name)
        kept = None if mode == KEEP_NONE else (y if mode == KEEP_OUTPUT else z)
        residuals = (x, weight, None if bias is None else bias.dtype, kept, mode, act_, plan)
    return (y,), residuals


def conv_transpose_backward(residuals, cotangents, needs, out=None):
    """g = dy · act' (+ dbias, two passes), cols = im2col(g); dx = cols · Wᵀ per group (C's
    forward), dW = xᵀ · cols per group (C's weight gradient with output gradient x)."""
    x, weight, bias_dtype, kept, mode, act_, plan = residuals
    xp = rt.array_module(x)
    cdt = rt.compute_dtype(rt.dtype_name(x))
    rows, channels, inner = _input_view(plan)
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], x.dtype)).reshape(-1)
    g, dbias = activation_grad(dy, kept, mode, act_, rows, channels, inner, cdt,
                               bias_dtype if "bias" in needs else None)
    grads = {}
    out = out or {}
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", dbias)
    if "x" in needs or "weight" in needs:
        cols = _cols(plan, g, cdt)
    if "x" in needs:
        zg = xp.matmul(cols, _weight_groups(plan, weight, cdt).transpose(0, 2, 1))
        grads["x"] = rt.into(out, "x", rt.cast(plan.ungrouped(zg), x.dtype).reshape(x.shape))
    if "weight" in needs:
        dw = xp.matmul(plan.grouped(rt.cast(x, cdt)).transpose(0, 2, 1), cols)
        grads["weight"] = rt.into(out, "weight", rt.cast(xp.ascontiguousarray(dw), weight.dtype).reshape(weight.shape))
    return grads
