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

Tiny layers (up to ``SERIAL_MAX_MACS``) are all Python overhead and BLAS: each pass is one
serial ``@njit`` call that runs the product (``np.dot`` on contiguous 2-D arrays inside the
kernel) and then the epilogue, with no thread pool of ours (measured: a parallel
launch costs more than such a layer), behind a wrapper that does as little Python as it can.
Larger layers (the MLP's 784->32 already) run in parts fixed by the shape, on our threads:
each part one single-threaded BLAS product (the runtime keeps BLAS at one thread during our
calls, so no BLAS worker spins afterwards) with its rows' epilogue or gradient pass; float64
bias partials are summed in part order, so results are reproducible run to run and across
thread counts.  Measured, (128, 784) @ (784, 32)ᵀ + relu, 2 threads, Xeon with AVX-512: one
part (one BLAS thread) 79 us forward, two parts on our threads 57 us (backward, weight and bias
gradients: 81 -> 71 us).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from portable_nn.kernel_codes import IDENTITY, keeps_output_only

from . import _runtime
from ._blas import gemm, power_of_two, span
from ._runtime import into as _into
from .activations import (
    act_grad_from_output_row,
    act_grad_row,
    act_row,
    apply_kind,
    deriv_kind,
    is_rectifier,
    rectifier_slope,
)

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}
# --------------------------------------------------------------------------- epilogue and gradient pass
#
# Loop nests take an activation *kind* as a literal (0 identity, 1 relu or leaky_relu): see
# ``kernels_cpu.conv`` for why (branchy relu loops, compile time).  Every other activation runs on
# whole rows in the vector loops of activations.act_row / act_grad_row, in the row's dtype: per
# element through a called float64 function, a (2048, 512) -> 512 float32 layer with silu took
# 40.9 ms forward and backward against the identity's 20.5 (2 threads, AMD Zen 5).


@njit(inline="always", **_OPTS)
def _epilogue_rows(z, b, y, r0, r1, keep_z, kind, code, slope):
    """Rows [r0, r1): z += b (kept) and y = act(z), or y = act(y + b) in place.  Kind 2 (neither the
    identity nor a rectifier) writes z + b per element, then act_row's vector loop along the row."""
    each = 0 if kind == 2 else kind
    for i in range(r0, r1):
        zr = z[i]
        yr = y[i]
        if keep_z:
            for j in range(zr.shape[0]):
                zr[j] += b[j]
            for j in range(zr.shape[0]):
                yr[j] = apply_kind(np.float64(zr[j]), each, code, slope)
        else:
            for j in range(zr.shape[0]):
                yr[j] = apply_kind(np.float64(zr[j] + b[j]), each, code, slope)
        if kind == 2:
            act_row(yr, code, slope)


@njit(**_OPTS)
def _epilogue(z, b, y, r0, r1, keep_z, code, slope):
    if code == IDENTITY:
        _epilogue_rows(z, b, y, r0, r1, keep_z, 0, code, slope)
    elif is_rectifier(code):
        _epilogue_rows(z, b, y, r0, r1, keep_z, 1, code, rectifier_slope(code, slope))
    else:
        _epilogue_rows(z, b, y, r0, r1, keep_z, 2, code, slope)


@njit(inline="always", **_OPTS)
def _grad_rows(dy, k, g, db, r0, r1, kind, code, slope, from_output):
    """Rows [r0, r1): g = dy · act'(k), and db += Σ_rows g in float64 (row by row, in order; the
    row is summed in a second loop while in cache, so stores and sums do not serialise).  Kind 2
    copies dy, then multiplies by act' in act_grad_row's (or, from y, act_grad_from_output_row's)
    vector loop along the row."""
    each = 0 if kind == 2 else kind
    for i in range(r0, r1):
        d = dy[i]
        kv = k[i]
        gr = g[i]
        for j in range(d.shape[0]):
            gr[j] = d[j] * deriv_kind(np.float64(kv[j]), each, code, slope, from_output)
        if kind == 2:
            if from_output:
                act_grad_from_output_row(kv, gr, code, slope)
            else:
                act_grad_row(kv, gr, code, slope)
        for j in range(d.shape[0]):
            db[j] += gr[j]


@njit(**_OPTS)
def _grad(dy, k, g, db, r0, r1, code, slope, from_output):
    if code == IDENTITY:
        _grad_rows(dy, k, g, db, r0, r1, 0, code, slope, from_output)
    elif is_rectifier(code) and from_output:
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
    if code == IDENTITY:
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


# --------------------------------------------------------------------------- blocked passes (larger layers)
#
# Above SERIAL_MAX_MACS a layer runs in parts fixed by its shape (so results do not depend on the
# thread count), each part one BLAS product on one thread plus its share of the epilogue:
#
#   forward:   rows [r0, r1) of Z = X @ Wᵀ, then y = act(Z + b) on those rows
#   backward:  rows [r0, r1) of g = dy · act'(kept), their bias partial, and dX = g @ W on them;
#              then the parts of dW = gᵀ @ X, split along dW's longer side


@njit(inline="always", **_OPTS)
def _forward_part(p, parts, x, w, b, y, z, keep_z, code, slope):
    r0, r1 = span(p, parts, x.shape[0])
    if r1 <= r0:
        return
    n_in, n_out = x.shape[1], w.shape[0]
    target = z if keep_z else y
    gemm(0, 1, r1 - r0, n_out, n_in, x.dtype.type(1.0), x.reshape(-1), r0 * n_in, n_in, w.reshape(-1), 0, n_in,
         x.dtype.type(0.0), target.reshape(-1), r0 * n_out, n_out)
    _epilogue(target, b, y, r0, r1, keep_z, code, slope)


@njit(inline="always", **_OPTS)
def _gradient_part(p, parts, w, dy, k, g, dx, dbp, code, slope, from_output, need_x):
    """Rows of g (g is dy itself for the identity: code 0), their bias partial dbp[p], and dX on them."""
    r0, r1 = span(p, parts, dy.shape[0])
    if r1 <= r0:
        return
    n_out, n_in = w.shape
    if code == IDENTITY:
        acc = dbp[p]
        for i in range(r0, r1):
            d = dy[i]
            for j in range(n_out):
                acc[j] += d[j]
    else:
        _grad(dy, k, g, dbp[p], r0, r1, code, slope, from_output)
    if need_x:
        gemm(0, 0, r1 - r0, n_in, n_out, g.dtype.type(1.0), g.reshape(-1), r0 * n_out, n_out, w.reshape(-1), 0, n_in,
             g.dtype.type(0.0), dx.reshape(-1), r0 * n_in, n_in)


@njit(inline="always", **_OPTS)
def _weight_part(p, parts, x, g, dw):
    """Part p of dW = gᵀ @ X: a block of dW's rows (output units) or columns (inputs), the longer side."""
    m, n_in = x.shape
    n_out = g.shape[1]
    one, zero = x.dtype.type(1.0), x.dtype.type(0.0)
    if n_out >= n_in:
        o0, o1 = span(p, parts, n_out)
        if o1 > o0:
            gemm(1, 0, o1 - o0, n_in, m, one, g.reshape(-1), o0, n_out, x.reshape(-1), 0, n_in, zero,
                 dw.reshape(-1), o0 * n_in, n_in)
    else:
        c0, c1 = span(p, parts, n_in)
        if c1 > c0:
            gemm(1, 0, n_out, c1 - c0, m, one, g.reshape(-1), 0, n_out, x.reshape(-1), c0, n_in, zero,
                 dw.reshape(-1), c0, n_in)


@njit(parallel=True, **_OPTS)
def _forward_parallel(parts, x, w, b, y, z, keep_z, code, slope):
    for p in prange(parts):
        _forward_part(np.int64(p), parts, x, w, b, y, z, keep_z, code, slope)


@njit(**_OPTS)
def _forward_parts(parts, x, w, b, y, z, keep_z, code, slope):
    """The same parts one after another (one thread allowed, or a forked child)."""
    for p in range(parts):
        _forward_part(p, parts, x, w, b, y, z, keep_z, code, slope)


@njit(parallel=True, **_OPTS)
def _backward_parallel(parts, wparts, x, w, dy, k, g, dx, dw, dbp, code, slope, from_output, need_x, need_w):
    for p in prange(parts):
        _gradient_part(np.int64(p), parts, w, dy, k, g, dx, dbp, code, slope, from_output, need_x)
    if need_w:
        for p in prange(wparts):
            _weight_part(np.int64(p), wparts, x, g, dw)


@njit(**_OPTS)
def _backward_parts(parts, wparts, x, w, dy, k, g, dx, dw, dbp, code, slope, from_output, need_x, need_w):
    """The same parts one after another."""
    for p in range(parts):
        _gradient_part(p, parts, w, dy, k, g, dx, dbp, code, slope, from_output, need_x)
    if need_w:
        for p in range(wparts):
            _weight_part(p, wparts, x, g, dw)


#: Layers with fewer multiply-adds run serially, product and epilogue in one compiled call (a
#: parallel launch costs more than it saves below ~1M, measured) ...
SERIAL_MAX_MACS = 1 << 20
#: ... larger ones in about one part per PART_MACS multiply-adds, at most MAX_PARTS parts, each
#: with at least MIN_PART_ROWS rows (or dW rows/columns).
PART_MACS = 1 << 20
MAX_PARTS = 8
MIN_PART_ROWS = 16


def _parts(macs, side):
    """Parts of a pass over ``side`` rows: fixed by the shape (results do not depend on the thread count),
    a power of two (see :func:`~kernels_cpu._blas.power_of_two`)."""
    return power_of_two(max(1, min(MAX_PARTS, macs // PART_MACS, side // MIN_PART_ROWS)))


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
    y2 = _runtime.empty((m, n_out), dtype)
    z2 = _runtime.empty((m, n_out), dtype) if keep_z else y2
    macs = m * n_in * n_out
    if macs <= SERIAL_MAX_MACS and not _runtime.every_variant_active():
        _forward_serial(x2, w, b, y2, z2, keep_z, code, slope)
    else:
        parts = _parts(macs, m)
        _runtime.run_sized(_forward_parallel, _forward_parts, parts > 1, parts, x2, w, b, y2, z2, keep_z, code,
                           slope)
    residuals = None
    if call.save:
        kept = None if code == IDENTITY else (y2 if from_output else z2)
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
    macs = m * n_in * n_out
    if macs <= SERIAL_MAX_MACS and not _runtime.every_variant_active():
        db = np.zeros(n_out)
        g = np.empty((m, n_out) if code else (0, n_out), dtype)
        _backward_serial(x2, w, dy2, k2, g, dx2, dw, db, code, slope, from_output, need_x, need_w)
    else:
        if not dy2.flags.writeable:  # g may be dy itself, and the kernels are typed for writable arrays
            dy2 = dy2.copy()
            k2 = dy2 if kept is None else kept
        parts = _parts(macs, m)
        wparts = _parts(macs, max(n_in, n_out)) if need_w else 1
        dbp = np.zeros((parts, n_out))
        g = dy2 if code == IDENTITY else _runtime.empty((m, n_out), dtype)
        _runtime.run_sized(_backward_parallel, _backward_parts, max(parts, wparts) > 1, parts, wparts, x2, w, dy2,
                           k2, g, dx2, dw, dbp, code, slope, from_output, need_x, need_w)
        db = dbp.sum(axis=0)
    grads = {}
    if need_x:
        grads["x"] = _into(out, "x", dx)
    if need_w:
        grads["weight"] = _into(out, "weight", dw)
    if "bias" in needs:
        grads["bias"] = _into(out, "bias", db.astype(dtype))
    return grads

