"""The CUDA C log_softmax and cross_entropy kernels in the emulator against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu.cuda_c import loss as closs

from .cuda_c_testing import ALL_DTYPES, LOSS_SPECS, _rng, emulated_case, gpu_compare, needs_emulator


@needs_emulator
@pytest.mark.parametrize("spec", LOSS_SPECS, ids=[s[0] for s in LOSS_SPECS])
def test_emulated_loss(spec, monkeypatch):
    monkeypatch.setattr(closs, "BLOCK", 32)
    monkeypatch.setattr(closs, "MAX_BLOCKS", 2)
    monkeypatch.setattr(closs, "REDUCE_BLOCK", 32)
    _, op, args, kwargs = spec
    probabilities = op == "cross_entropy" and args[1].dtype.kind == "f"
    dtypes = ALL_DTYPES + ([("float16", True), ("bfloat16", True)] if "weight" in kwargs else [])
    for dtype, mixed in dtypes:
        fwd, bwd = f"{op}_forward", f"{op}_backward"
        needs = {"x"} if op == "log_softmax" else ({"logits", "target"} if probabilities else {"logits"})
        emulated_case(closs, fwd, bwd, spec, dtype, mixed, needs, tol_factor=2.0)



def _large_loss_specs():
    r = _rng(11)
    labels = r.integers(0, 32000, 64)
    labels[3] = -100
    return [
        ("lsm-rows-32000", "log_softmax", (r.standard_normal((64, 32000)),), {}),
        ("ce-rows-32000-mean", "cross_entropy", (r.standard_normal((64, 32000)) * 3, labels), {}),
        ("ce-rows-32000-smooth", "cross_entropy", (r.standard_normal((64, 32000)) + 50, labels),
         {"label_smoothing": 0.1, "reduction": "sum"}),
    ]


LARGE_LOSS_SPECS = _large_loss_specs()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,mixed", ALL_DTYPES, ids=[f"{d}{'+f32' if m else ''}" for d, m in ALL_DTYPES])
@pytest.mark.parametrize("spec", LOSS_SPECS + LARGE_LOSS_SPECS, ids=[s[0] for s in LOSS_SPECS + LARGE_LOSS_SPECS])
def test_gpu_loss_matches_reference(spec, dtype, mixed):
    gpu_compare(spec, dtype, mixed, tol_factor=2.0)


def _offset_specs():
    r = _rng(12)
    labels = np.array([0, 4, 2, 1, 3, 1])
    return [
        ("lsm-rows-offset", "log_softmax", (r.standard_normal((6, 40)) + 1000,), {}),
        ("lsm-cols-offset", "log_softmax", (r.standard_normal((3, 4)) + 1000,), {"axis": 0}),
        ("ce-rows-offset", "cross_entropy", (r.standard_normal((6, 5)) + 1000, labels), {"label_smoothing": 0.2}),
        ("ce-cols-offset", "cross_entropy", (r.standard_normal((6, 5, 3)) + 1000, r.integers(0, 5, (6, 3))),
         {"reduction": "none"}),
    ]


@needs_emulator
@pytest.mark.parametrize("spec", _offset_specs(), ids=[s[0] for s in _offset_specs()])
def test_emulated_loss_keeps_float32_digits_at_a_large_offset(spec, monkeypatch):
    """log-probabilities are formed as (x − max) − log Σ: x − (max + log Σ) lost 4e-5 relative at
    offset 1000 in float32 on an H200, twice the float32 tolerance."""
    monkeypatch.setattr(closs, "BLOCK", 32)
    _, op, _, _ = spec
    needs = {"x"} if op == "log_softmax" else {"logits"}
    emulated_case(closs, f"{op}_forward", f"{op}_backward", spec, "float32", False, needs, tol_factor=0.1)


def _special_specs():
    r = _rng(13)
    z = r.standard_normal((6, 40))
    z[1, 3], z[2, 5], z[3, :], z[4, 7] = np.nan, np.inf, -np.inf, -np.inf
    labels = np.array([0, 3, 5, 2, 7, 1])
    return [
        ("lsm-rows-special", "log_softmax", (z,), {}),
        ("lsm-cols-special", "log_softmax", (z.T.copy(),), {"axis": 0}),
        ("ce-rows-special", "cross_entropy", (z, labels), {"reduction": "none", "label_smoothing": 0.1}),
        ("ce-cols-special", "cross_entropy", (z.reshape(6, 40, 1).repeat(2, axis=2), np.stack([labels] * 2, 1)),
         {"reduction": "none"}),
    ]


@needs_emulator
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's own inf − inf
@pytest.mark.parametrize("spec", _special_specs(), ids=[s[0] for s in _special_specs()])
def test_emulated_loss_special_values(spec, monkeypatch):
    """NaN, +inf (the row's log-sum-exp is NaN, as in PyTorch), −inf entries and all −inf rows: the
    one-pass row kernels agree with the reference where every output is NaN, inf or finite."""
    monkeypatch.setattr(closs, "BLOCK", 32)
    _, op, _, _ = spec
    needs = {"x"} if op == "log_softmax" else {"logits"}
    emulated_case(closs, f"{op}_forward", f"{op}_backward", spec, "float32", False, needs)
