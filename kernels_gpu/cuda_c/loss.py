"""Launchers of the CUDA C softmax-loss kernels (``loss.cu``): ``log_softmax`` and ``cross_entropy``.

The class axis views the (C-contiguous) input as ``(outer, C, inner)``.  ``inner == 1`` runs the
``rows`` kernels (a block per row, block reductions; cross_entropy's too); otherwise the ``cols``
kernels (a thread per position, adjacent threads on adjacent memory).  log_softmax keeps its output for the
backward (``dx = dy − exp(y) Σ dy``).  cross_entropy keeps, per position, the log-sum-exp and the
target-weight sum, and the mean's denominator (a one-element device array: no host sync);
its backward is one elementwise kernel writing the logits' and (probability targets) the
target's gradients.  Reductions have a fixed order: results are deterministic.
"""

from __future__ import annotations

from typing import Any

from portable_nn.kernel_plans import split_axis

from . import _runtime as rt

FAMILY = "loss"
#: Threads per block (a power of two >= 32: the block reductions need it).
BLOCK = 256
#: At most this many blocks per launch; the kernels stride over the rest.
MAX_BLOCKS = 65535 * 8
#: Threads of the single-block loss reduction.
REDUCE_BLOCK = 1024
#: Whether the rows kernels of log_softmax and the cross_entropy forward may use 16-byte vectors.
VECTOR_ROWS = True

_DTYPES = ("float", "double", "pnn_half", "pnn_bf16")
rt.declare(FAMILY, [f"{k}<{t}>" for k in ("lsm_rows_fwd", "lsm_cols_fwd", "lsm_rows_bwd", "lsm_cols_bwd", "ce_reduce")
                    for t in _DTYPES]
           + [f"{k}<{t}, {p}>" for k in ("ce_fwd", "ce_bwd", "ce_rows_fwd", "ce_rows_bwd") for t, p in rt.TYPE_PAIRS])

_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _grid(total: int) -> tuple[int]:
    return (min(rt.blocks(total, BLOCK), MAX_BLOCKS),)


def _shared(threads: int, dtype: str) -> int:
    return 2 * threads * (8 if dtype == "float64" else 4)


def _rows_vec(dtype: str, classes: int, *arrays: Any) -> int:
    """1 when the rows kernels can read (and write) their rows in 16-byte vectors: rows of whole
    vectors, arrays 16-byte aligned."""
    return int(VECTOR_ROWS and rt.whole_vectors(dtype, classes, *arrays))


def _softmax_launch(kind: str, dtype: str, arrays: list, outer: int, classes: int, inner: int) -> None:
    """A log_softmax kernel over (outer, C, inner): the rows variant when inner == 1."""
    t = rt.ctype(dtype)
    if inner == 1:
        block = rt.check_block(BLOCK, "BLOCK")
        rt.launch(FAMILY, f"lsm_rows_{kind}<{t}>", (min(outer, MAX_BLOCKS),), (block,),
                  [*arrays, rt.i64(outer), rt.i64(classes), rt.i32(_rows_vec(dtype, classes, *arrays))],
                  _shared(block, dtype))
    else:
        rt.launch(FAMILY, f"lsm_cols_{kind}<{t}>", _grid(outer * inner), (BLOCK,),
                  [*arrays, rt.i64(outer), rt.i64(classes), rt.i64(inner)])


def log_softmax_forward(call: Any) -> tuple[tuple[Any], Any]:
    """y = x − max − log Σ exp(x − max) along the axis."""
    x = call.x
    xp = rt.array_module(x)
    y = xp.empty_like(x)
    outer, classes, inner = split_axis(tuple(int(v) for v in x.shape), 0 if call.scalar else call.axis)
    if x.size:
        _softmax_launch("fwd", call.dtype, [x, y], outer, classes, inner)
    residuals = (y, call.replace(arrays={}), (outer, classes, inner)) if call.save else None
    return (y,), residuals


def log_softmax_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx = dy − exp(y) · Σ dy."""
    if "x" not in needs:
        return {}
    y, call, (outer, classes, inner) = residuals
    out = out or {}
    xp = rt.array_module(y)
    dy = xp.ascontiguousarray(cotangents[0])
    if dy.dtype != y.dtype:
        dy = dy.astype(y.dtype)
    given = out.get("x")
    dx = given if (given is not None and given.dtype == y.dtype and given.flags.c_contiguous) else xp.empty_like(y)
    if y.size:
        _softmax_launch("bwd", call.dtype, [y, dy, dx], outer, classes, inner)
    return {"x": rt.into(out, "x", dx)}


def _types(call: Any) -> tuple[str, str]:
    t = rt.ctype(call.dtype)
    return t, ("float" if call.params.get("mixed_precision") else t)


def cross_entropy_forward(call: Any) -> tuple[tuple[Any], Any]:
    """Per-position losses, then the reduction; see the module docstring."""
    z = call.logits
    xp = rt.array_module(z)
    acc = rt.acc_dtype(call.dtype)
    types = _types(call)
    shape = tuple(int(v) for v in z.shape)
    outer, classes, inner = split_axis(shape, call.axis)
    positions = outer * inner
    probabilities = bool(call.probabilities)
    labels = None if probabilities else xp.ascontiguousarray(call.target, dtype=xp.int64)
    probs = call.target if probabilities else None
    loss = xp.empty(positions, acc)
    wsum = xp.empty(positions, acc)
    lse = xp.empty(2 * positions, acc)  # every max, then every log Σ exp(z − max)
    total = xp.empty(positions, acc)
    reduction = _REDUCTIONS[call.reduction]
    out_shape = shape[: call.axis] + shape[call.axis + 1:]
    y = xp.empty(out_shape if reduction == 0 else (), z.dtype)
    outputs = [z, rt.ptr(labels), rt.ptr(probs), rt.ptr(call.weight), y if reduction == 0 else rt.NULL, loss, wsum,
               lse, total]
    options = [rt.i64(call.ignore_index), rt.f64(call.label_smoothing), rt.i32(probabilities)]
    if inner == 1 and classes > 0:
        block = rt.check_block(BLOCK, "BLOCK")
        rt.launch(FAMILY, f"ce_rows_fwd<{types[0]}, {types[1]}>", (min(outer, MAX_BLOCKS),), (block,),
                  [*outputs, rt.i64(outer), rt.i64(classes), *options, rt.i32(_rows_vec(call.dtype, classes, z))],
                  _shared(block, call.dtype))
    else:
        rt.launch(FAMILY, f"ce_fwd<{types[0]}, {types[1]}>", _grid(positions), (BLOCK,),
                  [*outputs, rt.i64(outer), rt.i64(classes), rt.i64(inner), *options])
    den = xp.ones(1, acc)
    if reduction:
        block = rt.check_block(REDUCE_BLOCK, "REDUCE_BLOCK")
        rt.launch(FAMILY, f"ce_reduce<{types[0]}>", (1,), (block,),
                  [loss, wsum, y, den, rt.i64(positions), rt.i32(reduction), rt.i32(probabilities)],
                  _shared(block, call.dtype))
    residuals = None
    if call.save:
        residuals = (z, labels, probs, call.replace(arrays={**call.arrays, "logits": None}), lse, total, den,
                     (outer, classes, inner))
    return (y,), residuals


def cross_entropy_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dlogits = g · (softmax · A − a); dtarget = −g (1 − ε) w log_softmax (probability targets)."""
    z, labels, probs, call, lse, total, den, (outer, classes, inner) = residuals
    out = out or {}
    xp = rt.array_module(z)
    types = _types(call)
    g = xp.ascontiguousarray(cotangents[0])
    if g.dtype != z.dtype:
        g = g.astype(z.dtype)
    need_z = "logits" in needs
    need_t = "target" in needs and probs is not None

    def buffer(name, like):
        given = out.get(name)
        ok = given is not None and given.dtype == like.dtype and given.flags.c_contiguous
        return given if ok else xp.empty_like(like)

    dz = buffer("logits", z) if need_z else None
    dt = buffer("target", probs) if need_t else None
    arrays = [z, rt.ptr(labels), rt.ptr(probs), rt.ptr(call.weight), g, den, lse, total, rt.ptr(dz), rt.ptr(dt)]
    options = [rt.i64(call.ignore_index), rt.f64(call.label_smoothing), rt.i32(probs is not None),
               rt.i32(_REDUCTIONS[call.reduction])]
    if (need_z or need_t) and inner == 1:
        rt.launch(FAMILY, f"ce_rows_bwd<{types[0]}, {types[1]}>", (min(outer, MAX_BLOCKS),), (BLOCK,),
                  [*arrays, rt.i64(outer), rt.i64(classes), *options])
    elif need_z or need_t:
        rt.launch(FAMILY, f"ce_bwd<{types[0]}, {types[1]}>", _grid(z.size), (BLOCK,),
                  [*arrays, rt.i64(outer), rt.i64(classes), rt.i64(inner), *options])
    grads = {}
    if need_z:
        grads["logits"] = rt.into(out, "logits", dz)
    if need_t:
        grads["target"] = rt.into(out, "target", dt)
    return grads
