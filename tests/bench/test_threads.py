"""The thread-scaling benchmark (``python -m portable_nn.bench.threads``): its thread counts, the
workloads it takes, and one quick run's table (timings themselves are never asserted)."""

from __future__ import annotations

from portable_nn.bench import threads
from portable_nn.bench.workloads import WORKLOADS


def test_thread_counts_double_up_to_the_cores():
    assert threads.thread_counts(1) == [1]
    assert threads.thread_counts(2) == [1, 2]
    assert threads.thread_counts(6) == [1, 2, 4, 6]
    assert threads.thread_counts(8) == [1, 2, 4, 8]


def test_every_workload_with_numba_kernels_is_measured():
    measured = [w.name for w in WORKLOADS if threads.has_numba_kernel(w)]
    assert any("layer_norm" in n for n in measured) and any("conv_transpose" in n for n in measured)
    assert any(w.name.startswith("lstm") for w in WORKLOADS if threads.has_numba_kernel(w))


def test_quick_run_prints_each_phase_with_its_speed_up(capsys):
    assert threads.main(["--quick", "--ops", "rms_norm", "--threads", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "usable cores" in out[0] and "2 threads" in out[1]
    rows = [line for line in out[2:] if line.startswith("rms_norm")]
    assert [r.split()[2] for r in rows] == ["fwd", "bwd", "fwd+bwd"]
    assert all(r.rstrip().endswith("x") for r in rows)
