"""The demo's printed header, results table and goal line."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Any

import numpy as np

import portable_nn as pnn
from portable_nn import dispatch

from ..about import package_version as _version
from .data import HELD_OUT_FRACTION, SPLIT_SEED, Digits
from .models import CNN, RowLSTM
from .optim import make_optimizer
from .train import RunStats, TrainConfig

__all__ = ["Outcome", "array_library", "format_goals", "format_header", "format_table"]


def array_library(backend: str) -> str:
    """The arrays the demo trains ``backend`` on: what its kernels take natively (``Backend.arrays``).

    CuPy for the GPU backends, NumPy for the CPU ones and the reference; ``"torch"`` for backends
    that take torch tensors only (``aten``), which the demo, training on NumPy and CuPy arrays,
    does not compare.
    """
    if backend == "torch.nn":  # the PyTorch twin of the models (examples.torch_twin)
        return "torch"
    arrays = dispatch.backend_arrays(backend)
    return "numpy" if arrays == "any" else arrays


@dataclass
class Outcome:
    """One model trained on one backend: its statistics, or the error that stopped it."""

    model: str
    backend: str
    stats: RunStats | None = None
    error: str | None = None
    goal: float | None = None
    unsupported: bool = False  #: the error is a missing kernel (BackendUnavailableError), not a failure


def _describe_models(dtype: Any) -> list[str]:
    """Fresh models (fixed generator; only their shapes are read) described for the header."""
    lines = []
    for cls in (CNN, RowLSTM):
        model = cls.init(np.random.default_rng(0), dtype)
        lines.append(f"  {cls.name:<5} {model.n_params:>7,} parameters   {model.describe()}")
    return lines


def format_header(data: Digits, cfg: TrainConfig, backend: str, auto: bool, others: list[str],
                  status: dict[str, Any], blas_note: str, quick: bool) -> str:
    """What is trained on what: data, split, models with parameter counts, backends, settings."""
    n_train, n_test = len(data.y_train), len(data.y_test)
    optimizer = make_optimizer(cfg.optimizer, [], cfg.lr).describe()
    unavailable = [b for b, s in status.items() if not s]
    chosen = f"{backend} (auto: fastest available for this small problem)" if auto else backend
    lines = [
        f"portable_nn {pnn.__version__} demo: two networks trained with portable_nn ops and pnn.vjp only",
        f"python {platform.python_version()}, numpy {_version('numpy')}, numba {_version('numba')}, "
        f"{os.cpu_count()} CPUs",
        "",
        f"data      scikit-learn {data.sklearn_version} handwritten digits: {data.n_total:,} grey 8x8 images, "
        "10 classes",
        f"split     {n_train:,} train / {n_test:,} held out, stratified {HELD_OUT_FRACTION:.0%} per class, "
        f"fixed (seed {SPLIT_SEED}, independent of --seed)" + ("; --quick: a subset of the training images" if quick
                                                                 else ""),
        f"training  {cfg.epochs} epoch{'s' * (cfg.epochs != 1)}, batch {cfg.batch_size}, {optimizer} with cosine "
        f"decay, seed {cfg.seed}, {data.x_train.dtype}",
        f"backend   {chosen}; then {', '.join(others) if others else 'no other backend'}",
    ]
    if unavailable:
        lines.append(f"          unavailable here: {', '.join(unavailable)} (why: see the table)")
    lines += [f"          {blas_note}", "", "models"]
    lines += _describe_models(data.x_train.dtype)
    return "\n".join(lines)




_HEAD = ("backend", "arrays", "model", "first step", "s/epoch", "vs ref", "epoch-1 loss", "epochs", "held-out")
_RIGHT = frozenset(range(3, len(_HEAD)))  # the numeric columns




def _cells(o: Outcome, reference: dict[str, float]) -> list[str]:
    """A measured outcome's table cells after (backend, arrays)."""
    s = o.stats
    if s is None:
        return [o.model.upper(), "unsupported" if o.unsupported else "failed"]
    ratio = reference.get(o.model)
    return [s.model, f"{s.first_step_s:.2f} s", f"{s.seconds_per_epoch:.3f}",
            f"{ratio / s.seconds_per_epoch:.1f}x" if ratio else "", f"{s.epochs[0].loss:.6f}", str(len(s.epochs)),
            f"{100 * s.accuracy:.2f}%"]


def format_table(outcomes: list[Outcome], first: str, status: dict[str, Any], data: Digits, compare: str) -> str:
    """The results: a row per (backend, model) with times, epoch-1 loss and final accuracy.

    Then a line per backend that did not run (unavailable here, torch tensors only, or skipped by
    ``--compare none``).
    ``vs ref`` is the reference backend's time per epoch over this backend's (how much faster).
    """
    reference = {o.model: o.stats.seconds_per_epoch for o in outcomes if o.backend == "reference" and o.stats}
    grid: list[list[str]] = []  # measured rows, aligned in columns
    errors: dict[int, str] = {}  # grid row -> error line printed under it
    for o in outcomes:
        new = not grid or o.backend != outcomes[outcomes.index(o) - 1].backend
        label = o.backend + (" *" if o.backend == first else "") if new else ""
        grid.append([label, array_library(o.backend) if new else "", *_cells(o, reference)])
        if o.error:
            errors[len(grid) - 1] = o.error
    widths = [max(len(h), *(len(r[i]) for r in grid if i < len(r))) for i, h in enumerate(_HEAD)]
    widths[0] = max(widths[0], *(len(name) for name in status))

    def row(cells: list[str]) -> str:
        text = "  ".join(c.rjust(w) if i in _RIGHT else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return ("  " + text).rstrip()

    lines = [
        f"results   s/epoch: seconds per training pass over the {len(data.y_train):,} images (median over epochs, "
        "evaluation excluded)",
        "          first step: one training step and one evaluation on fresh arrays (kernel compilation or "
        "cache load)",
        "",
        row(list(_HEAD)),
        row(["-" * w for w in widths]),
    ]
    for i, cells in enumerate(grid):
        lines.append(row(cells))
        if i in errors:
            lines.append(f"      {errors[i]}")
    ran = {o.backend for o in outcomes}
    for name, st in status.items():
        if name not in ran:
            if not st:
                why = f"unavailable: {st.reason}"
            elif array_library(name) == "torch":
                why = "not run: takes torch tensors only, and the demo trains on NumPy/CuPy arrays"
            else:
                why = "not run (--compare none)"
            lines.append(f"  {name:<{widths[0]}}  {'' if not st else array_library(name):<{widths[1]}}  {why}")
    notes = ["* trained first, with progress above"]
    if len(ran) > 1:
        notes[0] += f"; {first} and the others start from the same initialisation and see the same batches"
    if compare == "epoch" and any(len(o.stats.epochs) > 1 for o in outcomes if o.stats):
        notes.append("other backends ran one epoch (--compare epoch): their accuracy is after that epoch")
    lines += [""] + [f"  {n}" for n in notes]
    return "\n".join(lines)


def format_goals(first: list[Outcome], settings: str, seconds: float) -> str:
    """The accuracy goals of the first backend's run (met or not) and the run's wall time.

    ``settings`` is ``"default"``, ``"custom"`` (goals shown, with a note) or ``"quick"`` (not checked).
    """
    if settings == "quick":
        return f"goals     not checked with --quick (a smoke test)\nwall time {seconds:.1f} s"
    parts = []
    for o in first:
        if o.stats is None or o.goal is None:
            continue
        met = o.stats.accuracy >= o.goal
        parts.append(f"{o.stats.model} {100 * o.stats.accuracy:.2f}% {'>=' if met else '<'} {100 * o.goal:.0f}% "
                     f"{'met' if met else 'MISSED'}")
    note = "  (the goals are for the default settings)" if settings == "custom" else ""
    return f"goals     {'   '.join(parts)}{note}\nwall time {seconds:.1f} s"
