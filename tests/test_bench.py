"""``python -m portable_nn bench --quick``: the CI smoke test of the benchmark suite.

It runs every workload in a fresh process (as a user would) and checks the JSON
report's structure: each workload measured for each contender and phase, ratios
where PyTorch ran, GB/s for the memory-bound workloads, first-call latencies.
Timings themselves are not asserted: benchmarks are not tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pnn_testing import HAS_TORCH
from portable_nn.bench.workloads import WORKLOADS


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "report.json"
    done = subprocess.run([sys.executable, "-m", "portable_nn", "bench", "--quick", "--json", str(path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(path.read_text()), done.stdout


def test_every_workload_is_measured_for_every_phase(quick_report):
    report, text = quick_report
    assert "QUICK RUN" in text and "copy bandwidth" in text
    measured = {(r["workload"], r["contender"], r["phase"]) for r in report["rows"]}
    for w in WORKLOADS:
        contenders = {c for (name, c, _) in measured if name == w.name}
        assert "reference" in contenders, w.name
        if HAS_TORCH:
            assert "torch" in contenders, w.name
        for contender in contenders:
            assert (w.name, contender, "fwd") in measured
            assert (w.name, contender, "fwd+bwd") in measured
    assert all(r["median_ms"] > 0 for r in report["rows"])


def test_ratios_bandwidth_and_first_call_are_reported(quick_report):
    report, _ = quick_report
    assert report["copy_gbps"] > 0
    rows = report["rows"]
    if HAS_TORCH:
        assert all(r["ratio_vs_torch"] > 0 for r in rows)
    memory_bound = [r for r in rows if r["workload"].startswith(("layer_norm", "max_pool", "log_softmax"))]
    assert memory_bound and all(0 < r["fraction_of_copy"] for r in memory_bound)
    assert all(r["ratio_vs_reference"] > 0 for r in rows if r["contender"] not in ("reference", "torch"))
    assert "layer_norm" in report["first_call"]
    assert report["first_call"]["layer_norm"]["warm_cache_s"] > 0
