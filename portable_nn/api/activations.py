"""Fused activations: names, runtime codes and argument parsing.

Every op with an ``activation=`` argument accepts

* ``"identity"``, ``"relu"``, ``"sigmoid"``, ``"tanh"``,
* ``"gelu"`` (exact, with erf — PyTorch's default), ``"gelu_tanh"`` (the tanh
  approximation), ``"silu"``,
* ``"hardswish"``, ``"hardsigmoid"``, ``"relu6"``, ``"mish"`` (MobileNetV3's and
  YOLO's activations, PyTorch's definitions),
* ``"leaky_relu"`` (negative slope 0.01) or ``("leaky_relu", slope)``,
* ``"elu"`` (alpha 1) or ``("elu", alpha)``,
* an :class:`Activation` (e.g. ``Activation.leaky_relu(0.2)``, ``Activation.elu(0.5)``).

Kernels receive the activation as a small integer :attr:`Activation.code`
plus its one parameter (``slope``), so one compiled kernel serves every activation.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from ..kernel_codes import ACTIVATION_CODES, PARAMETER_DEFAULTS

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
| ``"hardswish"`` | 8 | z · min(max(z + 3, 0), 6) / 6 |
| ``"hardsigmoid"`` | 9 | min(max(z + 3, 0), 6) / 6 |
| ``"relu6"`` | 10 | min(max(z, 0), 6) |
| ``"mish"`` | 11 | z · tanh(softplus(z)), softplus(z) = log(1 + e^z) |
| ``"elu"`` | 12 | z if z > 0 else alpha · (e^z − 1) (alpha 1 unless given) |

Derivatives take PyTorch's values at the kinks: relu'(0) = relu6'(0) = relu6'(6) = 0,
leaky_relu'(0) = slope, hardswish'(−3) = −½ and hardswish'(3) = 3/2 (the middle piece's),
hardsigmoid'(±3) = 0, elu'(0) = alpha.

The names are the values an ``activation=`` argument accepts; kernels receive the code
(:attr:`Activation.code`) and the parameter (:attr:`Activation.slope`) instead of the name.
"""


@dataclass(frozen=True)
class Activation:
    """A parsed activation: its name, kernel code and (for leaky_relu and elu) parameter.

    Every ``activation=`` argument is normalised to one of these; pass one directly for a
    leaky ReLU with a custom slope, ``activation=Activation.leaky_relu(0.2)`` (the same
    as ``("leaky_relu", 0.2)``), or an ELU with a custom alpha, ``Activation.elu(0.5)``.
    Build one with these constructors or by passing a name to an op rather than with
    ``Activation(...)``, which does not validate.

    Attributes:
        name: one of the keys of :data:`ACTIVATIONS` (``"relu"``, ``"gelu"`` …).
        slope: the activation's one parameter, as kernels receive it: the negative-side slope
            of ``"leaky_relu"``, f(z) = slope · z for z < 0 (default 0.01, PyTorch's), or the
            alpha of ``"elu"`` (default 1.0, also :attr:`alpha`); ignored by every other
            activation.
    """

    name: str
    slope: float = 0.01

    @property
    def code(self) -> int:
        """The runtime code kernels receive for this activation: ``ACTIVATIONS[name]`` (0 to 12)."""
        return ACTIVATIONS[self.name]

    @property
    def alpha(self) -> float:
        """``"elu"``'s alpha, f(z) = alpha · (e^z − 1) for z ≤ 0 (the same field as :attr:`slope`)."""
        return self.slope

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

    @classmethod
    def elu(cls, alpha: float = 1.0) -> Activation:
        """An ELU, f(z) = z for z > 0 and alpha · (e^z − 1) below.

        Args:
            alpha: the value f approaches as z → −∞, negated; any finite real number (1.0 by
                default, PyTorch's).

        Returns:
            The validated :class:`Activation` ``("elu", float(alpha))``.

        Raises:
            ValueError: ``alpha`` is not a finite real number.
        """
        return parse_activation(("elu", alpha))

    def __str__(self) -> str:
        default = PARAMETER_DEFAULTS.get(self.name)
        if default is not None and self.slope != default:
            return f"{self.name}({self.slope:g})"
        return self.name


ActivationLike = str | tuple | Activation

#: Each name's (frozen, so shareable) Activation, made once rather than per call.
_BY_NAME = {activation_name: Activation(activation_name, PARAMETER_DEFAULTS.get(activation_name, 0.01))
            for activation_name in ACTIVATIONS}


def parse_activation(value: Any, name: str = "activation") -> Activation:
    """Normalise an ``activation=`` argument; ``ValueError`` for unknown names."""
    if isinstance(value, Activation):
        return value
    if isinstance(value, str):
        parsed = _BY_NAME.get(value)
        if parsed is None:
            raise ValueError(f"{name}: unknown activation {value!r}; expected one of {', '.join(ACTIVATIONS)}")
        return parsed
    if isinstance(value, tuple) and len(value) == 2 and value[0] in PARAMETER_DEFAULTS:
        param = value[1]
        what = "slope" if value[0] == "leaky_relu" else "alpha"
        if isinstance(param, bool) or not isinstance(param, numbers.Real) or not math.isfinite(param):
            raise ValueError(f"{name}: {value[0]} {what} must be a finite number, got {param!r}")
        return Activation(value[0], float(param))
    raise ValueError(
        f"{name} must be one of {', '.join(ACTIVATIONS)}, ('leaky_relu', slope) or ('elu', alpha), got {value!r}"
    )
