"""The drop-in modules of ``portable_nn.torch``: ``torch.nn`` subclasses running our kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from ...api.activations import ActivationLike, parse_activation
from .functional import (
    batch_norm,
    conv,
    conv_transpose,
    dense,
    group_norm,
    gru,
    instance_norm,
    layer_norm,
    lstm,
    rms_norm,
    rnn,
)

# =========================================================================== modules


class _FusedRepr:
    """First base of the modules with a fused activation: ``torch.nn``'s ``extra_repr`` plus the
    activation and a channels-last layout where they are not the defaults."""

    #: The ``channel_axis`` the repr leaves out (1, channels first; the layer and RMS norms: None, trailing).
    _default_channel_axis: int | None = 1

    def extra_repr(self) -> str:
        text = super().extra_repr()  # type: ignore[misc]
        if not getattr(self, "activation", parse_activation("identity")).is_identity:
            text += f", activation={self.activation}"  # type: ignore[attr-defined]
        channel_axis = getattr(self, "channel_axis", self._default_channel_axis)
        return text + ("" if channel_axis == self._default_channel_axis else f", channel_axis={channel_axis}")


def _check_channel_axis(channel_axis: Any) -> int:
    if channel_axis not in (1, -1):
        raise ValueError(f"channel_axis must be 1 (channels first) or -1 (channels last), got {channel_axis!r}")
    return int(channel_axis)


def _normalised_axes(module: Any, input: Tensor) -> tuple[int, ...]:
    """The axes of ``input`` a layer or RMS norm module normalises: the trailing ``normalized_shape``
    axes, or those from ``channel_axis`` on; their sizes must be ``normalized_shape``.

    The last answer is kept on the module with what decided it (a module sees one rank, call after
    call): re-deriving it was ~3 µs of a ~280 µs LayerNorm(64) step on a Zen 3."""
    ndim = input.ndim
    kept = module.__dict__.get("_pnn_axes")
    if kept is not None and kept[0] == ndim and kept[1] is module.normalized_shape \
            and kept[2] == module.channel_axis and input.shape[kept[3]] == kept[1]:
        return kept[4]
    axes = _derived_axes(module, input)
    if axes:
        module.__dict__["_pnn_axes"] = (ndim, module.normalized_shape, module.channel_axis,
                                        slice(axes[0], axes[-1] + 1), axes)
    return axes


def _derived_axes(module: Any, input: Tensor) -> tuple[int, ...]:
    shape, k, channel_axis = tuple(module.normalized_shape), len(module.normalized_shape), module.channel_axis
    name = type(module).__name__
    if channel_axis is None:
        axes = tuple(range(input.ndim - k, input.ndim))
        expected = f"(*, {', '.join(map(str, shape))})"
    else:
        first = channel_axis + input.ndim if channel_axis < 0 else channel_axis
        axes = tuple(range(first, first + k))
        expected = f"({', '.join(['*'] * first + list(map(str, shape)))}, *)"
        if first < 0 or first + k > input.ndim:
            raise ValueError(f"{name}: expected input with shape {expected} (channel_axis={channel_axis}), "
                             f"got {tuple(input.shape)}")
    if input.ndim < k or tuple(input.shape[a] for a in axes) != shape:
        raise ValueError(f"{name}: expected input with shape {expected}, got {tuple(input.shape)}")
    return axes


def _check_norm_axis(channel_axis: Any) -> int | None:
    if channel_axis is not None and (isinstance(channel_axis, bool) or not isinstance(channel_axis, int)):
        raise TypeError(f"channel_axis must be None (the trailing axes) or an int, got {channel_axis!r}")
    return channel_axis


class LayerNorm(_FusedRepr, nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` running our fused layer-norm kernels.

    y = act((x − mean) / sqrt(var + eps) · weight + bias) over the trailing
    ``normalized_shape`` axes — or, with ``channel_axis``, over the axes from
    ``channel_axis`` on: ``LayerNorm(C, channel_axis=1)`` normalises the channels of
    ``(N, C, *spatial)`` data in place, without the permutes (timm's
    ``LayerNorm2d``, ConvNeXt's channels-first LayerNorm).  Constructor arguments,
    defaults, parameters (``weight`` ones, ``bias`` zeros) and state_dict keys are
    ``torch.nn``'s.

    Args:
        normalized_shape, eps, elementwise_affine, bias, device, dtype: as in
            ``torch.nn.LayerNorm``.
        activation: keyword-only; an activation fused into the kernel
            (see :mod:`portable_nn.api.activations`), ``"identity"`` by default.
        channel_axis: keyword-only; ``None`` (the trailing axes, PyTorch's) or the
            first normalised axis (``1``: the channels of channels-first data).
    """

    _default_channel_axis = None

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        activation: ActivationLike = "identity",
        channel_axis: int | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.activation = parse_activation(activation)
        self.channel_axis = _check_norm_axis(channel_axis)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` over its ``normalized_shape`` axes (trailing, or from ``channel_axis``)."""
        return layer_norm(input, self.weight, self.bias, axis=_normalised_axes(self, input), eps=self.eps,
                          activation=self.activation)


class RMSNorm(_FusedRepr, nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` running our fused RMS-norm kernels.

    y = act(x / sqrt(mean(x²) + eps) · weight) over the trailing ``normalized_shape``
    axes (or, with ``channel_axis``, those from ``channel_axis`` on, as in
    :class:`LayerNorm`); ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in
    PyTorch.  Constructor arguments, parameters and state_dict keys are ``torch.nn``'s;
    ``activation`` (``"identity"`` by default) and ``channel_axis`` are keyword-only.
    """

    _default_channel_axis = None

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device: Any = None, dtype: Any = None, *,
                 activation: ActivationLike = "identity", channel_axis: int | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.activation = parse_activation(activation)
        self.channel_axis = _check_norm_axis(channel_axis)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` over its ``normalized_shape`` axes (trailing, or from ``channel_axis``)."""
        axes = _normalised_axes(self, input)
        eps = torch.finfo(input.dtype).eps if self.eps is None else self.eps
        return rms_norm(input, self.weight, axis=axes, eps=eps, activation=self.activation)


class GroupNorm(_FusedRepr, nn.GroupNorm):
    """Drop-in ``torch.nn.GroupNorm`` running our fused group-norm kernels.

    Args:
        num_groups, num_channels, eps, affine, device, dtype, bias: as in ``torch.nn.GroupNorm``
            (``bias=False``: a scale without a shift).
        activation: keyword-only fused activation (default ``"identity"``).
        channel_axis: keyword-only; 1 for ``(N, C, *)`` data (PyTorch's), -1 for
            channels-last ``(N, *, C)`` data.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        activation: ActivationLike = "identity",
        channel_axis: int = 1,
    ) -> None:
        # ``bias=`` is recent in torch.nn's norms: pass it only when it changes something.
        super().__init__(num_groups, num_channels, eps, affine, device, dtype, **({} if bias else {"bias": False}))
        self.activation = parse_activation(activation)
        self.channel_axis = _check_channel_axis(channel_axis)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` ``(N, C, *)`` (or ``(N, *, C)``) per sample and channel group."""
        return group_norm(input, self.num_groups, self.weight, self.bias, eps=self.eps,
                          channel_axis=self.channel_axis, activation=self.activation)


def momentum_factor(module: Any) -> float:
    """The weight of this batch's statistics in the running ones, counting the batch in
    ``num_batches_tracked`` when training (``torch.nn``'s rule: ``momentum``, or ``1 / batches``
    for a cumulative average when it is ``None``)."""
    factor = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    return factor


def _batch_norm_forward(module: Any, input: Tensor) -> Tensor:
    """``torch.nn``'s batch-norm module semantics (momentum, cumulative averages, eval) on our kernel."""
    module._check_input_dim(input)
    factor = momentum_factor(module)
    use_batch = module.training or (module.running_mean is None and module.running_var is None)
    keep = not module.training or module.track_running_stats
    return batch_norm(
        input, weight=module.weight, bias=module.bias,
        running_mean=module.running_mean if keep else None, running_var=module.running_var if keep else None,
        training=use_batch, momentum=factor, eps=module.eps, channel_axis=module.channel_axis,
        activation=module.activation,
    )


class _BatchNormMixin(_FusedRepr):
    """What our batch-norm modules add to ``torch.nn``'s: the kernel, ``activation=``, ``channel_axis=``."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        activation: ActivationLike = "identity",
        channel_axis: int = 1,
    ) -> None:
        # ``bias=`` is recent in torch.nn's norms: pass it only when it changes something.
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,  # type: ignore
                         **extra)
        self.activation = parse_activation(activation)
        self.channel_axis = _check_channel_axis(channel_axis)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` per channel (see the class docstring)."""
        return _batch_norm_forward(self, input)


class BatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    """Drop-in ``torch.nn.BatchNorm1d`` (``(N, C)`` or ``(N, C, L)`` input) on our fused kernels.

    Training normalises with the batch statistics and updates ``running_mean``
    and ``running_var`` in place (momentum, or a cumulative average when
    ``momentum=None``, counted in ``num_batches_tracked``); evaluation uses the
    running statistics — ``torch.nn``'s rules, buffers, initialisation and
    state_dict keys.

    Args:
        num_features: the number of channels C.
        eps: added to the variance for stability.
        momentum: weight of the batch statistics in the running averages; ``None`` for a
            cumulative average.
        affine: whether to learn ``weight`` (ones) and ``bias`` (zeros).
        track_running_stats: whether to keep ``running_mean``, ``running_var`` and
            ``num_batches_tracked`` (evaluation then uses them).
        device: where the parameters and buffers are created.
        dtype: their dtype.
        bias: keyword-only; ``False`` drops the learned shift (newer ``torch.nn`` option).
        activation: keyword-only fused activation (default ``"identity"``), e.g.
            ``"relu"`` for batch norm + ReLU in one kernel.
        channel_axis: keyword-only; 1 (PyTorch's layout) or -1 for channels-last data.

    The first eight are ``torch.nn.BatchNorm1d``'s, with its defaults.
    """


class BatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    """Drop-in ``torch.nn.BatchNorm2d`` (``(N, C, H, W)`` input) on our fused kernels.

    Same semantics, buffers and options as :class:`BatchNorm1d`.
    """


class BatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    """Drop-in ``torch.nn.BatchNorm3d`` (``(N, C, D, H, W)`` input) on our fused kernels.

    Same semantics, buffers and options as :class:`BatchNorm1d`.
    """


class _InstanceNormMixin(_FusedRepr):
    """What our instance-norm modules add to ``torch.nn``'s: the kernel, ``activation=``, ``channel_axis=``."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        activation: ActivationLike = "identity",
        channel_axis: int = 1,
    ) -> None:
        # ``bias=`` is recent in torch.nn's norms: pass it only when it changes something.
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,  # type: ignore
                         **extra)
        self.activation = parse_activation(activation)
        self.channel_axis = _check_channel_axis(channel_axis)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise each sample's channels over their spatial positions (unbatched input too)."""
        self._check_input_dim(input)  # type: ignore[attr-defined]
        unbatched = input.dim() == self._get_no_batch_dim()  # type: ignore[attr-defined]
        x = input.unsqueeze(0) if unbatched else input
        channels = x.shape[self.channel_axis]
        if channels != self.num_features:  # type: ignore[attr-defined]
            # PyTorch's rule: the parameters' size must match; without them num_features is unused.
            if self.affine or self.track_running_stats:  # type: ignore[attr-defined]
                raise ValueError(
                    f"expected input's size at the channel axis to match num_features "
                    f"({self.num_features}), but got: {channels}."  # type: ignore[attr-defined]
                )
        momentum = 0.0 if self.momentum is None else self.momentum  # type: ignore[attr-defined]
        y = instance_norm(
            x, weight=self.weight, bias=self.bias,  # type: ignore[attr-defined]
            running_mean=self.running_mean, running_var=self.running_var,  # type: ignore[attr-defined]
            use_input_stats=self.training or not self.track_running_stats,  # type: ignore[attr-defined]
            momentum=momentum, eps=self.eps, channel_axis=self.channel_axis,  # type: ignore[attr-defined]
            activation=self.activation,
        )
        return y.squeeze(0) if unbatched else y


class InstanceNorm1d(_InstanceNormMixin, nn.InstanceNorm1d):
    """Drop-in ``torch.nn.InstanceNorm1d`` (``(N, C, L)`` or unbatched ``(C, L)``) on our fused kernels.

    Each sample's channel is normalised over its positions.  With
    ``track_running_stats=True`` training updates the running statistics in
    place (``momentum=None`` leaves them unchanged, as in PyTorch) and
    evaluation normalises with them.  Defaults ``affine=False``,
    ``track_running_stats=False`` as in ``torch.nn``.

    Args:
        num_features: the number of channels C.
        eps: added to the variance for stability.
        momentum: weight of the batch statistics in the running averages.
        affine: whether to learn a per-channel ``weight`` and ``bias``.
        track_running_stats: whether to keep running statistics (evaluation then uses them).
        device: where the parameters and buffers are created.
        dtype: their dtype.
        bias: keyword-only; ``False`` drops the learned shift (newer ``torch.nn`` option).
        activation: keyword-only fused activation (default ``"identity"``).
        channel_axis: keyword-only; 1 (PyTorch's layout) or -1 for channels-last data.

    The first eight are ``torch.nn.InstanceNorm1d``'s, with its defaults.
    """


class InstanceNorm2d(_InstanceNormMixin, nn.InstanceNorm2d):
    """Drop-in ``torch.nn.InstanceNorm2d`` (``(N, C, H, W)`` or ``(C, H, W)``); see :class:`InstanceNorm1d`."""


class InstanceNorm3d(_InstanceNormMixin, nn.InstanceNorm3d):
    """Drop-in ``torch.nn.InstanceNorm3d`` (``(N, C, D, H, W)`` or ``(C, D, H, W)``); see :class:`InstanceNorm1d`."""


class _ConvMixin(_FusedRepr):
    """What our convolution modules add to ``torch.nn``'s: the kernel, ``activation=``, ``channel_axis=``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: str | int | tuple[int, ...] = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Any = None,
        *,
        activation: ActivationLike = "identity",
        channel_axis: int = 1,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,  # type: ignore
                         groups, bias, padding_mode, device, dtype)
        self.activation = parse_activation(activation)
        self.channel_axis = _check_channel_axis(channel_axis)

    def forward(self, input: Tensor) -> Tensor:
        """Convolve ``input`` (batched or not) with the fused bias and activation."""
        # The padding mode goes to the op, which pads in either layout (torch.nn pads with F.pad first).
        return conv(input, self.weight, self.bias, stride=self.stride, padding=self.padding,  # type: ignore
                    padding_mode=self.padding_mode, dilation=self.dilation,  # type: ignore[attr-defined]
                    groups=self.groups, activation=self.activation,  # type: ignore[attr-defined]
                    channel_axis=self.channel_axis)


class Conv1d(_ConvMixin, nn.Conv1d):
    """Drop-in ``torch.nn.Conv1d`` with the bias and an optional activation fused into our kernel.

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output.
        kernel_size: the window, an int or one int per spatial axis.
        stride: step of the window.
        padding: zeros added on both sides of each spatial axis, or ``"same"`` or ``"valid"``.
        dilation: spacing between the window's taps.
        groups: channel groups convolved separately.
        bias: whether to learn a bias, added inside the kernel.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"``
            (see :func:`portable_nn.conv`), in either layout.
        device: where the parameters are created.
        dtype: their dtype.
        activation: keyword-only fused activation (default ``"identity"``).
        channel_axis: keyword-only; 1 (``(N, C, L)``, PyTorch's) or -1 for
            channels-last ``(N, L, C)`` data.

    All but the last two are ``torch.nn.Conv1d``'s, with its defaults.

    Weight ``(out_channels, in_channels/groups, *kernel_size)``, initialisation
    and state_dict keys are ``torch.nn``'s.
    """


class Conv2d(_ConvMixin, nn.Conv2d):
    """Drop-in ``torch.nn.Conv2d`` with fused bias and activation; see :class:`Conv1d` for the options."""


class Conv3d(_ConvMixin, nn.Conv3d):
    """Drop-in ``torch.nn.Conv3d`` with fused bias and activation; see :class:`Conv1d` for the options."""


class Linear(_FusedRepr, nn.Linear):
    """Drop-in ``torch.nn.Linear``: y = act(x · weightᵀ + bias) in one fused kernel.

    Args:
        in_features, out_features, bias, device, dtype: as in ``torch.nn.Linear``.
        activation: keyword-only fused activation (default ``"identity"``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        activation: ActivationLike = "identity",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = parse_activation(activation)

    def forward(self, input: Tensor) -> Tensor:
        """``(*, in_features)`` → ``(*, out_features)``."""
        return dense(input, self.weight, self.bias, activation=self.activation)


# --------------------------------------------------------------------------- recurrent modules


def _packed_output(out: Tensor, packed: PackedSequence, batch_first: bool) -> PackedSequence:
    """A padded output in the caller's batch order → a PackedSequence laid out like ``packed``."""
    time_major = out.transpose(0, 1) if batch_first else out
    n = time_major.shape[1]
    order = packed.sorted_indices
    if order is not None:
        time_major = time_major.index_select(1, order.to(time_major.device))
    sizes = packed.batch_sizes
    valid = torch.arange(n)[None, :] < sizes[:, None]
    data = time_major[: sizes.shape[0]][valid.to(time_major.device)]
    return PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)


class _Recurrent(nn.RNNBase):
    """Shared forward of our RNN/LSTM/GRU modules (``torch.nn.RNNBase`` keeps the parameters).

    Subclassing ``RNNBase`` rather than ``torch.nn.LSTM`` keeps ``torch.compile``
    tracing the module: Dynamo refuses the ``torch.nn.RNN``/``GRU``/``LSTM``
    classes themselves.
    """

    _has_cell = False

    def _params(self) -> list[tuple[Any, ...]]:
        """pnn's list of ``(w_ih, w_hh, b_ih, b_hh[, w_hr])`` per layer and direction, from the registered
        parameters (``torch.nn``'s ``_flat_weights`` order: ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``)."""
        names = self._flat_weights_names
        projected = bool(getattr(self, "proj_size", 0))
        per = (4 if self.bias else 2) + projected
        params = []
        for k in range(len(names) // per):
            entry = [getattr(self, name) for name in names[k * per:(k + 1) * per]]
            w_hr = [entry.pop()] if projected else []
            params.append((*entry, *([] if self.bias else [None, None]), *w_hr))
        return params

    def _sequence(self, x: Tensor, params: list[tuple[Any, ...]], h0: Any, c0: Any, lengths: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def _check_input_dtype(self, x: Tensor) -> None:
        """torch.nn's ValueError for an input whose dtype the weights don't take (float16/bfloat16
        input with float32 weights, portable_nn's mixed precision, is allowed)."""
        w = getattr(self, self._flat_weights_names[0])
        if x.dtype == w.dtype or (x.dtype in (torch.float16, torch.bfloat16) and w.dtype == torch.float32):
            return
        raise ValueError(
            f"{type(self).__name__} input dtype {x.dtype} does not match weight dtype {w.dtype}. "
            f"Convert input: input.to({w.dtype}), or convert weight: module.to({x.dtype})"
        )

    def _run(self, x: Tensor, h0: Tensor | None, c0: Tensor | None, lengths: Any) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Every layer in one call, or layer by layer with dropout between them when training."""
        params = self._params()
        dirs = 2 if self.bidirectional else 1
        if not (self.training and self.dropout > 0 and self.num_layers > 1):
            return self._sequence(x, params, h0, c0, lengths)
        hs, cs = [], []
        for layer in range(self.num_layers):
            rows = slice(layer * dirs, (layer + 1) * dirs)
            x, states = self._sequence(
                x, params[rows], None if h0 is None else h0[rows], None if c0 is None else c0[rows], lengths)
            hs.append(states[0])
            if self._has_cell:
                cs.append(states[1])
            if layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        return x, (torch.cat(hs), torch.cat(cs)) if self._has_cell else (torch.cat(hs),)

    def forward(self, input: Tensor | PackedSequence, hx: Any = None, *, lengths: Any = None) -> tuple[Any, Any]:
        """Run the sequence(s) like ``torch.nn``'s module: ``(output, h_n)`` (LSTM: ``(output, (h_n, c_n))``).

        Args:
            input: ``(T, N, input_size)`` (``(N, T, ·)`` with ``batch_first``),
                unbatched ``(T, input_size)``, or a ``PackedSequence``.
            hx: initial state(s) ``(num_layers*D, N, H)`` (``(num_layers*D, H)``
                unbatched), a ``(h0, c0)`` pair for LSTM; ``None`` for zeros.
            lengths: keyword-only, for padded batched input: ``(N,)`` sequence
                lengths (ints or an integer tensor), as if packed — outputs past a
                sequence's end are zero and its state is taken at its last step.
        """
        packed = input if isinstance(input, PackedSequence) else None
        batch_dim = 0 if self.batch_first else 1
        if packed is not None:
            if lengths is not None:
                raise ValueError("lengths cannot be given with a PackedSequence input (it has its own)")
            x, packed_lengths = torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first=self.batch_first)
            lengths, batched = packed_lengths, True
        else:
            x = input
            if x.dim() not in (2, 3):
                raise ValueError(f"{type(self).__name__}: expected input to be 2D or 3D, got {x.dim()}D instead")
            batched = x.dim() == 3
            if not batched:
                if lengths is not None:
                    raise ValueError("lengths needs batched input")
                x = x.unsqueeze(batch_dim)
        self._check_input_dtype(x)
        states = (None, None) if hx is None else (tuple(hx) if self._has_cell else (hx, None))
        if not batched:
            for state in states:
                if state is not None and state.dim() != 2:
                    raise ValueError(f"for unbatched 2-D input, hx should also be 2-D but got {state.dim()}-D")
            states = tuple(None if s is None else s.unsqueeze(1) for s in states)
        out, final = self._run(x, states[0], states[1], lengths)
        if packed is not None:
            out = _packed_output(out, packed, self.batch_first)
        elif not batched:
            out = out.squeeze(batch_dim)
            final = tuple(s.squeeze(1) for s in final)
        return out, (final if self._has_cell else final[0])


class LSTM(_Recurrent):
    """Drop-in ``torch.nn.LSTM`` running our fused LSTM kernels (gate order i, f, g, o).

    Parameters ``weight_ih_l{k}[_reverse]``, ``weight_hh_l{k}[_reverse]``,
    ``bias_ih_l{k}[_reverse]``, ``bias_hh_l{k}[_reverse]`` (and ``weight_hr_l{k}[_reverse]``
    with ``proj_size``) with ``torch.nn``'s shapes, initialisation and state_dict keys.
    ``forward`` also accepts ``PackedSequence`` input and a ``lengths=`` keyword for padded
    batches.

    Args:
        input_size: features of each input step.
        hidden_size: features of the hidden and cell states.
        num_layers: stacked layers.
        bias: whether the layers have ``bias_ih`` and ``bias_hh``.
        batch_first: whether input and output are ``(N, T, ·)`` rather than ``(T, N, ·)``.
        dropout: dropout between layers in training, through
            ``torch.nn.functional.dropout``.
        bidirectional: whether each layer also runs backwards in time.
        proj_size: if > 0 (and < hidden_size), each step's hidden state is projected to
            this size (``h_t = (o ⊙ tanh(c_t))·W_hrᵀ``), as in ``torch.nn.LSTM``; every
            backend runs the projections.
        device: where the parameters are created.
        dtype: their dtype.

    These are ``torch.nn.LSTM``'s arguments, with its defaults.
    """

    _has_cell = True

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, device, dtype)

    def _sequence(self, x: Tensor, params: list[tuple[Any, ...]], h0: Any, c0: Any, lengths: Any) -> tuple[Any, Any]:
        out, (h_n, c_n) = lstm(x, params, h0, c0, batch_first=self.batch_first, bidirectional=self.bidirectional,
                               lengths=lengths)
        return out, (h_n, c_n)


class GRU(_Recurrent):
    """Drop-in ``torch.nn.GRU`` running our fused GRU kernels (gate order r, z, n).

    Parameters, initialisation and state_dict keys are ``torch.nn.GRU``'s;
    ``forward`` also accepts ``PackedSequence`` input and ``lengths=``.

    Args:
        input_size: features of each input step.
        hidden_size: features of the hidden state.
        num_layers: stacked layers.
        bias: whether the layers have ``bias_ih`` and ``bias_hh``.
        batch_first: whether input and output are ``(N, T, ·)`` rather than ``(T, N, ·)``.
        dropout: dropout between layers in training.
        bidirectional: whether each layer also runs backwards in time.
        device: where the parameters are created.
        dtype: their dtype.
        reset_after: keyword-only; ``True`` (default) is PyTorch's (and cuDNN's)
            form n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)); ``False`` the
            original form n = tanh(W_in x + b_in + W_hn (r ⊙ h) + b_hn), which
            ``torch.nn.GRU`` does not have (same parameters, other results).
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        reset_after: bool = True,
    ) -> None:
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype)
        if not isinstance(reset_after, bool):
            raise TypeError(f"reset_after must be a bool, got {type(reset_after).__name__}")
        self.reset_after = reset_after

    def _sequence(self, x: Tensor, params: list[tuple[Any, ...]], h0: Any, c0: Any, lengths: Any) -> tuple[Any, Any]:
        out, h_n = gru(x, params, h0, reset_after=self.reset_after, batch_first=self.batch_first,
                       bidirectional=self.bidirectional, lengths=lengths)
        return out, (h_n,)

    def extra_repr(self) -> str:
        """``torch.nn``'s description plus ``reset_after=False`` for the original GRU form."""
        return super().extra_repr() + ("" if self.reset_after else ", reset_after=False")


class RNN(_Recurrent):
    """Drop-in ``torch.nn.RNN`` (Elman, ``tanh`` or ``relu``) running our fused kernels.

    Parameters, initialisation and state_dict keys are ``torch.nn.RNN``'s;
    ``forward`` also accepts ``PackedSequence`` input and ``lengths=``.

    Args:
        input_size: features of each input step.
        hidden_size: features of the hidden state.
        num_layers: stacked layers.
        nonlinearity: ``"tanh"`` or ``"relu"``.
        bias: whether the layers have ``bias_ih`` and ``bias_hh``.
        batch_first: whether input and output are ``(N, T, ·)`` rather than ``(T, N, ·)``.
        dropout: dropout between layers in training.
        bidirectional: whether each layer also runs backwards in time.
        device: where the parameters are created.
        dtype: their dtype.

    These are ``torch.nn.RNN``'s arguments, with its defaults.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or 'relu'.")
        mode = "RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU"
        super().__init__(mode, input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype)
        self.nonlinearity = nonlinearity

    def _sequence(self, x: Tensor, params: list[tuple[Any, ...]], h0: Any, c0: Any, lengths: Any) -> tuple[Any, Any]:
        out, h_n = rnn(x, params, h0, activation=self.nonlinearity, batch_first=self.batch_first,
                       bidirectional=self.bidirectional, lengths=lengths)
        return out, (h_n,)


class _ConvTransposeMixin(_FusedRepr):
    """What our transposed convolution modules add to ``torch.nn``'s: the kernel, ``activation=``,
    ``channel_axis=``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int, ...] = 1,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Any = None,
        *,
        activation: ActivationLike = "identity",
        channel_axis: int = 1,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding,  # type: ignore
                         groups, bias, dilation, padding_mode, device, dtype)
        self.activation = parse_activation(activation)
        self.channel_axis = _check_channel_axis(channel_axis)

    def forward(self, input: Tensor, output_size: Sequence[int] | None = None) -> Tensor:
        """Transposed convolution of ``input`` (batched or not) with the fused bias and activation;
        ``output_size`` (optional, as in ``torch.nn``) picks the output padding that gives that size."""
        d = len(self.kernel_size)  # type: ignore[attr-defined]
        output_padding = self.output_padding  # type: ignore[attr-defined]
        if output_size is not None:
            # torch.nn's own rule, read on the channels-first view of the input.
            view = input.movedim(-1, 1 if input.ndim == d + 2 else 0) if self.channel_axis == -1 else input
            output_padding = self._output_padding(  # type: ignore[attr-defined]
                view, list(output_size), list(self.stride), list(self.padding),  # type: ignore[attr-defined]
                list(self.kernel_size), d, list(self.dilation))  # type: ignore[attr-defined]
        return conv_transpose(input, self.weight, self.bias, stride=self.stride,  # type: ignore[attr-defined]
                              padding=self.padding, output_padding=output_padding,  # type: ignore[attr-defined]
                              groups=self.groups, dilation=self.dilation,  # type: ignore[attr-defined]
                              activation=self.activation, channel_axis=self.channel_axis)


class ConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    """Drop-in ``torch.nn.ConvTranspose1d`` with the bias and an optional activation fused into our kernel.

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output.
        kernel_size: the window, an int or one int per spatial axis.
        stride: the upsampling step.
        padding: ``dilation·(kernel_size − 1) − padding`` zeros on each side of the input
            (it crops the output), as in ``torch.nn``.
        output_padding: extra size on the high side of each output axis.
        groups: channel groups handled separately.
        bias: whether to learn a bias, added inside the kernel.
        dilation: spacing between the window's taps.
        padding_mode: ``"zeros"`` only, as in ``torch.nn``.
        device: where the parameters are created.
        dtype: their dtype.
        activation: keyword-only fused activation (default ``"identity"``).
        channel_axis: keyword-only; 1 (``(N, C, L)``, PyTorch's) or -1 for channels-last
            ``(N, L, C)`` data.

    All but the last two are ``torch.nn.ConvTranspose1d``'s, with its defaults; ``forward``
    takes ``output_size=`` as ``torch.nn``'s does.  Weight ``(in_channels,
    out_channels/groups, *kernel_size)``, initialisation and state_dict keys are ``torch.nn``'s.
    """


class ConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    """Drop-in ``torch.nn.ConvTranspose2d`` with fused bias and activation; see :class:`ConvTranspose1d`."""


class ConvTranspose3d(_ConvTransposeMixin, nn.ConvTranspose3d):
    """Drop-in ``torch.nn.ConvTranspose3d`` with fused bias and activation; see :class:`ConvTranspose1d`."""
