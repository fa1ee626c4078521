"""The demo's two models in plain PyTorch, for the comparison a user would make.

:func:`train_torch` builds :class:`~portable_nn.examples.models.CNN` and
:class:`~portable_nn.examples.models.RowLSTM` from ``torch.nn`` layers, starts them from the same
initial parameters (the same seed's), trains them on the same batches in the same order with
``torch.optim``'s Adam or SGD under the same learning-rate schedule, and times them the same way:
training seconds per epoch (evaluation excluded), and a first step on a throwaway copy.  PyTorch
runs with its own defaults (its thread count, autograd), as a user's script would.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from .data import Digits, batches
from .models import MODELS
from .optim import cosine_lr, make_optimizer
from .train import EpochStats, RunStats, TrainConfig, model_rng

__all__ = ["LABEL", "train_torch"]

#: The contender's name in the demo's output.
LABEL = "torch.nn"


def _modules(model_name: str, params: dict[str, np.ndarray]) -> Any:
    """The ``torch.nn`` twin of a model, holding copies of ``params``."""
    import torch
    from torch import nn

    def put(module: nn.Module, **values: np.ndarray) -> nn.Module:
        with torch.no_grad():
            for name, value in values.items():
                getattr(module, name).copy_(torch.from_numpy(np.array(value)))
        return module

    p = params
    if model_name == "cnn":
        c1, c2 = p["conv1.weight"].shape[0], p["conv2.weight"].shape[0]
        hidden, flat = p["fc1.weight"].shape
        return nn.Sequential(
            put(nn.Conv2d(1, c1, 3, padding=1, bias=False), weight=p["conv1.weight"]),
            put(nn.BatchNorm2d(c1), weight=p["bn1.weight"], bias=p["bn1.bias"]), nn.ReLU(), nn.MaxPool2d(2),
            put(nn.Conv2d(c1, c2, 3, padding=1, bias=False), weight=p["conv2.weight"]),
            put(nn.BatchNorm2d(c2), weight=p["bn2.weight"], bias=p["bn2.bias"]), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            put(nn.Linear(flat, hidden), weight=p["fc1.weight"], bias=p["fc1.bias"]), nn.ReLU(),
            put(nn.Linear(hidden, p["fc2.weight"].shape[0]), weight=p["fc2.weight"], bias=p["fc2.bias"]),
        )

    class RowLSTM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            hidden = p["lstm.w_hh"].shape[1]
            self.lstm = put(nn.LSTM(8, hidden, batch_first=True), weight_ih_l0=p["lstm.w_ih"],
                            weight_hh_l0=p["lstm.w_hh"], bias_ih_l0=p["lstm.b_ih"], bias_hh_l0=p["lstm.b_hh"])
            self.fc = put(nn.Linear(hidden, p["fc.weight"].shape[0]), weight=p["fc.weight"], bias=p["fc.bias"])

        def forward(self, x: Any) -> Any:
            _, (h_n, _) = self.lstm(x.reshape(x.shape[0], x.shape[2], x.shape[3]))
            return self.fc(h_n[0])

    return RowLSTM()


def _optimizer(cfg: TrainConfig, module: Any) -> Any:
    """``torch.optim``'s twin of the demo's optimiser (same rule, hyper-parameters and defaults)."""
    import torch

    ours = make_optimizer(cfg.optimizer, [], cfg.lr)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(module.parameters(), lr=ours.lr, betas=ours.betas, eps=ours.eps)
    return torch.optim.SGD(module.parameters(), lr=ours.lr, momentum=ours.momentum)


def _step(module: Any, optimizer: Any, x: Any, y: Any, lr: float) -> float:
    import torch.nn.functional as F

    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(module(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _accuracy(module: Any, x: Any, y: Any) -> float:
    import torch

    module.eval()
    with torch.no_grad():
        correct = int((module(x).argmax(dim=1) == y).sum())
    module.train()
    return correct / max(int(y.shape[0]), 1)


def train_torch(model_name: str, data: Digits, cfg: TrainConfig) -> RunStats:
    """Train ``model_name`` in PyTorch as :func:`~portable_nn.examples.train.train` trains it with portable_nn."""
    import torch

    model = MODELS[model_name].init(model_rng(cfg.seed, model_name), data.x_train.dtype)
    module = _modules(model_name, model.params)
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train).long()
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test).long()
    stats = RunStats(model.name, LABEL, model.n_params)

    scratch = copy.deepcopy(module)
    n = min(cfg.batch_size, int(y_train.shape[0]))
    start = time.perf_counter()
    scratch_optimizer = _optimizer(cfg, scratch)
    _step(scratch, scratch_optimizer, x_train[:n], y_train[:n], scratch_optimizer.param_groups[0]["lr"])
    _accuracy(scratch, x_train[:n], y_train[:n])
    stats.first_step_s = time.perf_counter() - start

    optimizer = _optimizer(cfg, module)
    base = optimizer.param_groups[0]["lr"]
    plan = [batches(int(y_train.shape[0]), cfg.batch_size, model_rng(cfg.seed, model_name, e))
            for e in range(cfg.epochs)]
    total_steps, steps = sum(len(p) for p in plan), 0
    for epoch, order in enumerate(plan[:cfg.stop_after], start=1):
        loss_sum, seen = 0.0, 0
        start = time.perf_counter()
        for idx in order:
            index = torch.from_numpy(idx)
            loss_sum += _step(module, optimizer, x_train[index], y_train[index],
                              cosine_lr(base, steps, total_steps)) * idx.size
            steps += 1
            seen += idx.size
        seconds = time.perf_counter() - start
        stats.epochs.append(EpochStats(epoch, loss_sum / seen, _accuracy(module, x_test, y_test), seconds))
    return stats
