"""The synchronised batch-norm benchmark runs its three contenders on two processes (tiny shapes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from portable_nn.bench import distributed


def test_measure_times_every_contender(capsys):
    distributed.main(["--shape", "3,2,4,4", "--rounds", "1", "--steps", "1"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("batch norm forward+backward, 2 processes")
    rows = [line for line in table if line.startswith("| ") and "ms per step" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == list(distributed._contenders(2))
    assert all(float(r.split(" | ")[1]) > 0 for r in rows)
