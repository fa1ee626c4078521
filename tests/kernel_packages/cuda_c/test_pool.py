"""The CUDA C pooling kernels (and, on the device, pooling and losses) against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu.cuda_c import pool as cpool

from .cuda_c_testing import ALL_DTYPES, LOSS_SPECS, _rng, emulated_case, gpu_compare, needs_emulator


def pool_specs():
    r = _rng(2)
    ties = np.round(r.standard_normal((2, 3, 7, 6)))  # many equal values: the first maximum wins
    nan = r.standard_normal((2, 2, 6, 6))
    nan[0, 0, 1, 1] = np.nan
    nan[1, 1, 4, 2:4] = np.nan
    return [
        ("max2d-pad-ceil", "max_pool", (ties, 3), {"stride": 2, "padding": 1, "ceil_mode": True}),
        ("max1d-nlc-dil", "max_pool", (r.standard_normal((3, 9, 4)), (3,)),
         {"stride": 2, "dilation": 2, "channel_axis": -1}),
        ("max3d", "max_pool", (r.standard_normal((1, 2, 5, 4, 6)), 2), {}),
        ("max2d-unbatched-overlap", "max_pool", (ties[0], (2, 3)), {"stride": 1}),
        ("max-nan", "max_pool", (nan, 2), {}),
        ("max-pad-only-windows", "max_pool", (r.standard_normal((1, 2, 3, 3)), 2),
         {"stride": 2, "padding": 1, "ceil_mode": True}),
        ("max2d-indices", "max_pool", (ties, 3), {"stride": 2, "padding": 1, "ceil_mode": True,
                                                   "return_indices": True}),
        ("max1d-nlc-indices", "max_pool", (r.standard_normal((3, 9, 4)), (3,)),
         {"stride": 2, "dilation": 2, "channel_axis": -1, "return_indices": True}),
        ("avg2d-exclude-pad-ceil", "avg_pool", (r.standard_normal((2, 3, 7, 6)), 3),
         {"stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False}),
        ("avg2d-nhwc", "avg_pool", (r.standard_normal((2, 5, 6, 3)), 2), {"padding": 1, "channel_axis": -1}),
        ("avg1d-overlap", "avg_pool", (r.standard_normal((2, 3, 9)), 4), {"stride": 3, "padding": 2}),
        ("avg3d-unbatched", "avg_pool", (r.standard_normal((2, 4, 5, 6)), (2, 2, 2)), {"stride": (1, 2, 2)}),
        ("avg2d-divisor-override", "avg_pool", (r.standard_normal((2, 3, 7, 6)), 3),
         {"stride": 2, "padding": 1, "ceil_mode": True, "divisor_override": -5}),
    ]


POOL_SPECS = pool_specs()


def unpool_specs():
    """max_unpool of overlapping pools' indices (duplicates: the last entry wins), both layouts, 1-3-D."""
    r = _rng(5)
    dup = np.array([[[[0, 0, 5], [5, 7, 0]]]])  # duplicates within one plane
    nhwc = r.integers(0, 20, (2, 3, 2, 4))
    return [
        ("unpool2d-duplicates", "max_unpool", (r.standard_normal((1, 1, 2, 3)), dup, 2), {}),
        ("unpool2d-output-size", "max_unpool", (r.standard_normal((2, 3, 4, 3)), r.integers(0, 42, (2, 3, 4, 3)), 3),
         {"stride": 2, "padding": 1, "output_size": (7, 6)}),
        ("unpool2d-nhwc", "max_unpool", (r.standard_normal((2, 3, 2, 4)), nhwc, 2), {"channel_axis": -1}),
        ("unpool1d-unbatched", "max_unpool", (r.standard_normal((3, 5)), r.integers(0, 10, (3, 5)), (2,)), {}),
        ("unpool3d", "max_unpool", (r.standard_normal((1, 2, 2, 2, 3)), r.integers(0, 96, (1, 2, 2, 2, 3)), 2), {}),
    ]


UNPOOL_SPECS = unpool_specs()


@needs_emulator
@pytest.mark.parametrize("spec", POOL_SPECS, ids=[s[0] for s in POOL_SPECS])
def test_emulated_pool(spec, monkeypatch):
    monkeypatch.setattr(cpool, "BLOCK", 32)
    monkeypatch.setattr(cpool, "MAX_BLOCKS", 3)  # the kernels' grid-stride loops run
    for dtype, mixed in ALL_DTYPES:
        emulated_case(cpool, "pool_forward", "pool_backward", spec, dtype, mixed, {"x"})


@needs_emulator
@pytest.mark.parametrize("spec", UNPOOL_SPECS, ids=[s[0] for s in UNPOOL_SPECS])
def test_emulated_unpool(spec, monkeypatch):
    monkeypatch.setattr(cpool, "BLOCK", 32)
    monkeypatch.setattr(cpool, "MAX_BLOCKS", 3)
    for dtype, mixed in ALL_DTYPES:
        emulated_case(cpool, "unpool_forward", "unpool_backward", spec, dtype, mixed, {"x"})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,mixed", ALL_DTYPES, ids=[d for d, _ in ALL_DTYPES])
@pytest.mark.parametrize("spec", POOL_SPECS + UNPOOL_SPECS + LOSS_SPECS,
                         ids=[s[0] for s in POOL_SPECS + UNPOOL_SPECS + LOSS_SPECS])
def test_gpu_pool_loss_match_reference(spec, dtype, mixed):
    gpu_compare(spec, dtype, mixed, tol_factor=2.0)


HOST_SPECS = POOL_SPECS + UNPOOL_SPECS + LOSS_SPECS


@pytest.mark.parametrize("spec", HOST_SPECS, ids=[s[0] for s in HOST_SPECS])
def test_gpu_comparison_runs_on_numpy(spec):
    """The device comparison's own steps (the public call, cotangents, the reference), run on NumPy
    through the reference: a slip in them shows without a GPU."""
    gpu_compare(spec, "float64", False, lib="numpy", backend="reference")
