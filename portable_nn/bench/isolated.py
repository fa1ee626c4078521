"""The user-mode runner: each contender in its own fresh process, alternated, in the user's environment.

For every workload the contenders (portable_nn's backends and PyTorch) run one after the
other, each in a new ``python`` process (:mod:`portable_nn.bench.worker`), for ``rounds``
rounds: A, B, A, B, A, B.  A process builds the workload, warms it up (compilation and
first calls excluded), times steady-state bursts of every phase and reports per-phase
medians; the result of a contender is the median over its rounds of those medians.  So no
contender shares a process, an allocator, a thread pool or a spinning BLAS worker with
another, and machine drift (other tenants, turbo, thermal) hits each contender alike.

Why a small runner of our own rather than pyperf: pyperf's worker protocol runs one
benchmark function per process, calibrates its loop count in separate processes and
spreads its values over many short-lived workers.  Here one process must build a
workload once (large arrays, Numba compilation, a kept autograd graph for the backward
phase) and time several phases of it, report memory figures of that same process, and
contenders must alternate process by process; fitting that into pyperf would mean one
pyperf run per (contender, phase) with the build repeated in each, and no alternation.
What pyperf would add beyond that (CPU pinning, system tuning checks) does not apply to
the shared 2-core machines this runs on.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .progress import Progress
from .worker import BOOTSTRAP, RESULT_MARK
from .workloads import Workload

__all__ = ["WorkerError", "combine_rounds", "isolated_contenders", "measure_workload", "probe", "run_worker"]

#: A worker may compile kernels afresh (a new NUMBA_CPU_NAME, an empty cache): minutes, not hours.
WORKER_TIMEOUT_S = 1800


class WorkerError(RuntimeError):
    """A worker process failed or printed no result."""


def package_root() -> str:
    """The directory holding the ``portable_nn`` package this process imported (the workers' cwd)."""
    import portable_nn

    return str(Path(portable_nn.__file__).resolve().parent.parent)


def run_worker(spec: Mapping[str, Any], env: Mapping[str, str], timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Run one worker process with ``env``; returns its result.

    The working directory is the one holding this ``portable_nn`` package, so the worker
    imports the same code as its parent (the current directory comes first on ``sys.path``).

    Raises:
        WorkerError: a non-zero exit, a timeout or no result line.
    """
    try:
        done = subprocess.run([sys.executable, "-c", BOOTSTRAP, json.dumps(dict(spec))], env=dict(env),
                              cwd=package_root(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise WorkerError(f"timed out after {timeout_s:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WorkerError(f"exit status {done.returncode}: {tail[0]}")
    return json.loads(lines[-1][len(RESULT_MARK):])


def probe(env: Mapping[str, str], quick: bool, threads: int) -> dict[str, Any]:
    """The machine description and copy bandwidth as a worker with ``env`` sees them."""
    return run_worker({"kind": "probe", "quick": quick, "threads": threads}, env)


def have_torch() -> bool:
    """Whether PyTorch is installed (without importing it)."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None  # None: the import is blocked
    return importlib.util.find_spec("torch") is not None


def isolated_contenders(workload: Workload, with_reference: bool = False) -> list[str]:
    """The workload's contenders: its portable_nn backends (``reference`` only on request), then PyTorch."""
    from . import _contenders

    found = [b for b in _contenders(workload) if with_reference or b != "reference"]
    return [*found, "torch"] if have_torch() else found


def measure_workload(workload: Workload, contenders: Sequence[str], env: Mapping[str, str], *, rounds: int,
                     quick: bool, repeats: int, burst_s: float, threads: int, progress: Progress,
                     label: str = "") -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Alternate the contenders' worker processes for ``rounds`` rounds.

    Returns each contender's per-round results and notes on the processes that failed (a
    failing contender is left out of later rounds, the others go on).
    """
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    notes: list[str] = []
    failed: set[str] = set()
    for r in range(rounds):
        for contender in contenders:
            with progress.step(f"{label or workload.label(quick)} | {contender} | round {r + 1}/{rounds}"):
                if contender in failed:
                    continue
                spec = {"kind": "workload", "workload": workload.name, "contender": contender, "quick": quick,
                        "threads": threads, "repeats": repeats, "burst_s": burst_s}
                try:
                    results[contender].append(run_worker(spec, env))
                except WorkerError as exc:
                    failed.add(contender)
                    notes.append(f"{workload.label(quick)} [{contender}]: {exc}")
    return {c: v for c, v in results.items() if v}, notes


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def combine_rounds(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One contender's rounds → per-phase medians of the per-process medians, and median memory figures."""
    phases = list(results[0]["phases"])
    per_round = {p: [r["phases"][p] for r in results if p in r["phases"]] for p in phases}
    memory_keys = ("footprint_mib", "peak_growth_mib")
    return {
        "phases": {p: statistics.median(v) for p, v in per_round.items()},
        "per_round": per_round,
        "memory": {k: _median_or_none([r["memory"].get(k) for r in results]) for k in memory_keys},
        "bytes_moved": results[0].get("bytes_moved", {}),
        "copy_gbps": _median_or_none([r.get("copy_gbps") for r in results]),
        "env": results[0].get("env", {}),
    }
