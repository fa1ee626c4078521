"""The benchmark suite: the CI smoke run, the isolated-process runner, the environments, the mixed section.

``python -m portable_nn bench --quick`` runs every workload at its quick shapes in one fresh
process (as CI does) and its JSON report's structure is checked; the user mode's runner
and the mixed section run on one cheap case each.  Timings themselves are never asserted:
benchmarks are not tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pnn_testing import HAS_TORCH
from portable_nn.bench import run_mixed_section, run_user_suite, settings_for, settings_from_args
from portable_nn.bench.environment import (
    ISA_SETTINGS,
    TUNED_SETTINGS,
    TUNING_VARIABLES,
    reported_variables,
    tuned_environment,
    user_environment,
    vector_isa,
)
from portable_nn.bench.mixed import MIXED_CASES, mixed_row
from portable_nn.bench.report import format_report, report_json
from portable_nn.bench.workloads import WORKLOADS

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "report.json"
    done = subprocess.run([sys.executable, "-m", "portable_nn", "bench", "--quick", "--json", str(path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(path.read_text()), done.stdout, done.stderr


# --------------------------------------------------------------------------- the quick smoke run


def test_quick_run_measures_every_workload_at_its_quick_shapes(quick_report):
    report, text, _ = quick_report
    assert report["mode"] == "quick" and report["quick"]
    measured = {(r["workload"], r["contender"], r["phase"]) for r in report["rows"]}
    for w in WORKLOADS:
        label = w.label(True)
        contenders = {c for (name, c, _) in measured if name == label}
        assert "numba" in contenders, label
        assert "reference" not in contenders, label  # only with --with-reference
        if HAS_TORCH:
            assert "torch" in contenders, label
        for contender in contenders:
            assert (label, contender, "fwd") in measured
            assert (label, contender, "fwd+bwd") in measured
        if w.quick_name and w.quick_name != w.name:  # the labels show the shapes that ran
            assert w.name not in {name for name, _, _ in measured}, w.name
    assert all(r["median_ms"] > 0 for r in report["rows"])
    assert "QUICK RUN" in text and "copy bandwidth" in text


def test_quick_run_reports_ratios_bandwidth_and_the_machine(quick_report):
    report, text, stderr = quick_report
    assert report["copy_gbps"] > 0
    rows = report["rows"]
    if HAS_TORCH:
        assert all(r["ratio_vs_torch"] > 0 for r in rows)
    memory_bound = [r for r in rows if r["workload"].startswith(("layer_norm", "max_pool", "log_softmax"))]
    assert memory_bound and all(0 < r["fraction_of_copy"] for r in memory_bound)
    machine = report["environment"]
    for key in ("cpu", "isa", "isa_extensions", "cpus", "openblas_coretype", "numpy", "numba", "torch", "env"):
        assert key in machine, key
    assert report["first_call"] == {}  # the quick run skips the first-call processes
    for needle in ("cpu:", "OpenBLAS core type", "environment as the process saw it", "threads for every contender"):
        assert needle in text, needle
    assert "\r" not in stderr  # progress in a log: one plain line per step


# --------------------------------------------------------------------------- environments


def test_user_environment_strips_the_tuning_variables_and_adds_nothing():
    base = {"PATH": "/bin", "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1", "OPENBLAS_THREAD_TIMEOUT": "4",
            "MALLOC_MMAP_MAX_": "0", "MALLOC_ARENA_MAX": "2", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2",
            "OPENBLAS_NUM_THREADS": "1", "NUMBA_CACHE_DIR": "/tmp/c"}
    env = user_environment(base)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1", "NUMBA_CACHE_DIR": "/tmp/c"}
    assert base["MALLOC_ARENA_MAX"] == "2"  # the caller's mapping is left alone


def test_tuned_and_isa_environments_add_exactly_their_settings():
    base = {"PATH": "/bin"}
    assert tuned_environment(base) == {"PATH": "/bin", **TUNED_SETTINGS}
    avx2 = user_environment(base, isa="avx2")
    assert avx2 == {"PATH": "/bin", "NUMBA_CPU_NAME": "haswell", "OPENBLAS_CORETYPE": "Haswell",
                    "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert user_environment(base, isa="native") == base and ISA_SETTINGS["native"] == {}


def test_reported_variables_and_vector_isa():
    env = {"PATH": "/bin", "MKL_DEBUG": "1", "OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "avx2", "XOMP_A": "1"}
    assert reported_variables(env) == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_DEBUG": "1", "OMP_NUM_THREADS": "2"}
    assert vector_isa({"avx2", "avx512f", "avx512_bf16", "amx_tile"}) == ("AVX-512", ["amx_tile", "avx512_bf16"])
    assert vector_isa({"avx", "avx2"}) == ("AVX2", [])


def test_command_line_modes():
    def parse(*argv: str):
        args = argparse.Namespace(ops=None, quick=False, tuned=False, rounds=None, repeats=None, isa=None,
                                  with_reference=False, mixed=False, no_mixed=False, no_cold=False)
        for a in argv:
            key, _, value = a.partition("=")
            setattr(args, key, value or True)
        return settings_from_args(args)

    full = parse()
    assert full.mode == "user" and full.mixed and full.workloads and full.rounds == 3 and not full.quick
    assert not parse("ops=layer_norm").mixed
    assert parse("mixed").workloads is False
    assert parse("tuned").mode == "tuned" and parse("quick").quick
    assert parse("isa=native,avx2").isas == ["native", "avx2"]
    assert parse("ops=layer_norm (4096,1024),conv, MLP").ops == ["layer_norm (4096,1024)", "conv", "MLP"]
    with pytest.raises(SystemExit):
        parse("isa=sse")
    with pytest.raises(SystemExit):
        parse("tuned", "isa=native,avx2")


# --------------------------------------------------------------------------- the isolated-process runner


def test_isolated_runner_on_one_cheap_workload(monkeypatch):
    # this test's environment, whatever the machine's (some set OPENBLAS_CORETYPE for everyone)
    for name in TUNING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "4")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    settings = settings_for("user", ops=["log_softmax"], rounds=1, repeats=2, burst_s=0.002, quick=True,
                            progress=False)
    report = run_user_suite(settings)
    assert not report.notes, report.notes
    rows = report.rows
    contenders = {r.contender for r in rows}
    assert "numba" in contenders and "reference" not in contenders
    assert ("torch" in contenders) == HAS_TORCH
    assert {r.workload for r in rows} == {"log_softmax (256,1000)"}
    for r in rows:
        assert r.median_ms > 0 and len(r.per_round_ms) == 1
        assert r.footprint_mib is None or r.footprint_mib > 0
        assert r.peak_growth_mib is None or r.peak_growth_mib >= 0
    if sys.platform.startswith("linux"):
        assert all(r.footprint_mib is not None for r in rows)
    # the roofline of a memory-bound row is a copy of its own size, timed in the workers, not the probe's
    for r in rows:
        assert r.copy_gbps and r.copy_gbps > 0 and r.fraction_of_copy == pytest.approx(r.gbps / r.copy_gbps)
    assert "% copy: of a copy moving the bytes" in format_report(report)
    # the workers saw the user's environment: the tuning variables removed, reported as such
    seen = report.environment["env"]
    assert "OPENBLAS_THREAD_TIMEOUT" not in seen and "MALLOC_ARENA_MAX" not in seen
    assert report.settings["removed"] == {"OPENBLAS_THREAD_TIMEOUT": "4", "MALLOC_ARENA_MAX": "2"}
    text = format_report(report)
    assert "MODE user" in text and "verdict" in text and "footprint MiB" in text
    data = report_json(report)
    assert data["mode"] == "user" and data["memory"]["native"]["log_softmax (256,1000)"]["numba"]


# --------------------------------------------------------------------------- the mixed section


def test_mixed_row_ratios():
    alternating = next(c for c in MIXED_CASES if c.kind == "alternating")
    row = mixed_row(alternating, False, [{"steps": {"torch": 0.002, "pnn": 0.001, "alternating": 0.0033}}])
    assert row.ratios["alternating / (torch + pnn)"] == pytest.approx(1.1) and row.goal_met
    twins = next(c for c in MIXED_CASES if c.kind == "twins")
    rounds = [{"steps": {"torch": 0.002, "ours": 0.004}}, {"steps": {"torch": 0.004, "ours": 0.004}}]
    row = mixed_row(twins, True, rounds)
    assert row.times_ms == pytest.approx({"torch": 3.0, "ours": 4.0}) and row.case == twins.quick_name
    assert row.ratios == pytest.approx({"torch / ours": 0.75})


@needs_torch
def test_mixed_section_runs_a_tiny_case_in_its_own_process():
    settings = settings_for("user", ops=["LayerNorm"], workloads=False, mixed=True, rounds=1, repeats=2,
                            burst_s=0.002, quick=True, progress=False)
    notes: list[str] = []
    rows = run_mixed_section(settings, notes)
    assert not notes, notes
    assert [r.case for r in rows] == ["LayerNorm(1024) (256,1024) fwd+bwd"]
    assert set(rows[0].times_ms) == {"torch", "ours"} and rows[0].ratios["torch / ours"] > 0


@needs_torch
def test_swap_modules_puts_ours_in_with_the_same_weights():
    import torch
    from torch import nn

    import portable_nn.torch as pnt
    from portable_nn.bench.torch_models import LstmLanguageModel, ResNet18, swap_modules

    resnet = ResNet18()
    before = resnet.state_dict()
    swapped = swap_modules(resnet)
    kinds = {type(m) for m in swapped.modules()}
    assert not kinds & {nn.Conv2d, nn.BatchNorm2d, nn.Linear}
    assert {pnt.Conv2d, pnt.BatchNorm2d, pnt.Linear} <= kinds
    after = swapped.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    torch.manual_seed(0)
    model = LstmLanguageModel(vocab=50, width=8, layers=2)
    import copy

    ours = swap_modules(copy.deepcopy(model))
    assert isinstance(ours.lstm, pnt.LSTM) and isinstance(ours.decoder, pnt.Linear)
    tokens = torch.randint(0, 50, (5, 3))
    torch.testing.assert_close(ours(tokens), model(tokens), rtol=1e-4, atol=1e-5)


#: A ``python -c`` program: PyTorch made unimportable (as on a machine without it), then the command line.
_WITHOUT_TORCH = """
import importlib.abc, importlib.util, runpy, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoTorch())
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else _find(name, *a, **k)
sys.argv = ["portable_nn", *sys.argv[1:]]
runpy.run_module("portable_nn", run_name="__main__")
"""


def test_quick_run_without_pytorch_measures_portable_nn_alone():
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, "bench", "--quick", "--ops", "layer_norm"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "PyTorch is not installed" in done.stderr
    assert "layer_norm (256,1024)" in done.stdout
    models = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, "bench", "--models"], capture_output=True,
                            text=True, timeout=120)
    assert models.returncode == 2 and "PyTorch is not installed" in models.stdout
