"""The fused activations with torch's own elementwise ops, for the ``aten`` kernels.

``apply`` is act(z), in place when the caller keeps no ``z``; ``times_derivative`` is
dy · act'(z) from what the forward kept: ``y`` for the activations whose derivative is a
function of the output (relu, sigmoid, tanh, leaky_relu with a positive slope: see
``portable_nn.kernel_codes.keeps_output_only``), else ``z``.  Every activation
portable_nn has exists in PyTorch (``gelu`` exact and ``gelu_tanh`` as its ``approximate``
forms, ``relu6`` as ``hardtanh(0, 6)``), so no activation is declined.  hardsigmoid's
backward is written out: PyTorch's multiplies by 1/6 rounded to float32 in every dtype, ours by
the dtype's 1/6 (float64 gradients 3e-8 apart, relatively, otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portable_nn.api.activations import Activation
from portable_nn.kernel_codes import keeps_output_only


def apply(z: torch.Tensor, act: Activation, in_place: bool) -> torch.Tensor:
    """act(z), overwriting ``z`` when ``in_place``."""
    name = act.name
    if name == "relu":
        return torch.relu_(z) if in_place else torch.relu(z)
    if name == "sigmoid":
        return torch.sigmoid_(z) if in_place else torch.sigmoid(z)
    if name == "tanh":
        return torch.tanh_(z) if in_place else torch.tanh(z)
    if name == "leaky_relu":
        return F.leaky_relu(z, act.slope, inplace=in_place)
    if name == "silu":
        return F.silu(z, inplace=in_place)
    if name in ("gelu", "gelu_tanh"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_(z, approximate=approximate) if in_place else F.gelu(z, approximate=approximate)
    if name == "hardswish":
        return F.hardswish(z, inplace=in_place)
    if name == "hardsigmoid":
        return F.hardsigmoid(z, inplace=in_place)
    if name == "relu6":
        return F.hardtanh(z, 0.0, 6.0, inplace=in_place)
    if name == "mish":
        return F.mish(z, inplace=in_place)
    if name == "elu":
        return F.elu(z, act.slope, inplace=in_place)
    return z  # identity


def times_derivative(dy: torch.Tensor, kept: torch.Tensor, act: Activation) -> torch.Tensor:
    """dy · act'(z), from ``kept``: y for the activations whose derivative is a function of y, else z.

    torch's own activation-backward ops, which pick the same values at the kinks as the
    reference: relu'(0) = 0, leaky_relu'(0) = slope.
    """
    aten = torch.ops.aten
    name = act.name
    if name == "relu":
        return aten.threshold_backward(dy, kept, 0)
    if name == "sigmoid":
        return aten.sigmoid_backward(dy, kept)
    if name == "tanh":
        return aten.tanh_backward(dy, kept)
    if name == "leaky_relu":
        return aten.leaky_relu_backward(dy, kept, act.slope, keeps_output_only(act))
    if name == "silu":
        return aten.silu_backward(dy, kept)
    if name in ("gelu", "gelu_tanh"):
        return aten.gelu_backward(dy, kept, approximate="tanh" if name == "gelu_tanh" else "none")
    if name == "hardswish":
        return aten.hardswish_backward(dy, kept)
    if name == "hardsigmoid":
        inside = (kept > -3.0) & (kept < 3.0)
        return dy * (inside.to(dy.dtype) * (1.0 / 6.0))
    if name == "relu6":
        return aten.hardtanh_backward(dy, kept, 0.0, 6.0)
    if name == "mish":
        return aten.mish_backward(dy, kept)
    if name == "elu":
        return aten.elu_backward(dy, act.slope, 1.0, 1.0, False, kept)
    return dy  # identity
