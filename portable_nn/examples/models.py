"""The demo's two networks, written with portable_nn ops and ``pnn.vjp`` only.

Each model owns its parameters (a name → array dict), one preallocated gradient buffer per
parameter, and a :class:`Workspace` of buffers for the gradients of intermediate activations.
:meth:`Model.loss_and_grads` runs the forward pass as a chain of ``pnn.vjp`` calls, then the
pullbacks in reverse order, each writing into preallocated buffers through ``out=``; the
optimiser then reads :attr:`Model.grads`.  No autograd library is involved: the chain rule is
the explicit sequence of pullbacks.

* :class:`CNN` (LeNet-style): ``conv 3x3 → batch_norm + relu → max_pool 2`` twice, then
  ``dense + relu`` and a ``dense`` classifier.  The convolutions have no bias (the batch norm's
  shift replaces it) and the relu is fused into the batch norm.
* :class:`RowLSTM`: an LSTM reads each 8x8 image as 8 time steps of 8 pixels (one row per step);
  a ``dense`` classifier reads its final hidden state.

Arrays are NumPy, or CuPy for the GPU backends (:meth:`Model.to`); the dtype is the data's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import portable_nn as pnn

from .data import N_CLASSES
from .optim import array_module

__all__ = ["CNN", "MODELS", "OPS", "Model", "RowLSTM", "Workspace"]

#: The portable_nn ops the two models call (the demo compiles their kernels first on a new machine).
OPS = ("conv", "batch_norm", "max_pool", "dense", "cross_entropy", "lstm")


class Workspace:
    """Gradient buffers for intermediate activations, allocated on first use per (name, shape).

    Batch shapes repeat (a full batch, at most one shorter last batch, the same every epoch), so
    after the first epoch the backward pass allocates nothing for these gradients.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], Any] = {}

    def get(self, name: str, like: Any) -> Any:
        """A buffer with ``like``'s shape, dtype and array library."""
        key = (name, tuple(like.shape))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.dtype != like.dtype:
            buffer = self._buffers[key] = array_module(like).empty_like(like)
        return buffer


class Model:
    """A classifier trained with ``pnn.vjp``: parameters, gradient buffers, running statistics.

    Attributes:
        name: short name for tables ("CNN", "LSTM").
        params: trainable arrays by name (the optimiser updates them in place).
        grads: one buffer per parameter, same names, filled by :meth:`loss_and_grads`.
        state: non-trainable arrays (batch-norm running statistics), updated in training.
    """

    name = "model"

    def __init__(self, params: dict[str, Any], state: dict[str, Any] | None = None) -> None:
        self.params = params
        self.state = state or {}
        xp = array_module(next(iter(params.values())))
        self.grads = {k: xp.zeros_like(v) for k, v in params.items()}
        self._work = Workspace()
        dtype = next(iter(params.values())).dtype
        self._one = xp.ones((), dtype)  # the cotangent of the scalar loss

    @property
    def n_params(self) -> int:
        """Number of trainable scalars."""
        return sum(int(p.size) for p in self.params.values())

    def describe(self) -> str:
        """The architecture in one line (for the demo's header)."""
        raise NotImplementedError

    def to(self, xp: Any) -> Model:
        """A copy with every array moved to the array library ``xp`` (``numpy`` or ``cupy``)."""
        return type(self)({k: xp.asarray(v).copy() for k, v in self.params.items()},
                          {k: xp.asarray(v).copy() for k, v in self.state.items()})

    def copy(self) -> Model:
        """An independent copy (same array library)."""
        return self.to(array_module(next(iter(self.params.values()))))

    def loss_and_grads(self, x: Any, y: Any) -> float:
        """Mean cross-entropy of the batch, with every parameter's gradient written into :attr:`grads`.

        Runs in training mode: batch-norm layers normalise with the batch's statistics and update
        their running statistics in place.
        """
        raise NotImplementedError

    def logits(self, x: Any) -> Any:
        """Class scores ``(N, 10)`` in evaluation mode (batch norm uses its running statistics)."""
        raise NotImplementedError


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], bound: float, dtype: Any) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def _he_normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, dtype: Any) -> np.ndarray:
    """N(0, 2/fan_in): keeps the activations' scale through relu layers (He et al., 2015)."""
    return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(dtype)


class CNN(Model):
    """LeNet-style: two (conv 3x3 → batch norm + relu → max pool 2) blocks, dense + relu, dense.

    Shapes for an ``(N, 1, 8, 8)`` batch: ``(N, c1, 8, 8) → (N, c1, 4, 4) → (N, c2, 4, 4) →
    (N, c2, 2, 2) → (N, 4·c2) → (N, hidden) → (N, 10)``.
    """

    name = "CNN"

    @classmethod
    def init(cls, rng: np.random.Generator, dtype: Any = np.float32, channels: tuple[int, int] = (16, 32),
             hidden: int = 64) -> CNN:
        """Fresh parameters: He-normal convolutions and dense layers, unit/zero batch-norm affines."""
        c1, c2 = channels
        flat = c2 * 2 * 2
        params = {
            "conv1.weight": _he_normal(rng, (c1, 1, 3, 3), 9, dtype),
            "bn1.weight": np.ones(c1, dtype),
            "bn1.bias": np.zeros(c1, dtype),
            "conv2.weight": _he_normal(rng, (c2, c1, 3, 3), 9 * c1, dtype),
            "bn2.weight": np.ones(c2, dtype),
            "bn2.bias": np.zeros(c2, dtype),
            "fc1.weight": _he_normal(rng, (hidden, flat), flat, dtype),
            "fc1.bias": np.zeros(hidden, dtype),
            "fc2.weight": _uniform(rng, (N_CLASSES, hidden), 1.0 / math.sqrt(hidden), dtype),
            "fc2.bias": np.zeros(N_CLASSES, dtype),
        }
        state = {
            "bn1.running_mean": np.zeros(c1, dtype), "bn1.running_var": np.ones(c1, dtype),
            "bn2.running_mean": np.zeros(c2, dtype), "bn2.running_var": np.ones(c2, dtype),
        }
        return cls(params, state)

    def describe(self) -> str:
        c1, c2 = self.params["conv1.weight"].shape[0], self.params["conv2.weight"].shape[0]
        hidden, flat = self.params["fc1.weight"].shape
        return (f"conv3x3(1→{c1}) bn relu maxpool2 · conv3x3({c1}→{c2}) bn relu maxpool2 · "
                f"dense({flat}→{hidden}) relu · dense({hidden}→{N_CLASSES})")

    def _bn(self, layer: str, training: bool) -> dict[str, Any]:
        return {"running_mean": self.state[f"{layer}.running_mean"], "running_var": self.state[f"{layer}.running_var"],
                "training": training, "activation": "relu"}

    def loss_and_grads(self, x: Any, y: Any) -> float:
        p, g, work = self.params, self.grads, self._work
        # forward: each vjp returns the output and the pullback that maps its cotangent back
        a1, conv1 = pnn.vjp(pnn.conv, x, p["conv1.weight"], padding=1, wrt=("weight",))  # no dx for the input
        h1, bn1 = pnn.vjp(pnn.batch_norm, a1, weight=p["bn1.weight"], bias=p["bn1.bias"], **self._bn("bn1", True))
        m1, pool1 = pnn.vjp(pnn.max_pool, h1, 2)
        a2, conv2 = pnn.vjp(pnn.conv, m1, p["conv2.weight"], padding=1)
        h2, bn2 = pnn.vjp(pnn.batch_norm, a2, weight=p["bn2.weight"], bias=p["bn2.bias"], **self._bn("bn2", True))
        m2, pool2 = pnn.vjp(pnn.max_pool, h2, 2)
        flat = m2.reshape(m2.shape[0], -1)
        f1, fc1 = pnn.vjp(pnn.dense, flat, p["fc1.weight"], p["fc1.bias"], activation="relu")
        logits, fc2 = pnn.vjp(pnn.dense, f1, p["fc2.weight"], p["fc2.bias"])
        loss, xent = pnn.vjp(pnn.cross_entropy, logits, y)
        # backward: the same chain in reverse, every gradient into a preallocated buffer
        d = xent(self._one, out={"logits": work.get("logits", logits)}).logits
        d = fc2(d, out={"x": work.get("f1", f1), "weight": g["fc2.weight"], "bias": g["fc2.bias"]}).x
        d = fc1(d, out={"x": work.get("flat", flat), "weight": g["fc1.weight"], "bias": g["fc1.bias"]}).x
        d = pool2(d.reshape(m2.shape), out={"x": work.get("h2", h2)}).x
        d = bn2(d, out={"x": work.get("a2", a2), "weight": g["bn2.weight"], "bias": g["bn2.bias"]}).x
        d = conv2(d, out={"x": work.get("m1", m1), "weight": g["conv2.weight"]}).x
        d = pool1(d, out={"x": work.get("h1", h1)}).x
        d = bn1(d, out={"x": work.get("a1", a1), "weight": g["bn1.weight"], "bias": g["bn1.bias"]}).x
        conv1(d, out={"weight": g["conv1.weight"]})
        return float(loss)

    def logits(self, x: Any) -> Any:
        p = self.params
        h = pnn.conv(x, p["conv1.weight"], padding=1)
        h = pnn.max_pool(pnn.batch_norm(h, weight=p["bn1.weight"], bias=p["bn1.bias"], **self._bn("bn1", False)), 2)
        h = pnn.conv(h, p["conv2.weight"], padding=1)
        h = pnn.max_pool(pnn.batch_norm(h, weight=p["bn2.weight"], bias=p["bn2.bias"], **self._bn("bn2", False)), 2)
        h = pnn.dense(h.reshape(h.shape[0], -1), p["fc1.weight"], p["fc1.bias"], activation="relu")
        return pnn.dense(h, p["fc2.weight"], p["fc2.bias"])


class RowLSTM(Model):
    """An LSTM over the image rows (8 steps of 8 pixels, batch first) and a dense classifier.

    The classifier reads the last hidden state ``h_n``; the pullback of ``pnn.lstm`` takes its
    cotangent as ``(d_outputs, (d_h_n, d_c_n))`` with the unused entries ``None``.
    """

    name = "LSTM"

    @classmethod
    def init(cls, rng: np.random.Generator, dtype: Any = np.float32, hidden: int = 64) -> RowLSTM:
        """PyTorch's U(−1/√H, 1/√H) for every LSTM weight, forget-gate bias 1 (Jozefowicz et al., 2015)."""
        bound = 1.0 / math.sqrt(hidden)
        b_ih = _uniform(rng, (4 * hidden,), bound, dtype)
        b_ih[hidden:2 * hidden] += 1.0  # gate order i, f, g, o: remember by default early in training
        params = {
            "lstm.w_ih": _uniform(rng, (4 * hidden, 8), bound, dtype),
            "lstm.w_hh": _uniform(rng, (4 * hidden, hidden), bound, dtype),
            "lstm.b_ih": b_ih,
            "lstm.b_hh": _uniform(rng, (4 * hidden,), bound, dtype),
            "fc.weight": _uniform(rng, (N_CLASSES, hidden), bound, dtype),
            "fc.bias": np.zeros(N_CLASSES, dtype),
        }
        return cls(params)

    def describe(self) -> str:
        hidden = self.params["lstm.w_hh"].shape[1]
        return f"lstm(8→{hidden}) over the 8 rows · dense({hidden}→{N_CLASSES}) on the last hidden state"

    def _lstm_params(self) -> list[tuple[Any, Any, Any, Any]]:
        p = self.params
        return [(p["lstm.w_ih"], p["lstm.w_hh"], p["lstm.b_ih"], p["lstm.b_hh"])]

    @staticmethod
    def _rows(x: Any) -> Any:
        """``(N, 1, 8, 8)`` images as ``(N, 8, 8)`` batch-first sequences (a view, no copy)."""
        return x.reshape(x.shape[0], x.shape[2], x.shape[3])

    def loss_and_grads(self, x: Any, y: Any) -> float:
        p, g, work = self.params, self.grads, self._work
        (_, (h_n, _c_n)), lstm = pnn.vjp(pnn.lstm, self._rows(x), self._lstm_params(), batch_first=True,
                                         wrt=("params",))
        last = h_n[0]
        logits, fc = pnn.vjp(pnn.dense, last, p["fc.weight"], p["fc.bias"])
        loss, xent = pnn.vjp(pnn.cross_entropy, logits, y)
        d = xent(self._one, out={"logits": work.get("logits", logits)}).logits
        d = fc(d, out={"x": work.get("h", last), "weight": g["fc.weight"], "bias": g["fc.bias"]}).x
        lstm((None, (d.reshape(h_n.shape), None)),
             out={"params": [(g["lstm.w_ih"], g["lstm.w_hh"], g["lstm.b_ih"], g["lstm.b_hh"])]})
        return float(loss)

    def logits(self, x: Any) -> Any:
        _, (h_n, _) = pnn.lstm(self._rows(x), self._lstm_params(), batch_first=True)
        return pnn.dense(h_n[0], self.params["fc.weight"], self.params["fc.bias"])


MODELS: dict[str, type[Model]] = {"cnn": CNN, "lstm": RowLSTM}
