"""Launchers of the CUDA C pooling kernels (``pool.cu``): ``max_pool`` and ``avg_pool``.

Every call runs on one canonical view of the C-contiguous ``x``: ``B`` planes of ``D·H·W``
positions of ``K`` contiguous channels (channels first: ``B = N·C``, ``K = 1``; channels last:
``B = N``, ``K = C``; unbatched input has ``N = 1``), with 1-D and 2-D pools padded to 3-D by
leading axes of size 1 (window 1, stride 1, no padding).  The forward is one thread per output,
the backward one thread per input gathering from the windows that cover it, so no atomics and
no zero-fill are needed and gradients are deterministic.  max_pool keeps, with a backward to
come, the winning position per output (``int32``; planes of 2**31 positions or more are
declined); avg_pool divides by the per-position divisors the api computed (cached on the device
per geometry).  ``max_unpool`` claims each output position for the last entry naming it
(``atomicMax`` of x positions), then gathers, so duplicates resolve deterministically.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from . import _runtime as rt

FAMILY = "pool"
#: Threads per block of both kernels.
BLOCK = 256
#: At most this many blocks per launch; the kernels stride over the rest.
MAX_BLOCKS = 65535 * 8

_DTYPES = ("float", "double", "pnn_half", "pnn_bf16")
rt.declare(FAMILY, [f"{k}<{t}>" for k in ("pool_fwd", "pool_bwd", "unpool_fill", "unpool_bwd") for t in _DTYPES]
           + ["unpool_claim"])

_divisors: dict[tuple, Any] = {}
_divisors_lock = threading.Lock()


def geometry(call: Any, shape: tuple[int, ...]) -> tuple[int, int, list[list[int]]]:
    """(B, K, [in, out, window, stride, pad_lo, dilation] each padded to 3 axes) of a pooling call."""
    axes = call.spatial_axes
    K = shape[-1] if call.layout == "channels_last" else 1
    B = math.prod(shape[: axes[0]])
    lead = 3 - len(axes)
    rows = [call.in_size, call.out_size, call.window, call.stride, call.pad_lo, call.dilation]
    fills = [1, 1, 1, 1, 0, 1]
    return B, K, [[fill] * lead + [int(v) for v in row] for row, fill in zip(rows, fills)]


def _divisor_arrays(call: Any, xp: Any) -> list[Any]:
    """The per-axis divisors as float64 device arrays (ones for max_pool and padded axes), cached."""
    per_axis = list(call.params.get("divisors") or [(1,) * o for o in call.out_size])
    per_axis = [(1.0,)] * (3 - len(per_axis)) + [tuple(float(v) for v in d) for d in per_axis]
    device = xp.cuda.runtime.getDevice() if xp.__name__ == "cupy" else -1
    key = (device, xp.__name__, tuple(per_axis))
    arrays = _divisors.get(key)
    if arrays is None:
        arrays = [xp.asarray(d, dtype=xp.float64) for d in per_axis]
        with _divisors_lock:
            if len(_divisors) > 256:
                _divisors.clear()
            _divisors[key] = arrays
    return arrays


def _args(B: int, K: int, geo: list[list[int]]) -> list:
    i, o, w, s, p, d = geo
    return [rt.i64(B), rt.i64(K), *map(rt.i64, i), *map(rt.i64, o), *map(rt.i64, w), *map(rt.i64, s),
            *map(rt.i64, p), *map(rt.i64, d)]


def _grid(total: int) -> tuple[int]:
    return (min(rt.blocks(total, BLOCK), MAX_BLOCKS),)


def pool_forward(call: Any) -> tuple[tuple[Any], Any]:
    """Forward of max_pool/avg_pool; keeps the argmax positions when saving for max_pool."""
    x = call.x
    xp = rt.array_module(x)
    is_max = call.op == "max_pool"
    shape = tuple(int(v) for v in x.shape)
    B, K, geo = geometry(call, shape)
    out_shape = list(shape)
    for a, o in zip(call.spatial_axes, call.out_size):
        out_shape[a] = int(o)
    y = xp.empty(tuple(out_shape), x.dtype)
    indices = is_max and bool(call.params.get("return_indices"))
    arg = xp.empty(tuple(out_shape), xp.int32) if (is_max and (call.save or indices)) else None
    divs = _divisor_arrays(call, xp)
    rt.launch(FAMILY, f"pool_fwd<{rt.ctype(call.dtype)}>", _grid(y.size), (BLOCK,),
              [x, y, rt.ptr(arg), *divs, *_args(B, K, geo), rt.i32(is_max)])
    residuals = (call.replace(arrays={}), shape, x.dtype, arg, divs) if call.save else None
    if indices:
        return (y, arg.astype(xp.int64)), residuals  # flat spatial positions: PyTorch's indices
    return (y,), residuals


def _gradient_buffers(dy: Any, out: dict[str, Any], shape: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
    """(dy C-contiguous in x's dtype, dx: the caller's ``out["x"]`` when the kernel can write into it)."""
    xp = rt.array_module(dy)
    dy = xp.ascontiguousarray(dy)
    if dy.dtype != dtype:
        dy = dy.astype(dtype)
    given = out.get("x")
    usable = given is not None and given.dtype == dtype and given.flags.c_contiguous
    return dy, (given if usable else xp.empty(shape, dtype))


def pool_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx of max_pool (to each window's recorded maximum) and avg_pool (dy / divisor over each window)."""
    if "x" not in needs:
        return {}
    call, shape, dtype, arg, divs = residuals
    out = out or {}
    dy, dx = _gradient_buffers(cotangents[0], out, shape, dtype)
    B, K, geo = geometry(call, shape)
    rt.launch(FAMILY, f"pool_bwd<{rt.ctype(call.dtype)}>", _grid(dx.size), (BLOCK,),
              [dy, dx, rt.ptr(arg), *divs, *_args(B, K, geo), rt.i32(call.op == "max_pool")])
    return {"x": rt.into(out, "x", dx)}


def _unpool_planes(call: Any, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(B, K, P_in, P_out) of a max_unpool call."""
    K = shape[-1] if call.layout == "channels_last" else 1
    return math.prod(shape[: call.spatial_axes[0]]), K, math.prod(call.in_size), math.prod(call.out_size)


def unpool_forward(call: Any) -> tuple[tuple[Any], Any]:
    """y of max_unpool: the last entry naming each position (claimed with atomicMax), zero elsewhere."""
    x = call.x
    xp = rt.array_module(x)
    shape = tuple(int(v) for v in x.shape)
    B, K, p_in, p_out = _unpool_planes(call, shape)
    idx = xp.ascontiguousarray(call.indices)
    if idx.dtype != xp.int64:
        idx = idx.astype(xp.int64)
    out_shape = list(shape)
    for a, o in zip(call.spatial_axes, call.out_size):
        out_shape[a] = int(o)
    y = xp.empty(tuple(out_shape), x.dtype)
    winner = xp.full(y.shape, -1, dtype=xp.int32)
    sizes = [rt.i64(B), rt.i64(K), rt.i64(p_in), rt.i64(p_out)]
    if x.size:
        rt.launch(FAMILY, "unpool_claim", _grid(x.size), (BLOCK,), [idx, winner, *sizes])
    rt.launch(FAMILY, f"unpool_fill<{rt.ctype(call.dtype)}>", _grid(y.size), (BLOCK,), [x, winner, y, *sizes])
    residuals = (idx, winner, shape, x.dtype, sizes, call.dtype) if call.save else None
    return (y,), residuals


def unpool_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx of max_unpool: dy at each entry's index where that entry holds the claim, else 0."""
    if "x" not in needs:
        return {}
    idx, winner, shape, dtype, sizes, dtype_name = residuals
    out = out or {}
    dy, dx = _gradient_buffers(cotangents[0], out, shape, dtype)
    rt.launch(FAMILY, f"unpool_bwd<{rt.ctype(dtype_name)}>", _grid(dx.size), (BLOCK,), [dy, idx, winner, dx, *sizes])
    return {"x": rt.into(out, "x", dx)}
