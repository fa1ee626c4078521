"""Launchers of conv on CuPy: im2col/col2im kernels (``conv.cu``), cuBLAS GEMMs, fused epilogues.

1-D to 3-D, batched or not, channels first or last, every stride/padding/dilation/groups::

    cols = im2col(x)                        (N, G, Cg·K, L)   (skipped for 1×1, stride 1, unpadded NC… data)
    z    = W_g @ cols                       (N, G, Og, L) = (N, O, L)        one batched cuBLAS GEMM
    y    = act(z + b)                       written in x's layout by the dense epilogue kernel
    g    = dy · act'(z + b)  and the bias gradient's partials (one kernel), merged in a fixed order
    dW   = Σ_n g_n @ cols_nᵀ,   dcols = W_gᵀ @ g,   dx = col2im(dcols)  (a gather: no atomics)

cols is rebuilt in the backward rather than kept (memory).  float32 and float64.
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
    """1×1, stride 1, unpadded, channels-first: x already is cols."""
    return (not geo["cl"] and all(k == 1 for k in geo["k"]) and all(s == 1 for s in geo["s"])
            and all(p == 0 for p in geo["p"]))


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
    wg = w.reshape(g, o // g, -1)
    z = xp.matmul(wg, cols).reshape(n, o, ll)
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


def conv_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx (col2im of Wᵀ g), dweight (Σ_n g cols ᵀ), dbias (fused with act')."""
    x, w, pre, call, geo, has_bias = residuals
    out = out or {}
    xp = rt.array_module(x)
    act = call.activation
    n, g, o = geo["N"], geo["G"], int(w.shape[0])
    ll = math.prod(geo["out"])
    dy = xp.ascontiguousarray(cotangents[0])
    if dy.dtype != x.dtype:
        dy = dy.astype(x.dtype)
    need_b = "bias" in needs and has_bias
    if act.is_identity and not need_b and not geo["cl"]:
        gz, db = dy.reshape(n, o, ll), None
    else:
        gz, db = _dense.activation_grad(dy, pre, call.dtype, act, n, o, ll, geo["cl"], need_b, xp, w.dtype)
    g4 = gz.reshape(n, g, o // g, ll)
    wg = w.reshape(g, o // g, -1)
    grads = {}
    if "weight" in needs:
        cols = _cols(x, geo, call.dtype, xp)
        dw = xp.matmul(g4, cols.transpose(0, 1, 3, 2)).sum(axis=0) if n else xp.zeros(wg.shape, w.dtype)
        grads["weight"] = rt.into(out, "weight", dw.astype(w.dtype, copy=False).reshape(w.shape))
    if "x" in needs:
        dcols = xp.matmul(wg.transpose(0, 2, 1), g4)
        if _direct(geo):
            dx = dcols.reshape(x.shape)
        else:
            dx = xp.empty(x.shape, x.dtype)
            rt.launch(FAMILY, f"col2im<{rt.ctype(call.dtype)}>", _grid(dx.size), (BLOCK,),
                      [xp.ascontiguousarray(dcols), dx, *_args(geo)])
        grads["x"] = rt.into(out, "x", dx)
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", db) if need_b else None
    return grads
