"""Optimisers as plain array code: SGD with momentum and Adam, updating parameters in place.

Both follow PyTorch's update rules exactly (``torch.optim.SGD`` with ``momentum``, dampening 0,
and ``torch.optim.Adam``), keep their state in arrays allocated once, and allocate nothing per
step: every update is a ufunc writing into an existing buffer (``out=``).  They work on NumPy
and CuPy arrays alike (CuPy arrays take the CuPy ufuncs of the same names).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SGD", "Adam", "Optimizer", "array_module", "cosine_lr", "make_optimizer"]


def array_module(a: Any) -> Any:
    """``cupy`` for a CuPy array, else ``numpy``: the ufuncs that write into ``a`` in place."""
    root = type(a).__module__.split(".")[0]
    return sys.modules[root] if root == "cupy" else np


class Optimizer:
    """Base class: a list of parameter arrays updated in place by :meth:`step`.

    Attributes:
        params: the parameters, in the order gradients are passed to :meth:`step`.
        lr: the base learning rate; :meth:`step` may be given another one (a schedule).
        steps: updates made so far.
    """

    name = "optimizer"

    def __init__(self, params: Sequence[Any], lr: float) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.params = list(params)
        self.lr = float(lr)
        self.steps = 0
        self._xp = array_module(self.params[0]) if self.params else np

    def step(self, grads: Sequence[Any], lr: float | None = None) -> None:
        """One update of every parameter from its gradient (same order, shapes and dtypes)."""
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients, got {len(grads)}")
        self.steps += 1
        self._update(grads, self.lr if lr is None else float(lr))

    def _update(self, grads: Sequence[Any], lr: float) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        """A one-line description for the demo's header."""
        return f"{self.name} lr {self.lr:g}"


class SGD(Optimizer):
    """Stochastic gradient descent with (heavy-ball) momentum, PyTorch's form.

    With gradient g_t and momentum μ::

        b_1 = g_1,   b_t = μ·b_{t−1} + g_t,   p_t = p_{t−1} − lr·b_t

    (μ = 0 is plain SGD).
    """

    name = "SGD"

    def __init__(self, params: Sequence[Any], lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__(params, lr)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)
        self._velocity = [self._xp.zeros_like(p) for p in self.params]
        self._scratch = [self._xp.empty_like(p) for p in self.params]

    def _update(self, grads: Sequence[Any], lr: float) -> None:
        xp = self._xp
        for p, g, b, tmp in zip(self.params, grads, self._velocity, self._scratch):
            if self.steps == 1 or self.momentum == 0.0:
                b[...] = g
            else:
                b *= self.momentum
                b += g
            xp.multiply(b, lr, out=tmp)
            p -= tmp

    def describe(self) -> str:
        return f"SGD lr {self.lr:g} momentum {self.momentum:g}"


class Adam(Optimizer):
    """Adam (Kingma & Ba), PyTorch's form with bias corrections.

    With gradient g_t, β₁, β₂ and ε::

        m_t = β₁·m_{t−1} + (1 − β₁)·g_t
        v_t = β₂·v_{t−1} + (1 − β₂)·g_t²
        p_t = p_{t−1} − lr/(1 − β₁ᵗ) · m_t / (√v_t / √(1 − β₂ᵗ) + ε)
    """

    name = "Adam"

    def __init__(self, params: Sequence[Any], lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, lr)
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self._m = [self._xp.zeros_like(p) for p in self.params]
        self._v = [self._xp.zeros_like(p) for p in self.params]
        self._scratch = [self._xp.empty_like(p) for p in self.params]

    def _update(self, grads: Sequence[Any], lr: float) -> None:
        xp = self._xp
        b1, b2 = self.betas
        correction1 = 1.0 - b1**self.steps
        root_correction2 = math.sqrt(1.0 - b2**self.steps)
        for p, g, m, v, tmp in zip(self.params, grads, self._m, self._v, self._scratch):
            m *= b1
            xp.multiply(g, 1.0 - b1, out=tmp)
            m += tmp
            v *= b2
            xp.multiply(g, g, out=tmp)
            tmp *= 1.0 - b2
            v += tmp
            xp.sqrt(v, out=tmp)
            tmp /= root_correction2
            tmp += self.eps
            xp.divide(m, tmp, out=tmp)
            tmp *= lr / correction1
            p -= tmp

    def describe(self) -> str:
        return f"Adam lr {self.lr:g} betas {self.betas[0]:g}/{self.betas[1]:g}"


def make_optimizer(name: str, params: Sequence[Any], lr: float | None = None) -> Optimizer:
    """``"adam"`` or ``"sgd"`` over ``params``, with the demo's default learning rate unless ``lr``."""
    if name == "adam":
        return Adam(params) if lr is None else Adam(params, lr)
    if name == "sgd":
        return SGD(params) if lr is None else SGD(params, lr)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


def cosine_lr(base: float, step: int, total: int) -> float:
    """Cosine decay from ``base`` (step 0) towards 0 (step ``total``): lr·(1 + cos(π·step/total))/2."""
    if total <= 0:
        return base
    return 0.5 * base * (1.0 + math.cos(math.pi * min(step, total) / total))
