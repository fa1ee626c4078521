"""A general matrix product callable from ``@njit`` code: strides (leading dimensions), offsets,
transposes and ``beta`` — what ``np.dot`` inside a kernel cannot express.

``np.dot`` in nopython mode takes contiguous 2-D arrays and overwrites its output.  The
convolution kernels need more: products over *shifted, strided* row blocks of one buffer
(``rows p .. p + m`` of a channels-last image, every row ``lda`` elements apart) accumulated
into the same output (``beta = 1``).  :func:`gemm` gives that, on the BLAS that Numba's own
``np.dot`` calls (SciPy's, through Numba's ``numba_xxgemm`` helper, so kernels using it cache
like any other), for row-major operands::

    C[c_off + i·ldc + j] = alpha · Σ_k A'[i, k] · B'[k, j] + beta · C[c_off + i·ldc + j]
    A'[i, k] = A[a_off + i·lda + k]  (or A[a_off + k·lda + i] with trans_a)
    B'[k, j] = B[b_off + k·ldb + j]  (or B[b_off + j·ldb + k] with trans_b)

for ``0 <= i < m``, ``0 <= j < n``, ``0 <= k < kk``.  Nothing is checked: the caller keeps
every index inside its arrays (BLAS reads and writes raw memory).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _runtime

__all__ = ["gemm", "parallel_gemm", "power_of_two", "span"]

_FLOATS = (types.float32, types.float64)


@intrinsic
def gemm(typingctx, trans_a, trans_b, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc):
    """Row-major ``C = alpha·op(A)·op(B) + beta·C`` on flat (or any C-contiguous) float arrays.

    Args:
        trans_a, trans_b: nonzero to use the operand transposed.
        m, n, kk: the product's shape ``(m, kk) @ (kk, n)``.
        alpha, beta: scalars of the arrays' dtype.
        a, b, c: float32 or float64 arrays of one dtype; ``c`` writable.
        a_off, b_off, c_off: element offsets of the operands' first elements.
        lda, ldb, ldc: elements between consecutive rows (row-major leading dimensions).

    Returns:
        BLAS's status (0; negative when no BLAS could be loaded).
    """
    arrays = (a, b, c)
    if not all(isinstance(t, types.Array) for t in arrays) or c.dtype not in _FLOATS:
        return None
    if a.dtype != c.dtype or b.dtype != c.dtype:
        return None
    from numba.np.linalg import ensure_blas

    ensure_blas()  # SciPy's BLAS bindings, as np.dot inside a kernel needs them
    dt = c.dtype
    sig = types.int32(trans_a, trans_b, m, n, kk, dt, a, a_off, lda, b, b_off, ldb, dt, c, c_off, ldc)

    def codegen(context, builder, signature, args):
        al, be = args[5], args[12]
        tys = signature.args
        char = ir.IntType(8)
        void_p = char.as_pointer()
        intp = context.get_value_type(types.intp)
        fnty = ir.FunctionType(ir.IntType(32),
                               [char, char, char, intp, intp, intp, void_p, void_p, intp, void_p, intp, void_p,
                                void_p, intp])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")

        def index(i):
            return context.cast(builder, args[i], tys[i], types.intp)

        def pointer(i_array, i_offset):
            data = context.make_array(tys[i_array])(context, builder, value=args[i_array]).data
            return builder.bitcast(builder.gep(data, [index(i_offset)]), void_p)

        def flag(i):
            on = builder.icmp_unsigned("!=", index(i), context.get_constant(types.intp, 0))
            return builder.select(on, ir.Constant(char, ord("t")), ir.Constant(char, ord("n")))

        kind = ir.Constant(char, ord("s" if dt == types.float32 else "d"))
        alpha_slot = cgutils.alloca_once_value(builder, al)
        beta_slot = cgutils.alloca_once_value(builder, be)
        # Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: BLAS gets the operands swapped.
        return builder.call(fn, (kind, flag(1), flag(0), index(3), index(2), index(4),
                                 builder.bitcast(alpha_slot, void_p), pointer(9, 10), index(11), pointer(6, 7),
                                 index(8), builder.bitcast(beta_slot, void_p), pointer(13, 14), index(15)))

    return sig, codegen


# --------------------------------------------------------------------------- a product split across our threads

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}


@njit(inline="always", **_OPTS)
def span(p, parts, size):
    """[start, stop) of part p when ``size`` items are cut into ``parts`` equal parts (the last shorter)."""
    step = (size + parts - 1) // parts
    start = p * step
    return start, min(size, start + step)


def power_of_two(parts: int) -> int:
    """The largest power of two <= parts: 2, 4 or 8 threads then share the parts evenly (three parts on
    two threads take as long as two: a (128, 784) @ (784, 32) product, 78 vs 50 us)."""
    return 1 << (parts.bit_length() - 1)


@njit(inline="always", **_OPTS)
def _part(p, parts, by_rows, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc):
    """Part p of ``parts``: the product's output rows [i0, i1) (``by_rows``; row i of op(A) starts at
    i·lda, or at i when transposed) or its output columns (column j of op(B) at j, or j·ldb)."""
    i0, i1 = span(p, parts, m if by_rows else n)
    if i1 <= i0:
        return
    if by_rows:
        gemm(ta, tb, i1 - i0, n, kk, alpha, a, a_off + (i0 if ta else i0 * lda), lda, b, b_off, ldb, beta, c,
             c_off + i0 * ldc, ldc)
    else:
        gemm(ta, tb, m, i1 - i0, kk, alpha, a, a_off, lda, b, b_off + (i0 * ldb if tb else i0), ldb, beta, c,
             c_off + i0, ldc)


@njit(parallel=True, **_OPTS)
def _gemm_parallel(parts, by_rows, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc):
    for p in prange(parts):
        _part(np.int64(p), parts, by_rows, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off,
              ldc)


@njit(**_OPTS)
def _gemm_serial(parts, by_rows, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc):
    """The same parts one after another (one thread allowed): the same products, the same bits."""
    for p in range(parts):
        _part(p, parts, by_rows, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc)


@njit(inline="always", **_OPTS)
def _k_part(p, step, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, partial):
    """Part p of the inner dimension: partial[p] = op(A)[:, k0:k1] @ op(B)[k0:k1, :]."""
    k0 = p * step
    k1 = min(kk, k0 + step)
    out = partial[p].reshape(-1)
    if k1 <= k0:
        out[:] = 0.0
        return
    gemm(ta, tb, m, n, k1 - k0, alpha, a, a_off + (k0 * lda if ta else k0), lda, b, b_off + (k0 if tb else k0 * ldb),
         ldb, alpha * 0.0, out, 0, n)


@njit(parallel=True, **_OPTS)
def _k_parallel(step, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, partial):
    for p in prange(partial.shape[0]):
        _k_part(np.int64(p), step, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, partial)


@njit(**_OPTS)
def _k_serial(step, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, partial):
    for p in range(partial.shape[0]):
        _k_part(p, step, ta, tb, m, n, kk, alpha, a, a_off, lda, b, b_off, ldb, partial)


#: Output rows (or columns) of one part of :func:`parallel_gemm` at least: narrower parts lose
#: BLAS efficiency (a (32, 64) part of a K=12800 product ran at 51 GFLOP/s, (256, 64) at 97).
MIN_PART = 128
#: Multiply-adds of a whole product at least before it is split (measured: a parallel
#: launch costs ~10-20 us).
MIN_PARALLEL_MACS = 1 << 20
#: The most parts a product is split into: fixed by the shape, never by the thread count, so every
#: output element is computed the same way whatever the number of threads.
MAX_PARTS = 8
#: Products with a small output (at most this many elements) and a long inner dimension (weight
#: gradients: dW = dAᵀ·X over every time step) are split along the inner dimension instead, in
#: parts of K_PART, into partial outputs summed in part order: BLAS runs such a product at its
#: best in chunks of 512-1024 (114 GFLOP/s for (256, 64) outputs, one thread, vs 97 for K=12800).
K_SPLIT_MAX_OUTPUT = 1 << 16
K_PART = 1024


def parallel_gemm(ta, tb, m, n, kk, a, a_off, lda, b, b_off, ldb, beta, c, c_off=0, ldc=None):
    """:func:`gemm` (alpha 1) from Python, split into parts that run on our threads.

    Arrays are flat (``reshape(-1)`` of C-contiguous arrays); arguments as :func:`gemm`.  The
    longer output side is split (rows, or columns), or for small outputs the inner dimension
    (see K_SPLIT_MAX_OUTPUT); each part is one BLAS product on one thread (the runtime keeps
    BLAS at one thread during our calls), so no BLAS worker is left spinning afterwards.  The
    parts depend on the shape only: the result does not depend on the thread count.
    """
    ldc = n if ldc is None else ldc
    dt = c.dtype.type
    if m * n * kk < MIN_PARALLEL_MACS and not _runtime.every_variant_active():
        _gemm_serial(1, True, ta, tb, m, n, kk, dt(1.0), a, a_off, lda, b, b_off, ldb, dt(beta), c, c_off, ldc)
        return
    if m * n <= K_SPLIT_MAX_OUTPUT and kk >= 2 * K_PART and ldc == n:
        parts = power_of_two(min(MAX_PARTS * 2, -(-kk // K_PART)))
        step = -(-kk // parts)
        partial = np.empty((parts, m, n), c.dtype)
        _runtime.run_sized(_k_parallel, _k_serial, True, step, ta, tb, m, n, kk, dt(1.0), a, a_off, lda, b, b_off,
                           ldb, partial)
        target = c[c_off : c_off + m * n].reshape(m, n)
        total = partial.sum(axis=0)  # in part order
        if beta:
            target *= dt(beta)
            target += total
        else:
            target[...] = total
        return
    by_rows = m >= n
    parts = power_of_two(max(1, min(MAX_PARTS, (m if by_rows else n) // MIN_PART)))
    _runtime.run_sized(_gemm_parallel, _gemm_serial, parts > 1, parts, by_rows, ta, tb, m, n, kk, dt(1.0), a, a_off,
                       lda, b, b_off, ldb, dt(beta), c, c_off, ldc)
