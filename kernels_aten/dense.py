"""PyTorch's own dense layer, forward and backward (backend ``"aten"``), for torch tensors.

Forward: ``z = F.linear(x, weight, bias)`` (one ``addmm``: BLAS GEMM with the bias, any
leading shape of ``x``), then ``y = act(z)`` with torch's elementwise op, in place when the
backward does not need ``z``.  Backward, with ``g = dy · act'`` (from ``y`` or ``z``, as in
``kernels_aten/activations.py``) seen as ``(M, out)`` over the flattened leading axes::

    dx = g @ weight,   dweight = gᵀ @ x,   dbias = Σ_M g

each computed only when ``needs`` asks for it.  Residuals: ``x``, ``weight``, and ``y`` or
``z`` per the activation (nothing more for the identity).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from portable_nn.kernel_codes import keeps_output_only

from .activations import apply, times_derivative


def dense_forward(call: Any) -> tuple[tuple[torch.Tensor], Any]:
    """y = act(x @ weightᵀ + bias); residuals ``(x, weight, kept, has_bias, activation)``."""
    x, weight, bias, act = call.x, call.weight, call.bias, call.activation
    z = F.linear(x, weight, bias)
    from_output = keeps_output_only(act)
    y = apply(z, act, in_place=not (call.save and not from_output))
    residuals = None
    if call.save:
        kept = None if act.is_identity else (y if from_output else z)
        residuals = (x, weight, kept, bias is not None, act)
    return (y,), residuals


def dense_backward(residuals: Any, cotangents: Any, needs: frozenset[str]) -> dict[str, torch.Tensor]:
    """dx, dweight, dbias (those in ``needs``) from ``g = dy · act'``."""
    x, weight, kept, has_bias, act = residuals
    dy = cotangents[0]
    g = dy if kept is None else times_derivative(dy, kept, act)
    grads = {}
    if "x" in needs:
        grads["x"] = g @ weight
    if "weight" in needs or ("bias" in needs and has_bias):
        rows = g.reshape(-1, weight.shape[0])
        if "weight" in needs:
            grads["weight"] = rows.mT @ x.reshape(-1, weight.shape[1])
        if "bias" in needs and has_bias:
            grads["bias"] = rows.sum(0)
    return grads
