"""Compiling the kernels ahead of time: ``python -m portable_nn compile [--ops ...] [--dtypes ...]``.

A kernel compiles on its first use with a dtype and is then loaded from Numba's on-disk cache
(:mod:`portable_nn.kernel_cache`).  :func:`compile_kernels` makes those first uses happen now —
in a Docker image build or a CI setup step — by running one small call of each op, forward and
backward, per dtype and layout, on the chosen backend.  :func:`samples` is that call per op (the
tests use it as "one valid call of every op").
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from . import api, backends, config, dispatch, kernel_cache
from .autodiff import vjp

__all__ = ["compile_kernels", "samples"]

#: What ``compile`` builds by default: the dtypes the CPU kernels take.
DEFAULT_DTYPES = ("float32", "float64")


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of a sample's data: bfloat16 is ml_dtypes' (the arrays JAX hands over,
    which the CPU kernels read as their bits just as they read a bfloat16 torch tensor's).

    Raises:
        ValueError: ``"bfloat16"`` without the ml_dtypes package.
    """
    if dtype != "bfloat16":
        return np.dtype(dtype)
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError("bfloat16 samples are NumPy arrays of ml_dtypes' bfloat16: pip install ml-dtypes") from None
    return np.dtype(ml_dtypes.bfloat16)


def _data(dtype: str) -> Callable[..., np.ndarray]:
    rng = np.random.default_rng(0)
    resolved = numpy_dtype(dtype)
    return lambda *shape: rng.standard_normal(shape).astype(resolved)


def _rnn_params(a: Callable[..., np.ndarray], gates: int, features: int, hidden: int) -> list[tuple[Any, ...]]:
    return [(a(gates * hidden, features), a(gates * hidden, hidden), a(gates * hidden), a(gates * hidden))]


def samples(dtype: str = "float64") -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Per op, small valid calls ``(args, kwargs)`` with data of ``dtype``: channels first, and
    channels last where the op takes ``channel_axis`` (each compiles what its layout needs)."""
    a = _data(dtype)
    dtype = numpy_dtype(dtype)
    labels = np.array([0, 2, 1, 0])
    both = ({}, {"channel_axis": -1})

    def layouts(x_first: np.ndarray, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, ...]]:
        x_last = np.ascontiguousarray(np.moveaxis(x_first, 1, -1))
        return [((x if not extra else x_last, *args), {**kwargs, **extra}) for x, extra in zip((x_first,) * 2, both)]

    return {
        "moments": [((a(2, 3),), {"axis": 0})],
        "batch_norm": [*layouts(a(4, 3, 2), (), {"weight": a(3), "bias": a(3), "running_mean": np.zeros(3, dtype),
                                                 "running_var": np.ones(3, dtype)}),
                       ((a(2, 3, 8, 8),), {"weight": a(3), "bias": a(3)})],  # row mode (images of >= 32 pixels)
        "layer_norm": [((a(2, 3), a(3), a(3)), {})],
        "group_norm": layouts(a(2, 4, 3), (2, a(4), a(4)), {}),
        "instance_norm": layouts(a(2, 3, 5), (), {"weight": a(3), "bias": a(3)}),
        "rms_norm": [((a(2, 3), a(3)), {})],
        "rnn_cell": [((a(2, 3), a(2, 4), a(4, 3), a(4, 4)), {})],
        "lstm_cell": [((a(2, 3), a(2, 4), a(2, 4), a(16, 3), a(16, 4)), {})],
        "gru_cell": [((a(2, 3), a(2, 4), a(12, 3), a(12, 4)), {})],
        "rnn": [((a(5, 2, 3), _rnn_params(a, 1, 3, 4)), {})],
        "lstm": [((a(5, 2, 3), _rnn_params(a, 4, 3, 4)), {})],
        "gru": [((a(5, 2, 3), _rnn_params(a, 3, 3, 4)), {})],
        "conv": [((a(2, 3, 6, 6), a(4, 3, 3, 3), a(4)), {}),
                 ((np.ascontiguousarray(np.moveaxis(a(2, 3, 6, 6), 1, -1)), a(4, 3, 3, 3), a(4)),
                  {"channel_axis": -1})],
        "conv_transpose": [((a(2, 4, 3, 3), a(4, 3, 3, 3), a(3)), {"stride": 2, "activation": "gelu"}),
                           ((np.ascontiguousarray(np.moveaxis(a(2, 4, 3, 3), 1, -1)), a(4, 3, 2, 2), a(3)),
                            {"stride": 2, "channel_axis": -1})],
        "dense": [((a(2, 3), a(4, 3), a(4)), {})],
        "max_pool": layouts(a(2, 3, 6, 6), (2,), {}),
        "max_unpool": [((a(2, 3, 3, 3), np.zeros((2, 3, 3, 3), np.int64), 2), {})],
        "avg_pool": layouts(a(2, 3, 6, 6), (2,), {}),
        "log_softmax": [((a(2, 3),), {})],
        "cross_entropy": [((a(4, 3), labels), {})],
    }


def _ones_like(tree: Any) -> Any:
    """A cotangent shaped like an op's result: ones for every floating array."""
    if isinstance(tree, tuple):
        return tuple(_ones_like(t) for t in tree)
    if tree is None or np.asarray(tree).dtype.kind not in "fV":  # indices take no cotangent (V: bfloat16)
        return None
    return np.ones_like(tree)


def _run(op: str, backend: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """One forward and backward of ``op`` on ``backend``; ``False`` when the backend declines the call."""
    function = getattr(api, op)
    with config.use_backend(**{op: backend}):
        try:
            function(*args, **kwargs)
            result, pullback = vjp(function, *args, **kwargs)
        except dispatch.BackendUnavailableError:
            return False
        pullback(_ones_like(result))
    return True


def compile_kernels(
    ops: Sequence[str] | None = None,
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    backend: str = "numba",
    progress: bool | None = None,
    jobs: int = 1,
    quiet: bool = False,
    runner: Callable[[Sequence[str], Sequence[str], str], list[tuple[str, float, bool]]] | None = None,
) -> dict[str, float]:
    """Compile (or load from the cache) ``backend``'s kernels of ``ops`` for ``dtypes``.

    Args:
        ops: op names (default: every op).
        dtypes: data dtypes to compile for (default float32 and float64).
        backend: the kernel backend (default ``"numba"``, the CPU kernels).
        progress: a progress bar (tqdm, when installed) on a terminal; ``None`` decides by
            whether stderr is one.  Without one, a line per op.
        jobs: processes compiling at once (Numba compiles on one core per process); each takes
            whole op families (the ops of one kernel module), so no two compile the same kernel
            or write the same cache index.
        quiet: no line per op where there is no progress bar.
        runner: what compiles one op family, ``runner(ops, dtypes, backend)`` returning
            ``(op, seconds, ran)`` per op; a picklable module-level function when ``jobs > 1``.
            By default each op's sample calls (:func:`samples`), as they are and under the
            backend's ``compile_variants``; a program may instead run its own calls, so that only
            what it uses compiles (the demo does).

    Returns:
        Seconds spent per op (compilation, or loading an already-filled cache), in the process
        that built it.

    Raises:
        ValueError: an unknown op or dtype, a backend that is not available here, or ``jobs < 1``.
    """
    known = dispatch.op_names()
    chosen = list(known) if not ops else list(ops)
    unknown = [op for op in chosen if op not in known]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; expected some of {', '.join(known)}")
    dtypes = tuple(dtypes)
    bad = [d for d in dtypes if d not in (*DEFAULT_DTYPES, "float16", "bfloat16")]
    if bad:
        raise ValueError(f"dtypes must be floating dtype names such as float32, got {', '.join(bad)}")
    for dtype in dtypes:
        numpy_dtype(dtype)  # bfloat16 needs ml_dtypes: said before any work
    status = dispatch.backend_status(backend)
    if not status:
        raise ValueError(f"backend {backend!r} is not available here: {status.reason}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    terminal = bool(getattr(sys.stderr, "isatty", lambda: False)()) if progress is None else progress
    bar = _bar(len(chosen), terminal)
    timings: dict[str, float] = {}

    def report(op: str, seconds: float, ran: bool) -> None:
        timings[op] = seconds
        if bar is not None:
            bar.update(1)
        elif not quiet:
            what = "compiled or loaded" if ran else f"nothing: {backend} declines these calls"
            print(f"{op}: {what} in {seconds:.1f} s", flush=True)

    families = _families(chosen)
    job = runner or _compile_family
    if jobs > 1 and len(families) > 1:
        _compile_in_processes(families, dtypes, backend, min(jobs, len(families)), bar, report, job)
    elif runner is not None:
        for family in families:
            for op, seconds, ran in runner(family, dtypes, backend):
                report(op, seconds, ran)
    else:
        for op in chosen:
            if bar is not None:
                bar.set_description(f"compiling {op}")
            report(op, *_compile_op(op, dtypes, backend))
    if bar is not None:
        bar.close()
    return timings


def _families(ops: Sequence[str]) -> list[list[str]]:
    """``ops`` grouped by op family (the kernel module they share), in first-seen order."""
    groups: dict[str, list[str]] = {}
    for op in ops:
        groups.setdefault(dispatch.op_family(op), []).append(op)
    return list(groups.values())


def _variants(backend: str) -> list[Callable[[], Any]]:
    """The contexts to run the samples under: as they are, then (where the backend declares one)
    taking the variants only large calls reach."""
    contexts: list[Callable[[], Any]] = [contextlib.nullcontext]
    dispatch.backend_names()  # loads the backend packages (a fresh worker process has none yet)
    declared = backends.declared().get(backend)
    if declared is not None and declared.compile_variants:
        module, _, name = declared.compile_variants.partition(":")
        contexts.append(getattr(importlib.import_module(module), name))
    return contexts


def _compile_op(op: str, dtypes: Sequence[str], backend: str) -> tuple[float, bool]:
    """(seconds, whether the backend took any call) of compiling ``op``'s kernels for ``dtypes``."""
    start = time.perf_counter()
    calls = [call for dtype in dtypes for call in samples(dtype)[op]]
    ran = []
    for variant in _variants(backend):
        with variant():
            ran += [_run(op, backend, args, kwargs) for args, kwargs in calls]
    return time.perf_counter() - start, any(ran)


def _compile_family(ops: Sequence[str], dtypes: Sequence[str], backend: str) -> list[tuple[str, float, bool]]:
    """A worker process's job: every op of one family, in turn."""
    return [(op, *_compile_op(op, dtypes, backend)) for op in ops]


def _quiet_worker() -> None:
    """The workers leave the compile notices to the parent's progress (one line per op)."""
    os.environ[kernel_cache.NOTICE_VARIABLE] = "0"


#: Seconds to compile each family's Numba kernels for one dtype, every variant, from an empty cache
#: (2-core Xeon with AVX-512, numba 0.68).  Only orders the work, longest first, so that the
#: processes finish together: `demo --quick` compiled its six families on two cores in 50.6 s in
#: the api's order, 44.9 s longest first.
_FAMILY_SECONDS = {"rnn": 26.0, "norm": 22.0, "conv": 18.0, "pool": 18.0, "loss": 13.0, "dense": 5.0}


def _compile_in_processes(families: list[list[str]], dtypes: Sequence[str], backend: str, jobs: int, bar: Any,
                          report: Callable[[str, float, bool], None], job: Callable[..., Any]) -> None:
    """Each family in a fresh process (spawned: Numba's and TBB's threads do not survive a fork),
    ``jobs`` at a time, the slowest to compile first (see _FAMILY_SECONDS)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ordered = sorted(families, key=lambda ops: _FAMILY_SECONDS.get(dispatch.op_family(ops[0]), 0.0), reverse=True)
    if bar is not None:
        bar.set_description(f"compiling in {jobs} processes")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_quiet_worker) as pool:
        pending = [pool.submit(job, family, tuple(dtypes), backend) for family in ordered]
        for future in as_completed(pending):
            for op, seconds, ran in future.result():
                report(op, seconds, ran)


def _bar(total: int, terminal: bool) -> Any:
    """A tqdm progress bar on a terminal, else ``None``."""
    if not terminal:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="op", file=sys.stderr)
