"""The Numba-CUDA pooling kernels on the device against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

from .numba_cuda_testing import _gpu_vjp_check


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("op", "shape", "kw"), [
    ("max_pool", (2, 3, 11, 9), {"window": 3, "stride": 2, "padding": 1, "dilation": (2, 1), "ceil_mode": True}),
    ("max_pool", (2, 6, 7, 4), {"window": (2, 2), "channel_axis": -1}),
    ("max_pool", (3, 17), {"window": (4,), "stride": 3, "padding": 2}),
    ("avg_pool", (2, 3, 5, 6, 7), {"window": 3, "stride": 2, "padding": 1, "count_include_pad": False,
                                   "ceil_mode": True}),
    ("avg_pool", (2, 9, 8, 5), {"window": 3, "padding": 1, "channel_axis": -1}),
])
def test_gpu_pools_match_reference(op, shape, kw, dtype):
    import cupy

    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}[dtype]
    _gpu_vjp_check(getattr(pnn, op), (cupy.asarray(x),), (x.astype(np.float64),), kw, tol)

