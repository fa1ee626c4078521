"""The Numba-CUDA dense, conv and conv_transpose kernels on the device against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

from .numba_cuda_testing import _gpu_vjp_check


def _gpu_params_check(fn, x, params, kw, dtype):
    """``fn(x, *params, **kw)`` on CuPy (params float32 for float16 data) against the reference."""
    import cupy

    pdt = "float32" if dtype == "float16" else dtype
    x = x.astype(dtype)
    params = [p.astype(pdt) for p in params]
    tol = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3}[dtype]
    _gpu_vjp_check(fn, (cupy.asarray(x), *map(cupy.asarray, params)),
                   (x.astype(np.float64), *(p.astype(np.float64) for p in params)), kw, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("x_shape", "n_out", "bias", "activation"), [
    ((33, 70), 45, True, "gelu"),
    ((2, 5, 16), 300, True, "relu"),
    ((64,), 8, False, "identity"),
    ((1000, 3), 7, True, "silu"),
    ((9, 12), 5, True, ("leaky_relu", 0.2)),
])
def test_gpu_dense_matches_reference(x_shape, n_out, bias, activation, dtype):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((n_out, x_shape[-1])) / np.sqrt(x_shape[-1])]
    if bias:
        params.append(rng.standard_normal(n_out))
    _gpu_params_check(pnn.dense, rng.standard_normal(x_shape), params, {"activation": activation}, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("x_shape", "w_shape", "bias", "kw"), [
    ((2, 6, 17), (8, 3, 5), True, {"groups": 2, "stride": 2, "padding": 2, "activation": "relu"}),
    ((2, 4, 13, 11), (6, 4, 3, 3), True, {"padding": "same", "dilation": 2, "activation": "gelu"}),
    ((2, 9, 8, 8), (8, 2, 3, 3), False, {"groups": 4, "channel_axis": -1, "stride": (2, 1), "padding": 1}),
    ((3, 6, 5, 4), (3, 1, 3, 2, 2), True, {"groups": 3, "padding": ((1, 0), 1, 0), "activation": "tanh"}),
    ((16, 12, 12), (16, 1, 3, 3), True, {"groups": 16, "padding": 1, "activation": "silu"}),
])
def test_gpu_conv_matches_reference(x_shape, w_shape, bias, kw, dtype):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))]
    if bias:
        params.append(rng.standard_normal(w_shape[0]))
    _gpu_params_check(pnn.conv, rng.standard_normal(x_shape), params, kw, dtype)



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("x_shape", "w_shape", "bias", "kw"), [
    ((2, 4, 7, 6), (4, 3, 3, 3), True, {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2,
                                        "activation": "relu"}),
    ((2, 6, 17), (6, 4, 5), True, {"dilation": 2, "padding": 2, "activation": "gelu"}),
    ((2, 8, 8, 9), (9, 2, 3, 3), False, {"groups": 3, "channel_axis": -1, "stride": (2, 1), "padding": 1}),
    ((3, 5, 4, 4), (3, 2, 3, 2, 2), True, {"stride": (1, 2, 2), "padding": (1, 0, 1), "activation": "tanh"}),
    ((6, 9, 9), (6, 4, 4, 4), True, {"stride": 2, "padding": 1}),
])
def test_gpu_conv_transpose_matches_reference(x_shape, w_shape, bias, kw, dtype):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))]
    if bias:
        params.append(rng.standard_normal(kw.get("groups", 1) * w_shape[1]))
    _gpu_params_check(pnn.conv_transpose, rng.standard_normal(x_shape), params, kw, dtype)
