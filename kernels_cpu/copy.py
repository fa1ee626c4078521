"""A parallel copy: the memory-bandwidth roofline the benchmark reports kernels against."""

from __future__ import annotations

from numba import njit, prange

from . import _runtime


@njit(parallel=True, cache=True, error_model="numpy", nogil=True)
def _copy(src, dst):
    n = src.shape[0]
    block = 1 << 16
    for k in prange((n + block - 1) // block):
        start = k * block
        stop = min(n, start + block)
        d = dst[start:stop]
        s = src[start:stop]
        for i in range(stop - start):
            d[i] = s[i]


def parallel_copy(src, dst):
    """dst[:] = src for 1-D contiguous arrays, with all Numba threads."""
    with _runtime.parallel_section():
        _copy(src, dst)
