"""PyTorch-side helpers shared by the op tests: activations by label, data layouts, and the
check of a (x, weight, bias) layer's output and gradients against a float64 PyTorch oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import portable_nn as pnn
from pnn_testing import assert_close, family_of, snapshot, to_numpy, unchanged

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
    "hardswish": F.hardswish,
    # PyTorch's own hardsigmoid backward multiplies by 1/6 rounded to float32 even in float64; ours
    # by the dtype's 1/6 (the kinks at ±3 and 0 are those of relu6 here too)
    "hardsigmoid": lambda z: F.relu6(z + 3.0) / 6.0,
    "relu6": F.relu6,
    "mish": F.mish,
    "elu": F.elu,
    "elu(0.5)": lambda z: F.elu(z, 0.5),
}


def activation_arg(label: str) -> Any:
    """The ``activation=`` argument for a label of :data:`TORCH_ACT`: a name, or ``name(parameter)``
    as ``(name, parameter)``."""
    if label.endswith(")"):
        name, param = label[:-1].split("(")
        return (name, float(param))
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


def check_layer_against_torch(case: Any, op: Callable[..., Any], data: tuple, kwargs: dict, layout: str,
                              batched: bool, rng: np.random.Generator, oracle: Callable[..., Any], what: str) -> None:
    """Run ``op(x, weight, bias, **kwargs)`` under ``pnn.vjp`` on ``case``'s library, backend and dtype
    and check it against ``oracle``.

    ``data`` is the float64 ``(x, weight, bias)`` with ``x`` batched channels first (``bias`` may be
    ``None``); ``oracle(x, weight, bias, dy)`` gets exactly the (rounded) values our call saw, batched
    channels first, and returns ``(y, (dx, dweight, dbias))``.  Checks the inputs are untouched, the
    output's library and dtype, the gradients' fields and dtypes, and every value within ``case.tol``.
    """
    x64, w64, b64 = data
    x = case.asarray(to_layout(x64, layout, batched))
    w, b = case.param(w64), case.param(b64)
    before = snapshot([x, w, b])
    with case.use():
        y, pullback = pnn.vjp(op, x, w, b, **kwargs)
        dy = case.asarray(rng.standard_normal(tuple(y.shape)))
        grads = pullback(dy)
    assert unchanged([x, w, b], before)
    assert family_of(y) == case.lib and y.dtype == x.dtype
    assert grads._fields == ("x", "weight", "bias")
    assert grads.x.dtype == x.dtype and grads.weight.dtype == w.dtype
    assert (grads.bias is None) == (b is None)
    y_ref, (dx_ref, dw_ref, db_ref) = oracle(
        from_layout(to_numpy(x), layout, batched), to_numpy(w), to_numpy(b),
        from_layout(to_numpy(dy), layout, batched),
    )
    tol = case.tol
    assert_close(from_layout(to_numpy(y), layout, batched), y_ref, tol, f"{what} output")
    assert_close(from_layout(to_numpy(grads.x), layout, batched), dx_ref, tol, f"{what} dx")
    assert_close(grads.weight, dw_ref, tol, f"{what} dweight")
    if b is not None:
        assert grads.bias.dtype == b.dtype
        assert_close(grads.bias, db_ref, tol, f"{what} dbias")
