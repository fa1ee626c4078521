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

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["gemm"]

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
