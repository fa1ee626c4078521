"""Benchmark suite: ``python -m portable_nn bench [--ops ...] [--quick] [--json P] [--plot P]``.

Each workload runs forward, backward and forward+backward for every backend
that implements the op, and PyTorch when installed, *interleaved* in one
process (round-robin, so drift hits everyone alike; each sample a burst of
back-to-back calls of ~20 ms, reported per call), reporting medians, the
time ratio to PyTorch (> 1 means faster than PyTorch) and, for memory-bound
ops, GB/s as a fraction of a copy bandwidth measured in the same run.

The process is configured as ``../shared/PERFORMANCE.md`` describes: the suite
re-executes itself with ``OPENBLAS_THREAD_TIMEOUT`` (no spinning BLAS threads
stealing a core) and glibc ``MALLOC_*`` settings (no page faults on every
large output), for every contender alike, and pins 2 threads for everyone.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import dispatch
from .workloads import WORKLOADS, Workload

__all__ = ["main", "run_suite"]

_PROCESS_ENV = {
    "OPENBLAS_THREAD_TIMEOUT": "4",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
}
_MARK = "PORTABLE_NN_BENCH_CONFIGURED"


@dataclass
class Row:
    """One measured (workload, contender, phase)."""

    workload: str
    contender: str
    phase: str
    median_ms: float
    bytes_moved: int
    ratio_vs_torch: float | None = None
    ratio_vs_reference: float | None = None
    gbps: float | None = None
    fraction_of_copy: float | None = None


@dataclass
class Report:
    environment: dict[str, Any]
    copy_gbps: float
    rows: list[Row] = field(default_factory=list)
    first_call: dict[str, dict[str, float]] = field(default_factory=dict)
    quick: bool = False
    notes: list[str] = field(default_factory=list)  # what could not be measured, and why


def _threads(n: int) -> None:
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass


def _environment() -> dict[str, Any]:
    from ..__main__ import _version

    env = {k: os.environ.get(k, "") for k in (*_PROCESS_ENV, "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                               "NUMBA_THREADING_LAYER")}
    return {
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "numba": _version("numba"),
        "torch": _version("torch"),
        "env": env,
    }


def _copy_bandwidth(quick: bool) -> float:
    """GB/s (read + write counted) of a 64 MiB copy: the memory roofline of this run."""
    n = (16 if quick else 64) * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    try:
        from kernels_cpu.copy import parallel_copy

        copy: Callable[[], Any] = lambda: parallel_copy(src, dst)  # noqa: E731
    except ImportError:
        copy = lambda: np.copyto(dst, src)  # noqa: E731
    copy()
    times = []
    for _ in range(5 if quick else 20):
        t = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / statistics.median(times) / 1e9


def progress_bar(done: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr, redrawn in place."""
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:40s}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\n")


#: Pause between two contenders' calls: lets the previous runtime's worker threads (torch's OpenMP,
#: Numba's TBB) stop spin-waiting, so no contender is timed while another's threads hold the cores.
SETTLE_S = 0.02


#: Each sample is a burst of back-to-back calls lasting about this long, reported per call: a
#: single call after the settle pause would mostly time thread pools waking up (OpenMP, TBB,
#: OpenBLAS park their threads within milliseconds), which no training loop pays per call.
BURST_S = 0.02


def _nothing() -> None:
    return None


def _burst_length(fn: Callable[[], Any], burst_s: float, wait: Callable[[], Any]) -> int:
    """How many back-to-back calls of ``fn`` (then ``wait()``) last about ``burst_s`` (1 for slow calls)."""
    t = time.perf_counter()
    fn()
    wait()
    once = max(time.perf_counter() - t, 1e-7)
    return max(1, min(200, round(burst_s / once)))


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, *, settle_s: float = SETTLE_S,
                     burst_s: float = BURST_S, wait: Callable[[], Any] = _nothing) -> dict[str, float]:
    """Median seconds per call of each function, run round-robin after one warm-up call each.

    A sample is a burst of back-to-back calls lasting about ``burst_s``, after a ``settle_s``
    pause; ``wait`` ends every sample (the GPU suite passes a device synchronisation, so a
    burst's launches are timed to completion).
    """
    for fn in fns.values():
        fn()
    wait()
    bursts = {name: _burst_length(fn, burst_s, wait) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if settle_s:
                time.sleep(settle_s)
            wait()
            t = time.perf_counter()
            for _ in range(bursts[name]):
                fn()
            wait()
            samples[name].append((time.perf_counter() - t) / bursts[name])
    return {k: statistics.median(v) for k, v in samples.items()}


def _contenders(workload: Workload) -> list[str]:
    """Backends that run every op of the workload on NumPy float32 CPU arrays."""
    probe = _cpu_probe()
    per_op = [
        {
            impl.backend
            for impl in dispatch.implementations(op)
            if dispatch.backend_status(impl.backend) and impl.supports.matches_arrays(probe) is None
        }
        for op in workload.ops
    ]
    common = set.intersection(*per_op)
    return [impl.backend for impl in dispatch.implementations(workload.ops[0]) if impl.backend in common]


def _cpu_probe() -> dispatch.Call:
    import array_api_compat.numpy as xp

    return dispatch.Call("probe", {}, {}, xp=xp, family="numpy", device="cpu", dtype="float32")


def run_suite(ops: list[str] | None = None, quick: bool = False, progress: bool = True,
              cold: bool = True) -> Report:
    """Measure every selected workload; returns the :class:`Report`."""
    _threads(2)
    report = Report(_environment(), _copy_bandwidth(quick), quick=quick)
    selected = [w for w in WORKLOADS if ops is None or w.name in ops or any(op in ops for op in w.ops)]
    repeats = 5 if quick else 15
    total = len(selected)
    for n, workload in enumerate(selected):
        if progress:
            progress_bar(n, total, workload.name)
        cases = workload.build(quick)
        fns: dict[tuple[str, str], Callable[[], Any]] = {}
        for backend in _contenders(workload):
            for phase, fn in cases.portable(backend).items():
                fns[(backend, phase)] = fn
        if cases.torch is not None:
            for phase, fn in cases.torch().items():
                fns[("torch", phase)] = fn
        timed = time_interleaved({f"{b}|{p}": fn for (b, p), fn in fns.items()}, repeats)
        for key, seconds in timed.items():
            contender, phase = key.split("|")
            moved = cases.bytes_moved.get(phase, 0)
            row = Row(workload.name, contender, phase, seconds * 1e3, moved)
            torch_s = timed.get(f"torch|{phase}")
            if torch_s is not None:
                row.ratio_vs_torch = torch_s / seconds
            ref_s = timed.get(f"reference|{phase}")
            if ref_s is not None and contender != "reference":
                row.ratio_vs_reference = ref_s / seconds
            if moved:
                row.gbps = moved / seconds / 1e9
                row.fraction_of_copy = row.gbps / report.copy_gbps
            report.rows.append(row)
    if progress:
        progress_bar(total, total, "done")
    report.first_call = _first_call_latency(selected, quick or not cold)
    return report


_FIRST_CALL = """
import sys, time
import numpy as np
import portable_nn as pnn
from portable_nn.bench.workloads import WORKLOADS
w = next(w for w in WORKLOADS if w.name == sys.argv[1])
cases = w.build(True)
t0 = time.perf_counter()
if sys.argv[2] == "after_startup":
    from kernels_cpu.copy import parallel_copy  # numba, its BLAS bindings, the thread pool: paid once per process
    a = np.ones(1 << 20, np.float32)
    parallel_copy(a, np.empty_like(a))
t1 = time.perf_counter()
fns = cases.portable("numba")  # runs the first vjp
fns["fwd+bwd"]()
print(t1 - t0, time.perf_counter() - t1)
"""


def _first_call_latency(selected: list[Workload], quick: bool) -> dict[str, dict[str, float]]:
    """Seconds of the first fwd+bwd call in a new process.

    Reported per op: ``warm_cache_s`` — the process's first call of anything, warm on-disk
    cache (includes Numba's one-off start-up: importing numba and its BLAS bindings, its typing
    registries, the thread pool); ``startup_s`` — that one-off part alone, measured with a
    trivial kernel; ``op_after_startup_s`` — the op's own first call once Numba is up (what
    every further op costs); ``cold_compile_s`` — first call with an empty cache (full runs only).
    """
    if not dispatch.backend_status("numba"):
        return {}
    result = {}
    ops_done = set()
    for workload in selected:
        if len(workload.ops) > 1 or workload.op in ops_done or not any(
            i.backend == "numba" for i in dispatch.implementations(workload.op)
        ):
            continue
        ops_done.add(workload.op)
        entry = {}
        runs = [("warm_cache_s", "first", {}), ("op_after_startup_s", "after_startup", {})]
        if not quick:  # a cold compile takes tens of seconds per op
            cold_dir = tempfile.mkdtemp(prefix="pnn-cold-cache-")
            runs.insert(0, ("cold_compile_s", "first", {"NUMBA_CACHE_DIR": cold_dir}))
        for label, mode, extra in runs:
            out = subprocess.run(
                [sys.executable, "-c", _FIRST_CALL, workload.name, mode],
                capture_output=True, text=True, env={**os.environ, **extra}, timeout=900,
            )
            if out.returncode == 0:
                startup, op_s = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
                entry[label] = op_s
                if mode == "after_startup":
                    entry["startup_s"] = startup
        result[workload.op] = entry
    return result


def format_report(report: Report) -> str:
    """The report as a text table."""
    env = report.environment
    lines = [
        "QUICK RUN: small shapes, few repeats (a smoke test, not a measurement)" if report.quick else
        "standard shapes, medians of 15 interleaved repeats (each a ~20 ms burst of calls, per call)",
        f"python {env['python']}, numpy {env['numpy']}, numba {env['numba']}, torch {env['torch']}, "
        f"{env['cpus']} CPUs, 2 threads for everyone",
        "env: " + ", ".join(f"{k}={v or '-'}" for k, v in env["env"].items()),
        f"copy bandwidth (read+write): {report.copy_gbps:.1f} GB/s",
        "",
        f"{'workload':38s} {'contender':10s} {'phase':8s} {'median ms':>10s} {'vs torch':>9s} {'vs ref':>7s} "
        f"{'GB/s':>7s} {'% copy':>7s}",
    ]
    for r in report.rows:
        ratio = f"{r.ratio_vs_torch:.2f}x" if r.ratio_vs_torch is not None else "-"
        vs_ref = f"{r.ratio_vs_reference:.1f}x" if r.ratio_vs_reference is not None else "-"
        gbps = f"{r.gbps:.1f}" if r.gbps is not None else "-"
        frac = f"{100 * r.fraction_of_copy:.0f}%" if r.fraction_of_copy is not None else "-"
        lines.append(f"{r.workload:38s} {r.contender:10s} {r.phase:8s} {r.median_ms:10.3f} {ratio:>9s} "
                     f"{vs_ref:>7s} {gbps:>7s} {frac:>7s}")
    if report.first_call:
        lines += ["", "first fwd+bwd call in a new process (numba, seconds): warm_cache = the process's first call "
                  "(with numba's one-off startup); op_after_startup = the op's own first call once numba is up"]
        for op, entry in report.first_call.items():
            lines.append(f"  {op:14s} " + ", ".join(f"{k}={v:.2f}" for k, v in entry.items()))
    return "\n".join(lines)


def _plot(report: Report, path: str) -> None:
    """Horizontal bars: each workload's fwd+bwd speed vs PyTorch, one bar per backend (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.contender != "torch" and r.ratio_vs_torch and r.phase == "fwd+bwd"]
    workloads = list(dict.fromkeys(r.workload for r in rows))
    backends = list(dict.fromkeys(r.contender for r in rows))
    height = 0.8 / max(len(backends), 1)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(workloads) + 1.2))
    for k, backend in enumerate(backends):
        ratio = {r.workload: r.ratio_vs_torch for r in rows if r.contender == backend}
        ys = [i + k * height for i, w in enumerate(workloads) if w in ratio]
        ax.barh(ys, [ratio[w] for w in workloads if w in ratio], height=height, label=backend)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(workloads))], workloads, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("fwd+bwd speed vs PyTorch (x, > 1 is faster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: Any) -> int:
    """Entry point of ``python -m portable_nn bench`` (re-executes itself once, configured)."""
    if os.environ.get(_MARK) != "1":
        env = {**os.environ, **_PROCESS_ENV, _MARK: "1"}
        return subprocess.call([sys.executable, "-m", "portable_nn", *sys.argv[1:]], env=env)
    ops = args.ops.split(",") if args.ops else None
    report = run_suite(ops, quick=args.quick, cold=not getattr(args, "no_cold", False))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": report.environment, "copy_gbps": report.copy_gbps,
                       "rows": [r.__dict__ for r in report.rows], "first_call": report.first_call}, fh, indent=2)
    if args.plot:
        try:
            _plot(report, args.plot)
        except ImportError:
            print(f"--plot {args.plot}: needs matplotlib (pip install 'portable_nn[docs]' or matplotlib)",
                  file=sys.stderr)
            return 2
    return 0
