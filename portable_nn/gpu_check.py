"""``python -m portable_nn gpu-check``: one-command validation on a CUDA machine.

1. Reports the device, the library versions and which GPU backends run (and why not).
2. Runs the GPU tests (``pytest -m gpu``, from a source checkout): every kernel,
   op and gradient on CuPy arrays and CUDA tensors, each GPU backend forced,
   checked against the reference implementation; ``--full`` adds every API
   test's GPU cases (an hour).
3. Runs the GPU benchmark (:mod:`portable_nn.bench.gpu`) against PyTorch CUDA
   and checks the GPU goals (:func:`portable_nn.bench.gpu.goal_checks`).
4. Writes one Markdown report (``--out``, default ``gpu-check.md``) and, with
   ``--save-preference``, stores per op the faster GPU backend as ``auto``'s order.

It needs no network: where ``array-api-compat`` (or another pure-Python
dependency) is missing on the GPU machine, install the wheels that
``python -m portable_nn wheels DIR`` downloads on a connected machine
(``pip install --no-index --find-links DIR array-api-compat``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from . import dispatch

#: Budget of the test part (the default selection takes minutes; ``--full`` about an hour).
TEST_TIMEOUT_S = 11 * 60
FULL_TEST_TIMEOUT_S = 90 * 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``gpu-check``'s options."""
    parser.add_argument("--out", default="gpu-check.md", help="Markdown report path (default: gpu-check.md)")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats, tests stop at first failure")
    parser.add_argument("--skip-tests", action="store_true", help="benchmark only")
    parser.add_argument("--full", action="store_true",
                        help="also every API test on the GPU libraries (tens of thousands of cases: about an hour "
                             "with 15 workers on an H200 host); default: the kernel and adapter GPU tests")
    parser.add_argument("--skip-bench", action="store_true", help="tests only")
    parser.add_argument("--ops", help="benchmark only these: comma-separated op names or workload-name substrings")
    parser.add_argument("--save-preference", action="store_true",
                        help="store the faster GPU backend per op as auto's order (see portable_nn.dispatch)")


def _repo_root() -> Path | None:
    """The source checkout holding ``tests/`` (gpu-check runs the tests from there)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tests" / "conftest.py").exists() else None


def gpu_status() -> tuple[bool, str]:
    """Whether a CUDA device is usable from CuPy and PyTorch, and a sentence saying so."""
    cupy_status = dispatch.backend_status("cupy")
    try:
        import torch

        torch_ok = torch.cuda.is_available()
    except ImportError:
        torch_ok = False
    if not cupy_status:
        return False, f"no GPU for portable_nn: {cupy_status.reason}"
    if not torch_ok:
        return False, "CuPy sees a GPU but PyTorch (the benchmark's baseline) does not"
    return True, cupy_status.reason


#: The GPU tests gpu-check runs by default: every kernel on the device against the reference, and
#: the adapters on CUDA tensors (about 1,300 cases, a minute with 15 workers on an H200 host).  The
#: API tests parametrise every op over the GPU libraries too: with ``--full`` all of them run
#: (about 67,000 cases: 2,700 took 140 s on that host).
KERNEL_TEST_PATHS = ("tests/kernel_packages", "tests/adapters")


def run_tests(quick: bool, full: bool = False) -> dict[str, Any]:
    """``pytest -m gpu`` in a subprocess (the kernel and adapter tests, or all with ``full``);
    counts, failures and the wall time."""
    root = _repo_root()
    if root is None:
        return {"skipped": "the tests ship with the source checkout; run gpu-check from a clone"}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        cmd = [sys.executable, "-m", "pytest", *([] if full else KERNEL_TEST_PATHS), "-m", "gpu", "-q",
               "-p", "no:cacheprovider", "--tb=short", f"--junitxml={junit}", *(["-x"] if quick else []),
               *_parallel_workers()]
        t0 = time.perf_counter()
        try:
            limit = FULL_TEST_TIMEOUT_S if full else TEST_TIMEOUT_S
            out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"error": f"the GPU tests ran past {limit} s", "seconds": limit}
        result = _parse_junit(junit) if junit.exists() else {}
        result["seconds"] = time.perf_counter() - t0
        result["returncode"] = out.returncode
        result["tail"] = out.stdout[-3000:]
    return result


def _parallel_workers() -> list[str]:
    """``-n N`` when pytest-xdist is installed: the GPU tests are thousands of small cases, mostly
    host-side checking, so a few processes sharing the device finish well inside the time budget."""
    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(15, (os.cpu_count() or 2) - 1)))]


def _parse_junit(path: Path) -> dict[str, Any]:
    """Totals and failing test ids from a JUnit XML file."""
    tree = ET.parse(path)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for suite in tree.iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    for case in tree.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                failed.append(f"{case.get('classname')}::{case.get('name')} — {message}")
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    return {**totals, "failed": failed}


def preference_from(report: Any) -> dict[str, str]:
    """Per op, the GPU backend with the lower fwd+bwd time on its single-op float32 workloads."""
    from .bench.gpu import gpu_backends
    from .bench.workloads import WORKLOADS

    single = {w.label(report.quick): w.op for w in WORKLOADS if len(w.ops) == 1}
    best: dict[str, dict[str, float]] = {}
    for r in report.rows:
        if r.contender in gpu_backends() and r.phase == "fwd+bwd" and r.workload in single:
            per = best.setdefault(single[r.workload], {})
            per[r.contender] = per.get(r.contender, 0.0) + r.median_ms
    return {op: min(times, key=times.__getitem__) for op, times in best.items() if len(times) > 1}


def format_markdown(status: str, tests: dict[str, Any] | None, report: Any | None,
                    preference: dict[str, str] | None) -> str:
    """The whole report as Markdown."""
    from . import __version__

    lines = ["# portable_nn gpu-check", "", f"{datetime.datetime.now().isoformat(timespec='minutes')} — "
             f"portable_nn {__version__}; {status}", ""]
    lines += ["## Backends", "", "| backend | available | why |", "|---|---|---|"]
    for name, st in dispatch.available_backends().items():
        lines.append(f"| {name} | {'yes' if st else 'no'} | {st.reason} |")
    lines.append("")
    if tests is not None:
        lines += ["## GPU tests (`pytest -m gpu`)", ""]
        if "skipped" in tests and isinstance(tests["skipped"], str):
            lines.append(tests["skipped"])
        elif "error" in tests:
            lines.append(f"**{tests['error']}**")
        else:
            lines.append(f"{tests.get('passed', 0)} passed, {tests.get('failures', 0)} failed, "
                         f"{tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped "
                         f"in {tests['seconds']:.0f} s")
            if tests.get("failed"):
                lines += ["", "Failures:", ""] + [f"- `{f}`" for f in tests["failed"][:60]]
                if len(tests["failed"]) > 60:
                    lines.append(f"- … and {len(tests['failed']) - 60} more")
        lines.append("")
    if report is not None:
        from .bench.gpu import goal_checks

        env = report.environment
        lines += ["## Benchmark against PyTorch CUDA", "",
                  ", ".join(f"{k} {v}" for k, v in env.items()), "",
                  f"device-to-device copy bandwidth (read + write): **{report.copy_gbps:.0f} GB/s**; "
                  "ratio = PyTorch time / portable_nn time (> 1: faster than PyTorch)"
                  + (" — QUICK RUN, not a measurement" if report.quick else ""), "",
                  "| workload | contender | phase | median ms | vs torch | GB/s | % copy |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in report.rows:
            ratio = f"{r.ratio_vs_torch:.2f}x" if r.ratio_vs_torch is not None else "-"
            gbps = f"{r.gbps:.0f}" if r.gbps is not None else "-"
            frac = f"{100 * r.fraction_of_copy:.0f}%" if r.fraction_of_copy is not None else "-"
            lines.append(f"| {r.workload} | {r.contender} | {r.phase} | {r.median_ms:.4f} | {ratio} | {gbps} "
                         f"| {frac} |")
        if report.notes:
            lines += ["", "Not measured:", ""] + [f"- {n}" for n in report.notes]
        checks = goal_checks(report)
        if checks:
            met = sum(ok for *_, ok in checks)
            lines += ["", f"### GPU goals: {met}/{len(checks)} met", "", "| row | goal | met |", "|---|---|---|"]
            lines += [f"| {row} | {goal} | {'yes' if ok else '**no**'} |" for row, goal, ok in checks]
        lines.append("")
    if preference:
        lines += ["## auto's GPU preference (measured)", "", "| op | backend |", "|---|---|"]
        lines += [f"| {op} | {b} |" for op, b in sorted(preference.items())]
        lines.append("")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m portable_nn gpu-check``; 0 when tests pass (or were skipped)."""
    ok, status = gpu_status()
    print(f"gpu-check: {status}")
    if not ok:
        Path(args.out).write_text(format_markdown(status, None, None, None))
        print(f"report: {args.out}")
        return 2
    tests = None
    if not args.skip_tests:
        print("running the GPU tests (pytest -m gpu) …", flush=True)
        tests = run_tests(args.quick, args.full)
        print(f"  {tests.get('passed', '?')} passed, {tests.get('failures', '?')} failed, "
              f"{tests.get('errors', '?')} errors in {tests.get('seconds', 0):.0f} s", flush=True)
    report = preference = None
    if not args.skip_bench:
        from .bench import split_selectors
        from .bench.gpu import run_gpu_suite

        print("benchmarking against PyTorch CUDA …", flush=True)
        os.environ.setdefault("CUPY_CACHE_SAVE_CUDA_SOURCE", "0")
        selectors = split_selectors(args.ops) if args.ops else None
        report = run_gpu_suite(args.quick, progress=True, selectors=selectors,
                               on_row=lambda r: print(f"  {r.workload} [{r.contender}, {r.phase}] "
                                                      f"{r.median_ms:.4f} ms", flush=True))
        preference = preference_from(report)
        if args.save_preference and preference:
            path = dispatch.save_gpu_preference(preference, report.environment.get("device", "?"))
            print(f"auto's GPU preference saved to {path}")
    text = format_markdown(status, tests, report, preference)
    Path(args.out).write_text(text)
    print(text)
    print(f"report: {args.out}")
    failed = tests is not None and (tests.get("failures") or tests.get("errors") or "error" in tests)
    return 1 if failed else 0
