"""Padding modes other than zeros (PyTorch's ``padding_mode``), as an input map applied before dispatch.

Along a spatial axis of size ``L`` padded by ``lo`` before and ``hi`` after, the padded array's
position ``p`` (``0 <= p < lo + L + hi``) holds ``a[src(p − lo)]``, where for ``i = p − lo``:

    reflect     src(i) = −i for i < 0,  2(L − 1) − i for i >= L   (mirrored, the edge not repeated)
    replicate   src(i) = clamp(i, 0, L − 1)                         (the edge repeated)
    circular    src(i) = i mod L                                     (wrapped around)

and ``src(i) = i`` inside.  PyTorch's validity rules come with them: reflect needs
``lo, hi < L``, circular ``lo, hi <= L`` (it wraps around once), replicate ``L >= 1``.

Padding is then a gather along each padded axis (the array-API ``take`` with one index
vector per axis), which every array library and device runs, so every backend gets the
modes at once: the convolution runs without padding on the padded array.  The gather is
linear; its adjoint, the gradient's way back, adds each padded position's gradient to its
source: the interior slice, plus the border positions summed per source (:class:`_AxisGather`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import array_api_compat
import numpy as np

from ..dispatch import InputMap

#: The padding modes, PyTorch's names (``torch.nn.Conv2d``'s ``padding_mode``).
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def check_padding_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`PADDING_MODES`; ``TypeError``/``ValueError`` naming ``padding_mode``."""
    if not isinstance(mode, str):
        raise TypeError(f"padding_mode must be a string, one of {', '.join(map(repr, PADDING_MODES))}; "
                        f"got {type(mode).__name__}")
    if mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))} (as in "
                         f"torch.nn.Conv2d), got {mode!r}")
    return mode


def check_mode_padding(mode: str, lo: Sequence[int], hi: Sequence[int], size: Sequence[int],
                       x_shape: tuple[int, ...]) -> None:
    """PyTorch's limits on the padding of each spatial axis for ``mode`` (``ValueError`` naming
    ``padding_mode`` and ``padding``): reflect pads less than the size, circular at most the size,
    replicate needs something to repeat."""
    for i, (low, high, length) in enumerate(zip(lo, hi, size)):
        if mode == "reflect" and max(low, high) >= length:
            need = "padding smaller than x's size on each spatial axis (the edge is not repeated)"
        elif mode == "circular" and max(low, high) > length:
            need = "padding at most x's size on each spatial axis (it wraps around once)"
        elif mode == "replicate" and max(low, high) > 0 and length == 0:
            need = "a non-empty spatial axis to repeat where it pads"
        else:
            continue
        raise ValueError(
            f"padding_mode={mode!r} needs {need}, as in PyTorch; got padding ({low}, {high}) on spatial "
            f"axis {i} of size {length} (x has shape {x_shape}); pad less or use padding_mode='zeros'"
        )


def source_indices(mode: str, length: int, lo: int, hi: int) -> np.ndarray:
    """``src(p − lo)`` for every padded position ``p`` (see the module docstring)."""
    i = np.arange(-lo, length + hi)
    if mode == "reflect":
        return np.where(i < 0, -i, np.where(i >= length, 2 * (length - 1) - i, i))
    if mode == "replicate":
        return np.clip(i, 0, length - 1)
    if mode == "circular":
        return np.mod(i, length)
    raise AssertionError(mode)  # pragma: no cover - validated before


class _AxisGather:
    """The padding of one axis: the gather ``A`` and the index vectors of its adjoint.

    ``Aᵀ g = g[lo : lo + L] + S``, with ``S`` holding, at each source ``j`` of a border position,
    the sum of the gradients of the border positions that read ``j``.  The border gradients
    (``lo + hi`` positions, with a zero slot after them: ``ext``) are summed per source in
    ``rounds`` gathers of ``ext`` (round ``r`` takes each source's ``r``-th border position, or the
    zero slot), giving one value per distinct source (``sums``); one gather of ``sums`` (with its
    own zero slot) then places them along the axis.  Only that last gather and the addition touch
    the whole axis; the rounds (1 for reflect and circular unless the two borders meet; for
    replicate, as many as the border positions repeating one edge) touch border-sized arrays.
    """

    def __init__(self, axis: int, mode: str, length: int, lo: int, hi: int) -> None:
        self.axis, self.length, self.lo, self.hi = axis, length, lo, hi
        self.gather = source_indices(mode, length, lo, hi)
        border = np.concatenate([self.gather[:lo], self.gather[lo + length:]])  # ext's sources, in ext order
        sources, counts = np.unique(border, return_counts=True)
        zero_slot = lo + hi
        readers = [np.flatnonzero(border == s) for s in sources]  # the border positions reading each source
        self.rounds = [np.array([t[r] if r < len(t) else zero_slot for t in readers])
                       for r in range(int(counts.max(initial=0)))]
        self.place = np.full(length, len(sources))  # where each source's sum is; the zero slot elsewhere
        self.place[sources] = np.arange(len(sources))

    def apply(self, xp: Any, a: Any) -> Any:
        return xp.take(a, _indices(xp, self.gather, a), axis=self.axis)

    def adjoint(self, xp: Any, g: Any) -> Any:
        lo, length, axis = self.lo, self.length, self.axis
        ext = xp.concat([_along(g, axis, 0, lo), _along(g, axis, lo + length, None), _zeros(xp, g, axis)], axis=axis)
        sums = None
        for positions in self.rounds:
            part = xp.take(ext, _indices(xp, positions, g), axis=axis)
            sums = part if sums is None else sums + part
        placed = xp.take(xp.concat([sums, _zeros(xp, g, axis)], axis=axis), _indices(xp, self.place, g), axis=axis)
        return _along(g, axis, lo, lo + length) + placed


def _indices(xp: Any, values: np.ndarray, like: Any) -> Any:
    """``values`` as an index array of ``xp`` beside ``like``: from a list, so each library takes its own
    default integer type (int32 for JAX without 64-bit mode)."""
    return xp.asarray(values.tolist(), device=array_api_compat.device(like))


def _along(a: Any, axis: int, start: int, stop: int | None) -> Any:
    """``a[start:stop]`` along ``axis``."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]


def _zeros(xp: Any, like: Any, axis: int) -> Any:
    """Zeros shaped like ``like`` with size 1 along ``axis``: the zero slot of a gather."""
    shape = list(like.shape)
    shape[axis] = 1
    return xp.zeros(tuple(shape), dtype=like.dtype, device=array_api_compat.device(like))


class ModePadding(InputMap):
    """``x`` padded with a non-zero ``padding_mode``, axis by axis (an :class:`~portable_nn.dispatch.InputMap`).

    Args:
        mode: ``"reflect"``, ``"replicate"`` or ``"circular"``.
        axes: the array's spatial axes.
        size: their sizes.
        lo, hi: the padding before and after, per spatial axis (checked with :func:`check_mode_padding`).
    """

    def __init__(self, mode: str, axes: Sequence[int], size: Sequence[int], lo: Sequence[int],
                 hi: Sequence[int]) -> None:
        self.mode = mode
        self.axes = tuple(_AxisGather(a, mode, n, low, high)
                          for a, n, low, high in zip(axes, size, lo, hi) if low or high)

    def apply(self, xp: Any, a: Any) -> Any:
        for gather in self.axes:
            a = gather.apply(xp, a)
        return a

    def adjoint(self, xp: Any, g: Any) -> Any:
        for gather in reversed(self.axes):  # (A_d ⋯ A_1)ᵀ = A_1ᵀ ⋯ A_dᵀ
            g = gather.adjoint(xp, g)
        return g

    def __str__(self) -> str:
        pads = ", ".join(f"axis {g.axis}: ({g.lo}, {g.hi})" for g in self.axes)
        return f"padded with padding_mode={self.mode!r} ({pads}) by index gathers, before the convolution"
