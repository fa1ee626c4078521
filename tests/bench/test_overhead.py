"""The per-call cost benchmark (``python -m portable_nn.bench.overhead``): its cases run on both array
libraries and match PyTorch's calls, and one quick run prints every row (timings are never asserted)."""

from __future__ import annotations

import numpy as np
import pytest

from portable_nn.bench import overhead

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("case", overhead.cases(), ids=lambda c: c.name)
def test_each_case_computes_what_pytorch_does(case):
    ours_np = np.asarray(case.ours(*case.build("numpy")))
    ours_torch = case.ours(*case.build("torch"))
    theirs = case.theirs(*case.build("torch"))
    np.testing.assert_allclose(ours_np, theirs.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours_torch.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-5)


def test_module_pairs_share_the_layer():
    for _, ours, theirs, shape in overhead.module_pairs():
        mine, base = ours(), theirs()
        assert isinstance(mine, type(base)) and mine.state_dict().keys() == base.state_dict().keys()
        mine.load_state_dict(base.state_dict())
        x = torch.randn(*shape)
        torch.testing.assert_close(mine(x), base(x), rtol=1e-4, atol=1e-5)


def test_quick_run_prints_a_row_per_case_and_library(capsys):
    assert overhead.main(["--quick", "--repeats", "1", "--ops", "layer_norm,LayerNorm"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "microseconds per call" in out[0]
    rows = out[2:]
    assert [r.split("  ")[0].strip() for r in rows] == ["layer_norm (4,64)"] * 2 + ["LayerNorm(64) (4,64)"]
    assert all(r.rstrip().endswith("x") for r in rows)
