"""A parallel copy: the memory-bandwidth roofline the benchmark reports kernels against."""

from __future__ import annotations

from numba import njit, prange

from . import _runtime

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}
_BLOCK = 1 << 16


@njit(inline="always", **_OPTS)
def _copy_block(k, src, dst):
    start = k * _BLOCK
    stop = min(src.shape[0], start + _BLOCK)
    d = dst[start:stop]
    s = src[start:stop]
    for i in range(stop - start):
        d[i] = s[i]


@njit(parallel=True, **_OPTS)
def _copy(src, dst):
    for k in prange((src.shape[0] + _BLOCK - 1) // _BLOCK):
        _copy_block(k, src, dst)


@njit(**_OPTS)
def _copy_serial(src, dst):
    for k in range((src.shape[0] + _BLOCK - 1) // _BLOCK):
        _copy_block(k, src, dst)


def parallel_copy(src, dst):
    """dst[:] = src for 1-D contiguous arrays, with the threads portable_nn may use."""
    _runtime.run_sized(_copy, _copy_serial, True, src, dst)
