"""The benchmark's worker processes: one contender, one workload (or one mixed case), one fresh process.

The parent (:mod:`portable_nn.bench.isolated`) starts ``python -c BOOTSTRAP SPEC`` with the
environment under test.  :data:`BOOTSTRAP` imports NumPy alone and reads the resident set
size, the baseline of the one-time footprint, before anything of ours is imported; then
:func:`main` reads the JSON ``SPEC`` and prints one line, :data:`RESULT_MARK` followed by the
result as JSON, on stdout (anything else a library prints there is ignored).

Specs (``kind``):

* ``probe`` — the machine description (:func:`~portable_nn.bench.environment.describe_machine`)
  and the copy bandwidth, as a worker with this environment sees them.
* ``workload`` — builds one workload for one contender (``numba``, ``reference`` … or
  ``torch``) at 2 threads, warms it up (the first calls, compilation included, are timed
  separately and kept out of the medians), then times steady-state bursts of each phase
  round-robin and reports per-phase medians, with the memory figures of :func:`_memory_probe`.
* ``mixed`` — one case of :mod:`portable_nn.bench.mixed`: PyTorch and portable_nn in this one
  process.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BOOTSTRAP", "RESULT_MARK", "main", "peak_rss_bytes", "reset_peak_rss", "rss_bytes"]

RESULT_MARK = "portable-nn-bench-result: "

#: The worker's ``-c`` program: RSS after a plain ``import numpy``, then :func:`main`.
BOOTSTRAP = """
import sys
import numpy
base = None
try:
    with open("/proc/self/status") as fh:
        base = next((int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:")), None)
except OSError:
    pass
from portable_nn.bench.worker import main
sys.exit(main(sys.argv[1], base))
"""

#: Warm-up: at least this many calls of each phase after the first, and about this long in all.
WARMUP_CALLS = 2
WARMUP_S = 0.3


# --------------------------------------------------------------------------- memory


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``) in bytes, or ``None`` off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int | None:
    """The resident set size now, or ``None`` where ``/proc`` does not say."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int | None:
    """The peak resident set size since the start or the last :func:`reset_peak_rss`."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs`` 5); ``False`` where that is unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


def _memory_probe(baseline: int | None, before: int | None, peak_reset: bool) -> dict[str, float | None]:
    """The memory figures of a worker, in MiB.

    ``footprint_mib``: RSS after warm-up minus RSS after ``import numpy`` (libraries, compiled
    kernels, the workload's data, pools and caches: paid once); ``peak_growth_mib``: the
    peak RSS during the timed phase over the RSS before it (what steady-state steps add on
    top), ``None`` where the peak cannot be reset.
    """
    peak = peak_rss_bytes() if peak_reset else None
    return {
        "footprint_mib": _mib(before - baseline) if before is not None and baseline is not None else None,
        "peak_growth_mib": _mib(max(peak - before, 0)) if peak is not None and before is not None else None,
        "rss_before_timed_mib": _mib(before),
    }


# --------------------------------------------------------------------------- timing


def set_threads(n: int, torch_too: bool) -> None:
    """Give portable_nn (and PyTorch, when ``torch_too``) ``n`` threads, by their own calls."""
    import portable_nn as pnn

    pnn.set_num_threads(n)
    if torch_too:
        import torch

        torch.set_num_threads(n)


def warm_up(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Call every function until it is warm; returns each one's first-call seconds (compilation included)."""
    first = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t
    deadline = time.perf_counter() + WARMUP_S
    for k in range(100):
        for fn in fns.values():
            fn()
        if k + 1 >= WARMUP_CALLS and time.perf_counter() > deadline:
            break
    return first


def timed_steady_state(fns: dict[str, Callable[[], Any]], repeats: int, burst_s: float,
                       settle_s: float = 0.0) -> tuple[dict[str, float], dict[str, float]]:
    """Warm ``fns`` up, then time them round-robin; returns (first-call seconds, median seconds per call)."""
    from . import time_interleaved

    first = warm_up(fns)
    return first, time_interleaved(fns, repeats, settle_s=settle_s, burst_s=burst_s)


# --------------------------------------------------------------------------- kinds


def _probe(spec: dict[str, Any]) -> dict[str, Any]:
    from . import _copy_bandwidth
    from .environment import describe_machine

    set_threads(spec["threads"], torch_too=False)
    return {"machine": describe_machine(), "copy_gbps": _copy_bandwidth(spec["quick"])}


def _phases(spec: dict[str, Any]) -> tuple[dict[str, Callable[[], Any]], dict[str, int]]:
    """The workload's phases for the spec's contender, and its bytes moved per phase."""
    from .workloads import WORKLOADS

    workload = next(w for w in WORKLOADS if w.name == spec["workload"])
    cases = workload.build(spec["quick"])
    if spec["contender"] == "torch":
        if cases.torch is None:
            raise ValueError(f"{workload.name} has no PyTorch side")
        return cases.torch(), cases.bytes_moved
    return cases.portable(spec["contender"]), cases.bytes_moved


def _workload(spec: dict[str, Any], baseline: int | None) -> dict[str, Any]:
    from . import _copy_bandwidth, time_interleaved

    set_threads(spec["threads"], torch_too=spec["contender"] == "torch")
    fns, moved = _phases(spec)
    first = warm_up(fns)
    before = rss_bytes()
    reset = reset_peak_rss()
    medians = time_interleaved(fns, spec["repeats"], settle_s=0.0, burst_s=spec["burst_s"])
    memory = _memory_probe(baseline, before, reset)
    # The memory roofline at this workload's size: a copy moving the bytes its forward moves.
    copy = _copy_bandwidth(spec["quick"], moved["fwd"] // 2) if moved.get("fwd") else None
    return {"phases": medians, "first_call_s": first, "bytes_moved": moved, "memory": memory, "copy_gbps": copy}


def _mixed(spec: dict[str, Any]) -> dict[str, Any]:
    from .mixed import measure_case

    set_threads(spec["threads"], torch_too=True)
    return measure_case(spec["case"], spec["quick"], spec["repeats"], spec["burst_s"])


def main(spec_json: str, baseline_rss: int | None = None) -> int:
    """Run one spec and print its result line; the exit status is 0 on success."""
    from .environment import reported_variables

    spec = json.loads(spec_json)
    kinds: dict[str, Callable[[], dict[str, Any]]] = {
        "probe": lambda: _probe(spec),
        "workload": lambda: _workload(spec, baseline_rss),
        "mixed": lambda: _mixed(spec),
    }
    result = kinds[spec["kind"]]()
    result["env"] = reported_variables()
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0
