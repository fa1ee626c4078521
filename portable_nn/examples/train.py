"""The demo's training loop: mini-batches, optimiser steps, evaluation and timing.

Randomness comes from ``numpy.random.default_rng`` seeded with ``(seed, model, epoch)``: a model's
initial parameters depend on ``(seed, model)`` only, and an epoch's batch order on ``(seed, model,
epoch)`` only, so a backend timed for one epoch sees exactly the batches of the full run's first
epoch, and two runs with one seed print the same numbers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

import portable_nn as pnn

from .data import Digits, batches
from .models import MODELS, Model
from .optim import cosine_lr, make_optimizer
from .progress import Progress

__all__ = ["EpochStats", "RunStats", "TrainConfig", "accuracy", "exercise", "single_threaded_blas", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (the demo's defaults reach the accuracy goals)."""

    epochs: int = 20
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float | None = None
    seed: int = 0
    #: stop after this many epochs (``None``: all); the learning-rate schedule still spans ``epochs``,
    #: so a shortened run's epochs are exactly the full run's first ones
    stop_after: int | None = None


@dataclass
class EpochStats:
    """One epoch: mean training loss, held-out accuracy, seconds of training (evaluation excluded)."""

    epoch: int
    loss: float
    accuracy: float
    seconds: float


@dataclass
class RunStats:
    """A training run on one backend: first-step time, then one :class:`EpochStats` per epoch."""

    model: str
    backend: str
    n_params: int
    first_step_s: float = 0.0
    epochs: list[EpochStats] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        """Held-out accuracy after the last epoch."""
        return self.epochs[-1].accuracy

    @property
    def seconds_per_epoch(self) -> float:
        """Median training seconds per epoch (robust to a noisy neighbour on a shared machine)."""
        return float(np.median([e.seconds for e in self.epochs]))


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[str]:
    """Limit BLAS to one thread for the run, yielding a note for the header.

    The matrices here are tiny: BLAS threads gain nothing, and an idle OpenBLAS thread spins
    for a while after each product, taking a core from Numba's parallel kernels (10x slower
    steps on a 2-core machine).  The limit is lifted when the demo ends.
    """
    try:
        import scipy.linalg  # noqa: F401  (loads the BLAS that Numba's kernels call, so it is limited too)
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield "BLAS threads: library default (threadpoolctl not installed)"
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield "BLAS limited to 1 thread for the run (tiny matrices; spinning BLAS threads would take Numba's cores)"


def model_rng(seed: int, model: str, *epoch: int) -> np.random.Generator:
    """The generator for ``model``'s initialisation (no epoch) or an epoch's batch order."""
    return np.random.default_rng([seed, list(MODELS).index(model), *epoch])


def accuracy(model: Model, x: Any, y: Any, batch_size: int = 512) -> float:
    """Fraction of ``x`` classified as ``y`` (evaluation mode: batch norm's running statistics)."""
    correct = 0
    for start in range(0, int(y.shape[0]), batch_size):
        scores = model.logits(x[start:start + batch_size])
        correct += int((scores.argmax(axis=1) == y[start:start + batch_size]).sum())
    return correct / max(int(y.shape[0]), 1)


def _step(model: Model, optimizer: Any, x: Any, y: Any, lr: float) -> float:
    loss = model.loss_and_grads(x, y)
    optimizer.step(list(model.grads.values()), lr)
    return loss


def _first_step(model: Model, cfg: TrainConfig, x: Any, y: Any) -> float:
    """Seconds of one training step and one evaluation on a throwaway copy of ``model``.

    The first call of each kernel compiles it or loads it from Numba's on-disk cache (GPU
    backends: CUDA context, module loads); timing it on a copy keeps the real run's numbers
    unchanged and its epochs free of one-off costs.
    """
    scratch = model.copy()
    optimizer = make_optimizer(cfg.optimizer, list(scratch.params.values()), cfg.lr)
    n = min(cfg.batch_size, int(y.shape[0]))
    start = time.perf_counter()
    _step(scratch, optimizer, x[:n], y[:n], optimizer.lr)
    accuracy(scratch, x[:n], y[:n])
    return time.perf_counter() - start


def exercise(ops: Sequence[str], dtypes: Sequence[str], backend: str, *, batch_size: int,
             train_images: int | None) -> list[tuple[str, float, bool]]:
    """Compile ``backend``'s kernels of ``ops`` exactly as training the demo's models meets them.

    Both models take one training step on a full batch and one on the epoch's last, partial batch,
    then evaluate the held-out images, with ``ops`` on ``backend`` and every other op on the
    reference: the calls, shapes and sizes (so the serial or parallel paths) are training's,
    and only ``ops``' kernels compile — a :func:`portable_nn.warmup.compile_kernels` runner, one
    op family per process.  Returns ``(op, seconds, ran)`` per op (the family's time on its first op).
    """
    from . import data as data_module

    start = time.perf_counter()
    for dtype in dtypes:
        digits = data_module.load(np.dtype(dtype))
        if train_images is not None:
            digits = digits.subset(train_images)
        n = int(digits.y_train.shape[0])
        sizes = {min(batch_size, n), n % batch_size or min(batch_size, n)}
        with pnn.use_backend("reference", **dict.fromkeys(ops, backend)):
            for name, cls in MODELS.items():
                model = cls.init(model_rng(0, name), digits.x_train.dtype)
                optimizer = make_optimizer("adam", list(model.params.values()), None)
                for size in sorted(sizes):
                    _step(model, optimizer, digits.x_train[:size], digits.y_train[:size], optimizer.lr)
                accuracy(model, digits.x_test, digits.y_test)
    seconds = time.perf_counter() - start
    return [(op, seconds if i == 0 else 0.0, True) for i, op in enumerate(ops)]


def train(model_name: str, data: Digits, cfg: TrainConfig, backend: str, xp: Any = np,
          stream: TextIO | None = None) -> tuple[Model, RunStats]:
    """Train one model from its seed's initialisation on ``backend`` with arrays of library ``xp``.

    Args:
        model_name: a key of :data:`MODELS` (``"cnn"`` or ``"lstm"``).
        data: the split data (NumPy; moved to ``xp`` here).
        cfg: epochs, batch size, optimiser, learning rate, seed.
        backend: a portable_nn backend name, forced for every op of the run.
        xp: ``numpy`` or ``cupy``.
        stream: where the per-epoch progress goes; ``None`` prints nothing.

    Returns:
        The trained model and the run's statistics.
    """
    cls = MODELS[model_name]
    model = cls.init(model_rng(cfg.seed, model_name), data.x_train.dtype)
    if xp is not np:
        model = model.to(xp)
    x_train, y_train = xp.asarray(data.x_train), xp.asarray(data.y_train)
    x_test, y_test = xp.asarray(data.x_test), xp.asarray(data.y_test)
    stats = RunStats(cls.name, backend, model.n_params)
    with pnn.use_backend(backend):
        stats.first_step_s = _first_step(model, cfg, x_train, y_train)
        optimizer = make_optimizer(cfg.optimizer, list(model.params.values()), cfg.lr)
        n = int(y_train.shape[0])
        plan = [batches(n, cfg.batch_size, model_rng(cfg.seed, model_name, e)) for e in range(cfg.epochs)]
        total_steps = sum(len(p) for p in plan)
        for epoch, order in enumerate(plan[:cfg.stop_after], start=1):
            bar = Progress(len(order), f"  {cls.name:<4} epoch {epoch:>{len(str(cfg.epochs))}}/{cfg.epochs}",
                           stream) if stream is not None else None
            loss_sum, seen = 0.0, 0
            start = time.perf_counter()
            for i, idx in enumerate(order):
                index = xp.asarray(idx)
                lr = cosine_lr(optimizer.lr, optimizer.steps, total_steps)
                loss_sum += _step(model, optimizer, x_train[index], y_train[index], lr) * idx.size
                seen += idx.size
                if bar is not None:
                    bar.update(i + 1, loss_sum / seen)
            seconds = time.perf_counter() - start
            result = EpochStats(epoch, loss_sum / seen, accuracy(model, x_test, y_test), seconds)
            stats.epochs.append(result)
            if bar is not None:
                bar.finish(f"{bar.prefix}  loss {result.loss:.4f}  held-out {100 * result.accuracy:6.2f}%  "
                           f"{seconds:6.2f} s")
    return model, stats
