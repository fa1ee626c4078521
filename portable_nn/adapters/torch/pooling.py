"""Drop-in ``torch.nn`` pooling modules running portable_nn's pooling kernels."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .errors import raises_like_torch
from .functional import avg_pool, max_pool, max_unpool
from .modules import _check_channel_axis


def _per_axis(value: Any, d: int) -> tuple[int, ...]:
    """``torch.nn``'s int-or-tuple geometry as a tuple of ``d`` ints (so unbatched input keeps its meaning)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * d


class _MaxPoolMixin:
    """What our max-pool modules add to ``torch.nn``'s: the kernel and ``channel_axis=``."""

    _d: int

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                 return_indices: bool = False, ceil_mode: bool = False, *, channel_axis: int = 1) -> None:
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)  # type: ignore[call-arg]
        self.channel_axis = _check_channel_axis(channel_axis)

    @raises_like_torch
    def forward(self, input: Tensor) -> Any:
        """Max over each window of ``input`` ``(N, C, *spatial)`` or ``(C, *spatial)`` (or channels last);
        ``(output, indices)`` with ``return_indices``."""
        d = self._d
        return max_pool(input, _per_axis(self.kernel_size, d), stride=_per_axis(self.stride, d),
                        padding=_per_axis(self.padding, d), dilation=_per_axis(self.dilation, d),
                        ceil_mode=bool(self.ceil_mode), return_indices=bool(self.return_indices),
                        channel_axis=self.channel_axis)


class MaxPool1d(_MaxPoolMixin, nn.MaxPool1d):
    """Drop-in ``torch.nn.MaxPool1d`` (arguments as there, ``return_indices`` included: PyTorch's flat
    spatial positions, for :class:`MaxUnpool1d`; keyword-only ``channel_axis=-1`` for ``(N, L, C)``
    data); the gradient goes to each window's first maximum."""

    _d = 1


class MaxPool2d(_MaxPoolMixin, nn.MaxPool2d):
    """Drop-in ``torch.nn.MaxPool2d`` (see :class:`MaxPool1d`)."""

    _d = 2


class MaxPool3d(_MaxPoolMixin, nn.MaxPool3d):
    """Drop-in ``torch.nn.MaxPool3d`` (see :class:`MaxPool1d`)."""

    _d = 3


class _AvgPoolMixin:
    """What our average-pool modules add to ``torch.nn``'s: the kernel and ``channel_axis=``."""

    _d: int

    @raises_like_torch
    def forward(self, input: Tensor) -> Tensor:
        """The mean over each window of ``input`` (PyTorch's divisor rule, or ``divisor_override``)."""
        d = self._d
        return avg_pool(input, _per_axis(self.kernel_size, d), stride=_per_axis(self.stride, d),
                        padding=_per_axis(self.padding, d), ceil_mode=bool(self.ceil_mode),
                        count_include_pad=bool(self.count_include_pad),
                        divisor_override=getattr(self, "divisor_override", None), channel_axis=self.channel_axis)


class AvgPool1d(_AvgPoolMixin, nn.AvgPool1d):
    """Drop-in ``torch.nn.AvgPool1d`` (arguments as there; keyword-only ``channel_axis=-1`` for
    ``(N, L, C)`` data)."""

    _d = 1

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, *, channel_axis: int = 1) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad)
        self.channel_axis = _check_channel_axis(channel_axis)


class AvgPool2d(_AvgPoolMixin, nn.AvgPool2d):
    """Drop-in ``torch.nn.AvgPool2d`` (arguments as there, ``divisor_override`` included; keyword-only
    ``channel_axis=-1`` for channels-last data)."""

    _d = 2

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, *,
                 channel_axis: int = 1) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        self.channel_axis = _check_channel_axis(channel_axis)


class AvgPool3d(_AvgPoolMixin, nn.AvgPool3d):
    """Drop-in ``torch.nn.AvgPool3d`` (see :class:`AvgPool2d`)."""

    _d = 3

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, *,
                 channel_axis: int = 1) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        self.channel_axis = _check_channel_axis(channel_axis)


class _MaxUnpoolMixin:
    """What our max-unpool modules add to ``torch.nn``'s: the kernel and ``channel_axis=``."""

    _d: int

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, *, channel_axis: int = 1) -> None:
        super().__init__(kernel_size, stride, padding)  # type: ignore[call-arg]
        self.channel_axis = _check_channel_axis(channel_axis)

    @raises_like_torch
    def forward(self, input: Tensor, indices: Tensor, output_size: Any = None) -> Tensor:
        """Each value of ``input`` at its index (``MaxPool*d(return_indices=True)``'s), zero elsewhere;
        ``output_size`` as in ``torch.nn`` (spatial sizes, or the full shape)."""
        d = self._d
        if output_size is not None:
            output_size = tuple(int(v) for v in output_size)
        return max_unpool(input, indices, _per_axis(self.kernel_size, d), stride=_per_axis(self.stride, d),
                          padding=_per_axis(self.padding, d), output_size=output_size, channel_axis=self.channel_axis)


class MaxUnpool1d(_MaxUnpoolMixin, nn.MaxUnpool1d):
    """Drop-in ``torch.nn.MaxUnpool1d`` (arguments as there; keyword-only ``channel_axis=-1`` for
    ``(N, L, C)`` data).  Duplicate indices: the last entry in the input's order wins, on every backend."""

    _d = 1


class MaxUnpool2d(_MaxUnpoolMixin, nn.MaxUnpool2d):
    """Drop-in ``torch.nn.MaxUnpool2d`` (see :class:`MaxUnpool1d`)."""

    _d = 2


class MaxUnpool3d(_MaxUnpoolMixin, nn.MaxUnpool3d):
    """Drop-in ``torch.nn.MaxUnpool3d`` (see :class:`MaxUnpool1d`)."""

    _d = 3
