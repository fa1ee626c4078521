"""The fixed cost of a call, and of a small model's step: ``python -m portable_nn.bench.overhead``.

Small calls (a few hundred elements) cost what the library does around the kernel — argument
checks, the choice of implementation, bridging torch tensors, autograd — far more than the
arithmetic.  The first table times such calls against PyTorch's own, in one process,
interleaved: an op through ``portable_nn`` on NumPy arrays and on CPU torch tensors, the same op
through the PyTorch adapter's function (``portable_nn.torch.<op>``), and a drop-in module's
forward and backward against its ``torch.nn`` original.  The GPU path pays the same Python cost
per call (the figures bound what a small GPU call can take on this host), plus its launches.
Each figure is the median over bursts of back-to-back calls, in microseconds per call.

The second table, *small-model steps* (:mod:`portable_nn.bench.model_steps`), times whole
training-step gradients — MLP and LeNet-5 at batch 32 and 128, the demo's CNN and LSTM steps, a
transformer MLP block, a resnet18 step — with each contender in its own fresh process in the
user's environment, alternated over ``--rounds`` rounds (per ``--isa``: ``native``, ``avx2``),
and, unless ``--no-in-process``, both interleaved in this process as well; milliseconds per step.

Every ratio is PyTorch's time over ours (above 1: we are faster).  Options: ``--ops`` and
``--models`` select rows by substring (``none`` skips a table), ``--quick`` is a smoke test
(short bursts, one round, every step of a contender in one process, no in-process figure, no
resnet18 unless named), ``--repeats``, ``--rounds``, ``--isa native,avx2``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import portable_nn as pnn

from . import isa_environment, split_selectors, time_interleaved
from .environment import ISA_SETTINGS, describe_machine, user_environment
from .model_steps import ModelStep, measure_in_process, measure_isolated, select_steps


@dataclass(frozen=True)
class Case:
    """One small call: ``ours`` through portable_nn or its PyTorch adapter, ``theirs`` PyTorch's (torch tensors).

    ``build(lib)`` returns the call's arguments for ``lib`` (``"numpy"`` or ``"torch"``);
    ``ours(module, *args)`` makes the call with ``module`` — ``portable_nn`` (on NumPy arrays or
    torch tensors) or ``portable_nn.torch`` (on torch tensors) — and ``theirs(*args)`` PyTorch's.
    """

    name: str
    build: Callable[[str], tuple[Any, ...]]
    ours: Callable[..., Any]
    theirs: Callable[..., Any]


@dataclass(frozen=True)
class ModulePair:
    """A drop-in module row: our module and ``torch.nn``'s, built alike, forward and backward on ``shape``.

    ``output`` picks the tensor a module's result is summed over (an LSTM returns a tuple).
    """

    name: str
    ours: Callable[[], Any]
    theirs: Callable[[], Any]
    shape: tuple[int, ...]
    output: Callable[[Any], Any] = lambda y: y


#: The "how" column: our call on NumPy arrays, on torch tensors, through the PyTorch adapter, a module.
HOWS = ("NumPy arrays", "torch tensors", "portable_nn.torch", "module fwd+bwd")

#: Process rounds per contender in the small-model section (``--rounds``), and in a ``--quick`` run.
ROUNDS, QUICK_ROUNDS = 3, 1

#: Threads each library gets in the small-model section's processes.
THREADS = 2


def _arrays(lib: str, *shapes: tuple[int, ...], seed: int = 0) -> tuple[Any, ...]:
    """Random float32 arrays of ``shapes`` for ``lib`` (NumPy arrays, or torch tensors sharing their memory)."""
    rng = np.random.default_rng(seed)
    made = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    if lib == "torch":
        import torch

        return tuple(torch.from_numpy(a) for a in made)
    return tuple(made)


def _labels(lib: str, n: int, classes: int) -> Any:
    """``n`` int64 class labels below ``classes`` for ``lib``."""
    labels = np.arange(n, dtype=np.int64) % classes
    if lib == "torch":
        import torch

        return torch.from_numpy(labels)
    return labels


def cases() -> list[Case]:
    """The small calls timed (float32, shapes of a few hundred to a few thousand elements)."""
    import torch.nn.functional as F

    return [
        Case("layer_norm (4,64)", lambda lib: _arrays(lib, (4, 64), (64,), (64,)),
             lambda m, x, w, b: m.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (64,), w, b)),
        Case("rms_norm (4,64)", lambda lib: _arrays(lib, (4, 64), (64,)),
             lambda m, x, w: m.rms_norm(x, w), lambda x, w: F.rms_norm(x, (64,), w)),
        Case("batch_norm train (4,8,4,4)", lambda lib: _arrays(lib, (4, 8, 4, 4), (8,), (8,)),
             lambda m, x, w, b: m.batch_norm(x, weight=w, bias=b),
             lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
        Case("log_softmax (4,64)", lambda lib: _arrays(lib, (4, 64)),
             lambda m, x: m.log_softmax(x), lambda x: F.log_softmax(x, -1)),
        Case("cross_entropy (4,64)", lambda lib: (*_arrays(lib, (4, 64)), _labels(lib, 4, 64)),
             lambda m, x, t: m.cross_entropy(x, t), lambda x, t: F.cross_entropy(x, t)),
        Case("dense (4,64)->64 + relu", lambda lib: _arrays(lib, (4, 64), (64, 64), (64,)),
             lambda m, x, w, b: m.dense(x, w, b, activation="relu"), lambda x, w, b: F.relu(F.linear(x, w, b))),
        Case("conv 3x3 (1,4,8,8)->4 + relu", lambda lib: _arrays(lib, (1, 4, 8, 8), (4, 4, 3, 3), (4,)),
             lambda m, x, w, b: m.conv(x, w, b, padding=1, activation="relu"),
             lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1))),
    ]


def module_pairs() -> list[ModulePair]:
    """The drop-in module rows: our module against its ``torch.nn`` twin."""
    import torch

    import portable_nn.torch as pnt

    return [
        ModulePair("LayerNorm(64) (4,64)", lambda: pnt.LayerNorm(64), lambda: torch.nn.LayerNorm(64), (4, 64)),
        ModulePair("Linear(64,64) (4,64)", lambda: pnt.Linear(64, 64), lambda: torch.nn.Linear(64, 64), (4, 64)),
        ModulePair("Conv2d(4,4,3) (1,4,8,8)", lambda: pnt.Conv2d(4, 4, 3, padding=1),
                   lambda: torch.nn.Conv2d(4, 4, 3, padding=1), (1, 4, 8, 8)),
        ModulePair("BatchNorm2d(8) (4,8,4,4)", lambda: pnt.BatchNorm2d(8), lambda: torch.nn.BatchNorm2d(8),
                   (4, 8, 4, 4)),
        ModulePair("LSTM(16,16) (5,4,16)", lambda: pnt.LSTM(16, 16), lambda: torch.nn.LSTM(16, 16), (5, 4, 16),
                   output=lambda y: y[0]),
    ]


def _step(module: Any, x: Any, output: Callable[[Any], Any]) -> Callable[[], Any]:
    """Forward and backward of ``output(module(x)).sum()``."""
    def run() -> None:
        output(module(x)).sum().backward()

    return run


def _selected(name: str, selectors: Sequence[str] | None) -> bool:
    """Whether ``--ops`` selects the row ``name`` (a substring of it; every row when none is given)."""
    return not selectors or any(s in name for s in selectors)


def case_rows(case: Case, repeats: int, burst_s: float) -> list[tuple[str, str, float, float]]:
    """A call's rows ``(call, how, our µs, PyTorch µs)``: on NumPy arrays, on tensors, through the adapter."""
    import portable_nn.torch as pnt

    on_numpy, on_torch = case.build("numpy"), case.build("torch")
    calls = {HOWS[0]: functools.partial(case.ours, pnn, *on_numpy),
             HOWS[1]: functools.partial(case.ours, pnn, *on_torch),
             HOWS[2]: functools.partial(case.ours, pnt, *on_torch),
             "theirs": functools.partial(case.theirs, *on_torch)}
    timed = time_interleaved(calls, repeats, settle_s=0.0, burst_s=burst_s)
    return [(case.name, how, timed[how] * 1e6, timed["theirs"] * 1e6) for how in HOWS[:3]]


def module_row(pair: ModulePair, repeats: int, burst_s: float) -> tuple[str, str, float, float]:
    """A drop-in module's row: forward and backward of ours and of ``torch.nn``'s on the same input."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(*pair.shape, requires_grad=True)
    timed = time_interleaved({"ours": _step(pair.ours(), x, pair.output),
                              "theirs": _step(pair.theirs(), x, pair.output)},
                             repeats, settle_s=0.0, burst_s=burst_s)
    return pair.name, HOWS[3], timed["ours"] * 1e6, timed["theirs"] * 1e6


def measure(repeats: int, burst_s: float,
            selectors: Sequence[str] | None = None) -> list[tuple[str, str, float, float]]:
    """Rows ``(call, how, our µs, PyTorch µs)``: each case three ways, each module pair."""
    rows = [row for case in cases() if _selected(case.name, selectors) for row in case_rows(case, repeats, burst_s)]
    return rows + [module_row(p, repeats, burst_s) for p in module_pairs() if _selected(p.name, selectors)]


# --------------------------------------------------------------------------- small-model steps


@dataclass
class ModelRow:
    """A small-model step's figures: seconds per step by ISA and contender in own processes, and in-process."""

    name: str
    isolated: dict[str, dict[str, float]] = field(default_factory=dict)
    in_process: dict[str, float] | None = None


def model_rows(steps: Sequence[ModelStep], isas: Sequence[str], *, rounds: int, repeats: int, burst_s: float,
               quick: bool, in_process: bool, notes: list[str]) -> list[ModelRow]:
    """Each step timed with each contender in its own processes (per ISA), then interleaved here.

    A ``quick`` run puts all of a contender's steps in one process per round (fewer start-ups) and
    warms each step up by one call.
    """
    rows = {s.name: ModelRow(s.name) for s in steps}
    for isa in isas:
        timed = measure_isolated(steps, isa_environment(isa), rounds=rounds, repeats=repeats, burst_s=burst_s,
                                 threads=THREADS, quick=quick, notes=notes)
        for name, seconds in timed.items():
            rows[name].isolated[isa] = seconds
    if in_process:
        for step in steps:
            rows[step.name].in_process = measure_in_process(step, repeats, burst_s, warm=not quick)
    return list(rows.values())


def _figures(seconds: Mapping[str, float] | None) -> str:
    """``ours ms, PyTorch ms, ratio`` columns, or blanks."""
    if not seconds:
        return f"{'-':>11} {'-':>9} {'-':>7}"
    ours, theirs = seconds["ours"] * 1e3, seconds["theirs"] * 1e3
    return f"{ours:11.2f} {theirs:9.2f} {theirs / ours:6.2f}x"


def format_model_table(rows: Sequence[ModelRow], isas: Sequence[str], in_process: bool) -> list[str]:
    """The small-model table's lines: a group of columns per ISA (own processes), then in-process."""
    groups = [f"{isa}, own processes" for isa in isas] + (["in-process, interleaved"] if in_process else [])
    lines = [f"{'':<44} " + " ".join(f"{g:-^29}" for g in groups),
             f"{'model step (ms per step)':<44} " + " ".join(f"{'portable_nn':>11} {'PyTorch':>9} {'ratio':>7}"
                                                            for _ in groups)]
    for row in rows:
        cells = [_figures(row.isolated.get(isa)) for isa in isas] + ([_figures(row.in_process)] if in_process else [])
        lines.append(f"{row.name:<44} " + " ".join(cells))
    return lines


# --------------------------------------------------------------------------- command line


def machine_line() -> str:
    """The header every table starts with: CPU model, vector ISA, library versions."""
    machine = describe_machine()
    return f"{machine['cpu']} ({machine['isa']}); numba {machine['numba']}, torch {machine['torch']}"


def _isa_note(isas: Sequence[str]) -> str:
    """What each ``--isa`` column's processes get on top of the user environment."""
    return "; ".join(f"{isa}: " + (" ".join(f"{k}={v}" for k, v in ISA_SETTINGS[isa].items()) or "the CPU's own")
                     for isa in isas)


def print_call_table(args: argparse.Namespace, repeats: int) -> None:
    """The tiny-call table (``--ops`` selects its rows)."""
    print(f"{machine_line()}; microseconds per call, ratio = PyTorch / portable_nn")
    print(f"{'call':<32} {'how':<18} {'portable_nn':>11} {'PyTorch':>9} {'ratio':>7}")
    selectors = split_selectors(args.ops) if args.ops else None
    for name, how, ours, theirs in measure(repeats, 0.002 if args.quick else 0.02, selectors):
        print(f"{name:<32} {how:<18} {ours:11.1f} {theirs:9.1f} {theirs / ours:6.2f}x", flush=True)


def chosen_steps(models: str | None, quick: bool) -> tuple[list[ModelStep], list[str]]:
    """The steps ``--models`` selects, and lines on those a ``--quick`` run leaves out (the slow ones, unless named)."""
    steps = select_steps(split_selectors(models) if models else None)
    if not quick or models:
        return steps, []
    return [s for s in steps if not s.slow], [f"{s.name}: skipped in --quick (seconds per step; "
                                              f"select it with --models {s.name.split()[0]})" for s in steps if s.slow]


def print_model_table(args: argparse.Namespace, isas: Sequence[str], repeats: int,
                      steps: Sequence[ModelStep] | None = None, title: str = "small-model steps") -> None:
    """The small-model section (or ``steps``, under ``title``): each step's contenders in their own
    processes, alternated, then in-process."""
    skipped: list[str] = []
    if steps is None:
        steps, skipped = chosen_steps(args.models, args.quick)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    removed = [k for k in os.environ if k not in user_environment()]
    print(f"\n{title}: {machine_line()}; milliseconds per step (forward + backward), "
          "ratio = PyTorch / portable_nn")
    print(f"own processes: one contender per fresh process, {rounds} round(s) alternated, median; the user's "
          f"environment (removed: {', '.join(removed) or 'nothing'}); {THREADS} threads; {_isa_note(isas)}")
    notes: list[str] = []
    rows = model_rows(steps, isas, rounds=rounds, repeats=repeats, burst_s=0.005 if args.quick else 0.02,
                      quick=args.quick, in_process=args.in_process, notes=notes)
    for line in format_model_table(rows, isas, args.in_process):
        print(line, flush=True)
    for line in skipped + notes:
        print(f"  {line}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line's options."""
    parser = argparse.ArgumentParser(prog="python -m portable_nn.bench.overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated substrings of the call names (default: all; none: skip)")
    parser.add_argument("--models", help="comma-separated substrings of the model steps' names, case-insensitive "
                                         "(default: all; none: skip the section)")
    parser.add_argument("--quick", action="store_true", help="short bursts, few repeats, one round (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed bursts per contender (per process for the model steps; default 15, quick 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"processes per contender and model step (default {ROUNDS}, quick {QUICK_ROUNDS})")
    parser.add_argument("--isa", default="native",
                        help=f"comma-separated ISAs for the model steps' processes: {', '.join(ISA_SETTINGS)} "
                             "(default native, the machine's own; native,avx2 shows both)")
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                        help="also time each model step's contenders interleaved in this process "
                             "(default: yes, but not with --quick)")
    args = parser.parse_args(argv)
    if args.in_process is None:
        args.in_process = not args.quick
    unknown = [i for i in args.isa.split(",") if i not in ISA_SETTINGS]
    if unknown:
        parser.error(f"unknown --isa {', '.join(unknown)} (choose from {', '.join(ISA_SETTINGS)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tiny-call table, then the small-model table."""
    args = parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 15)
    if args.ops != "none":
        print_call_table(args, repeats)
    if args.models != "none":
        print_model_table(args, args.isa.split(","), repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
