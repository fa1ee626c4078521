"""The demo (``python -m portable_nn demo``): training on real data with portable_nn ops only.

Two small classifiers learn scikit-learn's bundled handwritten digits (1,797 8x8 images, no
download): a LeNet-style CNN (:class:`~portable_nn.examples.models.CNN`) and an LSTM reading each
image row by row (:class:`~portable_nn.examples.models.RowLSTM`).  Forward passes are portable_nn
ops, gradients come from ``pnn.vjp`` pullbacks writing into preallocated buffers, and the
optimiser (Adam by default, or SGD with momentum) is plain array code.

The run trains both models on the chosen backend with a progress bar per epoch, then trains them
again, from the same initialisation and with the same batches, on every other backend available
on this machine (NumPy arrays for the CPU backends, CuPy arrays for the GPU ones) and, when
PyTorch is installed, as the same ``torch.nn`` models with ``torch.optim``
(:mod:`.torch_twin`), and ends with
a table of first-step time (kernel compilation or cache load), training time per epoch, the first
epoch's loss (the backends agree to rounding) and the final held-out accuracy.

Modules: :mod:`.data` (data set and fixed split), :mod:`.models`, :mod:`.optim`, :mod:`.train`,
:mod:`.progress`, :mod:`.report` (header and table).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import numpy as np

import portable_nn as pnn

from . import data as data_module
from . import torch_twin
from . import train as training
from .models import OPS as model_ops
from .report import Outcome, array_library, format_goals, format_header, format_table
from .train import RunStats, TrainConfig

__all__ = ["DEFAULT_EPOCHS", "GOALS", "add_demo_arguments", "exit_status", "run_demo"]

DEFAULT_EPOCHS = TrainConfig.epochs
#: Held-out accuracy each model must reach with the default settings.
GOALS = {"cnn": 0.97, "lstm": 0.95}
#: ``--backend auto`` trains first on the first available of these.  The data set is tiny
#: (batches of 32 8x8 images): CPU kernels win over GPU launch latency, and the GPU backends are
#: still measured in the table.
AUTO_ORDER = ("numba", "reference")
#: ``--quick``: training images and epochs (a CI smoke test of every code path).
QUICK_TRAIN_IMAGES = 512
QUICK_EPOCHS = 2


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the demo's command-line options."""
    parser.add_argument("--backend", default="auto", choices=["auto", *pnn.dispatch.backend_names()],
                        help="backend to train on first, with progress bars (default: auto, the fastest "
                             f"available of {', '.join(AUTO_ORDER)})")
    parser.add_argument("--epochs", type=int, default=None, help=f"training epochs (default {DEFAULT_EPOCHS})")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initialisation and batch order (the held-out split never changes)")
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size,
                        help=f"images per batch (default {TrainConfig.batch_size})")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                        help="Adam (default) or SGD with momentum 0.9")
    parser.add_argument("--lr", type=float, default=None, help="base learning rate (default: Adam 3e-3, SGD 0.05)")
    parser.add_argument("--compare", choices=["full", "epoch", "none"], default="full",
                        help="on the other available backends: the full training (default), one epoch, or none")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_TRAIN_IMAGES} training images, {QUICK_EPOCHS} epochs")


def _resolve_backend(name: str, status: dict[str, Any]) -> str:
    if name != "auto":
        if not status[name]:
            raise pnn.BackendUnavailableError(f"--backend {name}: {status[name].reason}")
        return name
    return next(b for b in AUTO_ORDER if status[b])


def _have_torch() -> bool:
    """Whether PyTorch is installed (the demo then times the same models in it)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _array_module(backend: str) -> Any:
    """NumPy for CPU backends, CuPy for the GPU ones (which take CuPy arrays)."""
    if array_library(backend) == "cupy":
        import cupy

        return cupy
    return np


def _train_both(data: data_module.Digits, cfg: TrainConfig, backend: str, verbose: bool) -> list[Outcome]:
    """Both models on ``backend``; with ``verbose`` a progress bar and line per epoch.

    A backend without a kernel for one of the ops (``BackendUnavailableError``) is reported as
    unsupported; any other error of a compared backend is reported as a failure (the first
    backend's errors propagate, with their traceback).
    """
    try:
        xp = _array_module(backend)
    except ImportError as err:
        return [Outcome(name, backend, error=f"{backend} takes CuPy arrays: {err}", unsupported=True)
                for name in ("cnn", "lstm")]
    outcomes = []
    for name in ("cnn", "lstm"):
        if verbose:
            print(f"\n{name.upper()} on {backend}")
        try:
            _, stats = training.train(name, data, cfg, backend, xp, stream=sys.stdout if verbose else None)
        except pnn.BackendUnavailableError as err:
            outcomes.append(Outcome(name, backend, error=str(err), unsupported=True))
            if verbose:
                print(f"  not supported: {err}")
            continue
        except Exception as err:  # one backend's failure is reported in the table, not fatal to the others
            if verbose:
                raise
            outcomes.append(Outcome(name, backend, error=f"{type(err).__name__}: {err}"))
            continue
        outcomes.append(Outcome(name, backend, stats=stats, goal=GOALS[name]))
    return outcomes


def _compare_line(outcome: Outcome) -> str:
    if outcome.stats is None:
        what = "not supported" if outcome.unsupported else "failed"
        return f"  {outcome.backend:<10} {outcome.model.upper():<4}  {what}: {outcome.error}"
    s: RunStats = outcome.stats
    epochs = f"{len(s.epochs)} epoch" + "s" * (len(s.epochs) != 1)
    return (f"  {outcome.backend:<10} {s.model:<4}  {epochs:>9}  loss {s.epochs[-1].loss:.4f}  "
            f"held-out {100 * s.accuracy:6.2f}%  {s.seconds_per_epoch:6.3f} s/epoch")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit status.

    0: success; 1: a backend failed (an error other than a missing kernel); 2: bad arguments, no
    scikit-learn, or the chosen backend cannot run the models; 3: with the default settings, a
    model missed its accuracy goal (:data:`GOALS`).
    """
    started = time.perf_counter()
    status = pnn.available_backends()
    try:
        backend = _resolve_backend(args.backend, status)
        digits = data_module.load(np.float32)
    except (pnn.BackendUnavailableError, ImportError) as err:
        print(f"demo: {err}", file=sys.stderr)
        return 2
    if args.quick:
        digits = digits.subset(QUICK_TRAIN_IMAGES)
    epochs = args.epochs if args.epochs is not None else QUICK_EPOCHS if args.quick else DEFAULT_EPOCHS
    if epochs < 1 or args.batch_size < 2:
        print("demo: --epochs must be >= 1 and --batch-size >= 2", file=sys.stderr)
        return 2
    cfg = TrainConfig(epochs=epochs, batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr,
                      seed=args.seed)
    others = [] if args.compare == "none" else [
        b for b, s in status.items() if s and b != backend and array_library(b) != "torch"
    ]
    compare_cfg = cfg if args.compare == "full" else dataclasses.replace(cfg, stop_after=1)

    with training.single_threaded_blas() as blas_note:
        print(format_header(digits, cfg, backend, args.backend == "auto", others, status, blas_note, args.quick))
        if backend == "numba" or "numba" in others:
            compile_models_first(str(digits.x_train.dtype), cfg.batch_size,
                                 QUICK_TRAIN_IMAGES if args.quick else None)
        outcomes = _train_both(digits, cfg, backend, verbose=True)
        if others:
            what = "full training" if args.compare == "full" else "one epoch"
            print(f"\nother backends ({what}: same initialisation, same batches)")
            for other in others:
                for outcome in _train_both(digits, compare_cfg, other, verbose=False):
                    print(_compare_line(outcome), flush=True)
                    outcomes.append(outcome)
    if args.compare != "none" and _have_torch():
        # Outside the BLAS limit above: PyTorch as a user's script runs it, with its own defaults.
        print(f"\nthe same models in PyTorch ({torch_twin.LABEL}, torch.optim; same initialisation, same batches)")
        for name in ("cnn", "lstm"):
            outcome = Outcome(name, torch_twin.LABEL, stats=torch_twin.train_torch(name, digits, compare_cfg))
            print(_compare_line(outcome), flush=True)
            outcomes.append(outcome)
    print()
    print(format_table(outcomes, backend, status, digits, args.compare))
    print()
    settings = "quick" if args.quick else "default" if cfg == TrainConfig(seed=cfg.seed) else "custom"
    print(format_goals(outcomes[:2], settings, time.perf_counter() - started))
    return exit_status(outcomes, settings)


def compile_models_first(dtype: str, batch_size: int, train_images: int | None) -> None:
    """On a new machine (no marker in the Numba kernel cache), compile the models' CPU kernels
    before training, one op family per process, as many at once as there are CPUs: training then
    loads them.  Each process runs the models' own calls at the run's sizes with its family on
    Numba and the other ops on the reference (:func:`~portable_nn.examples.train.exercise`), so
    exactly the kernels training meets compile, no generic variants.  On two cores
    ``demo --quick --compare none`` from an empty cache: 89 s with the kernels compiled as training
    met them, 60 s compiling the generic samples first, 46 s after the kernels' compile time was
    cut, 34-38 s with the models' own calls (six families of 4-21 s each, the slowest first).
    Skipped on one CPU, or where the cache cannot be written."""
    import functools
    import os

    import kernels_cpu

    from .. import kernel_cache, warmup

    jobs = min(os.cpu_count() or 1, len({pnn.dispatch.op_family(op) for op in model_ops}))
    # The sizes decide which paths run (serial or parallel, blocked or not): a run of other sizes
    # compiles again (loading what is cached already).
    marker = kernel_cache.warm_marker(kernels_cpu.__file__, f"demo-{dtype}-b{batch_size}-n{train_images or 'all'}")
    if jobs < 2 or marker is None or os.path.exists(marker):
        return
    print(f"compiling the models' kernels in {jobs} processes (first use only) …", flush=True)
    started = time.perf_counter()
    runner = functools.partial(training.exercise, batch_size=batch_size, train_images=train_images)
    warmup.compile_kernels(model_ops, [dtype], "numba", jobs=jobs, quiet=True, runner=runner)
    with open(marker, "w", encoding="utf-8") as fh:
        fh.write(f"{', '.join(model_ops)}\n")
    print(f"          compiled in {time.perf_counter() - started:.1f} s", flush=True)


def exit_status(outcomes: list[Outcome], settings: str) -> int:
    """The demo's exit status from its outcomes (the first two are the first backend's models).

    ``settings`` is ``"default"``, ``"custom"`` or ``"quick"``; see :func:`run_demo` for the codes.
    """
    if any(o.error and not o.unsupported for o in outcomes):
        return 1
    if any(o.unsupported for o in outcomes[:2]):
        return 2
    missed = any(o.stats.accuracy < o.goal for o in outcomes[:2] if o.stats and o.goal is not None)
    return 3 if settings == "default" and missed else 0
