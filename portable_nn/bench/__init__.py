"""Benchmark suite: ``python -m portable_nn bench [--tuned | --quick] [--ops ...] [--json P] [--plot P]``.

Each workload (:mod:`portable_nn.bench.workloads`) runs forward, backward and
forward+backward for portable_nn's CPU backends and PyTorch.  Three modes:

* **user** (the default) — what users get.  Every contender runs each workload in its own
  fresh Python process (:mod:`portable_nn.bench.isolated`, :mod:`portable_nn.bench.worker`)
  with the user's environment: the process environment less the tuning variables
  (``OPENBLAS_CORETYPE``, ``OPENBLAS_L2_SIZE``, ``OPENBLAS_THREAD_TIMEOUT``, ``MALLOC_*``,
  ``OMP_WAIT_POLICY``), nothing added (:mod:`portable_nn.bench.environment`).  A process builds
  the workload, warms it up (compilation and first calls excluded), times steady-state bursts
  and reports per-phase medians and its memory (one-time footprint, steady-state peak growth);
  the contenders alternate process by process (A, B, A, B, A, B for ``--rounds 3``) and each
  result is the median over rounds.  Then the **mixed** section (:mod:`portable_nn.bench.mixed`):
  PyTorch and portable_nn in one process.  The ratio to PyTorch of this mode is the verdict.
* **tuned** (``--tuned``) — the earlier harness: one process, re-executed with
  ``OPENBLAS_THREAD_TIMEOUT`` and glibc ``MALLOC_*`` settings, every contender *interleaved*
  (round-robin, a settle pause before each burst).  It shows what the kernels can do in a
  configured process, not what a user gets.
* **quick** (``--quick``) — a one-process smoke test with small shapes and few, short
  repeats (CI runs it); its labels show the shapes it ran.

``--isa avx2`` (or ``native,avx2``) forces the AVX2 code paths in every library
(:data:`~portable_nn.bench.environment.ISA_SETTINGS`).  Two threads for every contender.
Reported: medians, the time ratio to PyTorch (> 1: faster than PyTorch), for memory-bound
workloads GB/s and its fraction of a copy's bandwidth measured in the same run, and memory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import dispatch
from .environment import ISA_SETTINGS, describe_machine, tuned_environment, user_environment
from .isolated import have_torch
from .progress import Progress
from .workloads import WORKLOADS, Workload

__all__ = ["Report", "Row", "Settings", "main", "run_suite", "run_user_suite", "time_interleaved"]

#: Set in the re-executed process of an in-process mode (its environment is configured).
_MARK = "PORTABLE_NN_BENCH_CONFIGURED"

MODES = ("user", "tuned", "quick")


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
    copy_gbps: float | None = None  # the copy bandwidth fraction_of_copy is of (user mode: same bytes)
    isa: str = "native"
    per_round_ms: list[float] = field(default_factory=list)  # user mode: each process's median
    footprint_mib: float | None = None  # user mode: RSS after warm-up minus RSS after ``import numpy``
    peak_growth_mib: float | None = None  # user mode: peak RSS while timing over the RSS before


@dataclass
class Report:
    environment: dict[str, Any]
    copy_gbps: float
    rows: list[Row] = field(default_factory=list)
    first_call: dict[str, dict[str, float]] = field(default_factory=dict)
    quick: bool = False
    notes: list[str] = field(default_factory=list)  # what could not be measured, and why
    mode: str = "tuned"
    settings: dict[str, Any] = field(default_factory=dict)
    environments: dict[str, dict[str, Any]] = field(default_factory=dict)  # per ISA: header and copy GB/s
    mixed: list[Any] = field(default_factory=list)  # MixedRow


@dataclass
class Settings:
    """What a ``bench`` run measures and how (the command line's options)."""

    mode: str = "user"
    ops: list[str] | None = None
    isas: list[str] = field(default_factory=lambda: ["native"])
    rounds: int = 3
    repeats: int = 7  # bursts per phase: per process (user mode), or in all (in-process modes)
    burst_s: float = 0.02
    settle_s: float = 0.0
    threads: int = 2
    with_reference: bool = False
    workloads: bool = True
    mixed: bool = False
    cold: bool = True
    progress: bool = True
    quick: bool = False  # the quick shapes (the quick mode's, or a user-mode smoke test's)


def settings_for(mode: str, **given: Any) -> Settings:
    """The defaults of ``mode`` (repeats, burst and settle lengths) updated with ``given``."""
    defaults: dict[str, dict[str, Any]] = {
        "user": {"repeats": 7, "burst_s": 0.02, "settle_s": 0.0},
        "tuned": {"repeats": 15, "burst_s": 0.02, "settle_s": 0.02},
        "quick": {"repeats": 3, "burst_s": 0.005, "settle_s": 0.002, "cold": False, "quick": True},
    }
    return Settings(mode=mode, **{**defaults[mode], **given})


def _threads(n: int) -> None:
    """In-process modes: ``n`` threads for PyTorch (when installed) and portable_nn."""
    import portable_nn as pnn

    pnn.set_num_threads(n)
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass


def _copy_bandwidth(quick: bool, nbytes: int | None = None) -> float:
    """GB/s (read + write counted) of a copy of ``nbytes`` (64 MiB by default): a memory roofline.

    The roofline depends on the size: on the Xeon this was written on, a copy of 16 MiB ran at
    50 GB/s, of 64 MiB at 30-38 and of 128 MiB or more at 26 (the caches hold the smaller ones), so
    user mode compares each memory-bound workload with a copy moving the bytes its forward moves.
    """
    n = max(1, (nbytes if nbytes else (16 if quick else 64) * 2**20) // 4)
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


def select_workloads(ops: Sequence[str] | None) -> list[Workload]:
    """The workloads ``--ops`` selects (an op name or a substring of a workload's name; all when empty)."""
    return [w for w in WORKLOADS if w.matches(ops)]


# --------------------------------------------------------------------------- rows


def add_rows(report: Report, label: str, timed: Mapping[tuple[str, str], float], moved: Mapping[str, int],
             isa: str = "native", copy_gbps: float | None = None,
             extra: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Append one workload's rows: seconds per (contender, phase) → ms, ratios, GB/s.

    ``extra`` maps a contender to further :class:`Row` fields (per-round times, memory).
    """
    copy_gbps = copy_gbps or report.copy_gbps
    for (contender, phase), seconds in timed.items():
        nbytes = moved.get(phase, 0)
        row = Row(label, contender, phase, seconds * 1e3, nbytes, isa=isa)
        torch_s = timed.get(("torch", phase))
        if torch_s is not None:
            row.ratio_vs_torch = torch_s / seconds
        ref_s = timed.get(("reference", phase))
        if ref_s is not None and contender != "reference":
            row.ratio_vs_reference = ref_s / seconds
        if nbytes and copy_gbps:
            row.gbps = nbytes / seconds / 1e9
            row.fraction_of_copy = row.gbps / copy_gbps
            row.copy_gbps = copy_gbps
        for key, value in (extra or {}).get(contender, {}).items():
            setattr(row, key, value[phase] if key == "per_round_ms" else value)
        report.rows.append(row)


# --------------------------------------------------------------------------- in-process modes (tuned, quick)


def run_suite(ops: list[str] | None = None, quick: bool = False, progress: bool = True, cold: bool = True,
              settings: Settings | None = None) -> Report:
    """Every selected workload in this process, contenders interleaved; returns the :class:`Report`.

    The tuned and quick modes (``settings`` defaults to theirs for ``quick``).
    """
    s = settings or settings_for("quick" if quick else "tuned", ops=ops, progress=progress, cold=cold)
    _threads(s.threads)
    machine = describe_machine()
    report = Report(machine, _copy_bandwidth(s.quick), quick=s.quick, mode=s.mode, settings=asdict(s))
    isa = s.isas[0]
    report.environments = {isa: {**machine, "copy_gbps": report.copy_gbps}}
    selected = select_workloads(s.ops)
    bar = Progress(len(selected), enabled=s.progress)
    for workload in selected:
        label = workload.label(s.quick)
        with bar.step(label):
            cases = workload.build(s.quick)
            fns: dict[tuple[str, str], Callable[[], Any]] = {}
            for backend in _contenders(workload):
                if s.with_reference or backend != "reference":
                    fns.update({(backend, phase): fn for phase, fn in cases.portable(backend).items()})
            if cases.torch is not None and have_torch():
                fns.update({("torch", phase): fn for phase, fn in cases.torch().items()})
            timed = time_interleaved({f"{b}|{p}": fn for (b, p), fn in fns.items()}, s.repeats,
                                     settle_s=s.settle_s, burst_s=s.burst_s)
            add_rows(report, label, {tuple(k.split("|")): v for k, v in timed.items()}, cases.bytes_moved, isa)
    bar.close()
    if not s.quick:
        report.first_call = _first_call_latency(selected, not s.cold, dict(os.environ))
    return report


# --------------------------------------------------------------------------- user mode (isolated processes)


def isa_environment(isa: str) -> dict[str, str]:
    """The user environment with ``isa``'s settings: what every user-mode worker gets."""
    return user_environment(isa=isa)


def run_user_suite(settings: Settings) -> Report:
    """User mode: each contender in its own process per workload, alternated; then the mixed section."""
    from .isolated import WorkerError, combine_rounds, isolated_contenders, measure_workload, probe

    s = settings
    kept = user_environment()
    removed = {k: v for k, v in os.environ.items() if k not in kept}
    report = Report({}, 0.0, quick=s.quick, mode=s.mode, settings={**asdict(s), "removed": removed})
    for isa in s.isas:
        try:
            found = probe(isa_environment(isa), s.quick, s.threads)
        except WorkerError as exc:
            report.notes.append(f"probe [{isa}]: {exc}")
            continue
        report.environments[isa] = {**found["machine"], "env": found["env"], "copy_gbps": found["copy_gbps"]}
    first = report.environments.get(s.isas[0], {})
    report.environment, report.copy_gbps = first, first.get("copy_gbps", 0.0)
    selected = select_workloads(s.ops) if s.workloads else []
    plan = [(w, isa, isolated_contenders(w, s.with_reference)) for w in selected for isa in s.isas]
    bar = Progress(sum(len(c) for _, _, c in plan) * s.rounds, enabled=s.progress)
    for workload, isa, contenders in plan:
        label = workload.label(s.quick)
        results, notes = measure_workload(workload, contenders, isa_environment(isa), rounds=s.rounds,
                                          quick=s.quick, repeats=s.repeats, burst_s=s.burst_s, threads=s.threads,
                                          progress=bar, label=f"{label} [{isa}]" if len(s.isas) > 1 else label)
        report.notes += notes
        if not results:
            continue
        combined = {c: combine_rounds(r) for c, r in results.items()}
        timed = {(c, p): sec for c, r in combined.items() for p, sec in r["phases"].items()}
        moved = next(iter(combined.values()))["bytes_moved"]
        extra = {c: {"per_round_ms": {p: [1e3 * v for v in vs] for p, vs in r["per_round"].items()},
                     **r["memory"]} for c, r in combined.items()}
        # The roofline of a memory-bound row: the same-size copy its workers timed (see _copy_bandwidth).
        same_size = [r["copy_gbps"] for r in combined.values() if r.get("copy_gbps")]
        copy_gbps = statistics.median(same_size) if same_size else report.environments.get(isa, {}).get("copy_gbps")
        add_rows(report, label, timed, moved, isa, copy_gbps, extra)
    bar.close()
    if s.mixed:
        report.mixed = run_mixed_section(s, report.notes)
    if selected and not s.quick:
        report.first_call = _first_call_latency(selected, not s.cold, isa_environment(s.isas[0]))
    return report


def run_mixed_section(s: Settings, notes: list[str]) -> list[Any]:
    """The mixed cases (selected by ``--ops`` substrings when given), each in fresh processes, ``s.rounds`` times."""
    from .isolated import WorkerError, have_torch, run_worker
    from .mixed import MIXED_CASES, mixed_row

    if not have_torch():
        notes.append("mixed section: PyTorch is not installed")
        return []
    cases = [c for c in MIXED_CASES if not s.ops or s.workloads or any(o in c.name for o in s.ops)]
    env = isa_environment(s.isas[0])
    bar = Progress(len(cases) * s.rounds, enabled=s.progress)
    rows = []
    for case in cases:
        rounds = []
        for r in range(s.rounds):
            with bar.step(f"mixed: {case.label(s.quick)} | round {r + 1}/{s.rounds}"):
                spec = {"kind": "mixed", "case": case.name, "quick": s.quick, "threads": s.threads,
                        "repeats": s.repeats, "burst_s": max(s.burst_s, 0.05 if not s.quick else 0.01)}
                try:
                    rounds.append(run_worker(spec, env))
                except WorkerError as exc:
                    notes.append(f"mixed: {case.label(s.quick)}: {exc}")
                    break
        if rounds:
            rows.append(mixed_row(case, s.quick, rounds))
    bar.close()
    return rows


# --------------------------------------------------------------------------- first calls


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


def _first_call_latency(selected: list[Workload], quick: bool, env: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Seconds of the first fwd+bwd call in a new process.

    Reported per op: ``warm_cache_s`` — the process's first call of anything, warm on-disk
    cache (includes Numba's one-off start-up: importing numba and its BLAS bindings, its typing
    registries, the thread pool); ``startup_s`` — that one-off part alone, measured with a
    trivial kernel; ``op_after_startup_s`` — the op's own first call once Numba is up (what
    every further op costs); ``cold_compile_s`` — first call with an empty cache (unless ``quick``).
    Each in a new process with ``env``.
    """
    from .isolated import package_root

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
                capture_output=True, text=True, env={**env, **extra}, timeout=900, cwd=package_root(),
            )
            if out.returncode == 0:
                startup, op_s = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
                entry[label] = op_s
                if mode == "after_startup":
                    entry["startup_s"] = startup
        result[workload.op] = entry
    return result


# --------------------------------------------------------------------------- command line


def split_selectors(text: str) -> list[str]:
    """``--ops`` at its commas, except those inside parentheses (workload names hold shapes like ``(4096,1024)``)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth <= 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in [*parts, current] if p.strip()]


def settings_from_args(args: Any) -> Settings:
    """The :class:`Settings` of parsed ``bench`` arguments."""
    mode = "quick" if args.quick else "tuned" if getattr(args, "tuned", False) else "user"
    isas = [i.strip() for i in (getattr(args, "isa", None) or "native").split(",") if i.strip()]
    unknown = [i for i in isas if i not in ISA_SETTINGS]
    if unknown:
        raise SystemExit(f"bench: unknown --isa {', '.join(unknown)} (choose from {', '.join(ISA_SETTINGS)})")
    if mode != "user" and len(isas) > 1:
        raise SystemExit("bench: several --isa values need the user mode (one process cannot change its ISA)")
    ops = split_selectors(args.ops) if args.ops else None
    mixed_only = getattr(args, "mixed", False)
    given: dict[str, Any] = {
        "ops": ops, "isas": isas, "with_reference": getattr(args, "with_reference", False),
        "workloads": not mixed_only,
        "mixed": mixed_only or (mode == "user" and ops is None and not getattr(args, "no_mixed", False)),
        "progress": True,
    }
    if getattr(args, "no_cold", False):
        given["cold"] = False
    if getattr(args, "rounds", None):
        given["rounds"] = args.rounds
    if getattr(args, "repeats", None):
        given["repeats"] = args.repeats
    return settings_for(mode, **given)


def _in_process_environment(s: Settings) -> dict[str, str] | None:
    """The environment an in-process mode must re-execute itself with, or ``None`` when this one will do."""
    if s.mode == "tuned":
        return tuned_environment(isa=s.isas[0])
    if ISA_SETTINGS[s.isas[0]]:
        return {**os.environ, **ISA_SETTINGS[s.isas[0]]}
    return None


def main(args: Any) -> int:
    """Entry point of ``python -m portable_nn bench``."""
    from .report import format_report, plot_report, report_json

    s = settings_from_args(args)
    if not have_torch():
        print("PyTorch is not installed: measuring portable_nn alone, without the PyTorch columns "
              "(pip install 'portable_nn[bench]' for the comparison)", file=sys.stderr)
    if s.mode != "user" and s.workloads:
        env = _in_process_environment(s)
        if env is not None and os.environ.get(_MARK) != "1":
            return subprocess.call([sys.executable, "-m", "portable_nn", *sys.argv[1:]], env={**env, _MARK: "1"})
        report = run_suite(settings=s)
    else:
        report = run_user_suite(s)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report_json(report), fh, indent=2)
    if args.plot:
        try:
            plot_report(report, args.plot)
        except ImportError:
            print(f"--plot {args.plot}: needs matplotlib (pip install 'portable_nn[docs]' or matplotlib)",
                  file=sys.stderr)
            return 2
    return 0
