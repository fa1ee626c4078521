"""gpu-check without a GPU: the report, the goals, the measured preference, the bridge's plumbing.

The GPU run itself (tests + benchmark on a device) is exercised on a CUDA machine by
``python -m portable_nn gpu-check``; these tests pin everything around it that does
not need a device, so the command cannot rot while no GPU is at hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import dispatch, gpu_check, preference
from portable_nn.bench import Report, Row
from portable_nn.bench.gpu import goal_checks
from portable_nn.bench.workloads import CPU, WORKLOADS, Placement
from portable_nn.bridge import Bridge


def _report() -> Report:
    rows = [
        Row("layer_norm (8192,4096) float16", "cupy", "fwd", 0.10, 64 << 20, gbps=2600.0, fraction_of_copy=0.87),
        Row("layer_norm (8192,4096) float16", "cupy", "bwd", 0.30, 96 << 20, gbps=1500.0, fraction_of_copy=0.50),
        Row("layer_norm (8192,4096) float16", "cupy", "fwd+bwd", 0.40, 0),
        Row("layer_norm (8192,4096) float16", "torch", "fwd+bwd", 0.50, 0),
        Row("cross_entropy (4096,32000)", "cupy", "fwd", 0.3, 1 << 20, gbps=2000.0, fraction_of_copy=0.67),
        Row("cross_entropy (4096,32000)", "cupy", "bwd", 0.3, 1 << 20, gbps=2700.0, fraction_of_copy=0.90),
        Row("lstm 2 layers I=H=64 N=256 T=50", "numba_cuda", "fwd+bwd", 4.0, 0),
        Row("lstm 2 layers I=H=64 N=256 T=50", "cupy", "fwd+bwd", 3.0, 0),
        Row("lstm 2 layers I=H=64 N=256 T=50", "torch", "fwd+bwd", 3.5, 0),
    ]
    report = Report({"device": "test GPU"}, 3000.0, rows)
    from portable_nn.bench.gpu import _fill_ratios

    _fill_ratios(report)
    return report


def test_ratios_are_torch_time_over_ours():
    rows = {(r.workload[:4], r.contender, r.phase): r for r in _report().rows}
    assert rows[("laye", "cupy", "fwd+bwd")].ratio_vs_torch == pytest.approx(1.25)
    assert rows[("lstm", "numba_cuda", "fwd+bwd")].ratio_vs_torch == pytest.approx(3.5 / 4.0)


def test_goal_checks_apply_the_gpu_thresholds():
    checks = {(row, goal): ok for row, goal, ok in goal_checks(_report())}
    ln = "layer_norm (8192,4096) float16 [cupy, {}]"
    assert checks[(ln.format("fwd"), ">= 85% of copy bandwidth")] is True
    assert checks[(ln.format("bwd"), ">= 70% of copy bandwidth")] is False
    ce = "cross_entropy (4096,32000) [cupy, {}]"
    assert checks[(ce.format("fwd"), ">= 85% of copy bandwidth")] is False
    assert checks[(ce.format("bwd"), ">= 85% of copy bandwidth")] is True
    assert checks[(ln.format("fwd+bwd"), ">= 1.0x PyTorch")] is True
    assert checks[("lstm 2 layers I=H=64 N=256 T=50 [numba_cuda, fwd+bwd]", ">= 1.0x PyTorch")] is False
    assert checks[("lstm 2 layers I=H=64 N=256 T=50 [cupy, fwd+bwd]", ">= 1.0x PyTorch")] is True
    assert not any("torch" in row.split("[")[1] for row, _ in checks)  # PyTorch is the baseline, not a contender


def test_preference_picks_the_faster_gpu_backend_per_op():
    assert gpu_check.preference_from(_report()) == {"lstm": "cupy"}


def test_markdown_report_has_every_section():
    text = gpu_check.format_markdown(
        "cupy sees 1 GPU(s)",
        {"tests": 5, "passed": 4, "failures": 1, "errors": 0, "skipped": 0, "seconds": 12.0,
         "failed": ["tests/test_norm.py::test_x — AssertionError"]},
        _report(), {"lstm": "cupy"},
    )
    for needle in ("# portable_nn gpu-check", "## Backends", "| numba_cuda |", "4 passed, 1 failed",
                   "tests/test_norm.py::test_x", "3000 GB/s", "| lstm 2 layers I=H=64 N=256 T=50 | cupy | fwd+bwd |",
                   "1.17x", "### GPU goals: 4/7 met", "| lstm | cupy |"):
        assert needle in text, needle


def test_junit_parsing(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(textwrap.dedent("""\
        <testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">
          <testcase classname="tests.test_a" name="test_ok"/>
          <testcase classname="tests.test_a" name="test_bad">
            <failure message="assert 1 == 2&#10;more">x</failure></testcase>
          <testcase classname="tests.test_a" name="test_skip"><skipped/></testcase>
        </testsuite></testsuites>"""))
    got = gpu_check._parse_junit(xml)
    assert (got["tests"], got["passed"], got["failures"], got["skipped"]) == (3, 1, 1, 1)
    assert got["failed"] == ["tests.test_a::test_bad — assert 1 == 2"]


def test_command_without_a_gpu_says_why_and_exits_2(tmp_path):
    if dispatch.backend_status("cupy"):
        pytest.skip("this machine has a GPU")
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "portable_nn", "gpu-check", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no GPU for portable_nn" in proc.stdout
    assert "| cupy | no |" in out.read_text()


# --------------------------------------------------------------------------- measured preference


def _impl(backend: str, priority: int) -> dispatch.Implementation:
    return dispatch.Implementation("layer_norm", backend, forward=lambda call: None, priority=priority)


def test_preference_file_round_trip_and_order(tmp_path, monkeypatch):
    monkeypatch.setenv(preference.PREFERENCE_ENV, str(tmp_path / "pref.json"))
    monkeypatch.setattr(preference, "_cached", None)
    assert dispatch.gpu_preference() == {}  # no file: the static order
    impls = [_impl("gpu_a", 4), _impl("gpu_b", 3)]
    assert dispatch._effective_priority(impls[1], impls) == 3
    try:
        path = dispatch.save_gpu_preference({"layer_norm": "gpu_b"}, "test GPU")
        assert json.loads(path.read_text())["preference"] == {"layer_norm": "gpu_b"}
        monkeypatch.setattr(preference, "_cached", None)  # a new process reads the file
        assert dispatch.gpu_preference() == {"layer_norm": "gpu_b"}
        assert dispatch._effective_priority(impls[1], impls) > dispatch._effective_priority(impls[0], impls)
        with pytest.raises(ValueError, match="unknown ops"):
            dispatch.save_gpu_preference({"frobnicate": "gpu_a"}, "test GPU")
    finally:
        monkeypatch.setattr(preference, "_cached", None)
        dispatch._forget_choices()


def test_preference_ranks_among_the_gpu_backends_only(tmp_path, monkeypatch):
    """A measured GPU backend goes ahead of the other GPU backend, not ahead of PyTorch's kernels
    (cuDNN on CUDA tensors), which outrank both."""
    monkeypatch.setenv(preference.PREFERENCE_ENV, str(tmp_path / "pref.json"))
    monkeypatch.setattr(preference, "_cached", None)
    import kernels_aten

    declared = dispatch.backends.declared()
    priority = {"cupy": declared["cupy"].priority, "numba_cuda": declared["numba_cuda"].priority,
                "aten": kernels_aten.PRIORITY["lstm"]}
    impls = [dispatch.Implementation("lstm", name, forward=lambda call: None, priority=p)
             for name, p in priority.items()]
    try:
        dispatch.save_gpu_preference({"lstm": "numba_cuda"}, "test GPU")
        cupy, numba_cuda, aten = (dispatch._effective_priority(i, impls) for i in impls)
        assert cupy < numba_cuda < aten
    finally:
        monkeypatch.setattr(preference, "_cached", None)
        dispatch._forget_choices()


def test_a_corrupt_preference_file_is_ignored(tmp_path, monkeypatch):
    bad = tmp_path / "pref.json"
    bad.write_text("{not json")
    monkeypatch.setenv(preference.PREFERENCE_ENV, str(bad))
    monkeypatch.setattr(preference, "_cached", None)
    try:
        assert dispatch.gpu_preference() == {}
    finally:
        monkeypatch.setattr(preference, "_cached", None)


# --------------------------------------------------------------------------- placement and bridge


def test_cpu_placement_keeps_workloads_as_they_were():
    cases = next(w for w in WORKLOADS if w.op == "cross_entropy").build(True, CPU)
    assert cases.bytes_moved["fwd"] == 256 * 1000 * 4
    half = Placement("cpu", "float16")
    assert half.nbytes(np.ones((3, 4), np.float32)) == 24
    assert half.array(np.arange(3)).dtype == np.int64  # targets keep their integer dtype
    assert Placement("cpu", "float64").array(np.ones(2, np.float32)).dtype == np.float64


def test_bridge_is_inactive_for_native_arrays_and_numpy_for_cpu_torch():
    torch = pytest.importorskip("torch")
    assert not Bridge("numpy", "numpy").active
    assert not Bridge("cupy", "cupy", "cuda:0").active  # CuPy arrays need no bridge
    bridge = Bridge("torch", "numpy")
    t = torch.ones(3)
    view = bridge.inward(t)
    assert isinstance(view, np.ndarray) and np.shares_memory(view, t.numpy())
    assert bridge.context().__enter__() is None  # a CPU kernel runs where it is


def test_cuda_index_parsing():
    from portable_nn import _arrays

    assert [_arrays.cuda_index(d) for d in ("cuda", "cuda:0", "cuda:3")] == [0, 0, 3]


def test_capability_notes_name_the_cuda_bridge():
    rows = pnn.capabilities()
    gpu_rows = [r for r in rows if r["backend"] in ("cupy", "numba_cuda")]
    for r in gpu_rows:
        assert "torch CUDA tensors zero-copy" in r["notes"], r


def test_gpu_timing_waits_for_the_device_around_every_burst():
    """The GPU suite's timer is the CPU one with a device synchronisation ending each sample."""
    from portable_nn.bench import time_interleaved

    events = []
    timed = time_interleaved({"a": lambda: events.append("call")}, 3, settle_s=0.0, burst_s=0.0,
                             wait=lambda: events.append("wait"))
    assert set(timed) == {"a"} and timed["a"] >= 0
    # warm-up, calibration, then three bursts of one call, each between two waits
    assert events == ["call", "wait", "call", "wait"] + ["wait", "call", "wait"] * 3


def test_gpu_tests_default_to_the_kernel_and_adapter_suites(monkeypatch):
    """The API tests' GPU cases (about 67,000 on an H200 host) take an hour: gpu-check runs the kernel
    and adapter GPU tests unless asked for ``--full``."""
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append((cmd, kwargs["timeout"]))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    gpu_check.run_tests(quick=False)
    gpu_check.run_tests(quick=False, full=True)
    (default, t_default), (full, t_full) = seen
    assert all(p in default for p in gpu_check.KERNEL_TEST_PATHS) and "-m" in default
    assert not any(p in full for p in gpu_check.KERNEL_TEST_PATHS)
    assert t_default == gpu_check.TEST_TIMEOUT_S < t_full == gpu_check.FULL_TEST_TIMEOUT_S


def test_ops_selects_workloads_by_names_holding_commas(monkeypatch, tmp_path):
    """``--ops "(8192,4096) float32,cross_entropy (4096,32000)"`` picks those rows (a plain comma split
    selected "(4096" and ran the whole suite on a GPU machine)."""
    import argparse

    seen = {}

    def fake_suite(quick, progress=None, selectors=None, on_row=None):
        seen["selectors"] = selectors
        return Report({"device": "test GPU"}, 3000.0, [])

    monkeypatch.setattr(gpu_check, "gpu_status", lambda: (True, "a test GPU"))
    monkeypatch.setattr("portable_nn.bench.gpu.run_gpu_suite", fake_suite)
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    args = parser.parse_args(["--skip-tests", "--out", str(tmp_path / "r.md"),
                              "--ops", "(8192,4096) float32,cross_entropy (4096,32000)"])
    assert gpu_check.main(args) == 0
    assert seen["selectors"] == ["(8192,4096) float32", "cross_entropy (4096,32000)"]
