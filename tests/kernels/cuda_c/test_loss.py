"""The CUDA C log_softmax and cross_entropy kernels in the emulator against the reference."""

from __future__ import annotations

import pytest

from kernels_gpu.cuda_c import loss as closs

from .cuda_c_testing import ALL_DTYPES, LOSS_SPECS, emulated_case, needs_emulator


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

