"""The CUDA C dense and conv kernels (their GEMM epilogues) in the emulator and on the device."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu.cuda_c import conv as cconv
from kernels_gpu.cuda_c import dense as cdense

from .cuda_c_testing import GEMM_DTYPES, _call, _rng, emulated_case, gpu_compare, needs_emulator


def dense_specs():
    r = _rng(6)
    return [
        ("dense-bias-gelu", "dense", (r.standard_normal((5, 7)), r.standard_normal((4, 7)), r.standard_normal(4)),
         {"activation": "gelu"}),
        ("dense-3d-relu", "dense", (r.standard_normal((2, 3, 7)), r.standard_normal((9, 7)), r.standard_normal(9)),
         {"activation": "relu"}),
        ("dense-1d-nobias-tanh", "dense", (r.standard_normal(7), r.standard_normal((4, 7))), {"activation": "tanh"}),
        ("dense-identity-bias", "dense", (r.standard_normal((40, 3)), r.standard_normal((5, 3)), r.standard_normal(5)),
         {}),
        ("dense-plain", "dense", (r.standard_normal((4, 3)), r.standard_normal((5, 3))), {}),
        ("dense-zero-rows", "dense", (np.zeros((0, 3)), r.standard_normal((5, 3)), r.standard_normal(5)),
         {"activation": "silu"}),
    ]


def conv_specs():
    r = _rng(7)
    return [
        ("conv2d-pad-stride-bias-relu", "conv", (r.standard_normal((2, 4, 7, 6)), r.standard_normal((6, 4, 3, 3)),
                                                 r.standard_normal(6)),
         {"stride": 2, "padding": 1, "activation": "relu"}),
        ("conv2d-groups-dilation", "conv", (r.standard_normal((2, 4, 7, 8)), r.standard_normal((6, 2, 2, 3)),
                                            r.standard_normal(6)),
         {"dilation": (2, 1), "groups": 2, "padding": ((1, 0), (2, 1))}),
        ("conv2d-nhwc-same-silu", "conv", (r.standard_normal((2, 5, 6, 4)), r.standard_normal((3, 4, 3, 3)),
                                           r.standard_normal(3)),
         {"padding": "same", "channel_axis": -1, "activation": "silu"}),
        ("conv1d-depthwise", "conv", (r.standard_normal((3, 4, 9)), r.standard_normal((4, 1, 3))),
         {"groups": 4, "stride": 2, "padding": 1}),
        ("conv1d-unbatched-nlc", "conv", (r.standard_normal((9, 3)), r.standard_normal((2, 3, 2)),
                                          r.standard_normal(2)), {"channel_axis": -1, "activation": "gelu_tanh"}),
        ("conv3d", "conv", (r.standard_normal((1, 2, 4, 5, 4)), r.standard_normal((3, 2, 2, 3, 2)),
                            r.standard_normal(3)), {"stride": (1, 2, 1), "padding": 1}),
        ("conv2d-1x1-direct", "conv", (r.standard_normal((2, 4, 3, 5)), r.standard_normal((6, 4, 1, 1)),
                                       r.standard_normal(6)), {"activation": "sigmoid"}),
        ("conv2d-1x1-direct-plain", "conv", (r.standard_normal((2, 4, 3, 5)), r.standard_normal((6, 4, 1, 1))), {}),
    ]


def conv_transpose_specs():
    r = _rng(8)
    return [
        ("convT2d-stride2-pad1-outpad1-groups2-relu", "conv_transpose",
         (r.standard_normal((2, 4, 3, 4)), r.standard_normal((4, 3, 3, 3)), r.standard_normal(6)),
         {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "activation": "relu"}),
        ("convT1d-dilation2-gelu", "conv_transpose",
         (r.standard_normal((2, 3, 5)), r.standard_normal((3, 2, 3)), r.standard_normal(2)),
         {"dilation": 2, "padding": 1, "activation": "gelu"}),
        ("convT3d", "conv_transpose",
         (r.standard_normal((1, 2, 2, 3, 2)), r.standard_normal((2, 2, 2, 2, 2)), r.standard_normal(2)),
         {"stride": (2, 1, 2), "padding": (0, 1, 0)}),
        ("convT2d-nhwc-outpad-gelu", "conv_transpose",
         (r.standard_normal((2, 3, 4, 4)), r.standard_normal((4, 2, 3, 2)), r.standard_normal(2)),
         {"stride": (1, 2), "padding": (1, 0), "output_padding": (0, 1), "channel_axis": -1, "activation": "gelu"}),
        ("convT1d-unbatched-nlc-relu", "conv_transpose",
         (r.standard_normal((5, 3)), r.standard_normal((3, 2, 2)), r.standard_normal(2)),
         {"stride": 3, "output_padding": 2, "channel_axis": -1, "activation": "relu"}),
        ("convT2d-unbatched-plain", "conv_transpose",
         (r.standard_normal((4, 3, 3)), r.standard_normal((4, 2, 2, 2))), {"groups": 2}),
        ("convT1d-1x1-dilation-outpad", "conv_transpose",
         (r.standard_normal((2, 4, 5)), r.standard_normal((4, 3, 1)), r.standard_normal(3)),
         {"dilation": 2, "output_padding": 1}),
        ("convT2d-1x1-direct", "conv_transpose",
         (r.standard_normal((2, 4, 3, 3)), r.standard_normal((4, 6, 1, 1)), r.standard_normal(6)),
         {"activation": "relu"}),
    ]


DENSE_SPECS = dense_specs()


CONV_SPECS = conv_specs()


#: conv_transpose runs conv's kernels for the convolution it transposes (conv.py's launchers).
CONV_TRANSPOSE_SPECS = conv_transpose_specs()


GEMM_SPECS = DENSE_SPECS + CONV_SPECS + CONV_TRANSPOSE_SPECS


def _gemm_needs(call):
    needs = {"x", "weight"}
    if call.bias is not None:
        needs.add("bias")
    return needs


@needs_emulator
@pytest.mark.parametrize("spec", GEMM_SPECS, ids=[s[0] for s in GEMM_SPECS])
def test_emulated_dense_conv(spec, monkeypatch):
    for module in (cdense, cconv):
        monkeypatch.setattr(module, "BLOCK", 32)
        monkeypatch.setattr(module, "MAX_BLOCKS", 3)
    monkeypatch.setattr(cdense, "GRAD_BLOCK", (32, 2))
    monkeypatch.setattr(cdense, "TARGET_BLOCKS", 8)
    monkeypatch.setattr(cdense, "FINALIZE_BLOCK", 32)
    module = cdense if spec[1] == "dense" else cconv
    for dtype, mixed in GEMM_DTYPES:
        call = _call(spec[1], spec[2], spec[3], dtype, mixed)
        for needs in (_gemm_needs(call), {"weight"}, {"x"}):
            emulated_case(module, f"{spec[1]}_forward", f"{spec[1]}_backward", spec, dtype, mixed, needs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec", GEMM_SPECS, ids=[s[0] for s in GEMM_SPECS])
def test_gpu_dense_conv_match_reference(spec, dtype):
    gpu_compare(spec, dtype, False, tol_factor=2.0)


@pytest.mark.parametrize("spec", GEMM_SPECS, ids=[s[0] for s in GEMM_SPECS])
def test_gpu_comparison_runs_on_numpy(spec):
    """The device comparison's own steps (the public call, cotangents, the reference), run on NumPy
    through the reference: a slip in them shows without a GPU."""
    gpu_compare(spec, "float64", False, lib="numpy", backend="reference")
