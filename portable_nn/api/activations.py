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

from ..kernel_codes import ACTIVATION_CODES

__all__ = ["ACTIVATIONS", "Activation"]  # the public names (pnn.ACTIVATIONS …)

ACTIVATIONS: dict[str, int] = ACTIVATION_CODES  # defined in portable_nn.kernel_codes, with the kernels' names
"""Every activation name mapped to its runtime code, shared by every kernel.

| name | code | f(z) |
|---|---|---|
| ``"identity"`` | 0 | z |
| ``"relu"`` | 1 | max(z, 0) |
| ``"sigmoid"`` | 2 | 1 / (1 + e^−z) |
| ``"tanh"`` | 3 | tanh z |
| ``"gelu"`` | 4 | z · Φ(z), Φ the standard normal CDF (exact, with erf) |
| ``"gelu_tanh"`` | 5 | 0.5 z (1 + tanh(√(2/π) (z + 0.044715 z³))) |
| ``"silu"`` | 6 | z · sigmoid(z) |
| ``"leaky_relu"`` | 7 | z if z ≥ 0 else slope · z (slope 0.01 unless given) |

The names are the values an ``activation=`` argument accepts; kernels receive the code
(:attr:`Activation.code`) and the slope instead of the name.
"""


@dataclass(frozen=True)
class Activation:
    """A parsed activation: its name, kernel code and (for leaky_relu) slope.

    Every ``activation=`` argument is normalised to one of these; pass one directly for a
    leaky ReLU with a custom slope, ``activation=Activation.leaky_relu(0.2)`` (the same
    as ``("leaky_relu", 0.2)``).  Build one with ``Activation.leaky_relu`` or by passing a name
    to an op rather than with ``Activation(...)``, which does not validate.

    Attributes:
        name: one of the keys of :data:`ACTIVATIONS` (``"relu"``, ``"gelu"`` …).
        slope: the negative-side slope of ``"leaky_relu"``, f(z) = slope · z for z < 0
            (default 0.01, PyTorch's); ignored by every other activation.
    """

    name: str
    slope: float = 0.01

    @property
    def code(self) -> int:
        """The runtime code kernels receive for this activation: ``ACTIVATIONS[name]`` (0 to 7)."""
        return ACTIVATIONS[self.name]

    @property
    def is_identity(self) -> bool:
        """Whether this is ``"identity"`` (f(z) = z), so kernels may skip the activation entirely."""
        return self.name == "identity"

    @classmethod
    def leaky_relu(cls, slope: float = 0.01) -> Activation:
        """A leaky ReLU, f(z) = z for z ≥ 0 and slope · z below.

        Args:
            slope: the negative-side slope, any finite real number (0.01 by default).

        Returns:
            The validated :class:`Activation` ``("leaky_relu", float(slope))``.

        Raises:
            ValueError: ``slope`` is not a finite real number.
        """
        return parse_activation(("leaky_relu", slope))

    def __str__(self) -> str:
        if self.name == "leaky_relu" and self.slope != 0.01:
            return f"leaky_relu({self.slope:g})"
        return self.name


ActivationLike = str | tuple | Activation

#: Each name's (frozen, so shareable) Activation, made once rather than per call.
_BY_NAME = {activation_name: Activation(activation_name) for activation_name in ACTIVATIONS}


def parse_activation(value: Any, name: str = "activation") -> Activation:
    """Normalise an ``activation=`` argument; ``ValueError`` for unknown names."""
    if isinstance(value, Activation):
        return value
    if isinstance(value, str):
        parsed = _BY_NAME.get(value)
        if parsed is None:
            raise ValueError(f"{name}: unknown activation {value!r}; expected one of {', '.join(ACTIVATIONS)}")
        return parsed
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "leaky_relu":
        slope = value[1]
        if isinstance(slope, bool) or not isinstance(slope, numbers.Real) or not math.isfinite(slope):
            raise ValueError(f"{name}: leaky_relu slope must be a finite number, got {slope!r}")
        return Activation("leaky_relu", float(slope))
    raise ValueError(
        f"{name} must be one of {', '.join(ACTIVATIONS)} or ('leaky_relu', slope), got {value!r}"
    )
