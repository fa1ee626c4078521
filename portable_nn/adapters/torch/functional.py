"""The functions of ``portable_nn.torch``: tensors in and out, differentiable by autograd."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from ...api.activations import ActivationLike
from ._defs import _per_axis, _store_stats
from ._ops import _OPS, _act, _axes, _call, _eager, _ints, _wrt_mask

# =========================================================================== public functions


def layer_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    axis: int | tuple[int, ...] = -1,
    eps: float = 1e-5,
    activation: ActivationLike = "identity",
) -> Tensor:
    """Differentiable :func:`portable_nn.layer_norm` on tensors (custom op ``portable_nn::layer_norm``).

    y = act((x − mean) / sqrt(var + eps) · weight + bias) over the trailing
    ``axis``; arguments and returns as for :func:`portable_nn.layer_norm`.
    Gradients flow to ``x``, ``weight`` and ``bias`` through our fused backward.
    """
    return _call("layer_norm", x, weight, bias, _axes(axis), float(eps), *_act(activation))[0]


def rms_norm(
    x: Tensor, weight: Tensor | None = None, *, axis: int | tuple[int, ...] = -1, eps: float = 1e-6
) -> Tensor:
    """Differentiable :func:`portable_nn.rms_norm`: y = x / sqrt(mean(x²) + eps) · weight.

    Arguments and returns as for :func:`portable_nn.rms_norm`; gradients flow to
    ``x`` and ``weight`` (custom op ``portable_nn::rms_norm``).
    """
    return _call("rms_norm", x, weight, _axes(axis), float(eps))[0]


def group_norm(
    x: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
) -> Tensor:
    """Differentiable :func:`portable_nn.group_norm` (custom op ``portable_nn::group_norm``).

    Each sample's channel group is normalised over its channels and spatial
    positions, then y = act(x̂ · weight_c + bias_c).  Arguments and returns as
    for :func:`portable_nn.group_norm`.
    """
    return _call("group_norm", x, num_groups, weight, bias, float(eps), channel_axis, *_act(activation))[0]


def _with_stats(
    name: str, flag: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, use_batch: bool, momentum: float, eps: float, channel_axis: int,
    activation: ActivationLike, return_stats: bool,
) -> Any:
    """Batch or instance norm: in place through ``<name>_``, or functional with ``return_stats``."""
    if not isinstance(use_batch, bool):
        raise TypeError(f"{flag} must be a bool, got {type(use_batch).__name__}")
    args = (x, weight, bias, running_mean, running_var, use_batch, float(momentum), float(eps), channel_axis,
            *_act(activation))
    if not return_stats:
        if not _eager(_OPS[name], args):
            return getattr(torch.ops.portable_nn, f"{name}_")(*args, _wrt_mask(_OPS[name], args))
        # As the in-place op's composite implementation: the functional op, then the copy.
        y, mean, var = _call(name, *args)
        _store_stats(use_batch, running_mean, running_var, mean, var)
        return y
    y, mean, var = _call(name, *args)
    if not (use_batch and running_mean is not None):
        return y, running_mean, running_var
    return y, mean, var


def batch_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
    return_stats: bool = False,
) -> Any:
    """Differentiable :func:`portable_nn.batch_norm` (custom op ``portable_nn::batch_norm``).

    y = act((x − mean_c) / sqrt(var_c + eps) · weight_c + bias_c) with batch
    statistics when ``training`` (updating the running ones with
    r ← (1 − momentum)·r + momentum·s, unbiased variance), else the running
    statistics.  Arguments and returns as for :func:`portable_nn.batch_norm`:
    the running statistics are updated in place unless ``return_stats=True``,
    which returns ``(y, new_running_mean, new_running_var)`` instead.
    Gradients flow to ``x``, ``weight`` and ``bias``.
    """
    return _with_stats("batch_norm", "training", x, weight, bias, running_mean, running_var, training,
                       momentum, eps, channel_axis, activation, return_stats)


def instance_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
    return_stats: bool = False,
) -> Any:
    """Differentiable :func:`portable_nn.instance_norm` (custom op ``portable_nn::instance_norm``).

    Each sample's channel is normalised over its spatial positions (or with the
    running statistics when ``use_input_stats=False``), then scaled, shifted and
    activated.  Running statistics update in place unless ``return_stats=True``.
    Arguments and returns as for :func:`portable_nn.instance_norm`.
    """
    return _with_stats("instance_norm", "use_input_stats", x, weight, bias, running_mean, running_var,
                       use_input_stats, momentum, eps, channel_axis, activation, return_stats)


def moments(
    x: Tensor, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False, correction: float = 0
) -> tuple[Tensor, Tensor]:
    """Differentiable :func:`portable_nn.moments`: ``(mean, var)`` of ``x`` over ``axis``.

    Computed stably (shifted sums); ``correction=1`` gives the unbiased variance.
    Gradients of both outputs flow to ``x`` (custom op ``portable_nn::moments``).
    """
    axes = None if axis is None else _axes(axis)
    mean, var = _call("moments", x, axes, bool(keepdims), float(correction))
    return mean, var


def dense(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activation: ActivationLike = "identity") -> Tensor:
    """Differentiable :func:`portable_nn.dense`: y = act(x · weightᵀ + bias) (``F.linear`` + activation).

    ``weight`` is ``(out_features, in_features)``; ``x`` has any leading shape.
    Custom op ``portable_nn::dense``; the bias gradient is reduced in the same
    pass as the activation derivative.
    """
    return _call("dense", x, weight, bias, *_act(activation))[0]


def _conv_padding_args(padding: Any, d: int) -> tuple[list[int], str]:
    """``padding`` as the op's flat ``(low, high)`` list and mode (``"explicit"``, ``"same"``, ``"valid"``)."""
    if isinstance(padding, str):
        return [], padding
    if isinstance(padding, numbers.Integral) and not isinstance(padding, bool):
        return [int(padding)] * (2 * d), "explicit"
    if not isinstance(padding, (list, tuple)):
        raise TypeError(f"padding must be an int, a tuple, 'same' or 'valid', got {padding!r}")
    flat: list[int] = []
    for entry in padding:
        pair = _ints(entry, "padding")
        if len(pair) not in (1, 2):
            raise ValueError(f"padding entries must be an int or a (low, high) pair, got {entry!r}")
        flat.extend(pair * 2 if len(pair) == 1 else pair)
    return flat, "explicit"


def conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    stride: int | tuple[int, ...] = 1,
    padding: int | str | tuple[Any, ...] = 0,
    dilation: int | tuple[int, ...] = 1,
    groups: int = 1,
    activation: ActivationLike = "identity",
    channel_axis: int = 1,
) -> Tensor:
    """Differentiable :func:`portable_nn.conv`: 1-D to 3-D convolution with fused bias and activation.

    Arguments and returns as for :func:`portable_nn.conv` (PyTorch's weight
    layout ``(O, C/groups, *k)``; padding an int, per-axis ints or
    ``(low, high)`` pairs, ``"same"`` or ``"valid"``; ``channel_axis=-1`` for
    channels-last data).  Custom op ``portable_nn::conv``.
    """
    pads, mode = _conv_padding_args(padding, weight.ndim - 2)
    return _call("conv", x, weight, bias, _ints(stride, "stride"), pads, mode, _ints(dilation, "dilation"),
                 groups, *_act(activation), channel_axis)[0]


def _pool_geometry(x: Tensor, window: Any, stride: Any, padding: Any, dilation: Any) -> tuple[list[int], ...]:
    """Window, stride, padding, dilation as per-axis lists (the number of axes from ``window``)."""
    win = _ints(window, "window")
    d = len(win) if isinstance(window, (list, tuple)) else x.ndim - 2
    win = _per_axis(win, d)
    result = [win]
    for name, value in (("stride", window if stride is None else stride), ("padding", padding),
                        ("dilation", dilation)):
        values = _per_axis(_ints(value, name), d)
        if len(values) != d:
            raise ValueError(f"{name} must be an int or a tuple of {d} ints (one per spatial axis), got {value!r}")
        result.append(values)
    return tuple(result)


def max_pool(
    x: Tensor,
    window: int | tuple[int, ...],
    *,
    stride: int | tuple[int, ...] | None = None,
    padding: int | tuple[int, ...] = 0,
    dilation: int | tuple[int, ...] = 1,
    ceil_mode: bool = False,
    channel_axis: int = 1,
) -> Tensor:
    """Differentiable :func:`portable_nn.max_pool` (PyTorch's ``max_pool1d/2d/3d``).

    Arguments and returns as for :func:`portable_nn.max_pool`; the gradient goes
    to the first maximum of each window.  Custom op ``portable_nn::max_pool``.
    """
    win, step, pad, dil = _pool_geometry(x, window, stride, padding, dilation)
    return _call("max_pool", x, win, step, pad, dil, bool(ceil_mode), channel_axis)[0]


def avg_pool(
    x: Tensor,
    window: int | tuple[int, ...],
    *,
    stride: int | tuple[int, ...] | None = None,
    padding: int | tuple[int, ...] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    channel_axis: int = 1,
) -> Tensor:
    """Differentiable :func:`portable_nn.avg_pool` (PyTorch's ``avg_pool1d/2d/3d``).

    Arguments and returns as for :func:`portable_nn.avg_pool`.  Custom op
    ``portable_nn::avg_pool``.
    """
    win, step, pad, _ = _pool_geometry(x, window, stride, padding, 1)
    return _call("avg_pool", x, win, step, pad, bool(ceil_mode), bool(count_include_pad), channel_axis)[0]


def log_softmax(x: Tensor, *, axis: int = -1) -> Tensor:
    """Differentiable :func:`portable_nn.log_softmax`: log(softmax(x)) along ``axis``, max-shifted.

    Custom op ``portable_nn::log_softmax``.
    """
    return _call("log_softmax", x, int(axis))[0]


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    axis: int = 1,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """Differentiable :func:`portable_nn.cross_entropy` with ``F.cross_entropy``'s semantics.

    Integer class targets or class probabilities (then differentiable too),
    class ``weight``, ``ignore_index``, ``label_smoothing`` and ``reduction`` as
    for :func:`portable_nn.cross_entropy`.  Custom op ``portable_nn::cross_entropy``.
    """
    return _call("cross_entropy", logits, target, weight, int(axis), int(ignore_index), float(label_smoothing),
                 str(reduction))[0]


def rnn_cell(
    x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None, b_hh: Tensor | None = None, *,
    activation: str = "tanh",
) -> Tensor:
    """Differentiable :func:`portable_nn.rnn_cell`: h' = act(x·w_ihᵀ + b_ih + h·w_hhᵀ + b_hh).

    ``activation`` is ``"tanh"`` or ``"relu"``.  Custom op ``portable_nn::rnn_cell``.
    """
    return _call("rnn_cell", x, h, w_ih, w_hh, b_ih, b_hh, str(activation))[0]


def lstm_cell(
    x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Differentiable :func:`portable_nn.lstm_cell` (gates i, f, g, o): returns ``(h', c')``.

    Custom op ``portable_nn::lstm_cell``.
    """
    h1, c1 = _call("lstm_cell", x, h, c, w_ih, w_hh, b_ih, b_hh)
    return h1, c1


def gru_cell(
    x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None, b_hh: Tensor | None = None, *,
    reset_after: bool = True,
) -> Tensor:
    """Differentiable :func:`portable_nn.gru_cell` (gates r, z, n).

    ``reset_after=True`` is PyTorch's form, ``False`` the original one.
    Custom op ``portable_nn::gru_cell``.
    """
    return _call("gru_cell", x, h, w_ih, w_hh, b_ih, b_hh, bool(reset_after))[0]


def _split_params(params: Any) -> tuple[list[Tensor], list[Tensor]]:
    """pnn's list of ``(w_ih, w_hh, b_ih, b_hh)`` → flat weights and biases.

    The op takes all biases or none (a tensor list cannot hold ``None``); a
    missing bias among present ones becomes a constant zero tensor.
    """
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 4
                                                         for p in params):
        raise TypeError("params must be a list of (w_ih, w_hh, b_ih, b_hh) tuples, one per layer and direction")
    weights = [w for p in params for w in (p[0], p[1])]
    bias_values = [b for p in params for b in (p[2], p[3])]
    if all(b is None for b in bias_values):
        return weights, []
    biases = []
    for k, b in enumerate(bias_values):
        if b is None:
            w_hh = params[k // 2][1]
            b = w_hh.new_zeros(w_hh.shape[0])
        biases.append(b)
    return weights, biases


def _lengths(lengths: Any) -> list[int] | None:
    if lengths is None:
        return None
    if isinstance(lengths, Tensor):
        if lengths.is_floating_point() or lengths.ndim != 1:
            raise TypeError("lengths must be a 1-D integer tensor or a sequence of ints")
        return [int(v) for v in lengths.tolist()]
    return _ints(list(lengths), "lengths")


def rnn(
    x: Tensor, params: Any, h0: Tensor | None = None, *, activation: str = "tanh", batch_first: bool = False,
    bidirectional: bool = False, lengths: Any = None,
) -> tuple[Tensor, Tensor]:
    """Differentiable :func:`portable_nn.rnn`: a stacked (bidirectional) Elman RNN over whole sequences.

    ``params`` is a list of ``(w_ih, w_hh, b_ih, b_hh)`` per layer and
    direction (PyTorch's order); ``lengths`` (ints or an integer tensor) gives
    variable sequence lengths.  Returns ``(outputs, h_n)``.  Gradients flow to
    ``x``, every parameter and ``h0``.  Custom op ``portable_nn::rnn``.
    """
    weights, biases = _split_params(params)
    out, h_n = _call("rnn", x, weights, biases, h0, str(activation), bool(batch_first), bool(bidirectional),
                     _lengths(lengths))
    return out, h_n


def lstm(
    x: Tensor, params: Any, h0: Tensor | None = None, c0: Tensor | None = None, *, batch_first: bool = False,
    bidirectional: bool = False, lengths: Any = None,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Differentiable :func:`portable_nn.lstm` over whole sequences: returns ``(outputs, (h_n, c_n))``.

    Arguments as for :func:`portable_nn.lstm`; gradients flow to ``x``, every
    parameter, ``h0`` and ``c0``.  Custom op ``portable_nn::lstm``.
    """
    weights, biases = _split_params(params)
    out, h_n, c_n = _call("lstm", x, weights, biases, h0, c0, bool(batch_first), bool(bidirectional),
                          _lengths(lengths))
    return out, (h_n, c_n)


def gru(
    x: Tensor, params: Any, h0: Tensor | None = None, *, reset_after: bool = True, batch_first: bool = False,
    bidirectional: bool = False, lengths: Any = None,
) -> tuple[Tensor, Tensor]:
    """Differentiable :func:`portable_nn.gru` over whole sequences: returns ``(outputs, h_n)``.

    ``reset_after=True`` is PyTorch's GRU, ``False`` the original form.
    Custom op ``portable_nn::gru``.
    """
    weights, biases = _split_params(params)
    out, h_n = _call("gru", x, weights, biases, h0, bool(reset_after), bool(batch_first), bool(bidirectional),
                     _lengths(lengths))
    return out, h_n


