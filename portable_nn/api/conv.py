"""Convolution, 1-D to 3-D, with bias and activation fused: signature, validation, documentation.

The geometry is resolved once, here, with PyTorch's rules.  The number of
spatial axes ``d`` is ``weight.ndim - 2``; ``weight`` is ``(O, C/groups, *k)``
whatever the data layout; ``x`` is ``(N, C, *spatial)``, or ``(N, *spatial, C)``
with ``channel_axis=-1``, or either without ``N`` (``x.ndim == weight.ndim - 1``).
Per spatial axis, with input size ``L``, padding ``lo``/``hi`` and effective
kernel size ``e = dilation·(k − 1) + 1``:

    out = floor((L + lo + hi − e) / stride) + 1

``padding="same"`` pads ``dilation·(k − 1)`` in total with the odd one on the
high side (PyTorch's choice) and needs ``stride=1``; ``"valid"`` pads nothing.

Implementations receive the resolved geometry (spatial axes of ``x``, per-axis
kernel size, stride, dilation, low and high padding, output size), the groups,
the parsed activation and whether ``x`` is batched.  Implementations:
``portable_nn/reference/conv.py`` (every array library) and kernels where
present (``pnn.capabilities()``).
"""

from __future__ import annotations

from typing import Any

from ._common import (
    Prepared,
    check_int,
    check_layer_arrays,
    check_shape,
    make_call,
    per_axis,
    public_op,
    spatial_layout,
)
from ._types import Array, IntOrTuple, Padding
from .activations import ActivationLike, parse_activation

__all__ = ["conv"]

_CONV_FIELDS = ("x", "weight", "bias")



def _padding_pairs(
    padding: Any, d: int, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``padding`` as per-axis (low, high) tuples.

    Accepts an int (every side), ``"valid"`` (none), ``"same"`` (stride 1 only;
    ``dilation·(k − 1)`` in total, the extra one on the high side as PyTorch
    does), or a tuple of ``d`` entries, each an int (both sides) or a
    ``(low, high)`` pair.
    """
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * d, (0,) * d
        if padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError(
                    f"padding='same' needs stride=1 on every spatial axis (as in PyTorch), got stride={stride}; "
                    "give the padding explicitly for a strided convolution"
                )
            total = [dl * (k - 1) for k, dl in zip(kernel, dilation)]
            lo = tuple(t // 2 for t in total)
            return lo, tuple(t - low for t, low in zip(total, lo))
        raise ValueError(f"padding: unknown padding mode {padding!r}; expected 'same', 'valid', an int or a tuple")
    if not isinstance(padding, (tuple, list)):
        p = check_int(padding, "padding", minimum=0)
        return (p,) * d, (p,) * d
    if len(padding) != d:
        hint = " (for 1-D (low, high) padding write ((low, high),))" if d == 1 and len(padding) == 2 else ""
        raise ValueError(
            f"padding must be an int, 'same', 'valid' or a tuple of {d} entries (one per spatial axis, each an "
            f"int or a (low, high) pair), got {tuple(padding)!r}{hint}"
        )
    lo, hi = [], []
    for entry in padding:
        if isinstance(entry, (tuple, list)):
            if len(entry) != 2:
                raise ValueError(f"padding entries must be an int or a (low, high) pair, got {tuple(entry)!r}")
            lo.append(check_int(entry[0], "padding", minimum=0))
            hi.append(check_int(entry[1], "padding", minimum=0))
        else:
            p = check_int(entry, "padding", minimum=0)
            lo.append(p)
            hi.append(p)
    return tuple(lo), tuple(hi)


@public_op(grad_fields=_CONV_FIELDS)
def conv(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    stride: IntOrTuple = 1,
    padding: Padding = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
    activation: ActivationLike = "identity",
    channel_axis: int = 1,
) -> Any:
    """Convolution over 1 to 3 spatial axes with fused bias and activation
    (PyTorch's ``conv1d/2d/3d`` followed by the activation).

    With ``G = groups``, the output channel ``o`` in group ``g = o // (O/G)``:

        y[n, o, p] = act(bias[o] + Σ_{c < C/G} Σ_t weight[o, c, t] · x_pad[n, g·C/G + c, p·stride + t·dilation])

    where ``x_pad`` is ``x`` with zero padding, ``t`` runs over the kernel
    offsets and ``p`` over the output positions (per spatial axis).

    Args:
        x: ``(N, C, *spatial)``, or ``(N, *spatial, C)`` with ``channel_axis=-1``,
            or either without ``N`` (unbatched: ``x.ndim == weight.ndim - 1``).
        weight: ``(O, C/groups, *kernel)`` with 1 to 3 kernel axes (the
            dimensionality of the convolution), PyTorch's layout whatever the
            data layout.
        bias: ``(O,)`` or ``None``.
        stride: int or per-axis tuple, >= 1.
        padding: int (every side), a tuple with one entry per spatial axis
            (an int for both sides, or a ``(low, high)`` pair), ``"valid"``
            (none) or ``"same"`` (stride 1 only: output size = input size;
            ``dilation·(k − 1)`` in total, the odd one on the high side, as in
            PyTorch).  Zero padding.
        dilation: int or per-axis tuple, >= 1: spacing of the kernel taps.
        groups: the input and output channels split into ``groups`` independent
            convolutions (``groups == C`` is a depthwise convolution).
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`ACTIVATIONS`).
        channel_axis: 1 (channels first) or -1 (channels last), counted in the
            batched layout; the weight layout does not change.

    Returns:
        ``y`` with ``x``'s layout and dtype (batched iff ``x`` is), ``O``
        channels and each spatial size
        ``floor((L + lo + hi − dilation·(k − 1) − 1) / stride) + 1``, with ``L``
        the input size, ``lo``/``hi`` the padding before/after and ``k`` the
        kernel size on that axis.
        float16/bfloat16 ``x`` may come with float32 ``weight``/``bias``: the
        products accumulate in float32.

    Raises:
        ValueError: mismatched ranks, channels that do not match
            ``groups * weight.shape[1]`` or that ``groups`` does not divide,
            a bias that is not ``(O,)``, non-positive stride or dilation,
            negative padding, padding that leaves no output, ``"same"`` with a
            stride, an unknown padding mode or activation, an unsupported
            ``channel_axis``.
        TypeError: non-arrays, non-floating dtypes, dtype mixes other than half
            data with float32 parameters, arrays of different libraries,
            non-int geometry arguments.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``; dx is the transposed convolution of ``g =
        dy · act'``, dweight the correlation of ``g`` with ``x``, dbias ``Σ g`` (reduced
        with the activation derivative).  Besides ``x`` and ``weight``, the backward
        keeps nothing for the identity, ``y`` alone when the activation's derivative is
        a function of its output (relu, sigmoid, tanh, leaky_relu with a positive slope;
        float32 values for half data), else the pre-activation.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64; channels first or last); GPU kernels (``cupy``:
        CUDA C compiled through CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays
        and CUDA torch tensors, where ``pnn.capabilities()`` lists them; ``aten`` (torch
        tensors only, CPU or CUDA: PyTorch's own convolution — oneDNN, cuDNN — then the
        activation; first under ``auto`` for torch tensors, where it measured faster than
        ``numba``).  ``pnn.explain`` reports which one a call runs and why the others were
        passed over.
    """
    named = {"x": x, "weight": weight, "bias": bias}
    _, family, device, dtype, mixed = check_layer_arrays(named, ("bias",))

    if weight.ndim not in (3, 4, 5):
        raise ValueError(
            "weight must be (out_channels, in_channels/groups, *kernel) with 1 to 3 kernel axes "
            f"(3 to 5 dimensions), got shape {tuple(weight.shape)}"
        )
    d = weight.ndim - 2
    batched, layout, x_channel_axis, spatial_axes = spatial_layout(
        x, d, channel_axis, f"a {d}-D convolution (weight has shape {tuple(weight.shape)})"
    )

    groups = check_int(groups, "groups", minimum=1)
    out_channels = int(weight.shape[0])
    group_in = int(weight.shape[1])
    kernel = tuple(int(s) for s in weight.shape[2:])
    channels = int(x.shape[x_channel_axis])
    if any(k < 1 for k in kernel):
        raise ValueError(f"weight must have kernel sizes >= 1, got shape {tuple(weight.shape)}")
    if channels % groups:
        raise ValueError(f"x has {channels} channels, which groups={groups} does not divide")
    if out_channels % groups:
        raise ValueError(
            f"weight has {out_channels} output channels (weight.shape[0]), which groups={groups} does not divide"
        )
    if channels != groups * group_in:
        raise ValueError(
            f"x has {channels} channels (axis {x_channel_axis} of shape {tuple(x.shape)}) but weight expects "
            f"groups * weight.shape[1] = {groups} * {group_in} = {groups * group_in}"
        )
    check_shape(bias, "bias", (out_channels,), "one value per output channel, weight.shape[0]")

    strides = per_axis(stride, d, "stride", 1)
    dil = per_axis(dilation, d, "dilation", 1)
    pad_lo, pad_hi = _padding_pairs(padding, d, kernel, strides, dil)
    in_size = tuple(int(x.shape[a]) for a in spatial_axes)
    out_size = []
    for i in range(d):
        eff = dil[i] * (kernel[i] - 1) + 1
        padded = in_size[i] + pad_lo[i] + pad_hi[i]
        out = (padded - eff) // strides[i] + 1 if padded >= eff else 0
        if out < 1:
            what = f"kernel size {kernel[i]}"
            if dil[i] > 1:
                what += f" with dilation {dil[i]} (effective size {eff})"
            raise ValueError(
                f"weight's {what} on spatial axis {i} is larger than x's padded size there "
                f"({in_size[i]} + padding {pad_lo[i]} + {pad_hi[i]} = {padded}; x has shape {tuple(x.shape)}): "
                "the convolution has no output; pad more or use a smaller kernel"
            )
        out_size.append(out)

    params = {
        "spatial_axes": spatial_axes,
        "channel_axis": x_channel_axis,
        "batched": batched,
        "groups": groups,
        "kernel": kernel,
        "stride": strides,
        "dilation": dil,
        "pad_lo": pad_lo,
        "pad_hi": pad_hi,
        "in_size": in_size,
        "out_size": tuple(out_size),
        "activation": parse_activation(activation),
        "mixed_precision": mixed,
    }
    call = make_call("conv", named, params, family=family, device=device, dtype=dtype, layout=layout)
    return Prepared(call, _CONV_FIELDS, named)
