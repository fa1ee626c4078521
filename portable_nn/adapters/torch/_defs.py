"""The op definitions: how each portable_nn op becomes a pair of torch custom ops (schemas,
argument conversion, fake implementations, gradient fields), registered at import."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ... import api as _api
from ._ops import NAMESPACE, _act_arg, _as_tuple, _empty_stat, _int_or_tuple, _like, _nest_flat, _OpDef, _register

# =========================================================================== norms


def _norm_fake(bound: dict[str, Any]) -> tuple[Tensor, ...]:
    return (_like(bound["x"]),)


def _layer_norm_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (b["x"], b["weight"], b["bias"]), {
        "axis": _int_or_tuple(b["axis"]), "eps": b["eps"], "activation": _act_arg(b["activation"], b["slope"])}


_register(_OpDef(
    "layer_norm", _api.layer_norm,
    "Tensor x, Tensor? weight, Tensor? bias, int[] axis, float eps, str activation, float slope",
    1, 1, ("x", "weight", "bias"), _layer_norm_call, _norm_fake,
))


def _rms_norm_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (b["x"], b["weight"]), {"axis": _int_or_tuple(b["axis"]), "eps": b["eps"]}


_register(_OpDef(
    "rms_norm", _api.rms_norm, "Tensor x, Tensor? weight, int[] axis, float eps",
    1, 1, ("x", "weight"), _rms_norm_call, _norm_fake,
))


def _group_norm_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (b["x"], b["num_groups"], b["weight"], b["bias"]), {
        "eps": b["eps"], "channel_axis": b["channel_axis"], "activation": _act_arg(b["activation"], b["slope"])}


_register(_OpDef(
    "group_norm", _api.group_norm,
    "Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps, int channel_axis, str activation, float slope",
    1, 1, ("x", "weight", "bias"), _group_norm_call, _norm_fake,
))

_STATS_ARGS = (
    "Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor? running_var, bool {flag}, "
    "float momentum, float eps, int channel_axis, str activation, float slope"
)


def _stats_updated(b: dict[str, Any], flag: str) -> bool:
    return bool(b[flag]) and b["running_mean"] is not None


def _stats_call(flag: str) -> Callable[[dict[str, Any], bool], tuple[tuple[Any, ...], dict[str, Any]]]:
    def call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {
            flag: b[flag], "momentum": b["momentum"], "eps": b["eps"], "channel_axis": b["channel_axis"],
            "activation": _act_arg(b["activation"], b["slope"]),
        }
        if recompute and b[flag]:
            # Batch statistics normalise: the running ones do not change y, and must not be updated twice.
            return (b["x"], b["weight"], b["bias"]), kwargs
        kwargs.update(running_mean=b["running_mean"], running_var=b["running_var"], return_stats=True)
        return (b["x"], b["weight"], b["bias"]), kwargs

    return call


def _stats_flatten(flag: str) -> Callable[[Any, dict[str, Any]], tuple[Any, ...]]:
    def flatten(result: Any, b: dict[str, Any]) -> tuple[Any, ...]:
        y, mean, var = result
        if not _stats_updated(b, flag):
            return y, _empty_stat(b["x"]), _empty_stat(b["x"])
        return y, mean, var

    return flatten


def _stats_fake(flag: str) -> Callable[[dict[str, Any]], tuple[Tensor, ...]]:
    def fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
        y = _like(b["x"])
        if not _stats_updated(b, flag):
            return y, _empty_stat(b["x"]), _empty_stat(b["x"])
        return y, _like(b["running_mean"]), _like(b["running_var"])

    return fake


for _name, _fn, _flag in (("batch_norm", _api.batch_norm, "training"),
                          ("instance_norm", _api.instance_norm, "use_input_stats")):
    _register(_OpDef(
        _name, _fn, _STATS_ARGS.format(flag=_flag), 3, 1, ("x", "weight", "bias"),
        _stats_call(_flag), _stats_fake(_flag), flatten=_stats_flatten(_flag),
        unsaved=lambda b, flag=_flag: ("running_mean", "running_var") if b[flag] else (),
    ))

# The in-place variants: PyTorch takes autograd formulas only on functional custom ops, so these are
# composite — under autograd and torch.compile they decompose into the functional op and a copy.
_inplace_lib = torch.library.Library(NAMESPACE, "FRAGMENT")


def _store_stats(use_batch: bool, running_mean: Tensor | None, running_var: Tensor | None, mean: Tensor,
                 var: Tensor) -> None:
    """The in-place update of the running statistics from the functional op's new ones (batch statistics only)."""
    if use_batch and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(mean)
            running_var.copy_(var)


def _define_inplace(name: str, flag: str) -> None:
    args = _STATS_ARGS.format(flag=flag).replace("Tensor? running_mean", "Tensor(a!)? running_mean")
    args = args.replace("Tensor? running_var", "Tensor(b!)? running_var")
    _inplace_lib.define(f"{name}_({args}, bool[]? wrt=None) -> Tensor")

    def inplace(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, use_batch: bool, *rest: Any) -> Tensor:
        functional = getattr(torch.ops.portable_nn, name)
        y, mean, var, _ = functional(x, weight, bias, running_mean, running_var, use_batch, *rest)
        _store_stats(use_batch, running_mean, running_var, mean, var)
        return y

    _inplace_lib.impl(f"{name}_", inplace, "CompositeImplicitAutograd")


_define_inplace("batch_norm", "training")
_define_inplace("instance_norm", "use_input_stats")


def _moments_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    axis = None if b["axis"] is None else _int_or_tuple(b["axis"])
    return (b["x"], axis), {"keepdims": b["keepdims"], "correction": b["correction"]}


def _moments_fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
    x = b["x"]
    axes = range(x.ndim) if b["axis"] is None else [a % x.ndim for a in b["axis"]]
    if b["keepdims"]:
        shape = [1 if i in axes else s for i, s in enumerate(x.shape)]
    else:
        shape = [s for i, s in enumerate(x.shape) if i not in axes]
    dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return x.new_empty(shape, dtype=dtype), x.new_empty(shape, dtype=dtype)


_register(_OpDef(
    "moments", _api.moments, "Tensor x, int[]? axis, bool keepdims, float correction",
    2, 2, ("x",), _moments_call, _moments_fake, flatten=_as_tuple, nest=_nest_flat,
))


# =========================================================================== dense, conv


def _dense_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (b["x"], b["weight"], b["bias"]), {"activation": _act_arg(b["activation"], b["slope"])}


def _dense_fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
    x = b["x"]
    return (x.new_empty((*x.shape[:-1], b["weight"].shape[0])),)


_register(_OpDef(
    "dense", _api.dense, "Tensor x, Tensor weight, Tensor? bias, str activation, float slope",
    1, 1, ("x", "weight", "bias"), _dense_call, _dense_fake,
))


def _conv_padding(b: dict[str, Any]) -> Any:
    if b["padding_mode"] in ("same", "valid"):
        return b["padding_mode"]
    pads = b["padding"]
    return tuple((pads[i], pads[i + 1]) for i in range(0, len(pads), 2))


def _conv_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (b["x"], b["weight"], b["bias"]), {
        "stride": _int_or_tuple(b["stride"]), "padding": _conv_padding(b), "dilation": _int_or_tuple(b["dilation"]),
        "groups": b["groups"], "activation": _act_arg(b["activation"], b["slope"]), "channel_axis": b["channel_axis"],
    }


def _spatial_axes(ndim: int, d: int, channel_axis: int) -> tuple[int, list[int]]:
    """(channel axis, spatial axes) of an ``ndim``-D input with ``d`` spatial axes, batched or not."""
    first = channel_axis == 1 or (channel_axis >= 0 and channel_axis != d + 1)
    if first:
        return ndim - d - 1, list(range(ndim - d, ndim))
    return ndim - 1, list(range(ndim - d - 1, ndim - 1))


def _per_axis(values: Sequence[int], d: int) -> list[int]:
    return list(values) * d if len(values) == 1 else list(values)


def _conv_fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
    x, w = b["x"], b["weight"]
    d = w.ndim - 2
    caxis, spatial = _spatial_axes(x.ndim, d, b["channel_axis"])
    stride, dilation = _per_axis(b["stride"], d), _per_axis(b["dilation"], d)
    mode = b["padding_mode"]
    pads = [(0, 0)] * d if mode == "valid" else _conv_padding(b) if mode != "same" else None
    shape = list(x.shape)
    shape[caxis] = w.shape[0]
    for i, axis in enumerate(spatial):
        if pads is None:
            continue
        lo, hi = pads[i]
        span = x.shape[axis] + lo + hi - dilation[i] * (w.shape[2 + i] - 1) - 1
        shape[axis] = span // stride[i] + 1
    return (x.new_empty(shape),)


_register(_OpDef(
    "conv", _api.conv,
    "Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, str padding_mode, int[] dilation, "
    "int groups, str activation, float slope, int channel_axis",
    1, 1, ("x", "weight", "bias"), _conv_call, _conv_fake,
))


# =========================================================================== pooling, losses


def _pool_call(kind: str) -> Callable[[dict[str, Any], bool], tuple[tuple[Any, ...], dict[str, Any]]]:
    def call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {"stride": tuple(b["stride"]), "padding": tuple(b["padding"]), "ceil_mode": b["ceil_mode"],
                  "channel_axis": b["channel_axis"]}
        if kind == "max_pool":
            kwargs["dilation"] = tuple(b["dilation"])
        else:
            kwargs["count_include_pad"] = b["count_include_pad"]
        return (b["x"], tuple(b["window"])), kwargs

    return call


def _pool_fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
    x, window = b["x"], b["window"]
    d = len(window)
    dilation = b.get("dilation") or [1] * d
    _, spatial = _spatial_axes(x.ndim, d, b["channel_axis"])
    shape = list(x.shape)
    for i, axis in enumerate(spatial):
        size, pad, step = x.shape[axis], b["padding"][i], b["stride"][i]
        span = size + 2 * pad - dilation[i] * (window[i] - 1) - 1
        if b["ceil_mode"]:
            out = -(-span // step) + 1
            if (out - 1) * step >= size + pad:  # the last window must start inside the input or left padding
                out -= 1
        else:
            out = span // step + 1
        shape[axis] = out
    return (x.new_empty(shape),)


_POOL_ARGS = "Tensor x, int[] window, int[] stride, int[] padding, "
_register(_OpDef(
    "max_pool", _api.max_pool, _POOL_ARGS + "int[] dilation, bool ceil_mode, int channel_axis",
    1, 1, ("x",), _pool_call("max_pool"), _pool_fake,
))
_register(_OpDef(
    "avg_pool", _api.avg_pool, _POOL_ARGS + "bool ceil_mode, bool count_include_pad, int channel_axis",
    1, 1, ("x",), _pool_call("avg_pool"), _pool_fake,
))


def _log_softmax_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (b["x"],), {"axis": b["axis"]}


_register(_OpDef(
    "log_softmax", _api.log_softmax, "Tensor x, int axis", 1, 1, ("x",), _log_softmax_call, _norm_fake,
))


def _cross_entropy_call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (b["logits"], b["target"]), {
        "axis": b["axis"], "weight": b["weight"], "ignore_index": b["ignore_index"],
        "label_smoothing": b["label_smoothing"], "reduction": b["reduction"]}


def _cross_entropy_fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
    logits = b["logits"]
    if b["reduction"] != "none" or logits.ndim == 1:
        return (logits.new_empty(()),)
    axis = b["axis"] % logits.ndim
    return (logits.new_empty([s for i, s in enumerate(logits.shape) if i != axis]),)


def _cross_entropy_fields(op: _OpDef, b: dict[str, Any]) -> frozenset[str]:
    # Integer class targets have no gradient; probability targets do.
    return frozenset({"logits", "target"} if b["target"].is_floating_point() else {"logits"})


_register(_OpDef(
    "cross_entropy", _api.cross_entropy,
    "Tensor logits, Tensor target, Tensor? weight, int axis, int ignore_index, float label_smoothing, str reduction",
    1, 1, ("logits", "target"), _cross_entropy_call, _cross_entropy_fake,
    field_of={"logits": "logits", "target": "target"}, available=_cross_entropy_fields,
))


# =========================================================================== recurrent


_CELL_TENSORS = "Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh"


def _cell_call(kind: str) -> Callable[[dict[str, Any], bool], tuple[tuple[Any, ...], dict[str, Any]]]:
    def call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        weights = (b["w_ih"], b["w_hh"], b["b_ih"], b["b_hh"])
        if kind == "lstm_cell":
            return (b["x"], b["h"], b["c"], *weights), {}
        if kind == "gru_cell":
            return (b["x"], b["h"], *weights), {"reset_after": b["reset_after"]}
        return (b["x"], b["h"], *weights), {"activation": b["activation"]}

    return call


def _cell_fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
    h = b["h"]
    return (_like(h), _like(h)) if "c" in b else (_like(h),)


_CELL_FIELDS = ("x", "h", "w_ih", "w_hh", "b_ih", "b_hh")
_register(_OpDef(
    "rnn_cell", _api.rnn_cell, f"Tensor x, Tensor h, {_CELL_TENSORS}, str activation",
    1, 1, _CELL_FIELDS, _cell_call("rnn_cell"), _cell_fake,
))
_register(_OpDef(
    "gru_cell", _api.gru_cell, f"Tensor x, Tensor h, {_CELL_TENSORS}, bool reset_after",
    1, 1, _CELL_FIELDS, _cell_call("gru_cell"), _cell_fake,
))
_register(_OpDef(
    "lstm_cell", _api.lstm_cell, f"Tensor x, Tensor h, Tensor c, {_CELL_TENSORS}",
    2, 2, ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh"), _cell_call("lstm_cell"), _cell_fake,
    flatten=_as_tuple, nest=_nest_flat,
))


def _params(weights: Sequence[Tensor], biases: Sequence[Tensor]) -> list[tuple[Any, ...]]:
    """Flat ``[w_ih, w_hh, ...]`` and ``[b_ih, b_hh, ...]`` (or ``[]``) → pnn's list of 4-tuples."""
    params = []
    for k in range(len(weights) // 2):
        b_ih, b_hh = (biases[2 * k], biases[2 * k + 1]) if biases else (None, None)
        params.append((weights[2 * k], weights[2 * k + 1], b_ih, b_hh))
    return params


def _seq_call(kind: str) -> Callable[[dict[str, Any], bool], tuple[tuple[Any, ...], dict[str, Any]]]:
    def call(b: dict[str, Any], recompute: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {"batch_first": b["batch_first"], "bidirectional": b["bidirectional"], "lengths": b["lengths"]}
        params = _params(b["weights"], b["biases"])
        if kind == "lstm":
            return (b["x"], params, b["h0"], b["c0"]), kwargs
        if kind == "gru":
            kwargs["reset_after"] = b["reset_after"]
        else:
            kwargs["activation"] = b["activation"]
        return (b["x"], params, b["h0"]), kwargs

    return call


def _seq_flatten(result: Any, b: dict[str, Any]) -> tuple[Any, ...]:
    outputs, states = result
    return (outputs, *states) if isinstance(states, tuple) else (outputs, states)


def _seq_nest_lstm(cts: Sequence[Tensor]) -> Any:
    return cts[0], (cts[1], cts[2])


def _seq_fake(b: dict[str, Any]) -> tuple[Tensor, ...]:
    x, weights = b["x"], b["weights"]
    dirs = 2 if b["bidirectional"] else 1
    hidden = weights[1].shape[1]
    states = len(weights) // 2
    steps, n = (x.shape[1], x.shape[0]) if b["batch_first"] else (x.shape[0], x.shape[1])
    out_shape = (n, steps, dirs * hidden) if b["batch_first"] else (steps, n, dirs * hidden)
    state = x.new_empty((states, n, hidden))
    extra = (x.new_empty((states, n, hidden)),) if "c0" in b else ()
    return (x.new_empty(out_shape), state, *extra)


def _seq_grad(name: str, field_name: str, grads: Any) -> Any:
    if field_name != "params":
        return getattr(grads, field_name)
    j = 0 if name == "weights" else 2
    return [g for entry in grads.params for g in (entry[j], entry[j + 1])]


def _seq_fields(op: _OpDef, b: dict[str, Any]) -> frozenset[str]:
    return frozenset(f for f in op.fields if f == "params" or b.get(f) is not None)


_SEQ_TAIL = "bool batch_first, bool bidirectional, int[]? lengths"
_SEQ_MAP = {"x": "x", "weights": "params", "biases": "params", "h0": "h0"}
_register(_OpDef(
    "rnn", _api.rnn, f"Tensor x, Tensor[] weights, Tensor[] biases, Tensor? h0, str activation, {_SEQ_TAIL}",
    2, 2, ("x", "params", "h0"), _seq_call("rnn"), _seq_fake, flatten=_seq_flatten, nest=_nest_flat,
    field_of=dict(_SEQ_MAP), grad_of=_seq_grad, available=_seq_fields,
))
_register(_OpDef(
    "gru", _api.gru, f"Tensor x, Tensor[] weights, Tensor[] biases, Tensor? h0, bool reset_after, {_SEQ_TAIL}",
    2, 2, ("x", "params", "h0"), _seq_call("gru"), _seq_fake, flatten=_seq_flatten, nest=_nest_flat,
    field_of=dict(_SEQ_MAP), grad_of=_seq_grad, available=_seq_fields,
))
_register(_OpDef(
    "lstm", _api.lstm, f"Tensor x, Tensor[] weights, Tensor[] biases, Tensor? h0, Tensor? c0, {_SEQ_TAIL}",
    3, 3, ("x", "params", "h0", "c0"), _seq_call("lstm"), _seq_fake, flatten=_seq_flatten, nest=_seq_nest_lstm,
    field_of={**_SEQ_MAP, "c0": "c0"}, grad_of=_seq_grad, available=_seq_fields,
))
del _name, _fn, _flag


