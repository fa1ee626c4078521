"""PyTorch-side helpers shared by the op tests: activations by label, and data layouts."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: Each activation label the tests use, and PyTorch's version of it.
TORCH_ACT = {
    "identity": lambda z: z,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "leaky_relu": F.leaky_relu,
    "leaky_relu(0.2)": lambda z: F.leaky_relu(z, 0.2),
    "leaky_relu(-0.3)": lambda z: F.leaky_relu(z, -0.3),
}


def activation_arg(label: str) -> Any:
    """The ``activation=`` argument for a label of :data:`TORCH_ACT`."""
    if label.startswith("leaky_relu("):
        return ("leaky_relu", float(label[len("leaky_relu(") : -1]))
    return label


def to_layout(a: np.ndarray, layout: str, batched: bool) -> np.ndarray:
    """A batched channels-first array in the test's layout ("first"/"last", batched or not)."""
    if layout == "last":
        a = np.moveaxis(a, 1, -1)
    return a if batched else a[0]


def from_layout(a: np.ndarray, layout: str, batched: bool) -> np.ndarray:
    """The inverse of :func:`to_layout`: back to batched channels-first."""
    if not batched:
        a = a[None]
    return np.moveaxis(a, -1, 1) if layout == "last" else a
