"""Fused activations: names, runtime codes and argument parsing.

Every op with an ``activation=`` argument accepts

* ``"identity"``, ``"relu"``, ``"sigmoid"``, ``"tanh"``,
* ``"gelu"`` (exact, with erf — PyTorch's default), ``"gelu_tanh"`` (the tanh
  approximation), ``"silu"``,
* ``"leaky_relu"`` (negative slope 0.01) or ``("leaky_relu", slope)``,
* an :class:`Activation` (e.g. ``Activation.leaky_relu(0.2)``).

Kernels receive the activation as a small integer :attr:`Activation.code`
plus the slope, so one compiled kernel serves every activation.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

__all__ = ["ACTIVATIONS", "Activation", "ActivationLike", "parse_activation"]

#: Activation names and their runtime codes (shared by every kernel).
ACTIVATIONS = {
    "identity": 0,
    "relu": 1,
    "sigmoid": 2,
    "tanh": 3,
    "gelu": 4,
    "gelu_tanh": 5,
    "silu": 6,
    "leaky_relu": 7,
}


@dataclass(frozen=True)
class Activation:
    """A parsed activation: its name, kernel code and (for leaky_relu) slope."""

    name: str
    slope: float = 0.01

    @property
    def code(self) -> int:
        return ACTIVATIONS[self.name]

    @property
    def is_identity(self) -> bool:
        return self.name == "identity"

    @classmethod
    def leaky_relu(cls, slope: float = 0.01) -> Activation:
        return parse_activation(("leaky_relu", slope))

    def __str__(self) -> str:
        if self.name == "leaky_relu" and self.slope != 0.01:
            return f"leaky_relu({self.slope:g})"
        return self.name


ActivationLike = str | tuple | Activation


def parse_activation(value: Any, name: str = "activation") -> Activation:
    """Normalise an ``activation=`` argument; ``ValueError`` for unknown names."""
    if isinstance(value, Activation):
        return value
    if isinstance(value, str):
        if value not in ACTIVATIONS:
            raise ValueError(f"{name}: unknown activation {value!r}; expected one of {', '.join(ACTIVATIONS)}")
        return Activation(value)
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "leaky_relu":
        slope = value[1]
        if isinstance(slope, bool) or not isinstance(slope, numbers.Real) or not math.isfinite(slope):
            raise ValueError(f"{name}: leaky_relu slope must be a finite number, got {slope!r}")
        return Activation("leaky_relu", float(slope))
    raise ValueError(
        f"{name} must be one of {', '.join(ACTIVATIONS)} or ('leaky_relu', slope), got {value!r}"
    )
