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
``padding_mode`` other than ``"zeros"`` pads ``x`` before dispatch (an input map,
see :mod:`portable_nn.api._padding`): implementations then see no padding.

Implementations receive the resolved geometry (spatial axes of ``x``, per-axis
kernel size, stride, dilation, low and high padding, output size), the groups,
the parsed activation and whether ``x`` is batched.  Implementations:
``portable_nn/reference/conv.py`` (every array library) and kernels where
present (``pnn.capabilities()``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
from ._padding import ModePadding, check_mode_padding, check_padding_mode
from ._types import Array, IntOrTuple, Padding
from .activations import ActivationLike, parse_activation

__all__ = ["conv"]

_CONV_FIELDS = ("x", "weight", "bias")



class _Layout(NamedTuple):
    """What a convolution-like op reads off ``x`` and ``weight`` before its own channel checks."""

    d: int
    batched: bool
    layout: str
    channel_axis: int
    spatial_axes: tuple[int, ...]
    groups: int
    kernel: tuple[int, ...]
    channels: int


def _kernel_layout(x: Array, weight: Array, channel_axis: Any, groups: Any, weight_form: str, what: str) -> _Layout:
    """Validate ``weight``'s rank and kernel sizes, ``x``'s layout against them and ``groups``.

    ``weight_form`` names the weight layout in the error (``"(out_channels, in_channels/groups,
    *kernel)"``), ``what`` the op (``"convolution"``).
    """
    if weight.ndim not in (3, 4, 5):
        raise ValueError(
            f"weight must be {weight_form} with 1 to 3 kernel axes (3 to 5 dimensions), got shape {tuple(weight.shape)}"
        )
    d = weight.ndim - 2
    batched, layout, x_channel_axis, spatial_axes = spatial_layout(
        x, d, channel_axis, f"a {d}-D {what} (weight has shape {tuple(weight.shape)})"
    )
    groups = check_int(groups, "groups", minimum=1)
    kernel = tuple(int(s) for s in weight.shape[2:])
    if any(k < 1 for k in kernel):
        raise ValueError(f"weight must have kernel sizes >= 1, got shape {tuple(weight.shape)}")
    return _Layout(d, batched, layout, x_channel_axis, spatial_axes, groups, kernel, int(x.shape[x_channel_axis]))


def _geometry(lay: _Layout, stride: tuple[int, ...], dilation: tuple[int, ...], pad_lo: tuple[int, ...],
              pad_hi: tuple[int, ...], in_size: tuple[int, ...], out_size: tuple[int, ...], activation: Any,
              mixed: bool) -> dict[str, Any]:
    """A convolution's resolved geometry, as implementations receive it (the module docstring)."""
    return {
        "spatial_axes": lay.spatial_axes,
        "channel_axis": lay.channel_axis,
        "batched": lay.batched,
        "groups": lay.groups,
        "kernel": lay.kernel,
        "stride": stride,
        "dilation": dilation,
        "pad_lo": pad_lo,
        "pad_hi": pad_hi,
        "in_size": in_size,
        "out_size": out_size,
        "activation": parse_activation(activation),
        "mixed_precision": mixed,
    }


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
    padding_mode: str = "zeros",
    dilation: IntOrTuple = 1,
    groups: int = 1,
    activation: ActivationLike = "identity",
    channel_axis: int = 1,
) -> Any:
    """Convolution over 1 to 3 spatial axes with fused bias and activation
    (PyTorch's ``conv1d/2d/3d`` followed by the activation; ``torch.nn.Conv1d/2d/3d``
    with ``padding_mode``).

    With ``G = groups``, the output channel ``o`` in group ``g = o // (O/G)``:

        y[n, o, p] = act(bias[o] + Σ_{c < C/G} Σ_t weight[o, c, t] · x_pad[n, g·C/G + c, p·stride + t·dilation])

    where ``x_pad`` is ``x`` padded as ``padding_mode`` says, ``t`` runs over the
    kernel offsets and ``p`` over the output positions (per spatial axis).  Along an
    axis of size ``L``, ``x_pad[lo + i] = x[src(i)]`` for ``−lo <= i < L + hi``, with
    ``src(i) = i`` inside and, outside: zeros (``"zeros"``), ``−i`` / ``2(L − 1) − i``
    (``"reflect"``: mirrored, the edge not repeated), ``clamp(i, 0, L − 1)``
    (``"replicate"``), ``i mod L`` (``"circular"``).

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
            PyTorch).
        padding_mode: what the padding holds, ``torch.nn.Conv2d``'s choices:
            ``"zeros"`` (the default), ``"reflect"`` (padding < the input size on
            that axis), ``"replicate"``, ``"circular"`` (padding <= the input
            size).  Any padding form, ``"same"`` included, on every backend and
            layout.
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
            stride, an unknown padding or ``padding_mode`` or activation,
            ``padding_mode="reflect"`` with padding >= the input size on an axis
            (``"circular"``: > the size; ``"replicate"``: an empty axis), an
            unsupported ``channel_axis``.
        TypeError: non-arrays, non-floating dtypes, dtype mixes other than half
            data with float32 parameters, arrays of different libraries,
            non-int geometry arguments, a ``padding_mode`` that is not a string.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``; dx is the transposed convolution of ``g =
        dy · act'``, dweight the correlation of ``g`` with ``x``, dbias ``Σ g`` (reduced
        with the activation derivative).  Besides ``x`` and ``weight``, the backward
        keeps nothing for the identity, ``y`` alone when the activation's derivative is
        a function of its output (relu, sigmoid, tanh, leaky_relu with a positive slope;
        float32 values for half data), else the pre-activation.  With a ``padding_mode``
        other than ``"zeros"``, the convolution runs on the padded ``x_pad`` (which the
        backward keeps in place of ``x``) and dx is the gradient of ``x_pad`` summed back
        onto ``x``: each padded position's gradient is added to the position it copies.

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

    lay = _kernel_layout(x, weight, channel_axis, groups, "(out_channels, in_channels/groups, *kernel)",
                         "convolution")
    d, groups, kernel, channels, x_channel_axis, spatial_axes = (
        lay.d, lay.groups, lay.kernel, lay.channels, lay.channel_axis, lay.spatial_axes)
    out_channels = int(weight.shape[0])
    group_in = int(weight.shape[1])
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
    mode = check_padding_mode(padding_mode)
    in_size = tuple(int(x.shape[a]) for a in spatial_axes)
    if mode != "zeros":
        check_mode_padding(mode, pad_lo, pad_hi, in_size, tuple(x.shape))
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

    params = _geometry(lay, strides, dil, pad_lo, pad_hi, in_size, tuple(out_size), activation, mixed)
    input_maps: dict[str, ModePadding] = {}
    if mode != "zeros" and any(pad_lo + pad_hi):
        # x is padded before dispatch; implementations see the padded x and no padding.
        input_maps["x"] = ModePadding(mode, spatial_axes, in_size, pad_lo, pad_hi)
        params.update(pad_lo=(0,) * d, pad_hi=(0,) * d,
                      in_size=tuple(n + low + high for n, low, high in zip(in_size, pad_lo, pad_hi)))
    call = make_call("conv", named, params, family=family, device=device, dtype=dtype, layout=lay.layout,
                     input_maps=input_maps)
    return Prepared(call, _CONV_FIELDS, named)


# --------------------------------------------------------------------------- transposed convolution


def _transposed_sizes(
    in_size: tuple[int, ...],
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    output_padding: tuple[int, ...],
    dilation: tuple[int, ...],
    x_shape: tuple[int, ...],
) -> tuple[int, ...]:
    """Per axis ``(L − 1)·stride − 2·padding + dilation·(k − 1) + output_padding + 1``, checked."""
    out = []
    for i, length in enumerate(in_size):
        if output_padding[i] >= max(stride[i], dilation[i]):
            raise ValueError(
                f"output_padding must be smaller than stride or dilation on every spatial axis (as in PyTorch), "
                f"got output_padding={output_padding}, stride={stride}, dilation={dilation}"
            )
        size = (length - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + output_padding[i] + 1
        if size < 1:
            raise ValueError(
                f"padding={padding} leaves no output on spatial axis {i} of the transposed convolution "
                f"(x has shape {x_shape}, kernel size {kernel[i]}, stride {stride[i]}: size {size}); pad less"
            )
        out.append(size)
    return tuple(out)


@public_op(grad_fields=_CONV_FIELDS)
def conv_transpose(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    stride: IntOrTuple = 1,
    padding: IntOrTuple = 0,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    dilation: IntOrTuple = 1,
    activation: ActivationLike = "identity",
    channel_axis: int = 1,
) -> Any:
    """Transposed convolution over 1 to 3 spatial axes with fused bias and activation
    (PyTorch's ``conv_transpose1d/2d/3d`` followed by the activation): the adjoint of
    :func:`conv` with the same weight and geometry, as used to upsample in decoders,
    U-Nets and GAN generators.

    Every input position scatters its channels through the kernel into the output.  With
    ``G = groups``, input channel ``c`` in group ``g = c // (C/G)``:

        y[n, g·O/G + o, p·stride + t·dilation − padding] += Σ_c weight[c, o, t] · x[n, c, p]
        y = act(y + bias)

    for every input position ``p`` and kernel offset ``t`` (per spatial axis; positions
    outside ``[0, L_out)`` are dropped).  Equivalently, ``y`` is the input gradient of
    ``conv(z, weight, stride=stride, padding=padding, dilation=dilation, groups=groups)``
    for a ``z`` of ``y``'s shape, at the cotangent ``x``.

    Args:
        x: ``(N, C, *spatial)``, or ``(N, *spatial, C)`` with ``channel_axis=-1``,
            or either without ``N`` (unbatched: ``x.ndim == weight.ndim - 1``).
        weight: ``(C, O/groups, *kernel)`` with 1 to 3 kernel axes — PyTorch's layout for
            transposed convolutions (input channels first), whatever the data layout.
        bias: ``(O,)`` or ``None``.
        stride: int or per-axis tuple, >= 1: the upsampling factor.
        padding: int or per-axis tuple, >= 0: ``dilation·(k − 1) − padding`` zero padding
            on each side of the (dilated) input, as in PyTorch — it crops the output.
        output_padding: int or per-axis tuple, >= 0 and smaller than ``stride`` or
            ``dilation``: extra size on the high side of each output axis (which of the
            ``stride`` input sizes that a strided :func:`conv` maps to the same output size
            this one inverts).
        groups: the input and output channels split into ``groups`` independent
            transposed convolutions.
        dilation: int or per-axis tuple, >= 1: spacing of the kernel taps.
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`ACTIVATIONS`).
        channel_axis: 1 (channels first) or -1 (channels last), counted in the batched
            layout; the weight layout does not change.

    Returns:
        ``y`` with ``x``'s layout and dtype (batched iff ``x`` is), ``O = groups ·
        weight.shape[1]`` channels and each spatial size
        ``(L − 1)·stride − 2·padding + dilation·(k − 1) + output_padding + 1``.
        float16/bfloat16 ``x`` may come with float32 ``weight``/``bias``: the products
        accumulate in float32.

    Raises:
        ValueError: mismatched ranks, ``x`` channels that differ from
            ``weight.shape[0]`` or that ``groups`` does not divide, a bias that is not
            ``(O,)``, non-positive stride or dilation, negative padding, an
            ``output_padding`` not below ``stride`` or ``dilation``, padding that leaves no
            output, an unknown activation, an unsupported ``channel_axis``.
        TypeError: non-arrays, non-floating dtypes, dtype mixes other than half data with
            float32 parameters, arrays of different libraries, non-int geometry arguments.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``.  With ``g = dy · act'``: dx is the plain
        convolution of ``g`` with ``weight`` (same stride, padding, dilation, groups),
        dweight the correlation of ``g`` with ``x`` (the weight gradient of that convolution
        taken the other way round), dbias ``Σ g``.  The backward keeps ``x``, ``weight`` and,
        as :func:`conv` does, ``y`` or the pre-activation when the activation needs one.

    Backends:
        ``reference`` (every array library, device and floating dtype); ``numba`` (CPU
        kernels for NumPy arrays and CPU torch tensors: the column products and scatter of
        :func:`conv`'s input gradient, then a fused bias and activation pass); GPU kernels
        (``cupy``, ``numba_cuda``) where ``pnn.capabilities()`` lists them; ``aten`` (torch
        tensors: PyTorch's own transposed convolution, then the activation).  Implementations
        receive the geometry of the convolution this op transposes — ``in_size`` is this
        op's *output* size, ``out_size`` its input size, ``pad_lo``/``pad_hi`` that
        convolution's padding — plus ``output_padding``.
    """
    named = {"x": x, "weight": weight, "bias": bias}
    _, family, device, dtype, mixed = check_layer_arrays(named, ("bias",))

    lay = _kernel_layout(x, weight, channel_axis, groups, "(in_channels, out_channels/groups, *kernel)",
                         "transposed convolution")
    d, groups, kernel, channels, x_channel_axis, spatial_axes = (
        lay.d, lay.groups, lay.kernel, lay.channels, lay.channel_axis, lay.spatial_axes)
    in_channels, group_out = int(weight.shape[0]), int(weight.shape[1])
    if channels != in_channels:
        raise ValueError(
            f"x has {channels} channels (axis {x_channel_axis} of shape {tuple(x.shape)}) but weight expects "
            f"weight.shape[0] = {in_channels} (a transposed convolution's weight is (in, out/groups, *kernel))"
        )
    if channels % groups:
        raise ValueError(f"x has {channels} channels, which groups={groups} does not divide")
    out_channels = groups * group_out
    check_shape(bias, "bias", (out_channels,), "one value per output channel, groups * weight.shape[1]")

    strides = per_axis(stride, d, "stride", 1)
    dil = per_axis(dilation, d, "dilation", 1)
    pads = per_axis(padding, d, "padding", 0)
    extra = per_axis(output_padding, d, "output_padding", 0)
    in_size = tuple(int(x.shape[a]) for a in spatial_axes)
    out_size = _transposed_sizes(in_size, kernel, strides, pads, extra, dil, tuple(x.shape))

    # The convolution this op transposes maps out_size to in_size with padding `pads` low; its
    # high padding is what makes its padded grid (L_in − 1)·stride + dilation·(k − 1) + 1 long,
    # or none when output_padding exceeds padding (the trailing outputs then receive nothing).
    pad_hi = tuple(max(p - e, 0) for p, e in zip(pads, extra))
    params = _geometry(lay, strides, dil, pads, pad_hi, out_size, in_size, activation, mixed)
    params["output_padding"] = extra
    call = make_call("conv_transpose", named, params, family=family, device=device, dtype=dtype,
                     layout=lay.layout)
    return Prepared(call, _CONV_FIELDS, named)


__all__ += ["conv_transpose"]
