"""The functions of ``portable_nn.jax``: JAX arrays in and out, differentiable by ``jax.grad``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...api.activations import ActivationLike
from ._ops import _is_jax_array, _is_tracer, _op, _require_return_stats, _stats_arrays

# --------------------------------------------------------------------------- norms


@_op("moments", ("x", "axis"))
def moments(
    x: Any, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False, correction: float = 0
) -> tuple[Any, Any]:
    """Mean and variance of ``x`` over ``axis`` — :func:`portable_nn.moments` for JAX.

    Returns ``(mean, var)``; differentiable in ``x``.  Under ``auto`` it runs the
    traced reference (XLA fuses it); a forced ``numba`` runs the CPU kernel
    through the host callback.
    """
    return {"x": x}, {"axis": axis, "keepdims": keepdims, "correction": correction}


@_op("batch_norm", ("x", "weight", "bias"))
def batch_norm(
    x: Any,
    weight: Any = None,
    bias: Any = None,
    *,
    running_mean: Any = None,
    running_var: Any = None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
    return_stats: bool = False,
) -> Any:
    """Batch normalisation with a fused activation — :func:`portable_nn.batch_norm` for JAX.

    Training with running statistics needs ``return_stats=True`` and returns
    ``(y, new_running_mean, new_running_var)``; the new statistics carry no
    gradient.  Gradients: ``x``, ``weight``, ``bias``.
    """
    _require_return_stats("batch_norm", running_mean, training, return_stats)
    arrays = {"x": x, "weight": weight, "bias": bias, **_stats_arrays(running_mean, running_var)}
    static = {"training": training, "momentum": momentum, "eps": eps, "channel_axis": channel_axis,
              "activation": activation, "return_stats": return_stats}
    return arrays, static


@_op("layer_norm", ("x", "weight", "bias"))
def layer_norm(
    x: Any,
    weight: Any = None,
    bias: Any = None,
    *,
    axis: int | tuple[int, ...] = -1,
    eps: float = 1e-5,
    activation: ActivationLike = "identity",
) -> Any:
    """Layer normalisation with a fused activation — :func:`portable_nn.layer_norm` for JAX.

    Gradients: ``x``, ``weight``, ``bias``.
    """
    return {"x": x, "weight": weight, "bias": bias}, {"axis": axis, "eps": eps, "activation": activation}


@_op("group_norm", ("x", "num_groups", "weight", "bias"))
def group_norm(
    x: Any,
    num_groups: int,
    weight: Any = None,
    bias: Any = None,
    *,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
) -> Any:
    """Group normalisation with a fused activation — :func:`portable_nn.group_norm` for JAX.

    ``num_groups`` is static.  Gradients: ``x``, ``weight``, ``bias``.
    """
    static = {"num_groups": num_groups, "eps": eps, "channel_axis": channel_axis, "activation": activation}
    return {"x": x, "weight": weight, "bias": bias}, static


@_op("instance_norm", ("x", "weight", "bias"))
def instance_norm(
    x: Any,
    weight: Any = None,
    bias: Any = None,
    *,
    running_mean: Any = None,
    running_var: Any = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
    return_stats: bool = False,
) -> Any:
    """Instance normalisation with a fused activation — :func:`portable_nn.instance_norm` for JAX.

    Updating running statistics needs ``return_stats=True`` and returns
    ``(y, new_running_mean, new_running_var)``.  Gradients: ``x``, ``weight``, ``bias``.
    """
    _require_return_stats("instance_norm", running_mean, use_input_stats, return_stats)
    arrays = {"x": x, "weight": weight, "bias": bias, **_stats_arrays(running_mean, running_var)}
    static = {"use_input_stats": use_input_stats, "momentum": momentum, "eps": eps,
              "channel_axis": channel_axis, "activation": activation, "return_stats": return_stats}
    return arrays, static


@_op("rms_norm", ("x", "weight"))
def rms_norm(x: Any, weight: Any = None, *, axis: int | tuple[int, ...] = -1, eps: float = 1e-6) -> Any:
    """Root-mean-square normalisation — :func:`portable_nn.rms_norm` for JAX.

    Gradients: ``x``, ``weight``.
    """
    return {"x": x, "weight": weight}, {"axis": axis, "eps": eps}


# --------------------------------------------------------------------------- recurrent


_CELL_POSITIONAL = ("x", "h", "w_ih", "w_hh", "b_ih", "b_hh")


@_op("rnn_cell", _CELL_POSITIONAL)
def rnn_cell(
    x: Any, h: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None, *, activation: ActivationLike = "tanh"
) -> Any:
    """One Elman RNN step — :func:`portable_nn.rnn_cell` for JAX.

    Gradients: every array argument.
    """
    return {"x": x, "h": h, "w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh}, {"activation": activation}


@_op("lstm_cell", ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh"))
def lstm_cell(x: Any, h: Any, c: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None) -> tuple[Any, Any]:
    """One LSTM step, returning ``(h', c')`` — :func:`portable_nn.lstm_cell` for JAX.

    Gradients: every array argument.
    """
    return {"x": x, "h": h, "c": c, "w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh}, {}


@_op("gru_cell", _CELL_POSITIONAL)
def gru_cell(
    x: Any, h: Any, w_ih: Any, w_hh: Any, b_ih: Any = None, b_hh: Any = None, *, reset_after: bool = True
) -> Any:
    """One GRU step — :func:`portable_nn.gru_cell` for JAX.

    Gradients: every array argument.
    """
    return {"x": x, "h": h, "w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh}, {"reset_after": reset_after}


def _sequence_arrays(x: Any, params: Any, states: dict[str, Any], lengths: Any) -> tuple[dict, dict]:
    """Array and static parts of a sequence call; concrete ``lengths`` become static."""
    arrays = {"x": x, "params": _params_tree(params), **states}
    static: dict[str, Any] = {}
    if _is_tracer(lengths):
        arrays["lengths"] = lengths
    else:
        static["lengths"] = np.asarray(lengths) if _is_jax_array(lengths) else lengths
    return arrays, static


def _params_tree(params: Any) -> Any:
    """``params`` as a list of tuples (JAX pytrees); anything else is left for validation."""
    if isinstance(params, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in params):
        return [tuple(p) for p in params]
    return params


@_op("rnn", ("x", "params", "h0"))
def rnn(
    x: Any,
    params: Any,
    h0: Any = None,
    *,
    activation: ActivationLike = "tanh",
    batch_first: bool = False,
    bidirectional: bool = False,
    lengths: Any = None,
) -> tuple[Any, Any]:
    """A stacked (bidirectional) Elman RNN over sequences — :func:`portable_nn.rnn` for JAX.

    Returns ``(outputs, h_n)``.  Gradients: ``x``, ``params`` (a list of
    4-tuples like ``params``), ``h0``; ``lengths`` gets none.
    """
    arrays, static = _sequence_arrays(x, params, {"h0": h0}, lengths)
    static.update(activation=activation, batch_first=batch_first, bidirectional=bidirectional)
    return arrays, static


@_op("lstm", ("x", "params", "h0", "c0"))
def lstm(
    x: Any,
    params: Any,
    h0: Any = None,
    c0: Any = None,
    *,
    batch_first: bool = False,
    bidirectional: bool = False,
    lengths: Any = None,
) -> tuple[Any, tuple[Any, Any]]:
    """A stacked (bidirectional) LSTM over sequences — :func:`portable_nn.lstm` for JAX.

    Returns ``(outputs, (h_n, c_n))``.  Gradients: ``x``, ``params``, ``h0``,
    ``c0``; ``lengths`` gets none.
    """
    arrays, static = _sequence_arrays(x, params, {"h0": h0, "c0": c0}, lengths)
    static.update(batch_first=batch_first, bidirectional=bidirectional)
    return arrays, static


@_op("gru", ("x", "params", "h0"))
def gru(
    x: Any,
    params: Any,
    h0: Any = None,
    *,
    reset_after: bool = True,
    batch_first: bool = False,
    bidirectional: bool = False,
    lengths: Any = None,
) -> tuple[Any, Any]:
    """A stacked (bidirectional) GRU over sequences — :func:`portable_nn.gru` for JAX.

    Returns ``(outputs, h_n)``.  Gradients: ``x``, ``params``, ``h0``;
    ``lengths`` gets none.
    """
    arrays, static = _sequence_arrays(x, params, {"h0": h0}, lengths)
    static.update(reset_after=reset_after, batch_first=batch_first, bidirectional=bidirectional)
    return arrays, static


# --------------------------------------------------------------------------- conv, dense, pooling, losses


@_op("conv", ("x", "weight", "bias"))
def conv(
    x: Any,
    weight: Any,
    bias: Any = None,
    *,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    activation: ActivationLike = "identity",
    channel_axis: int = 1,
) -> Any:
    """1-D to 3-D convolution with fused bias and activation — :func:`portable_nn.conv` for JAX.

    Gradients: ``x``, ``weight``, ``bias``.
    """
    static = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups,
              "activation": activation, "channel_axis": channel_axis}
    return {"x": x, "weight": weight, "bias": bias}, static


@_op("dense", ("x", "weight", "bias"))
def dense(x: Any, weight: Any, bias: Any = None, *, activation: ActivationLike = "identity") -> Any:
    """act(x @ weightᵀ + bias) — :func:`portable_nn.dense` for JAX.

    Gradients: ``x``, ``weight``, ``bias``.
    """
    return {"x": x, "weight": weight, "bias": bias}, {"activation": activation}


@_op("max_pool", ("x", "window"))
def max_pool(
    x: Any,
    window: Any,
    *,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    channel_axis: int = 1,
) -> Any:
    """Max pooling — :func:`portable_nn.max_pool` for JAX (gradient to each window's first maximum)."""
    static = {"window": window, "stride": stride, "padding": padding, "dilation": dilation,
              "ceil_mode": ceil_mode, "channel_axis": channel_axis}
    return {"x": x}, static


@_op("avg_pool", ("x", "window"))
def avg_pool(
    x: Any,
    window: Any,
    *,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    channel_axis: int = 1,
) -> Any:
    """Average pooling — :func:`portable_nn.avg_pool` for JAX."""
    static = {"window": window, "stride": stride, "padding": padding, "ceil_mode": ceil_mode,
              "count_include_pad": count_include_pad, "channel_axis": channel_axis}
    return {"x": x}, static


@_op("log_softmax", ("x",))
def log_softmax(x: Any, *, axis: int = -1) -> Any:
    """Max-shifted log-softmax along ``axis`` — :func:`portable_nn.log_softmax` for JAX."""
    return {"x": x}, {"axis": axis}


@_op("cross_entropy", ("logits", "target"))
def cross_entropy(
    logits: Any,
    target: Any,
    *,
    axis: int = 1,
    weight: Any = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Any:
    """Softmax cross-entropy with PyTorch's semantics — :func:`portable_nn.cross_entropy` for JAX.

    Gradients: ``logits``, and ``target`` when it holds class probabilities;
    integer targets and the class ``weight`` get none.
    """
    static = {"axis": axis, "ignore_index": ignore_index, "label_smoothing": label_smoothing, "reduction": reduction}
    return {"logits": logits, "target": target, "weight": weight}, static



