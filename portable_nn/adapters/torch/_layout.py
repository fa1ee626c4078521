"""Memory formats through the torch adapter: channels_last in, channels_last out.

A tensor in ``torch.channels_last`` (``channels_last_3d``) memory format is logically
``(N, C, *spatial)`` and physically ``(N, *spatial, C)``.  torch.nn's convolutions, norms and
pools keep that format, so a network converted with ``model.to(memory_format=torch.channels_last)``
never converts between layers.  Our ops already run channels-last data natively
(``channel_axis=-1``), so a channels-first call (``channel_axis=1``) on such a tensor runs as the
channels-last call on its ``(N, *spatial, C)`` view — a view, no copy — and its outputs of the
data's rank come back through the inverse view: channels_last tensors, as torch.nn returns them.
Autograd records the two views (their backward is a view of the gradient), so gradients keep the
format too.

Which arguments are laid out like the data (``x``, and ``max_unpool``'s ``indices``) and when
an input is batched (the format names batched tensors only) are written here once per op.  A
layer or RMS norm over the channel axis (``axis=1``) of channels_last data becomes the
trailing-axis norm of the view.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _conv_batched(values: dict[str, Any]) -> bool:
    weight = values.get("weight")
    return isinstance(weight, Tensor) and weight.dim() == values["x"].dim()


def _pool_batched(values: dict[str, Any]) -> bool:
    window = values.get("window")
    return not isinstance(window, (tuple, list)) or len(window) == values["x"].dim() - 2


def _always(values: dict[str, Any]) -> bool:
    return True


#: The ops whose data may arrive channels_last: when their input is batched (the memory formats
#: name batched tensors), and the arguments laid out like the data.
_OPS: dict[str, tuple[Callable[[dict[str, Any]], bool], tuple[str, ...]]] = {
    "conv": (_conv_batched, ("x",)),
    "conv_transpose": (_conv_batched, ("x",)),
    "batch_norm": (_always, ("x",)),
    "instance_norm": (_always, ("x",)),
    "group_norm": (_always, ("x",)),
    "max_pool": (_pool_batched, ("x",)),
    "avg_pool": (_pool_batched, ("x",)),
    "max_unpool": (_pool_batched, ("x", "indices")),
}


#: The norms over named axes: over the channel axis alone (``axis=1``), channels_last data makes
#: them trailing-axis norms of the ``(N, *spatial, C)`` view — the fastest layout there is.
_AXIS_OPS = ("layer_norm", "rms_norm")


def laid_out_ops() -> frozenset[str]:
    """The ops whose calls :func:`channels_last_call` may rewrite."""
    return frozenset(_OPS) | frozenset(_AXIS_OPS)


def _over_channels(axis: Any, ndim: int) -> bool:
    """Whether ``axis`` names axis 1 of an ``ndim``-D tensor alone (as an int or a 1-tuple)."""
    if isinstance(axis, (tuple, list)) and len(axis) == 1:
        axis = axis[0]
    return isinstance(axis, int) and not isinstance(axis, bool) and axis in (1, 1 - ndim)


def is_channels_last(x: Tensor) -> bool:
    """Whether ``x`` (4-D or 5-D) is laid out channels_last rather than contiguous: its strides are
    ``torch.channels_last``'s (``channels_last_3d``'s) and not the default ones — or both (one
    channel) with the channel stride 1 that ``.to(memory_format=torch.channels_last)`` gives, as
    torch.nn's layers read it; a single spatial position is the same memory either way, and stays
    channels first."""
    fmt = _FORMATS.get(x.dim())
    if fmt is None or not x.is_contiguous(memory_format=fmt):
        return False
    if not x.is_contiguous():
        return True
    return x.stride(1) == 1 and math.prod(x.shape[2:]) > 1


def channels_last_call(name: str, values: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments of the channels-last call that runs a channels-first call of op ``name`` on
    channels_last data (see the module docstring), or ``None`` when it is not such a call."""
    x = values.get("x")
    if name in _AXIS_OPS:
        if not isinstance(x, Tensor) or not _over_channels(values.get("axis"), x.dim()) or not is_channels_last(x):
            return None
        return {**values, "x": x.movedim(1, -1), "axis": -1}
    rule = _OPS.get(name)
    if rule is None or values.get("channel_axis", 1) != 1:
        return None
    if not isinstance(x, Tensor) or not is_channels_last(x):
        return None
    batched, laid_out = rule
    if not batched(values):
        return None
    moved = dict(values)
    for arg in laid_out:
        value = values.get(arg)
        if isinstance(value, Tensor):
            if value.dim() != x.dim():
                return None  # the op names the wrong shape in its own words
            moved[arg] = value.movedim(1, -1)
    moved["channel_axis"] = -1
    size = values.get("output_size")
    if isinstance(size, (tuple, list)) and len(size) == x.dim():  # a full shape (max_unpool): in the view's order
        moved["output_size"] = (size[0], *size[2:], size[1])
    return moved


def restore(result: Any, ndim: int) -> Any:
    """The outputs of the channels-last call as the channels-first call returns them: each of the
    data's rank through the inverse view (channels_last strides), the others (statistics) as they are."""
    if isinstance(result, Tensor):
        return result.movedim(-1, 1) if result.dim() == ndim else result
    if isinstance(result, tuple):
        return type(result)(restore(r, ndim) for r in result) if not hasattr(result, "_fields") \
            else type(result)(*(restore(r, ndim) for r in result))
    return result
