"""Launchers of conv and conv_transpose on CuPy: im2col/col2im kernels (``conv.cu``), cuBLAS GEMMs,
fused epilogues.

1-D to 3-D, batched or not, channels first or last, every stride/padding/dilation/groups::

    cols = im2col(x)                        (N, G, Cg·K, L)   (skipped for 1×1, stride 1, unpadded NC… data)
    z    = W_g @ cols                       (N, G, Og, L) = (N, O, L)        one batched cuBLAS GEMM
    y    = act(z + b)                       written in x's layout by the dense epilogue kernel
    g    = dy · act'(z + b)  and the bias gradient's partials (one kernel), merged in a fixed order
    dW   = Σ_n g_n @ cols_nᵀ,   dcols = W_gᵀ @ g,   dx = col2im(dcols)  (a gather: no atomics)

cols is rebuilt in the backward rather than kept (memory).  float32 and float64.

conv_transpose runs the same pieces for the convolution C it transposes (its call carries C's
geometry: C's input is conv_transpose's output ``y``, C's weight is ``weight`` as given)::

    y    = act(col2im(W_gᵀ @ x) + b)        C's input gradient at the cotangent x, then the epilogue
    g    = dy · act'(pre)  and dbias        the same gradient kernels, on y's layout
    dx   = W_g @ im2col(g)                  C's forward of g (identity, no bias)
    dW   = Σ_n x_n @ im2col(g)_nᵀ           C's weight gradient with input g, output gradient x
"""

from __future__ import annotations

import math
from typing import Any

from . import _runtime as rt
from . import dense as _dense

FAMILY = "conv"
#: Threads per block of im2col/col2im.
BLOCK = 256
#: At most this many blocks per launch; the kernels stride over the rest.
MAX_BLOCKS = 65535 * 8

_DTYPES = ("float", "double", "pnn_half", "pnn_bf16")
rt.declare(FAMILY, [f"{k}<{t}>" for k in ("im2col", "col2im") for t in _DTYPES])


def geometry(call: Any, x_shape: tuple[int, ...]) -> dict[str, Any]:
    """N, C, O, G and the per-axis sizes (padded to 3 axes) of a conv call."""
    lead = 3 - len(call.kernel)
    pad3 = lambda values, fill: [fill] * lead + [int(v) for v in values]  # noqa: E731
    batched = bool(call.batched)
    channels = int(x_shape[call.channel_axis])
    return {
        "N": int(x_shape[0]) if batched else 1,
        "C": channels,
        "G": int(call.groups),
        "in": pad3(call.in_size, 1),
        "out": pad3(call.out_size, 1),
        "k": pad3(call.kernel, 1),
        "s": pad3(call.stride, 1),
        "p": pad3(call.pad_lo, 0),
        "d": pad3(call.dilation, 1),
        "cl": call.layout == "channels_last",
    }


def _direct(geo: dict[str, Any]) -> bool:
    """1×1, stride 1, unpadded, channels-first, as many outputs as inputs: x already is cols.

    (A transposed convolution's output may be longer than its input with 1×1 kernels: dilation
    admits an ``output_padding`` that the convolution it transposes leaves unread.)
    """
    return (not geo["cl"] and all(k == 1 for k in geo["k"]) and all(s == 1 for s in geo["s"])
            and all(p == 0 for p in geo["p"]) and geo["in"] == geo["out"])


def _args(geo: dict[str, Any]) -> list:
    return [rt.i64(geo["N"]), rt.i64(geo["C"]), *map(rt.i64, geo["in"]), *map(rt.i64, geo["out"]),
            *map(rt.i64, geo["k"]), *map(rt.i64, geo["s"]), *map(rt.i64, geo["p"]), *map(rt.i64, geo["d"]),
            rt.i32(geo["cl"])]


def _grid(total: int) -> tuple[int]:
    return (min(rt.blocks(total, BLOCK), MAX_BLOCKS),)


def _cols(x: Any, geo: dict[str, Any], dtype: str, xp: Any) -> Any:
    """im2col of x as (N, G, Cg·K, L)."""
    n, c, g = geo["N"], geo["C"], geo["G"]
    kk, ll = math.prod(geo["k"]), math.prod(geo["out"])
    if _direct(geo):
        return x.reshape(n, g, (c // g) * kk, ll)
    cols = xp.empty((n, g, (c // g) * kk, ll), x.dtype)
    rt.launch(FAMILY, f"im2col<{rt.ctype(dtype)}>", _grid(cols.size), (BLOCK,), [x, cols, *_args(geo)])
    return cols


def _col2im(dcols: Any, shape: tuple[int, ...], geo: dict[str, Any], dtype: str, xp: Any) -> Any:
    """The array of ``shape`` (the convolution's input, in its layout) whose every element is the
    sum of the ``dcols`` (N, G, Cg·K, L) entries that read it: the adjoint of :func:`_cols`."""
    if _direct(geo):
        return dcols.reshape(shape)
    dx = xp.empty(shape, dcols.dtype)
    rt.launch(FAMILY, f"col2im<{rt.ctype(dtype)}>", _grid(dx.size), (BLOCK,),
              [xp.ascontiguousarray(dcols), dx, *_args(geo)])
    return dx


def _grouped_weight(w: Any, groups: int) -> Any:
    """W (O, Cg, *k) as W_g (G, O/G, Cg·K)."""
    return w.reshape(groups, int(w.shape[0]) // groups, -1)


def _weight_gradient(g4: Any, cols: Any, w: Any, n: int, xp: Any) -> Any:
    """dW = Σ_n g4_n @ cols_nᵀ, with g4 (N, G, O/G, L) and cols (N, G, Cg·K, L), shaped like ``w``."""
    if not n:
        return xp.zeros(w.shape, w.dtype)
    dw = xp.matmul(g4, cols.transpose(0, 1, 3, 2)).sum(axis=0)
    return dw.astype(w.dtype, copy=False).reshape(w.shape)


def conv_forward(call: Any) -> tuple[tuple[Any], Any]:
    """y = act(conv(x, W) + b) in x's layout."""
    x, w, b = call.x, call.weight, call.bias
    xp = rt.array_module(x)
    act = call.activation
    shape = tuple(int(v) for v in x.shape)
    geo = geometry(call, shape)
    n, g, o = geo["N"], geo["G"], int(w.shape[0])
    ll = math.prod(geo["out"])
    cols = _cols(x, geo, call.dtype, xp)
    z = xp.matmul(_grouped_weight(w, g), cols).reshape(n, o, ll)
    out_sp = [int(v) for v in call.out_size]
    if geo["cl"]:
        y_shape = ([n] if call.batched else []) + out_sp + [o]
    else:
        y_shape = ([n] if call.batched else []) + [o] + out_sp
    keep = bool(call.save) and not act.is_identity
    if b is None and act.is_identity and not geo["cl"]:
        y = z.reshape(y_shape)
    else:
        y = xp.empty(tuple(y_shape), x.dtype)
        if y.size:
            _dense.epilogue(z, b, call.dtype, act, n, o, ll, geo["cl"], keep, y)
    residuals = (x, w, z if keep else None, call.replace(arrays={}), geo, b is not None) if call.save else None
    return (y,), residuals


def _cotangent(cotangents: Any, like: Any, xp: Any) -> Any:
    """The output's cotangent, C-contiguous in ``like``'s dtype."""
    dy = xp.ascontiguousarray(cotangents[0])
    return dy if dy.dtype == like.dtype else dy.astype(like.dtype)


def conv_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx (col2im of Wᵀ g), dweight (Σ_n g cols ᵀ), dbias (fused with act')."""
    x, w, pre, call, geo, has_bias = residuals
    out = out or {}
    xp = rt.array_module(x)
    act = call.activation
    n, g, o = geo["N"], geo["G"], int(w.shape[0])
    ll = math.prod(geo["out"])
    dy = _cotangent(cotangents, x, xp)
    need_b = "bias" in needs and has_bias
    if act.is_identity and not need_b and not geo["cl"]:
        gz, db = dy.reshape(n, o, ll), None
    else:
        gz, db = _dense.activation_grad(dy, pre, call.dtype, act, n, o, ll, geo["cl"], need_b, xp, w.dtype)
    g4 = gz.reshape(n, g, o // g, ll)
    wg = _grouped_weight(w, g)
    grads = {}
    if "weight" in needs:
        grads["weight"] = rt.into(out, "weight", _weight_gradient(g4, _cols(x, geo, call.dtype, xp), w, n, xp))
    if "x" in needs:
        dcols = xp.matmul(wg.transpose(0, 2, 1), g4)
        grads["x"] = rt.into(out, "x", _col2im(dcols, tuple(x.shape), geo, call.dtype, xp))
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", db) if need_b else None
    return grads


# --------------------------------------------------------------------------- transposed convolution

def _transposed_shape(call: Any, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> tuple[int, ...]:
    """conv_transpose's output shape (C's input: ``O = G · weight.shape[1]`` channels over
    ``call.in_size``) in x's layout, batched iff x is."""
    o, spatial = int(call.groups) * int(w_shape[1]), [int(v) for v in call.in_size]
    shape = (*spatial, o) if call.layout == "channels_last" else (o, *spatial)
    return (int(x_shape[0]), *shape) if call.batched else shape


def _rows(geo: dict[str, Any], channels: int) -> tuple[int, int, int]:
    """conv_transpose's output as the (N, O, L) the dense epilogues take in channels-first order:
    (N, O, L) channels first, (N·L, O, 1) channels last."""
    n, positions = geo["N"], math.prod(geo["in"])
    return (n * positions, channels, 1) if geo["cl"] else (n, channels, positions)


def _channels_first(a: Any, channels: int, geo: dict[str, Any], xp: Any) -> Any:
    """conv_transpose's input (C's output: ``channels = weight.shape[0]`` over ``out``) as the
    GEMMs' (N, G, Cin/G, L): a reshape channels first, one transposing copy channels last."""
    n, positions, g = geo["N"], math.prod(geo["out"]), geo["G"]
    if geo["cl"]:
        a = xp.ascontiguousarray(a.reshape(n, positions, channels).transpose(0, 2, 1))
    return a.reshape(n, g, channels // g, positions)


def _in_layout(z: Any, shape: tuple[int, ...], geo: dict[str, Any], xp: Any) -> Any:
    """The GEMM result z (N, Cin, L) in conv_transpose's input layout ``shape``."""
    if geo["cl"]:
        z = xp.ascontiguousarray(z.transpose(0, 2, 1))
    return z.reshape(shape)


def conv_transpose_forward(call: Any) -> tuple[tuple[Any], Any]:
    """y = act(col2im(W_gᵀ @ x) + b) in x's layout: C's input gradient at the cotangent x, then the
    dense epilogue on y's own layout (z + b kept in place for the backward)."""
    x, w, b = call.x, call.weight, call.bias
    xp = rt.array_module(x)
    act = call.activation
    y_shape = _transposed_shape(call, tuple(x.shape), tuple(w.shape))
    geo = geometry(call, y_shape)
    x4 = _channels_first(x, int(w.shape[0]), geo, xp)
    dcols = xp.matmul(_grouped_weight(w, geo["G"]).transpose(0, 2, 1), x4)
    z = _col2im(dcols, y_shape, geo, call.dtype, xp)
    keep = bool(call.save) and not act.is_identity
    y = z
    if (b is not None or not act.is_identity) and z.size:
        y = xp.empty_like(z) if keep else z
        _dense.epilogue(z, b, call.dtype, act, *_rows(geo, geo["C"]), False, keep, y)
    residuals = (x, w, z if keep else None, call.replace(arrays={}), geo, b is not None) if call.save else None
    return (y,), residuals


def conv_transpose_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """g = dy · act'(pre) with dbias (the dense gradient kernels), then C's passes with cols =
    im2col(g): dx = W_g @ cols, dweight = Σ_n x_n @ cols_nᵀ."""
    x, w, pre, call, geo, has_bias = residuals
    out = out or {}
    xp = rt.array_module(x)
    act = call.activation
    dy = _cotangent(cotangents, x, xp)
    need_b = "bias" in needs and has_bias
    if act.is_identity and not need_b:
        g, db = dy, None
    else:
        g, db = _dense.activation_grad(dy, pre, call.dtype, act, *_rows(geo, geo["C"]), False, need_b, xp,
                                       w.dtype)
    grads = {}
    if "x" in needs or "weight" in needs:
        cols = _cols(g.reshape(dy.shape), geo, call.dtype, xp)
    if "weight" in needs:
        x4 = _channels_first(x, int(w.shape[0]), geo, xp)
        grads["weight"] = rt.into(out, "weight", _weight_gradient(x4, cols, w, geo["N"], xp))
    if "x" in needs:
        z = xp.matmul(_grouped_weight(w, geo["G"]), cols).reshape(geo["N"], int(w.shape[0]), -1)
        grads["x"] = rt.into(out, "x", _in_layout(z, tuple(x.shape), geo, xp))
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", db) if need_b else None
    return grads
