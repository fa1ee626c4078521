"""Numba kernels for the dense layer, forward and backward (backend ``"numba"``).

Supported: what the api accepts for NumPy (and CPU torch) float32/float64 C-contiguous data —
any leading shape (a 1-D ``x``, zero rows, zero features), with or without bias, every fused
activation.  With ``x`` flattened to ``X (M, in)`` and ``W (out, in)``::

    forward:   Z = X @ Wᵀ  (BLAS, into the output buffer),  then in one pass  y = act(Z + b)
    backward:  g = dy · act'(kept)  and  db = Σ_rows g  (one pass over dy, row by row; the sums
               in float64, each row summed while in cache),  dW = gᵀ @ X,  dX = g @ W  (BLAS)

``kept`` is ``y`` when act' is a function of the output (identity, relu, sigmoid, tanh,
leaky_relu with a positive slope), else the pre-activation ``z`` (kept only when a backward
will follow; for the identity nothing is kept and g is dy itself).

Small layers (the MLP's, a few MFLOP) are all Python overhead and BLAS: each pass is one
serial ``@njit`` call that runs the product (``np.dot`` on contiguous 2-D arrays inside the
kernel) and then the epilogue, with no thread pool of ours (PERFORMANCE.md §6: a parallel
launch costs more than such a layer), behind a wrapper that does as little Python as it can.
Large layers call the product from Python (NumPy's BLAS, threaded as it sees fit) and run the
epilogue and the gradient pass in parallel over fixed row blocks, whose float64 bias partials
are summed in block order: results are reproducible run to run and across thread counts.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from portable_nn.reference.activations import keeps_output_only

from . import _runtime
from ._runtime import into as _into
from .activations import apply_kind, deriv_kind, rectifier_slope

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}
# Below this many output elements the epilogue and gradient passes run serially, in the same
# call as the products (PERFORMANCE.md §6: parallel pays above ~50 µs of work).
PARALLEL_MIN_ELEMENTS = 1 << 18
# Rows per parallel task (fixed, so the bias-gradient partials do not depend on the thread count).
BLOCK_ROWS = 256


# --------------------------------------------------------------------------- epilogue and gradient pass
#
# Loop nests take an activation *kind* as a literal (0 identity, 1 relu or leaky_relu, 2 any
# other, called): see ``kernels_cpu.conv`` for why (branchy relu loops, compile time).


@njit(inline="always", **_OPTS)
def _epilogue_rows(z, b, y, r0, r1, keep_z, kind, code, slope):
    """Rows [r0, r1): z += b (kept) and y = act(z), or y = act(y + b) in place."""
    for i in range(r0, r1):
        zr = z[i]
        yr = y[i]
        if keep_z:
            for j in range(zr.shape[0]):
                zr[j] += b[j]
            for j in range(zr.shape[0]):
                yr[j] = apply_kind(np.float64(zr[j]), kind, code, slope)
        else:
            for j in range(zr.shape[0]):
                yr[j] = apply_kind(np.float64(zr[j] + b[j]), kind, code, slope)


@njit(**_OPTS)
def _epilogue(z, b, y, r0, r1, keep_z, code, slope):
    if code == 0:
        _epilogue_rows(z, b, y, r0, r1, keep_z, 0, code, slope)
    elif code == 1 or code == 7:
        _epilogue_rows(z, b, y, r0, r1, keep_z, 1, code, rectifier_slope(code, slope))
    else:
        _epilogue_rows(z, b, y, r0, r1, keep_z, 2, code, slope)


@njit(inline="always", **_OPTS)
def _grad_rows(dy, k, g, db, r0, r1, kind, code, slope, from_output):
    """Rows [r0, r1): g = dy · act'(k), and db += Σ_rows g in float64 (row by row, in order; the
    row is summed in a second loop while in cache, so stores and sums do not serialise)."""
    for i in range(r0, r1):
        d = dy[i]
        kv = k[i]
        gr = g[i]
        for j in range(d.shape[0]):
            gr[j] = d[j] * deriv_kind(np.float64(kv[j]), kind, code, slope, from_output)
        for j in range(d.shape[0]):
            db[j] += gr[j]


@njit(**_OPTS)
def _grad(dy, k, g, db, r0, r1, code, slope, from_output):
    if code == 0:
        _grad_rows(dy, k, g, db, r0, r1, 0, code, slope, from_output)
    elif (code == 1 or code == 7) and from_output:
        _grad_rows(dy, k, g, db, r0, r1, 1, code, rectifier_slope(code, slope), from_output)
    else:
        _grad_rows(dy, k, g, db, r0, r1, 2, code, slope, from_output)


# --------------------------------------------------------------------------- serial kernels (product included)


@njit(**_OPTS)
def _forward_serial(x, w, b, y, z, keep_z, code, slope):
    """Z = X @ Wᵀ into z (kept) or y, then the epilogue."""
    target = z if keep_z else y
    np.dot(x, w.T, target)
    _epilogue(target, b, y, np.int64(0), x.shape[0], keep_z, code, slope)  # typed 0: a literal compiles anew


@njit(**_OPTS)
def _backward_serial(x, w, dy, k, g, dx, dw, db, code, slope, from_output, need_x, need_w):
    """g and db in one pass (skipped for the identity: g is dy), then dW = gᵀ @ X and dX = g @ W."""
    if code == 0:
        for i in range(dy.shape[0]):
            d = dy[i]
            for j in range(d.shape[0]):
                db[j] += d[j]
        g = dy
    else:
        _grad(dy, k, g, db, np.int64(0), dy.shape[0], code, slope, from_output)
    if need_w:
        np.dot(g.T, x, dw)
    if need_x:
        np.dot(g, w, dx)


# --------------------------------------------------------------------------- parallel passes (large layers)


@njit(inline="always", **_OPTS)
def _rows_task(t, backward, a, k, b, out, dbp, keep_z, code, slope, from_output):
    """Row block t: the epilogue (a = z, out = y) or the gradient pass (a = dy, k = kept, out = g,
    the block's bias partial in dbp[t])."""
    r0 = t * BLOCK_ROWS
    r1 = min(a.shape[0], r0 + BLOCK_ROWS)
    if backward:
        _grad(a, k, out, dbp[t], r0, r1, code, slope, from_output)
    else:
        _epilogue(a, b, out, r0, r1, keep_z, code, slope)


@njit(parallel=True, **_OPTS)
def _rows_parallel(backward, a, k, b, out, dbp, keep_z, code, slope, from_output):
    """Row blocks in parallel.  One parallel kernel for both passes: each costs seconds to compile."""
    for t in prange((a.shape[0] + BLOCK_ROWS - 1) // BLOCK_ROWS):
        # prange indices are unsigned: keep the serial signature
        _rows_task(np.int64(t), backward, a, k, b, out, dbp, keep_z, code, slope, from_output)


@njit(**_OPTS)
def _rows_serial(backward, a, k, b, out, dbp, keep_z, code, slope, from_output):
    """The same, one block after another (one thread allowed, or a forked child)."""
    for t in range((a.shape[0] + BLOCK_ROWS - 1) // BLOCK_ROWS):
        _rows_task(t, backward, a, k, b, out, dbp, keep_z, code, slope, from_output)


# --------------------------------------------------------------------------- entry points


def _target(out, name, shape, dtype):
    """The caller's ``out`` buffer when the kernel can write into it directly, else a new array."""
    buffer = out.get(name)
    if buffer is not None and buffer.flags.c_contiguous and buffer.dtype == dtype:
        return buffer
    return np.empty(shape, dtype)


def dense_forward(call):
    """y = act(x @ weightᵀ + bias); residuals (x rows, weight, kept y or z, x's shape, activation).

    The MLP's layers are all overhead (tens of µs of Python per call against ~100 µs of BLAS), so
    this wrapper reads the call's tables directly and keeps a plain tuple, not a copy of the call.
    """
    arrays, params = call.arrays, call.params
    x, w, b = arrays["x"], arrays["weight"], arrays["bias"]
    dtype = x.dtype
    n_in, n_out = x.shape[-1], w.shape[0]
    x2 = x.reshape(x.size // n_in if n_in else int(np.prod(x.shape[:-1])), n_in)
    m = x2.shape[0]
    if b is None:
        b = np.zeros(n_out, dtype)
    act_ = params["activation"]
    code, slope = act_.code, act_.slope
    from_output = keeps_output_only(act_)
    keep_z = call.save and not from_output
    y2 = np.empty((m, n_out), dtype)
    z2 = np.empty((m, n_out), dtype) if keep_z else y2
    if m * n_out < PARALLEL_MIN_ELEMENTS:
        _forward_serial(x2, w, b, y2, z2, keep_z, code, slope)
    else:
        np.matmul(x2, w.T, out=z2)
        _runtime.run_sized(_rows_parallel, _rows_serial, True,
                           False, z2, z2, b, y2, np.empty((0, 0)), keep_z, code, slope, from_output)
    residuals = None
    if call.save:
        kept = None if code == 0 else (y2 if from_output else z2)
        residuals = (x2, w, kept, x.shape, code, slope, from_output)
    return (y2.reshape((*x.shape[:-1], n_out)),), residuals


def dense_backward(residuals, cotangents, needs, out=None):
    """dx, dweight and dbias: one gradient pass (with the bias sum), two products."""
    x2, w, kept, x_shape, code, slope, from_output = residuals
    out = out or {}
    dtype = x2.dtype
    m, n_in = x2.shape
    n_out = w.shape[0]
    dy2 = cotangents[0]
    if dy2.dtype != dtype or not dy2.flags.c_contiguous:
        dy2 = np.ascontiguousarray(dy2, dtype=dtype)
    dy2 = dy2.reshape(m, n_out)
    k2 = dy2 if kept is None else kept
    need_x, need_w = "x" in needs, "weight" in needs
    dx = _target(out, "x", x_shape, dtype) if need_x else None
    dx2 = dx.reshape(m, n_in) if need_x else np.empty((0, n_in), dtype)
    dw = _target(out, "weight", w.shape, dtype) if need_w else np.empty((0, n_in), dtype)
    if m * n_out < PARALLEL_MIN_ELEMENTS:
        db = np.zeros(n_out)
        g = np.empty((m, n_out) if code else (0, n_out), dtype)
        _backward_serial(x2, w, dy2, k2, g, dx2, dw, db, code, slope, from_output, need_x, need_w)
    else:
        dbp = np.zeros((-(-m // BLOCK_ROWS), n_out))
        g = np.empty((m, n_out), dtype)
        _runtime.run_sized(_rows_parallel, _rows_serial, True,
                           True, dy2, k2, np.empty(0, dtype), g, dbp, False, code, slope, from_output)
        db = dbp.sum(axis=0)
        if need_w:
            np.matmul(g.T, x2, out=dw)
        if need_x:
            np.matmul(g, w, out=dx2)
    grads = {}
    if need_x:
        grads["x"] = _into(out, "x", dx)
    if need_w:
        grads["weight"] = _into(out, "weight", dw)
    if "bias" in needs:
        grads["bias"] = _into(out, "bias", db.astype(dtype))
    return grads

