"""Dense (fully connected) layer with bias and activation fused: signature, validation, documentation.

``dense(x, weight, bias)`` is PyTorch's ``F.linear`` followed by the
activation: ``weight`` is ``(out_features, in_features)`` and ``x`` has any
leading shape.  Implementations: ``portable_nn/reference/dense.py`` (every
array library) and kernels where present (``pnn.capabilities()``).
"""

from __future__ import annotations

from typing import Any

from ._common import (
    Prepared,
    check_layer_arrays,
    check_shape,
    make_call,
    public_op,
)
from ._types import Array
from .activations import ActivationLike, parse_activation

__all__ = ["dense"]

_DENSE_FIELDS = ("x", "weight", "bias")


@public_op(grad_fields=_DENSE_FIELDS)
def dense(x: Array, weight: Array, bias: Array | None = None, *, activation: ActivationLike = "identity") -> Any:
    """Fully connected layer: y = act(x · weightᵀ + bias) (PyTorch's ``F.linear`` + activation).

    Args:
        x: ``(..., in_features)``, any leading shape (including none: a 1-D
            ``x`` is one sample, and leading axes of size 0).
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or ``None``.
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`ACTIVATIONS`).

    Returns:
        ``y`` of shape ``(..., out_features)`` with ``x``'s dtype.
        float16/bfloat16 ``x`` may come with float32 ``weight``/``bias``: the
        product accumulates in float32.

    Raises:
        ValueError: a weight that is not 2-D, ``x``'s last axis not
            ``in_features``, a bias that is not ``(out_features,)``, an unknown
            activation.
        TypeError: non-arrays, non-floating dtypes, dtype mixes other than half
            data with float32 parameters, arrays of different libraries.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``; with ``g = dy · act'`` over the rows
        ``x`` flattened to ``(M, in_features)``: dx = g · weight, dweight = gᵀ · x,
        dbias = Σ_rows g (reduced with the activation derivative).  Besides ``x`` and
        ``weight``, the backward keeps nothing for the identity, ``y`` alone when the
        activation's derivative is a function of its output (relu, sigmoid, tanh,
        leaky_relu with a positive slope; float32 values for half data), else the
        pre-activation.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them; ``aten`` (torch tensors only, CPU or CUDA:
        PyTorch's ``F.linear`` then the activation; first under ``auto`` for torch tensors,
        where it measured faster than ``numba``). ``pnn.explain`` reports which one a
        call runs and why the others were passed over.
    """
    named = {"x": x, "weight": weight, "bias": bias}
    _, family, device, dtype, mixed = check_layer_arrays(named, ("bias",))
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if x.ndim < 1:
        raise ValueError("x must have at least 1 dimension (..., in_features), got a 0-D array")
    out_features, in_features = (int(s) for s in weight.shape)
    if int(x.shape[-1]) != in_features:
        raise ValueError(
            f"x has {int(x.shape[-1])} features in its last axis (shape {tuple(x.shape)}) but weight of shape "
            f"{tuple(weight.shape)} expects in_features = weight.shape[1] = {in_features}"
        )
    check_shape(bias, "bias", (out_features,), "(out_features,) = (weight.shape[0],)")
    params = {
        "activation": parse_activation(activation),
        "in_features": in_features,
        "out_features": out_features,
        "mixed_precision": mixed,
    }
    call = make_call("dense", named, params, family=family, device=device, dtype=dtype)
    return Prepared(call, _DENSE_FIELDS, named)
