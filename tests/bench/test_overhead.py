"""The per-call cost benchmark (``python -m portable_nn.bench.overhead``): its cases run on both array
libraries and through the PyTorch adapter and match PyTorch's calls, its module pairs are twins, and
one quick run prints every row of both tables (timings are never asserted)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn.bench import overhead

torch = pytest.importorskip("torch")
pnt = pytest.importorskip("portable_nn.torch")


@pytest.mark.parametrize("case", overhead.cases(), ids=lambda c: c.name)
def test_each_case_computes_what_pytorch_does(case):
    theirs = case.theirs(*case.build("torch")).numpy()
    ours = {"NumPy arrays": np.asarray(case.ours(pnn, *case.build("numpy"))),
            "torch tensors": case.ours(pnn, *case.build("torch")).numpy(),
            "portable_nn.torch": case.ours(pnt, *case.build("torch")).detach().numpy()}
    for how, result in ours.items():
        np.testing.assert_allclose(result, theirs, rtol=1e-4, atol=1e-5, err_msg=how)


@pytest.mark.parametrize("pair", overhead.module_pairs(), ids=lambda p: p.name)
def test_module_pairs_share_the_layer(pair):
    mine, base = pair.ours(), pair.theirs()
    assert type(mine).__name__ == type(base).__name__ and mine.state_dict().keys() == base.state_dict().keys()
    mine.load_state_dict(base.state_dict())
    x = torch.randn(*pair.shape, requires_grad=True)
    y_mine, y_base = pair.output(mine(x)), pair.output(base(x))
    torch.testing.assert_close(y_mine, y_base, rtol=1e-4, atol=1e-5)
    grads = [torch.autograd.grad(y.sum(), [x, *m.parameters()]) for y, m in ((y_mine, mine), (y_base, base))]
    for g_mine, g_base in zip(*grads):
        torch.testing.assert_close(g_mine, g_base, rtol=1e-4, atol=1e-5)


def test_the_new_module_rows_are_there():
    names = [p.name for p in overhead.module_pairs()]
    assert "BatchNorm2d(8) (4,8,4,4)" in names and "LSTM(16,16) (5,4,16)" in names


def test_quick_mode_leaves_resnet18_out_unless_named():
    steps, skipped = overhead.chosen_steps(None, quick=True)
    assert not any(s.slow for s in steps) and len(skipped) == 1 and "resnet18" in skipped[0]
    steps, skipped = overhead.chosen_steps("resnet18", quick=True)
    assert [s.name.split()[0] for s in steps] == ["resnet18"] and not skipped
    assert any(s.slow for s in overhead.chosen_steps(None, quick=False)[0])


def test_unknown_isa_is_refused():
    with pytest.raises(SystemExit):
        overhead.parse_args(["--isa", "avx1024"])


def test_model_table_has_a_column_group_per_isa_and_marks_missing_figures():
    rows = [overhead.ModelRow("step A", {"native": {"ours": 0.001, "theirs": 0.002}}, None)]
    lines = overhead.format_model_table(rows, ["native", "avx2"], in_process=True)
    assert "native, own processes" in lines[0] and "avx2, own processes" in lines[0] and "in-process" in lines[0]
    assert lines[2].startswith("step A") and "2.00x" in lines[2] and lines[2].split().count("-") == 6


def _rows(out: list[str], header: str) -> list[str]:
    """The table rows after the line starting with ``header`` (up to a blank line or an indented note)."""
    start = next(i for i, line in enumerate(out) if line.startswith(header)) + 1
    rows = []
    for line in out[start:]:
        if not line.strip() or line.startswith("  "):
            break
        rows.append(line)
    return rows


def test_quick_run_prints_a_row_per_case_library_and_model_step(capsys):
    argv = ["--quick", "--repeats", "1", "--ops", "layer_norm,LayerNorm,LSTM", "--models", "784-32-10,demo LSTM",
            "--in-process"]
    assert overhead.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "microseconds per call" in out[0] and "(" in out[0]  # the CPU model and its vector ISA
    calls = _rows(out, "call ")
    assert [r.split("  ")[0].strip() for r in calls] == (["layer_norm (4,64)"] * 3 + ["LayerNorm(64) (4,64)",
                                                                                      "LSTM(16,16) (5,4,16)"])
    assert [r[33:51].strip() for r in calls[:3]] == ["NumPy arrays", "torch tensors", "portable_nn.torch"]
    assert all(r.rstrip().endswith("x") for r in calls)
    section = next(i for i, line in enumerate(out) if line.startswith("small-model steps"))
    assert "(" in out[section] and "own processes" in out[section + 1]
    models = _rows(out, "model step (ms per step)")
    assert [r.split("  ")[0] for r in models] == ["MLP 784-32-10 gradient, batch 32",
                                                  "MLP 784-32-10 gradient, batch 128",
                                                  "demo LSTM training step (Adam), batch 32"]
    assert all(len(re.findall(r" \d+\.\d+x", r)) == 2 for r in models), models  # own processes, in-process
