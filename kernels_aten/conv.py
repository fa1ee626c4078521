"""PyTorch's own convolution, forward and backward (backend ``"aten"``), for torch tensors.

Forward, with ``z`` the convolution and bias (one ``aten::convolution`` call: oneDNN on the CPU
for float32/bfloat16/float16, PyTorch's im2col + GEMM for float64, cuDNN on CUDA)::

    z = conv(x, weight) + bias
    y = act(z)                      (torch's elementwise op, in place when nothing keeps z)

Backward, with ``g = dy · act'`` computed by torch's own activation-backward op from ``y``
(relu, sigmoid, tanh, leaky_relu with a positive slope) or from ``z`` (the others), one
``aten::convolution_backward`` call returns the gradients ``needs`` asks for, and only those:
its ``output_mask`` skips dx for ``wrt=("weight", "bias")``::

    dx = conv_transpose(g, weight),   dweight = corr(g, x),   dbias = Σ g

Layouts: channels-last data ``(N, *spatial, C)`` goes to torch as a permuted view ``(N, C,
*spatial)`` — the strides of ``memory_format=torch.channels_last`` for 2-D and 3-D, so
oneDNN runs it in NHWC without a copy — and the result comes back through the inverse
permutation (contiguous in the caller's layout; only 1-D channels-last output, which torch
returns channels first, is copied).  Unbatched input is a batch of one (a view).

Padding: symmetric padding (every int/tuple form, ``"valid"``, ``"same"`` with odd
effective kernels) is torch's own.  Asymmetric ``(low, high)`` padding — which ``"same"``
also needs for even effective kernels — pads a zero copy of ``x`` with ``F.pad`` first and
convolves it unpadded, as PyTorch's own ``padding="same"`` does; dx is the interior of the
padded input's gradient.  Declining it instead would send every even-kernel ``"same"``
call to another backend, for the price of one copy of ``x``.

Residuals: ``x`` (the padded copy when padding was asymmetric), ``weight``, and ``y`` or ``z``
per the activation (nothing more for the identity).

Precision: float32 on CUDA is computed in IEEE float32.  cuDNN's convolutions use TF32 by
default in PyTorch (``torch.backends.cudnn.allow_tf32``), which on an H200 gave relative errors
of 1e-4 to 5e-4 in dx against float64 where every other backend stays near 1e-6; the calls here
switch it off for their duration (:func:`_ieee_float32`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from portable_nn.api.activations import Activation
from portable_nn.kernel_codes import keeps_output_only

from .activations import apply, times_derivative


@dataclass(frozen=True)
class _Geometry:
    """What the backward needs to know about the forward call besides its tensors."""

    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int
    interior: tuple[slice, ...] | None  # dx's slice of the padded input's gradient (asymmetric padding)
    channels_last: bool
    batched: bool
    bias_sizes: list[int] | None
    activation: Activation
    transposed: bool = False
    output_padding: tuple[int, ...] = ()


def _channels_first(t: torch.Tensor, channels_last: bool, batched: bool) -> torch.Tensor:
    """``t`` as a batched channels-first view ``(N, C, *spatial)``."""
    if not batched:
        t = t.unsqueeze(0)
    return t.movedim(-1, 1) if channels_last else t


def _caller_layout(t: torch.Tensor, channels_last: bool, batched: bool) -> torch.Tensor:
    """A batched channels-first result in the caller's layout, C-contiguous."""
    if channels_last:
        t = t.movedim(1, -1)
    if not batched:
        t = t.squeeze(0)
    return t.contiguous()


def _pad_widths(pad_lo: tuple[int, ...], pad_hi: tuple[int, ...]) -> list[int]:
    """``F.pad``'s argument: (low, high) per spatial axis, the last axis first."""
    widths: list[int] = []
    for lo, hi in zip(reversed(pad_lo), reversed(pad_hi)):
        widths += [lo, hi]
    return widths


def _ieee_float32(t: torch.Tensor) -> Any:
    """A context computing cuDNN convolutions of ``t`` without TF32 (float32 CUDA tensors only)."""
    if t.is_cuda and t.dtype == torch.float32:
        return _no_tf32()
    return nullcontext()


@contextmanager
def _no_tf32() -> Iterator[None]:
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        yield


def conv_forward(call: Any) -> tuple[tuple[torch.Tensor], Any]:
    """y = act(conv(x, weight) + bias) with ``aten::convolution``; residuals per the module docstring."""
    d = len(call.kernel)
    if call.pad_lo != call.pad_hi:
        x = F.pad(_channels_first(call.x, call.layout == "channels_last", call.batched),
                  _pad_widths(call.pad_lo, call.pad_hi))
        interior = (slice(None), slice(None), *(slice(lo, lo + n) for lo, n in zip(call.pad_lo, call.in_size)))
        return _forward(call, x, [0] * d, interior, False, (0,) * d)
    return _forward(call, None, list(call.pad_lo), None, False, (0,) * d)


def conv_transpose_forward(call: Any) -> tuple[tuple[torch.Tensor], Any]:
    """y = act(conv_transpose(x, weight) + bias) with ``aten::convolution`` (``transposed=True``).

    The call carries the geometry of the convolution it transposes, whose low padding is
    PyTorch's ``padding`` argument of the transposed one.
    """
    return _forward(call, None, list(call.pad_lo), None, True, tuple(call.output_padding))


def _forward(call: Any, x: Any, padding: list[int], interior: Any, transposed: bool,
             output_padding: tuple[int, ...]) -> tuple[tuple[torch.Tensor], Any]:
    channels_last = call.layout == "channels_last"
    if x is None:
        x = _channels_first(call.x, channels_last, call.batched)
    weight, bias, act = call.weight, call.bias, call.activation
    with _ieee_float32(x):
        z = torch.ops.aten.convolution(
            x, weight, bias, list(call.stride), padding, list(call.dilation), transposed, list(output_padding),
            call.groups,
        )
    from_output = keeps_output_only(act)
    # z is needed after the activation only when the backward reads act' from it.
    y = apply(z, act, in_place=not (call.save and not from_output))
    residuals = None
    if call.save:
        kept = None if act.is_identity else (y if from_output else z)
        geometry = _Geometry(
            list(call.stride), padding, list(call.dilation), call.groups, interior, channels_last,
            call.batched, None if bias is None else [int(bias.shape[0])], act, transposed, output_padding,
        )
        residuals = (x, weight, kept, geometry)
    return (_caller_layout(y, channels_last, call.batched),), residuals


def conv_backward(residuals: Any, cotangents: Any, needs: frozenset[str]) -> dict[str, torch.Tensor]:
    """dx, dweight, dbias from one ``aten::convolution_backward`` call, computing only ``needs``."""
    x, weight, kept, geo = residuals
    dy = _channels_first(cotangents[0], geo.channels_last, geo.batched)
    g = dy if kept is None else times_derivative(dy, kept, geo.activation)
    want_bias = "bias" in needs and geo.bias_sizes is not None
    mask = ["x" in needs, "weight" in needs, want_bias]
    if not any(mask):
        return {}
    d = x.ndim - 2
    with _ieee_float32(x):
        dx, dweight, dbias = torch.ops.aten.convolution_backward(
            g, x, weight, geo.bias_sizes if want_bias else None, geo.stride, geo.padding, geo.dilation,
            geo.transposed, list(geo.output_padding) or [0] * d, geo.groups, mask,
        )
    grads = {}
    if mask[0]:
        if geo.interior is not None:
            dx = dx[geo.interior]
        grads["x"] = _caller_layout(dx, geo.channels_last, geo.batched)
    if mask[1]:
        grads["weight"] = dweight
    if want_bias:
        grads["bias"] = dbias
    return grads


#: The transposed convolution's backward is ``aten::convolution_backward`` with ``transposed=True``.
conv_transpose_backward = conv_backward
