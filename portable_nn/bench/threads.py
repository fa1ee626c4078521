"""Thread scaling of the CPU kernels: ``python -m portable_nn.bench.threads``.

Every benchmark workload that has a ``numba`` implementation is timed on the ``numba`` backend
at 1, 2, … threads (``pnn.use_threads``; by default every power of two up to the cores this
process may use, and that count), interleaved round by round in one process, each phase
(forward, backward, both) on its own.  The speed-up at ``n`` threads is the 1-thread time over
the ``n``-thread time; with ``--torch``, PyTorch's own speed-up on the same workload
(``torch.set_num_threads``) is printed beside it for comparison.

The kernels split their work by the shape alone (a fixed task size or task count, never the
thread count), so the results are bitwise the same at every thread count and the speed-up is
the work's parallel share: calls below the kernels' size thresholds run serially and show
1.0x by design (the thread pool's start-up would cost more than it saves).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import portable_nn as pnn

from . import time_interleaved
from .environment import describe_machine
from .workloads import WORKLOADS, Workload


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def thread_counts(limit: int) -> list[int]:
    """1, 2, 4, … up to ``limit``, and ``limit`` itself."""
    counts, n = [], 1
    while n < limit:
        counts.append(n)
        n *= 2
    return [*counts, limit]


def _under_threads(fn: Callable[[], Any], n: int) -> Callable[[], Any]:
    def run() -> Any:
        with pnn.use_threads(n):
            return fn()

    return run


def _under_torch_threads(fn: Callable[[], Any], n: int) -> Callable[[], Any]:
    import torch

    def run() -> Any:
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return run


def has_numba_kernel(workload: Workload) -> bool:
    """Whether every op of the workload has a ``numba`` implementation (else nothing of ours scales)."""
    return all(any(i.backend == "numba" for i in pnn.dispatch.implementations(op)) for op in workload.ops)


def measure(workload: Workload, counts: Sequence[int], quick: bool, repeats: int, with_torch: bool,
            burst_s: float) -> dict[str, dict[str, dict[int, float]]]:
    """Median seconds per call, ``{contender: {phase: {threads: s}}}``."""
    cases = workload.build(quick)
    contenders = {"numba": (cases.portable("numba"), _under_threads)}
    if with_torch and cases.torch is not None:
        contenders["torch"] = (cases.torch(), _under_torch_threads)
    results: dict[str, dict[str, dict[int, float]]] = {}
    for contender, (phases, wrap) in contenders.items():
        for phase, fn in phases.items():
            fns = {f"{n}": wrap(fn, n) for n in counts}
            times = time_interleaved(fns, repeats, burst_s=burst_s)
            results.setdefault(contender, {})[phase] = {n: times[f"{n}"] for n in counts}
    return results


def format_rows(label: str, results: dict[str, dict[str, dict[int, float]]], counts: Sequence[int]) -> list[str]:
    """One line per phase: the 1-thread time and each count's speed-up (PyTorch's in brackets)."""
    rows = []
    for phase, times in results["numba"].items():
        base = times[counts[0]]
        cells = []
        for n in counts[1:]:
            cell = f"{base / times[n]:5.2f}x"
            theirs = results.get("torch", {}).get(phase)
            if theirs:
                cell += f" ({theirs[counts[0]] / theirs[n]:4.2f}x)"
            cells.append(cell)
        rows.append(f"{label:<52} {phase:<8} {base * 1e3:10.3f}  " + "  ".join(cells))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_nn.bench.threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated op names or workload-name substrings (default: all)")
    parser.add_argument("--threads", help="comma-separated thread counts (default: 1, 2, 4, … up to the cores)")
    parser.add_argument("--quick", action="store_true", help="small shapes, short bursts (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed bursts per count (default 7, quick 2)")
    parser.add_argument("--torch", action="store_true", help="also PyTorch's own speed-up, in brackets")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.threads.split(",")] if args.threads else thread_counts(usable_cores())
    if counts[0] != 1:
        counts = [1, *counts]
    selectors = args.ops.split(",") if args.ops else None
    repeats = args.repeats or (2 if args.quick else 7)
    machine = describe_machine()
    print(f"{machine['cpu']} ({machine['isa']}), {usable_cores()} usable cores; numba {machine['numba']}, "
          f"torch {machine['torch']}; speed-up over 1 thread" + (" (PyTorch's in brackets)" if args.torch else ""))
    print(f"{'workload':<52} {'phase':<8} {'1 thread ms':>10}  " + "  ".join(f"{n} threads" for n in counts[1:]))
    for workload in WORKLOADS:
        if not workload.matches(selectors) or not has_numba_kernel(workload):
            continue
        results = measure(workload, counts, args.quick, repeats, args.torch, 0.02 if args.quick else 0.2)
        for row in format_rows(workload.label(args.quick), results, counts):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
