"""Numba-CUDA ``dense``: array-module GEMMs with fused epilogue kernels (backend ``"numba_cuda"``).

y = act(x · Wᵀ + b) over the rows of ``x`` flattened to (M, in_features):

* forward: z = x · Wᵀ by the array module's ``matmul`` (cuBLAS through CuPy on a GPU, NumPy in
  the simulator) in the compute type (float32 for float16/bfloat16/float32, float64 for
  float64), then one epilogue kernel (:func:`epilogue`) adds the bias into z in place and
  writes act(z) in the data's dtype;
* backward: one kernel (:func:`activation_grad`) forms g = dy · act' (from the kept output when
  the activation allows and the output is exact, else from the kept pre-activation; nothing is
  kept for the identity) and, in the same pass, per-chunk column sums of g; a second pass sums
  the chunks in a fixed order (deterministic dbias, no atomics); then dW = gᵀ · x and
  dx = g · W as GEMMs.

The epilogue and the gradient kernels take the output as (rows, channels, inner) — channel
``(i // inner) % channels`` — so ``conv`` reuses them for channels-first and channels-last outputs.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from portable_nn.kernel_codes import keeps_output_only

from . import _runtime as rt
from ._runtime import cast_as, kernel, load, store
from .activations import act, act_grad, act_grad_from_output

_I = "int64"
_EPILOGUE = f"void({{c}}[::1], {{c}}[::1], {{x}}[::1], {_I}, {_I}, {_I}, {_I}, {{c}})"
_GRAD = (f"void({{x}}[::1], {{c}}[::1], {{c}}[::1], float64[::1], {_I}, {_I}, {_I}, {_I}, {_I}, {_I}, "
         f"{{c}})")
_COLUMNS = "void(float64[::1], {x}[::1], int64, int64)"

#: How the backward finds act': nothing kept (identity), from the output, from the pre-activation.
KEEP_NONE, KEEP_OUTPUT, KEEP_PREACT = 0, 1, 2


@kernel(_EPILOGUE)
def _epilogue(z, bias, y, channels, inner, has_bias, code, slope):
    """z += bias[channel] (in place, the kept pre-activation); y = act(z) in y's dtype."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = z.shape[0]
    while i < n:
        v = z[i]
        if has_bias:
            v += bias[(i // inner) % channels]
            z[i] = v
        store(y, i, act(v, code, slope))
        i += stride


@kernel(_GRAD)
def _activation_grad(dy, kept, g, part, rows, channels, inner, per, mode, code, slope):
    """g = dy · act' (compute type); part[chunk, channel] = Σ of g over the chunk's rows (float64).

    Grid: x over channels, y over chunks of ``per`` rows; each thread owns one (chunk, channel)
    and sums in a fixed order.
    """
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    chunk = cuda.blockIdx.y
    if c >= channels:
        return
    r = chunk * per
    stop = min(r + per, rows)
    acc = 0.0
    while r < stop:
        base = (r * channels + c) * inner
        for j in range(inner):
            i = base + j
            d = load(dy, i)
            gv = cast_as(slope, d)
            if mode == 1:
                gv = gv * act_grad_from_output(kept[i], code, slope)
            elif mode == 2:
                gv = gv * act_grad(kept[i], code, slope)
            g[i] = gv
            acc += np.float64(gv)
        r += 1
    part[chunk * channels + c] = acc


@kernel(_COLUMNS)
def _sum_chunks(part, out, chunks, channels):
    """out[c] = Σ_chunk part[chunk, c] in chunk order (the second pass of the bias gradient)."""
    c = cuda.grid(1)
    if c < channels:
        s = 0.0
        for k in range(chunks):
            s += part[k * channels + c]
        store(out, c, s)


# --------------------------------------------------------------------------- shared host helpers


def keep_mode(activation, data_dtype: str) -> int:
    """What the backward keeps: nothing (identity), y (exact output, act' from y), or z."""
    if activation.is_identity:
        return KEEP_NONE
    if keeps_output_only(activation) and data_dtype in ("float32", "float64"):
        return KEEP_OUTPUT
    return KEEP_PREACT


def epilogue(z, bias, out_dtype, channels: int, inner: int, activation):
    """y = act(z + bias) in ``out_dtype``; z (C-contiguous, compute type) gets the bias in place."""
    xp = rt.array_module(z)
    cdt = z.dtype
    y = xp.empty(z.shape, dtype=out_dtype)
    b = rt.cast(bias, cdt).reshape(-1) if bias is not None else xp.zeros(1, cdt)
    n, block = int(z.size), rt.settings().block
    rt.launch(_epilogue, rt.blocks_for(n, block), block, z.reshape(-1), xp.ascontiguousarray(b), y.reshape(-1),
              channels, inner, int(bias is not None), activation.code, rt.scalar(activation.slope, cdt))
    return y


def activation_grad(dy, kept, mode: int, activation, rows: int, channels: int, inner: int, cdt, bias_dtype=None):
    """(g, dbias): g = dy · act' in the compute type ``cdt``, dbias = Σ g per channel (or None).

    ``dy`` is C-contiguous in the data's dtype with rows·channels·inner elements; ``kept`` the
    output or pre-activation (compute type) or None.  dbias is reduced in two deterministic
    passes and returned in ``bias_dtype`` when given.
    """
    xp = rt.array_module(dy)
    s = rt.settings()
    g = xp.empty(dy.shape, dtype=cdt)
    column_blocks = max(1, -(-channels // s.block))
    nchunks = rt.chunks(column_blocks, rows, max(1, s.min_chunk // max(1, inner)))
    per = max(1, -(-rows // nchunks)) if rows else 1
    nchunks = max(1, -(-rows // per)) if rows else 1
    part = xp.zeros(nchunks * channels, np.float64)
    k = kept.reshape(-1) if kept is not None else xp.zeros(1, cdt)
    if channels:
        rt.launch(_activation_grad, (column_blocks, nchunks), s.block, dy.reshape(-1), k, g.reshape(-1), part,
                  rows, channels, inner, per, mode, activation.code, rt.scalar(activation.slope, cdt))
    dbias = None
    if bias_dtype is not None:
        dbias = xp.empty(channels, dtype=bias_dtype)
        rt.launch(_sum_chunks, rt.blocks_for(channels, s.block), s.block, part, dbias, nchunks, channels)
    return g, dbias


# --------------------------------------------------------------------------- dense


def dense_forward(call):
    """y = act(x · Wᵀ + b): one GEMM in the compute type, then the fused epilogue."""
    x, weight, bias = call.x, call.weight, call.bias
    xp = rt.array_module(x)
    name = rt.dtype_name(x)
    cdt = rt.compute_dtype(name)
    n_out, n_in = (int(s) for s in weight.shape)
    rows = rt.prod(tuple(x.shape[:-1]))
    xr = rt.cast(x, cdt).reshape(rows, n_in)
    z = xp.ascontiguousarray(xp.matmul(xr, rt.cast(weight, cdt).T))
    act_ = call.activation
    y = epilogue(z, bias, x.dtype, n_out, 1, act_)
    y = y.reshape((*tuple(x.shape[:-1]), n_out))
    residuals = None
    if call.save:
        mode = keep_mode(act_, name)
        kept = None if mode == KEEP_NONE else (y if mode == KEEP_OUTPUT else z)
        residuals = (x, weight, None if bias is None else bias.dtype, kept, mode, act_)
    return (y,), residuals


def dense_backward(residuals, cotangents, needs, out=None):
    """g = dy · act' fused with the dbias column sums (two passes), then dW = gᵀx and dx = gW."""
    x, weight, bias_dtype, kept, mode, act_ = residuals
    xp = rt.array_module(x)
    cdt = rt.compute_dtype(rt.dtype_name(x))
    n_out, n_in = (int(s) for s in weight.shape)
    rows = rt.prod(tuple(x.shape[:-1]))
    dy = xp.ascontiguousarray(rt.cast(cotangents[0], x.dtype)).reshape(rows, n_out)
    g, dbias = activation_grad(dy, kept, mode, act_, rows, n_out, 1, cdt,
                               bias_dtype if "bias" in needs else None)
    grads = {}
    out = out or {}
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", dbias)
    if "weight" in needs:
        dw = xp.matmul(g.T, rt.cast(x, cdt).reshape(rows, n_in))
        grads["weight"] = rt.into(out, "weight", rt.cast(xp.ascontiguousarray(dw), weight.dtype))
    if "x" in needs:
        dx = xp.matmul(g, rt.cast(weight, cdt))
        grads["x"] = rt.into(out, "x", rt.cast(xp.ascontiguousarray(dx), x.dtype).reshape(x.shape))
    return grads
