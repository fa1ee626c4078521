"""Launchers of the dense layer on CuPy: cuBLAS products with the CUDA C epilogues of ``dense.cu``.

With ``x`` flattened to ``X (M, in)`` and ``W (out, in)``::

    forward:   Z = X @ Wᵀ (cuBLAS),  then one kernel  y = act(Z + b)  (keeping Z + b in place when
               the activation is not the identity and a backward will follow)
    backward:  one kernel  g = dy · act'(Z + b)  with the bias gradient's per-block partial sums,
               a second kernel reducing them in a fixed order (deterministic, no atomics);
               dW = gᵀ @ X,  dX = g @ W  (cuBLAS)

The epilogue kernels (:func:`epilogue`, :func:`activation_grad`) are shared with conv, whose GEMM
output has the same ``(N, O, L)`` order.  float32 and float64.
"""

from __future__ import annotations

from typing import Any

from . import _runtime as rt

FAMILY = "dense"
#: Threads per block of the elementwise epilogue.
BLOCK = 256
#: At most this many blocks per epilogue launch; the kernel strides over the rest.
MAX_BLOCKS = 65535 * 8
#: (threads along O·L, threads along samples) of the gradient pass.
GRAD_BLOCK = (32, 8)
#: Blocks the gradient pass should have to fill the device.
TARGET_BLOCKS = 528
#: Threads of the bias-gradient merge (one block per output channel).
FINALIZE_BLOCK = 256

_DTYPES = ("float", "double", "pnn_half", "pnn_bf16")
rt.declare(FAMILY, [f"{k}<{t}>" for k in ("bias_act_fwd", "act_grad_bias", "bias_grad_finalize") for t in _DTYPES])


def _shared(threads: int, dtype: str) -> int:
    return 2 * threads * (8 if dtype == "float64" else 4)


def epilogue(z: Any, bias: Any, dtype: str, act: Any, n: int, o: int, positions: int, channels_last: bool,
             keep: bool, y: Any) -> None:
    """y = act(z + b), z in (n, o, positions) order, y in that order or (n, positions, o); z := z + b if ``keep``."""
    total = n * o * positions
    rt.launch(FAMILY, f"bias_act_fwd<{rt.ctype(dtype)}>", (min(rt.blocks(total, BLOCK), MAX_BLOCKS),), (BLOCK,),
              [z, rt.ptr(bias), y, rt.i64(n), rt.i64(o), rt.i64(positions), rt.i32(channels_last), rt.i32(keep),
               rt.i32(act.code), rt.f64(act.slope)])


def sample_chunks(n: int, width: int) -> tuple[int, int]:
    """(chunks, samples per chunk) of the gradient pass: enough blocks to fill the device."""
    bx, by = GRAD_BLOCK
    col_blocks = max(1, rt.blocks(width, bx))
    chunks = max(1, min(rt.blocks(TARGET_BLOCKS, col_blocks), rt.blocks(max(n, 1), by), 65535))
    rows = max(1, rt.blocks(n, chunks))
    return max(1, rt.blocks(n, rows)), rows


def activation_grad(dy: Any, pre: Any, dtype: str, act: Any, n: int, o: int, positions: int, channels_last: bool,
                    need_bias: bool, xp: Any, bias_dtype: Any = None) -> tuple[Any, Any]:
    """(g = dy · act'(pre) in (n, o, positions) order, the bias gradient (o,) or None)."""
    acc = rt.acc_dtype(dtype)
    g = xp.empty((n, o, positions), dy.dtype)
    width = o * positions
    chunks, rows = sample_chunks(n, width)
    bx, by = GRAD_BLOCK
    rt.check_block(bx * by, "GRAD_BLOCK threads")
    part = xp.empty(chunks * width, acc) if need_bias else None
    rt.launch(FAMILY, f"act_grad_bias<{rt.ctype(dtype)}>", (rt.blocks(width, bx), chunks), (bx, by),
              [dy, rt.ptr(pre), g, rt.ptr(part), rt.i64(n), rt.i64(o), rt.i64(positions), rt.i64(rows),
               rt.i32(channels_last), rt.i32(act.code), rt.f64(act.slope)], _shared(bx * by, dtype))
    db = None
    if need_bias:
        db = xp.empty(o, bias_dtype or dy.dtype)
        if n == 0 or positions == 0:
            db[...] = 0
        else:
            block = rt.check_block(FINALIZE_BLOCK, "FINALIZE_BLOCK")
            rt.launch(FAMILY, f"bias_grad_finalize<{rt.ctype(dtype)}>", (o,), (block,),
                      [part, db, rt.i64(o), rt.i64(positions), rt.i64(chunks)], _shared(block, dtype))
    return g, db


def dense_forward(call: Any) -> tuple[tuple[Any], Any]:
    """y = act(x @ Wᵀ + b) for any leading shape of x."""
    x, w, b = call.x, call.weight, call.bias
    xp = rt.array_module(x)
    act = call.activation
    n_in, n_out = int(call.in_features), int(call.out_features)
    x2 = x.reshape(-1, n_in)
    rows = int(x2.shape[0])
    z = xp.matmul(x2, w.T)
    keep = bool(call.save) and not act.is_identity
    if b is None and act.is_identity:
        y2 = z
    else:
        y2 = xp.empty_like(z) if keep else z
        if y2.size:
            epilogue(z, b, call.dtype, act, rows, n_out, 1, False, keep, y2)
    y = y2.reshape((*tuple(x.shape[:-1]), n_out))
    residuals = (x2, w, z if keep else None, call.replace(arrays={}), tuple(x.shape), b is not None) if call.save \
        else None
    return (y,), residuals


def dense_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx, dweight, dbias (see the module docstring)."""
    x2, w, pre, call, x_shape, has_bias = residuals
    out = out or {}
    xp = rt.array_module(x2)
    act = call.activation
    n_out = int(call.out_features)
    dy = xp.ascontiguousarray(cotangents[0]).reshape(-1, n_out)
    if dy.dtype != x2.dtype:
        dy = dy.astype(x2.dtype)
    rows = int(dy.shape[0])
    need_b = "bias" in needs and has_bias
    if act.is_identity and not need_b:
        g, db = dy, None
    else:
        g, db = activation_grad(dy, pre, call.dtype, act, rows, n_out, 1, False, need_b, xp, w.dtype)
        g = g.reshape(rows, n_out)
    grads = {}
    if "x" in needs:
        grads["x"] = rt.into(out, "x", xp.matmul(g, w).reshape(x_shape))
    if "weight" in needs:
        grads["weight"] = rt.into(out, "weight", xp.matmul(g.T, x2))
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", db) if need_b else None
    return grads
