"""GPU benchmark: the CPU suite's workloads on a CUDA device, against PyTorch CUDA (cuDNN).

Part of ``python -m portable_nn gpu-check``.  Every workload of :data:`WORKLOADS`
is placed on the device (CuPy arrays for portable_nn, CUDA tensors for PyTorch)
and timed for each GPU backend that implements all of its ops, plus the large
layer_norm / rms_norm rows in float32, float16 and bfloat16.

Timing: a sample runs a phase ``inner`` times back to back and then waits for
the device (``torch.cuda.synchronize`` covers CuPy's and Numba's streams too),
so launch pipelining counts as it does in a real program, and a Python-side
cost (dispatch, launch overhead) shows up whenever it exceeds the GPU time.
``inner`` is calibrated per contender so a sample lasts a few milliseconds.
Contenders are interleaved round-robin, as on the CPU.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable, Sequence
from typing import Any

from .. import dispatch
from . import Report, Row, time_interleaved
from .progress import Progress
from .workloads import (
    WORKLOADS,
    Placement,
    Workload,
    _conv_workload,
    _loss_workload,
    _norm_workload,
    _sequence_workload,
)

__all__ = ["GPU_WORKLOADS", "gpu_backends", "gpu_contenders", "run_gpu_suite"]


def gpu_backends() -> tuple[str, ...]:
    """The backends whose kernels take CuPy arrays (declared by their packages)."""
    return dispatch.backends_taking("cupy")


#: The GPU-only rows (dtype, workload): the large norms in three dtypes, then float32 sizes that fill
#: a data-centre GPU: ResNet-50-size batch/group norm in both layouts, H=512 recurrences, a
#: 32000-class vocabulary and ResNet-size 3x3 convolutions at batch 64.
GPU_WORKLOADS: list[tuple[str, Workload]] = [
    *((dtype, _norm_workload(f"{op} (8192,4096) {dtype}", op, (8192, 4096), (512, 4096), lambda s: s[-1]))
      for op in ("layer_norm", "rms_norm") for dtype in ("float32", "float16", "bfloat16")),
    *(("float32", _norm_workload(f"{label} {{shape}}{' NHWC' if last else ''}", op, (64, 256, 56, 56),
                                 (8, 256, 56, 56), lambda s: s[1], extra, channels_last=last))
      for op, label, extra in (("batch_norm", "batch_norm train", ()), ("group_norm", "group_norm 32 groups", (32,)))
      for last in (False, True)),
    *(("float32", _sequence_workload(op, hidden=512)) for op in ("lstm", "gru")),
    *(("float32", _loss_workload(op, classes=32000)) for op in ("log_softmax", "cross_entropy")),
    ("float32", _conv_workload((64, 64, 56, 56), (64, 64, 3, 3), padding=1, quick_batch=4)),
    ("float32", _conv_workload((64, 256, 14, 14), (256, 256, 3, 3), padding=1, quick_batch=4)),
]

#: Target length of one timing sample (no settle pause: GPU work does not spin CPU threads).
SAMPLE_S = 0.005


def gpu_contenders(workload: Workload, dtype: str = "float32") -> list[str]:
    """GPU backends that run every op of ``workload`` on CuPy arrays of ``dtype``."""
    import array_api_compat.cupy as xp

    probe = dispatch.Call("probe", {}, {}, xp=xp, family="cupy", device="cuda:0", dtype=dtype)
    found = []
    for backend in gpu_backends():
        if not dispatch.backend_status(backend):
            continue
        ok = True
        for op in workload.ops:
            impl = next((i for i in dispatch.implementations(op) if i.backend == backend), None)
            s = impl.supports if impl else None
            if s is None or s.matches_arrays(probe) is not None or (s.dtypes is not None and dtype not in s.dtypes):
                ok = False
                break
        if ok:
            found.append(backend)
    return found


def _synchronize() -> None:
    import torch

    torch.cuda.synchronize()


def _time_gpu(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, interleaved, device-synchronised per sample."""
    return time_interleaved(fns, repeats, settle_s=0.0, burst_s=SAMPLE_S, wait=_synchronize)


def cuda_copy_bandwidth(quick: bool = False) -> float:
    """GB/s (read + write counted) of a device-to-device copy of 256 MiB (64 MiB quick)."""
    import torch

    n = (64 if quick else 256) * 2**20 // 4
    src = torch.ones(n, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _time_gpu({"copy": lambda: dst.copy_(src)}, 5 if quick else 20)["copy"]
    return 2 * src.numel() * 4 / seconds / 1e9


def gpu_environment() -> dict[str, Any]:
    """Device, driver and library versions for the report."""
    import torch

    from ..about import package_version as _version

    props = torch.cuda.get_device_properties(0)
    return {
        "python": platform.python_version(),
        "device": props.name,
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda (torch)": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "cupy": _version("cupy-cuda13x") if _version("cupy-cuda13x") != "not installed" else _version("cupy"),
        "numba": _version("numba"),
        "numba-cuda": _version("numba-cuda"),
        "numpy": _version("numpy"),
        "machine": platform.processor() or platform.machine(),
    }


def run_gpu_suite(quick: bool = False, progress: bool = False, selectors: Sequence[str] | None = None,
                  on_row: Callable[[Row], None] | None = None) -> Report:
    """Measure every workload on the GPU; returns a :class:`~portable_nn.bench.Report`.

    ``progress`` shows the workloads on stderr (:class:`~portable_nn.bench.progress.Progress`: a
    tqdm bar on a terminal, a line each otherwise); ``selectors`` keeps the workloads they match
    (op names or name substrings, as ``bench --ops``); ``on_row`` sees each row as soon as it is
    measured (a log that survives an interrupted run).
    """
    report = Report(gpu_environment(), cuda_copy_bandwidth(quick), quick=quick)
    plan = [(dtype, w) for dtype, w in [("float32", w) for w in WORKLOADS] + GPU_WORKLOADS if w.matches(selectors)]
    repeats = 5 if quick else 15
    bar = Progress(len(plan), enabled=progress)
    for dtype, workload in plan:
        with bar.step(workload.label(quick)):
            _measure_gpu_workload(report, dtype, workload, quick, repeats, on_row)
    bar.close()
    _fill_ratios(report)
    return report


def _measure_gpu_workload(report: Report, dtype: str, workload: Any, quick: bool, repeats: int,
                          on_row: Callable[[Row], None] | None) -> None:
    """One workload's rows (every GPU contender and PyTorch), appended to ``report``."""
    try:
        cases = workload.build(quick, Placement("cuda", dtype))
    except Exception as exc:  # a dtype PyTorch or CuPy cannot build here: reported, not fatal
        report.notes.append(f"{workload.label(quick)}: not built ({type(exc).__name__}: {exc})")
        return
    fns: dict[str, Callable[[], Any]] = {}
    builders = {b: functools.partial(cases.portable, b) for b in gpu_contenders(workload, dtype)}
    if cases.torch is not None:
        builders["torch"] = cases.torch
    for contender, build in builders.items():
        try:
            phases = build()
            for fn in phases.values():
                fn()
            _synchronize()
        except Exception as exc:  # a failing contender is reported and left out, the rest go on
            report.notes.append(f"{workload.label(quick)} [{contender}]: failed ({type(exc).__name__}: {exc})")
            continue
        fns.update({f"{contender}|{phase}": fn for phase, fn in phases.items()})
    for key, seconds in _time_gpu(fns, repeats).items():
        contender, phase = key.split("|")
        moved = cases.bytes_moved.get(phase, 0)
        row = Row(workload.label(quick), contender, phase, seconds * 1e3, moved)
        if moved:
            row.gbps = moved / seconds / 1e9
            row.fraction_of_copy = row.gbps / report.copy_gbps
        report.rows.append(row)
        if on_row:
            on_row(row)


def _fill_ratios(report: Report) -> None:
    """Each row's time ratio to PyTorch's row of the same workload and phase."""
    torch_ms = {(r.workload, r.phase): r.median_ms for r in report.rows if r.contender == "torch"}
    for r in report.rows:
        ref = torch_ms.get((r.workload, r.phase))
        if ref and r.median_ms:
            r.ratio_vs_torch = ref / r.median_ms


# --------------------------------------------------------------------------- goals

#: The GPU goals (an H100/H200 against PyTorch CUDA with cuDNN): the fraction of copy bandwidth per
#: phase for the large memory-bound rows, and time ratios to PyTorch for the rest.
COPY_GOALS = {"fwd": 0.85, "bwd": 0.70}
LARGE_NORMS = ("layer_norm (8192,4096)", "rms_norm (8192,4096)")
LARGE_LOSSES = ("log_softmax (4096,32000)", "cross_entropy (4096,32000)")
RATIO_GOALS = (*LARGE_NORMS, "batch_norm train (64,256,56,56)", "group_norm 32 groups (64,256,56,56)",
               "lstm 2 layers", "gru 2 layers", "conv")


def goal_checks(report: Report) -> list[tuple[str, str, bool]]:
    """``(row, goal, met)`` for every portable_nn row a GPU goal applies to."""
    checks = []
    for r in report.rows:
        if r.contender not in gpu_backends():
            continue
        label = f"{r.workload} [{r.contender}, {r.phase}]"
        if r.workload.startswith(RATIO_GOALS) and r.phase == "fwd+bwd" and r.ratio_vs_torch is not None:
            checks.append((label, ">= 1.0x PyTorch", r.ratio_vs_torch >= 1.0))
        copy_goal = r.workload.startswith(LARGE_NORMS) or r.workload.startswith(LARGE_LOSSES)
        if copy_goal and r.fraction_of_copy is not None and r.phase in COPY_GOALS:
            need = COPY_GOALS["fwd"] if r.workload.startswith(LARGE_LOSSES) else COPY_GOALS[r.phase]
            checks.append((label, f">= {need:.0%} of copy bandwidth", r.fraction_of_copy >= need))
    return checks
