"""Sliding-window geometry shared by convolution and pooling (array-API reference).

A window op visits, for each offset ``t`` of the window (kernel), the strided
slice of the padded input that this offset meets at every output position:
along spatial axis ``a`` it starts at ``t·dilation`` and takes ``out_size``
elements ``stride`` apart.  Forward passes gather these slices; backward
passes add gradients back into the same slices.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def window_offsets(window: Sequence[int]) -> list[tuple[int, ...]]:
    """Window offsets in row-major order (the first spatial axis varies slowest)."""
    return list(itertools.product(*(range(k) for k in window)))


def window_slice(
    ndim: int,
    axes: Sequence[int],
    offset: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    out_size: Sequence[int],
) -> tuple[slice, ...]:
    """Index of the padded input that window offset ``offset`` meets at every output position."""
    index = [slice(None)] * ndim
    for a, t, s, dl, o in zip(axes, offset, stride, dilation, out_size):
        start = t * dl
        index[a] = slice(start, start + s * (o - 1) + 1, s)
    return tuple(index)
