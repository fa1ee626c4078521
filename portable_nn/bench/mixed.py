"""The mixed section: PyTorch and portable_nn in one process, as a user combining them runs them.

Each case runs in its own fresh process (``kind: mixed`` in :mod:`portable_nn.bench.worker`)
with the user's environment, 2 threads for both libraries, and times its steps round-robin
(bursts after a settle pause, medians):

* **alternating** — a small torch training step (``torch.nn`` MLP 784-32-10, SGD, batch 128)
  and a portable_nn step (the MLP workload's gradient on NumPy arrays) alternating, against
  each alone in the same process.  Reported: ``alternating / (torch alone + pnn alone)``;
  the goal is at most 1.15 (the two libraries' thread pools and BLAS must not fight).
* **twins** — a ``torch.nn`` model against the same model with :mod:`portable_nn.torch`'s
  drop-in modules swapped in (:func:`~portable_nn.bench.torch_models.swap_modules`), forward
  and backward through autograd: LayerNorm, a Conv2d+BatchNorm2d+ReLU block (also with the
  ReLU fused into our BatchNorm2d), LSTM, a resnet18 training step and an LSTM
  language-model training step.  Reported: torch time / ours (> 1: ours is faster).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MIXED_CASES", "MixedCase", "MixedRow", "measure_case", "mixed_row"]

Steps = dict[str, Callable[[], Any]]

#: The alternating case's goal: alternating steps cost at most this much of their sum alone.
ALTERNATING_GOAL = 1.15


@dataclass(frozen=True)
class MixedCase:
    """A mixed-section case: ``build(quick)`` gives its named steps (``torch`` first)."""

    name: str
    quick_name: str
    kind: str  # "alternating" or "twins"
    build: Callable[[bool], Steps]

    def label(self, quick: bool) -> str:
        """The name with the sizes a run uses."""
        return self.quick_name if quick else self.name


@dataclass
class MixedRow:
    """One measured mixed case: median milliseconds per step and the case's ratios."""

    case: str
    kind: str
    times_ms: dict[str, float]
    ratios: dict[str, float] = field(default_factory=dict)
    per_round_ms: dict[str, list[float]] = field(default_factory=dict)
    goal: str = ""
    goal_met: bool | None = None


# --------------------------------------------------------------------------- building blocks


def _seeded() -> Any:
    import torch

    torch.manual_seed(0)
    return np.random.default_rng(0)


def _grad_step(module: Any, x: Any, dy: Any, first: Callable[[Any], Any] = lambda y: y) -> Callable[[], Any]:
    """Forward and backward through autograd: gradients of ``<first(module(x)), dy>`` w.r.t. x and the parameters."""
    import torch

    inputs = [x, *module.parameters()]
    return lambda: torch.autograd.grad(first(module(x)), inputs, dy)


def _twin_steps(model: Any, x: Any, dy: Any, first: Callable[[Any], Any] = lambda y: y,
                fused: Any = None) -> Steps:
    """``torch``: ``model``; ``ours``: a copy with our modules swapped in; ``ours (fused)``: ``fused`` if given."""
    from .torch_models import swap_modules

    steps = {"torch": _grad_step(model, x, dy, first),
             "ours": _grad_step(swap_modules(copy.deepcopy(model)), x, dy, first)}
    if fused is not None:
        steps["ours (relu fused)"] = _grad_step(fused, x, dy, first)
    return steps


def _tensor(rng: np.random.Generator, *shape: int, grad: bool = False) -> Any:
    import torch

    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).requires_grad_(grad)


def _training_steps(model: Any, inputs: Any, targets: Any) -> Steps:
    """SGD training steps of ``model`` (``torch``) and of a copy with our modules swapped in (``ours``)."""
    import torch

    from .torch_models import swap_modules, training_step

    ours = swap_modules(copy.deepcopy(model))
    steps = {}
    for name, m in (("torch", model), ("ours", ours)):
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        steps[name] = lambda m=m, opt=opt: training_step(m, opt, inputs, targets)
    return steps


# --------------------------------------------------------------------------- cases


def _alternating(quick: bool) -> Steps:
    """A torch MLP training step, portable_nn's MLP gradient, and the two back to back."""
    import torch
    from torch import nn

    from .torch_models import training_step
    from .workloads import WORKLOADS

    rng = _seeded()
    model = nn.Sequential(nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = _tensor(rng, 128, 784)
    y = torch.from_numpy(rng.integers(0, 10, 128))
    mlp = next(w for w in WORKLOADS if w.name.startswith("MLP 784-32-10"))
    pnn_step = mlp.build(quick).portable("numba")["fwd+bwd"]

    def torch_step() -> Any:
        return training_step(model, opt, x, y)

    def both() -> Any:
        torch_step()
        return pnn_step()

    return {"torch": torch_step, "pnn": pnn_step, "alternating": both}


def _layer_norm(quick: bool) -> Steps:
    from torch import nn

    rng = _seeded()
    rows = 256 if quick else 4096
    return _twin_steps(nn.LayerNorm(1024), _tensor(rng, rows, 1024, grad=True), _tensor(rng, rows, 1024))


def _conv_block(quick: bool) -> Steps:
    from torch import nn

    import portable_nn.torch as pnt

    rng = _seeded()
    n, hw = (2, 14) if quick else (16, 28)
    block = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
    fused = nn.Sequential(pnt.Conv2d(64, 64, 3, padding=1), pnt.BatchNorm2d(64, activation="relu"))
    fused.load_state_dict(block.state_dict())
    return _twin_steps(block, _tensor(rng, n, 64, hw, hw, grad=True), _tensor(rng, n, 64, hw, hw), fused=fused)


def _lstm(quick: bool) -> Steps:
    from torch import nn

    rng = _seeded()
    t, n = (5, 16) if quick else (50, 256)
    return _twin_steps(nn.LSTM(64, 64, 2), _tensor(rng, t, n, 64, grad=True), _tensor(rng, t, n, 64),
                       first=lambda out: out[0])


def _resnet18(quick: bool) -> Steps:
    import torch

    from .torch_models import ResNet18

    rng = _seeded()
    n, hw = (2, 32) if quick else (8, 64)
    images = _tensor(rng, n, 3, hw, hw)
    return _training_steps(ResNet18(), images, torch.from_numpy(rng.integers(0, 1000, n)))


def _lstm_language_model(quick: bool) -> Steps:
    import torch

    from .torch_models import LstmLanguageModel

    rng = _seeded()
    t, n = (5, 4) if quick else (35, 32)
    tokens = torch.from_numpy(rng.integers(0, 1000, (t + 1, n)))
    return _training_steps(LstmLanguageModel(), tokens[:-1], tokens[1:])


MIXED_CASES = [
    MixedCase("alternating steps: torch MLP 784-32-10 SGD b128 + pnn MLP gradient b128",
              "alternating steps: torch MLP 784-32-10 SGD b128 + pnn MLP gradient b128", "alternating", _alternating),
    MixedCase("LayerNorm(1024) (4096,1024) fwd+bwd", "LayerNorm(1024) (256,1024) fwd+bwd", "twins", _layer_norm),
    MixedCase("Conv2d(64,64,3,p1)+BatchNorm2d+ReLU (16,64,28,28) fwd+bwd",
              "Conv2d(64,64,3,p1)+BatchNorm2d+ReLU (2,64,14,14) fwd+bwd", "twins", _conv_block),
    MixedCase("LSTM(64,64,2) N=256 T=50 fwd+bwd", "LSTM(64,64,2) N=16 T=5 fwd+bwd", "twins", _lstm),
    MixedCase("resnet18 SGD step (8,3,64,64)", "resnet18 SGD step (2,3,32,32)", "twins", _resnet18),
    MixedCase("LSTM LM SGD step (emb 1000x64, LSTM 64x2, 1000 classes) N=32 T=35",
              "LSTM LM SGD step (emb 1000x64, LSTM 64x2, 1000 classes) N=4 T=5", "twins", _lstm_language_model),
]


# --------------------------------------------------------------------------- measuring


def find_case(name: str) -> MixedCase:
    """The case called ``name`` (its standard name)."""
    return next(c for c in MIXED_CASES if c.name == name)


def measure_case(name: str, quick: bool, repeats: int, burst_s: float) -> dict[str, Any]:
    """In a worker: build the case, warm it up, time its steps round-robin; median seconds per step."""
    from . import SETTLE_S
    from .worker import timed_steady_state

    steps = find_case(name).build(quick)
    first, medians = timed_steady_state(steps, repeats, burst_s, settle_s=SETTLE_S)
    return {"steps": medians, "first_call_s": first}


def mixed_row(case: MixedCase, quick: bool, rounds: Sequence[dict[str, Any]]) -> MixedRow:
    """The case's row from its worker rounds: medians over rounds, and the ratios."""
    import statistics

    per_round = {k: [1e3 * r["steps"][k] for r in rounds] for k in rounds[0]["steps"]}
    times = {k: statistics.median(v) for k, v in per_round.items()}
    row = MixedRow(case.label(quick), case.kind, times, per_round_ms=per_round)
    if case.kind == "alternating":
        ratio = times["alternating"] / (times["torch"] + times["pnn"])
        row.ratios = {"alternating / (torch + pnn)": ratio}
        row.goal, row.goal_met = f"<= {ALTERNATING_GOAL}", ratio <= ALTERNATING_GOAL
    else:
        row.ratios = {f"torch / {k}": times["torch"] / v for k, v in times.items() if k != "torch"}
    return row
