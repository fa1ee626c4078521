"""The fixed cost of a call: ``python -m portable_nn.bench.overhead``.

Small calls (a few hundred elements) cost what the library does around the kernel — argument
checks, the choice of implementation, bridging torch tensors, autograd — far more than the
arithmetic.  This benchmark times such calls three ways against PyTorch's own, in one process,
interleaved: an op on NumPy arrays, the same op on CPU torch tensors, and a drop-in module's
forward and backward against its ``torch.nn`` original.  The GPU path pays the same Python cost
per call (the figures bound what a small GPU call can take on this host), plus its launches.

Each figure is the median over bursts of back-to-back calls, in microseconds per call; the ratio
is PyTorch's time over ours (above 1: we are faster).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import portable_nn as pnn

from . import time_interleaved
from .environment import describe_machine


@dataclass(frozen=True)
class Case:
    """One small call: ``ours`` on NumPy arrays and on torch tensors, ``theirs`` PyTorch's (torch tensors).

    ``build(lib)`` returns the call's arguments for ``lib`` (``"numpy"`` or ``"torch"``);
    ``ours(args)`` and ``theirs(args)`` make the call.
    """

    name: str
    build: Callable[[str], tuple[Any, ...]]
    ours: Callable[..., Any]
    theirs: Callable[..., Any]


def _arrays(lib: str, *shapes: tuple[int, ...], seed: int = 0) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    made = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    if lib == "torch":
        import torch

        return tuple(torch.from_numpy(a) for a in made)
    return tuple(made)


def _labels(lib: str, n: int, classes: int) -> Any:
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
             lambda x, w, b: pnn.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (64,), w, b)),
        Case("rms_norm (4,64)", lambda lib: _arrays(lib, (4, 64), (64,)),
             lambda x, w: pnn.rms_norm(x, w), lambda x, w: F.rms_norm(x, (64,), w)),
        Case("batch_norm train (4,8,4,4)", lambda lib: _arrays(lib, (4, 8, 4, 4), (8,), (8,)),
             lambda x, w, b: pnn.batch_norm(x, weight=w, bias=b),
             lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
        Case("log_softmax (4,64)", lambda lib: _arrays(lib, (4, 64)),
             lambda x: pnn.log_softmax(x), lambda x: F.log_softmax(x, -1)),
        Case("cross_entropy (4,64)", lambda lib: (*_arrays(lib, (4, 64)), _labels(lib, 4, 64)),
             lambda x, t: pnn.cross_entropy(x, t), lambda x, t: F.cross_entropy(x, t)),
        Case("dense (4,64)->64 + relu", lambda lib: _arrays(lib, (4, 64), (64, 64), (64,)),
             lambda x, w, b: pnn.dense(x, w, b, activation="relu"), lambda x, w, b: F.relu(F.linear(x, w, b))),
        Case("conv 3x3 (1,4,8,8)->4 + relu", lambda lib: _arrays(lib, (1, 4, 8, 8), (4, 4, 3, 3), (4,)),
             lambda x, w, b: pnn.conv(x, w, b, padding=1, activation="relu"),
             lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1))),
    ]


def module_pairs() -> list[tuple[str, Callable[[], Any], Callable[[], Any], tuple[int, ...]]]:
    """(name, our module's maker, torch.nn's maker, input shape) for the drop-in module rows."""
    import torch

    import portable_nn.torch as pt

    return [
        ("LayerNorm(64) (4,64)", lambda: pt.LayerNorm(64), lambda: torch.nn.LayerNorm(64), (4, 64)),
        ("Linear(64,64) (4,64)", lambda: pt.Linear(64, 64), lambda: torch.nn.Linear(64, 64), (4, 64)),
        ("Conv2d(4,4,3) (1,4,8,8)", lambda: pt.Conv2d(4, 4, 3, padding=1),
         lambda: torch.nn.Conv2d(4, 4, 3, padding=1), (1, 4, 8, 8)),
    ]


def _step(module: Any, x: Any) -> Callable[[], Any]:
    def run() -> None:
        module(x).sum().backward()

    return run


def measure(repeats: int, burst_s: float,
            selectors: Sequence[str] | None = None) -> list[tuple[str, str, float, float]]:
    """Rows ``(call, how, our µs, PyTorch µs)``: each case on NumPy and on torch tensors, each module pair."""
    import torch

    rows = []
    for case in cases():
        if selectors and not any(s in case.name for s in selectors):
            continue
        on_numpy, on_torch = case.build("numpy"), case.build("torch")
        calls = {"numpy": functools.partial(case.ours, *on_numpy), "torch": functools.partial(case.ours, *on_torch),
                 "theirs": functools.partial(case.theirs, *on_torch)}
        timed = time_interleaved(calls, repeats, settle_s=0.0, burst_s=burst_s)
        rows.append((case.name, "NumPy arrays", timed["numpy"] * 1e6, timed["theirs"] * 1e6))
        rows.append((case.name, "torch tensors", timed["torch"] * 1e6, timed["theirs"] * 1e6))
    for name, ours, theirs, shape in module_pairs():
        if selectors and not any(s in name for s in selectors):
            continue
        torch.manual_seed(0)
        x = torch.randn(*shape, requires_grad=True)
        timed = time_interleaved({"ours": _step(ours(), x), "theirs": _step(theirs(), x)}, repeats,
                                 settle_s=0.0, burst_s=burst_s)
        rows.append((name, "module fwd+bwd", timed["ours"] * 1e6, timed["theirs"] * 1e6))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_nn.bench.overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated substrings of the call names (default: all)")
    parser.add_argument("--quick", action="store_true", help="short bursts, few repeats (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed bursts per contender (default 15, quick 2)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 15)
    machine = describe_machine()
    print(f"{machine['cpu']} ({machine['isa']}); numba {machine['numba']}, torch {machine['torch']}; "
          "microseconds per call, ratio = PyTorch / portable_nn")
    print(f"{'call':<32} {'how':<16} {'portable_nn':>11} {'PyTorch':>9} {'ratio':>7}")
    selectors = args.ops.split(",") if args.ops else None
    for name, how, ours, theirs in measure(repeats, 0.002 if args.quick else 0.02, selectors):
        print(f"{name:<32} {how:<16} {ours:11.1f} {theirs:9.1f} {theirs / ours:6.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
