"""Softmax losses: ``log_softmax`` and ``cross_entropy`` — signatures, validation, documentation.

``cross_entropy`` follows PyTorch's ``F.cross_entropy`` exactly (integer class
targets or class probabilities, K-dimensional logits, class weights,
``ignore_index``, label smoothing, the three reductions), with a ``axis``
argument for the class axis so channels-last logits need no transpose.
Everything about the call, including the class range of integer targets, is
checked here before any computation.  Implementations:
``portable_nn/reference/loss.py`` (every array library) and kernels where
present (``pnn.capabilities()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _arrays
from ._common import (
    Prepared,
    check_array,
    check_fraction,
    check_int,
    check_param_dtypes,
    check_same_library,
    check_shape,
    floating_dtype,
    make_call,
    normalize_axis,
    public_op,
)
from ._types import Array

__all__ = ["cross_entropy", "log_softmax"]

_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_REDUCTIONS = ("mean", "sum", "none")


# --------------------------------------------------------------------------- log_softmax


@public_op(grad_fields=("x",))
def log_softmax(x: Array, *, axis: int = -1) -> Any:
    """Logarithm of the softmax along ``axis``, max-shifted for stability.

    y = x − m − log Σ_axis exp(x − m), with m = max_axis x.

    Args:
        x: any floating array (float16/bfloat16 are computed in float32); a 0-d
            ``x`` is a single class (``y = 0``).
        axis: the axis to normalise over (keyword-only).

    Returns:
        ``y`` with ``x``'s shape and dtype.

    Raises:
        TypeError: a non-array or non-floating ``x``, a non-int ``axis``.
        ValueError: ``axis`` out of range.

    Gradients:
        ``vjp`` fields: ``(x,)``; dx = dy − softmax(x) · Σ_axis dy, computed from the
        output alone.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them. ``pnn.explain`` reports which one a
        call runs and why the others were passed over.
    """
    check_array(x, "x")
    family, device = check_same_library({"x": x})
    xp = _arrays.namespace(x)
    dtype = floating_dtype(xp, x, "x")
    # A 0-d x is one class (as in PyTorch): axis -1 or 0.
    resolved = normalize_axis(axis, max(x.ndim, 1), "axis")
    params = {"axis": resolved, "scalar": x.ndim == 0}
    call = make_call("log_softmax", {"x": x}, params, family=family, device=device, dtype=dtype)
    return Prepared(call, ("x",), {"x": x})


# --------------------------------------------------------------------------- cross_entropy


def _class_axis(logits: Any, axis: Any) -> int:
    if logits.ndim == 1:
        # Unbatched (C,) logits: the only axis holds the classes.
        if isinstance(axis, bool) or not isinstance(axis, int) or axis not in (-1, 0, 1):
            raise ValueError(
                f"axis={axis!r} does not fit unbatched logits of shape {tuple(logits.shape)}: "
                "their only axis is the class axis (use the default axis=1, or 0 / -1)"
            )
        return 0
    resolved = normalize_axis(axis, logits.ndim, "axis")
    if resolved == 0:
        raise ValueError(
            "axis must not be 0: axis 0 of batched logits is the batch axis "
            "(use 1 for (N, C, d1, ...) or -1 for channels-last (N, d1, ..., C))"
        )
    return resolved


def _labels_in_range(target: Any, classes: int) -> bool:
    """Whether a NumPy or torch target's labels all lie in [0, C): the usual call, seen in one or two
    reductions instead of the six operations of the exact test (other libraries take that test:
    a lazy one would evaluate the target once per reduction)."""
    family = _arrays.family(target)
    if family == "numpy":
        return bool(target.size) and 0 <= np.minimum.reduce(target, None) and np.maximum.reduce(target, None) < classes
    if family == "torch" and target.numel():
        import torch

        low, high = torch.aminmax(target)
        return 0 <= int(low) and int(high) < classes
    return False


def _labels_valid(call: Any) -> None:
    """The per-call check of ``cross_entropy`` with class targets (it reads their values)."""
    if _arrays.has_values(call.target):
        _check_labels(call.xp, call.target, call.classes, call.ignore_index)


def _check_labels(xp: Any, target: Any, classes: int, ignore_index: int) -> None:
    """``ValueError`` naming ``target`` if a label is outside [0, C) and not ignore_index.

    This reads the target's values (a lazy library evaluates it here).  NumPy targets use NumPy
    itself (array-API conformant), not the lazily imported wrapper namespace.
    """
    if _labels_in_range(target, classes):
        return
    if isinstance(target, np.ndarray):
        xp = np
    if _arrays.dtype_name(xp, target.dtype) != "int64":
        target = xp.astype(target, xp.int64)
    bad = xp.logical_and(
        xp.logical_or(target < 0, target >= classes),
        target != ignore_index,
    )
    if bool(xp.any(bad)):
        low, high = int(xp.min(target)), int(xp.max(target))
        raise ValueError(
            f"target holds class indices outside [0, {classes}) that are not ignore_index={ignore_index} "
            f"(its values range over [{low}, {high}]); logits have {classes} classes"
        )


@public_op(grad_fields=("logits", "target"), outputs="loss")
def cross_entropy(
    logits: Array,
    target: Array,
    *,
    axis: int = 1,
    weight: Array | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Any:
    """Softmax cross-entropy with PyTorch's semantics (``F.cross_entropy``).

    With p = log_softmax(logits) along the class axis, ε = ``label_smoothing``,
    C classes and class weights w (1 when ``weight`` is ``None``), each position
    n (batch and extra axes) has the loss

    * integer targets y: ℓ_n = −(1 − ε) w_{y_n} p_{n,y_n} − (ε / C) Σ_c w_c p_{n,c},
      and ℓ_n = 0 where y_n = ``ignore_index``;
    * probability targets t: ℓ_n = −Σ_c w_c t'_{n,c} p_{n,c}, t' = (1 − ε) t + ε / C.

    ``reduction="none"`` returns ℓ; ``"sum"`` returns Σ ℓ_n; ``"mean"`` returns
    Σ ℓ_n / Σ_{n not ignored} w_{y_n} for integer targets (NaN when that is 0,
    e.g. every target ignored) and Σ ℓ_n / (N · d1 · …) for probability
    targets (NaN when there are no positions) — as PyTorch does.

    Args:
        logits: ``(C,)`` (unbatched), ``(N, C)`` or ``(N, C, d1, ...)``; with
            ``axis=-1`` channels-last ``(N, d1, ..., C)``.
        target: integer class indices with the logits' shape less the class axis
            (0-d for unbatched logits), any integer dtype, each in [0, C) or
            equal to ``ignore_index``; or floating class probabilities with the
            logits' shape and dtype.
        axis: the class axis of batched logits (1, PyTorch's layout, or any
            other non-batch axis, e.g. -1).
        weight: ``(C,)`` class weights or ``None``; the logits' dtype, or
            float32 for float16/bfloat16 logits.
        ignore_index: integer targets equal to it contribute nothing (not to
            the mean's denominator either); with probability targets it must
            stay negative (it is unused), as in PyTorch.
        label_smoothing: ε in [0, 1].
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    Returns:
        The loss in the logits' dtype: 0-d for ``"mean"``/``"sum"``, the
        positions' shape for ``"none"``.

    Raises:
        ValueError: labels out of range (naming ``target``), a target or
            weight shape that does not fit, ``label_smoothing`` outside [0, 1],
            an unknown ``reduction``, a bad ``axis``, a non-negative
            ``ignore_index`` with probability targets.
        TypeError: non-arrays, mixed libraries, non-floating logits, a target
            that is neither integer nor of the logits' floating dtype, a
            floating target with the shape of class labels (labels need an
            integer dtype), a weight of the wrong dtype.

    Gradients:
        ``vjp`` fields: ``(logits,)`` for integer targets, ``(logits, target)`` for
        probability targets.  The forward is max-shifted; the backward is fused: with
        a_{n,c} the target weights above and g_n the incoming scale (dy, divided by the
        mean's denominator), dlogits = g_n · (softmax · Σ_c a_{n,c} − a_{n,c}) and, for
        probability targets, dtarget = −g_n (1 − ε) w_c p_{n,c}.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them. ``pnn.explain`` reports which one a
        call runs and why the others were passed over.
    """
    check_array(logits, "logits")
    check_array(target, "target")
    check_array(weight, "weight", optional=True)
    family, device = check_same_library({"logits": logits, "target": target, "weight": weight})
    xp = _arrays.namespace(logits)
    dtype = floating_dtype(xp, logits, "logits")
    if logits.ndim == 0:
        raise ValueError("logits must have a class axis: (C,), (N, C) or (N, C, d1, ...); got a 0-d array")
    class_axis = _class_axis(logits, axis)
    classes = int(logits.shape[class_axis])
    if classes < 1:
        raise ValueError(
            f"logits must have at least one class along axis {class_axis}, got shape {tuple(logits.shape)}"
        )

    target_dtype = _arrays.dtype_name(xp, target.dtype)
    if target_dtype in _INT_DTYPES:
        probabilities = False
        expected = tuple(int(s) for i, s in enumerate(logits.shape) if i != class_axis)
        check_shape(target, "target", expected, "class indices: the logits' shape without the class axis")
    elif target_dtype in _arrays.FLOAT_DTYPES:
        labels_shape = tuple(int(s) for i, s in enumerate(logits.shape) if i != class_axis)
        if tuple(target.shape) == labels_shape and labels_shape != tuple(logits.shape):
            raise TypeError(
                f"target has the shape of class labels {labels_shape} but a floating dtype ({target_dtype}): "
                "integer class labels need an integer dtype (e.g. int64); floating targets are class "
                f"probabilities with the logits' shape {tuple(logits.shape)}"
            )
        if target_dtype != dtype:
            raise TypeError(
                f"target has dtype {target_dtype} but logits have {dtype}: probability targets must have "
                "the logits' dtype (or pass integer class indices)"
            )
        probabilities = True
        check_shape(target, "target", tuple(logits.shape), "class probabilities: the logits' shape")
    else:
        raise TypeError(
            f"target must hold integer class indices or floating class probabilities, got dtype {target_dtype}"
        )

    mixed = check_param_dtypes(xp, dtype, {"weight": weight}, x_name="logits")
    check_shape(weight, "weight", (classes,), "one weight per class")
    ignore_index = check_int(ignore_index, "ignore_index")
    label_smoothing = check_fraction(label_smoothing, "label_smoothing")
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got {reduction!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got {reduction!r}")
    if probabilities and ignore_index >= 0:
        raise ValueError(
            f"ignore_index={ignore_index} cannot apply to probability targets (only integer class targets "
            "can be ignored); leave ignore_index at its default, as PyTorch requires"
        )

    positions = 1  # N · d1 · ... : the number of loss terms
    for i, s in enumerate(logits.shape):
        if i != class_axis:
            positions *= int(s)
    params = {
        "axis": class_axis,
        "classes": classes,
        "probabilities": probabilities,
        "ignore_index": ignore_index,
        "label_smoothing": label_smoothing,
        "reduction": reduction,
        "positions": positions,
        "mixed_precision": mixed,
    }
    arrays = {"logits": logits, "target": target, "weight": weight}
    call = make_call("cross_entropy", arrays, params, family=family, device=device, dtype=dtype)
    if probabilities:
        return Prepared(call, ("logits", "target"), {"logits": logits, "target": target})
    _labels_valid(call)
    return Prepared(call, ("logits",), {"logits": logits}, checks=(_labels_valid,))
