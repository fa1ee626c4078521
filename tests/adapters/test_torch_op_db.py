"""PyTorch's own functional test samples (``torch.testing._internal.common_methods_invocations.op_db``)
through ``portable_nn.torch``: every sample of the ops we implement gives ``torch.nn.functional``'s
output and input gradients, and the samples we refuse are exactly the documented gaps."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal needs it

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

import portable_nn.torch as pt  # noqa: E402

from .torch_samples_testing import clone  # noqa: E402


class Refused(Exception):
    """A sample using an argument portable_nn does not offer (a documented gap)."""


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    """Positional-or-keyword argument ``name`` of a torch.nn.functional call."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _layer_norm(x, args, kw):
    shape = _arg(args, kw, 0, "normalized_shape", None)
    axis = tuple(range(-len(shape), 0))
    return pt.layer_norm(x, _arg(args, kw, 1, "weight", None), _arg(args, kw, 2, "bias", None), axis=axis,
                         eps=_arg(args, kw, 3, "eps", 1e-5))


def _rms_norm(x, args, kw):
    shape = _arg(args, kw, 0, "normalized_shape", None)
    eps = _arg(args, kw, 2, "eps", None)
    return pt.rms_norm(x, _arg(args, kw, 1, "weight", None), axis=tuple(range(-len(shape), 0)),
                       eps=torch.finfo(x.dtype).eps if eps is None else eps)


def _batch_norm(x, args, kw):
    return pt.batch_norm(x, running_mean=_arg(args, kw, 0, "running_mean", None),
                         running_var=_arg(args, kw, 1, "running_var", None), weight=_arg(args, kw, 2, "weight", None),
                         bias=_arg(args, kw, 3, "bias", None), training=_arg(args, kw, 4, "training", False),
                         momentum=_arg(args, kw, 5, "momentum", 0.1), eps=_arg(args, kw, 6, "eps", 1e-5))


def _instance_norm(x, args, kw):
    return pt.instance_norm(x, running_mean=_arg(args, kw, 0, "running_mean", None),
                            running_var=_arg(args, kw, 1, "running_var", None),
                            weight=_arg(args, kw, 2, "weight", None), bias=_arg(args, kw, 3, "bias", None),
                            use_input_stats=_arg(args, kw, 4, "use_input_stats", True),
                            momentum=_arg(args, kw, 5, "momentum", 0.1), eps=_arg(args, kw, 6, "eps", 1e-5))


def _group_norm(x, args, kw):
    return pt.group_norm(x, _arg(args, kw, 0, "num_groups", None), _arg(args, kw, 1, "weight", None),
                         _arg(args, kw, 2, "bias", None), eps=_arg(args, kw, 3, "eps", 1e-5))


def _conv(x, args, kw):
    return pt.conv(x, _arg(args, kw, 0, "weight", None), _arg(args, kw, 1, "bias", None),
                   stride=_arg(args, kw, 2, "stride", 1), padding=_arg(args, kw, 3, "padding", 0),
                   dilation=_arg(args, kw, 4, "dilation", 1), groups=_arg(args, kw, 5, "groups", 1))


def _conv_transpose(x, args, kw):
    return pt.conv_transpose(x, _arg(args, kw, 0, "weight", None), _arg(args, kw, 1, "bias", None),
                             stride=_arg(args, kw, 2, "stride", 1), padding=_arg(args, kw, 3, "padding", 0),
                             output_padding=_arg(args, kw, 4, "output_padding", 0),
                             groups=_arg(args, kw, 5, "groups", 1), dilation=_arg(args, kw, 6, "dilation", 1))


def _per_axis(value: Any, d: int) -> Any:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * d


def _max_pool(d: int) -> Callable:
    def run(x, args, kw):
        stride = _arg(args, kw, 1, "stride", None)
        return pt.max_pool(x, _per_axis(_arg(args, kw, 0, "kernel_size", None), d),
                           stride=stride,  # (torch's as they are: () and one-element tuples included)
                           padding=_arg(args, kw, 2, "padding", 0),
                           dilation=_arg(args, kw, 3, "dilation", 1),
                           ceil_mode=bool(_arg(args, kw, 4, "ceil_mode", False)),
                           return_indices=bool(_arg(args, kw, 5, "return_indices", False)))

    return run


def _max_unpool(d: int) -> Callable:
    def run(x, args, kw):
        stride = _arg(args, kw, 2, "stride", None)
        size = _arg(args, kw, 4, "output_size", None)
        window = _per_axis(_arg(args, kw, 1, "kernel_size", None), d)
        return pt.max_unpool(x, _arg(args, kw, 0, "indices", None), window,
                             stride=_per_axis(stride, d) if stride else None,
                             padding=_per_axis(_arg(args, kw, 3, "padding", 0), d),
                             output_size=None if size is None else tuple(size))

    return run


def _written(indices: torch.Tensor, d: int) -> torch.Tensor:
    """Per entry, whether it is the last in its plane naming its index (the one max_unpool writes)."""
    planes = indices.reshape(-1, indices.shape[-d:].numel())
    written = torch.zeros(planes.shape, dtype=torch.bool)
    for plane, won in zip(planes.tolist(), written):
        won[list({q: p for p, q in enumerate(plane)}.values())] = True
    return written.reshape(indices.shape)


def _unpool_gradient(d: int) -> Callable:
    """torch's gradient of x made the derivative: zero for the entries a duplicate index overwrote
    (torch.nn gives them the cotangent too, and skips its own gradient checks of such samples)."""
    return lambda grad, args, kw: torch.where(_written(_arg(args, kw, 0, "indices", None), d), grad, 0.0)


def _avg_pool(d: int) -> Callable:
    def run(x, args, kw):
        stride = _arg(args, kw, 1, "stride", None)
        return pt.avg_pool(x, _per_axis(_arg(args, kw, 0, "kernel_size", None), d),
                           stride=stride,  # (torch's as they are: () and one-element tuples included)
                           padding=_arg(args, kw, 2, "padding", 0),
                           ceil_mode=bool(_arg(args, kw, 3, "ceil_mode", False)),
                           count_include_pad=bool(_arg(args, kw, 4, "count_include_pad", True)),
                           divisor_override=_arg(args, kw, 5, "divisor_override", None))

    return run


def _cross_entropy(x, args, kw):
    reduction = kw.get("reduction", "mean")
    return pt.cross_entropy(x, args[0], axis=1 if x.dim() > 1 else 0, weight=kw.get("weight"),
                            ignore_index=kw.get("ignore_index", -100), reduction=reduction,
                            label_smoothing=kw.get("label_smoothing", 0.0))


def _log_softmax(x, args, kw):
    dim = _arg(args, kw, 0, "dim", None)
    if kw.get("dtype") is not None:
        x = x.to(kw["dtype"])
    return pt.log_softmax(x, axis=dim)


#: OpInfo name -> our call of the sample (input, args, kwargs).
OURS: dict[str, Callable] = {
    "nn.functional.layer_norm": _layer_norm,
    "nn.functional.rms_norm": _rms_norm,
    "nn.functional.batch_norm": _batch_norm,
    "nn.functional.instance_norm": _instance_norm,
    "nn.functional.group_norm": _group_norm,
    "nn.functional.conv1d": _conv,
    "nn.functional.conv2d": _conv,
    "nn.functional.conv3d": _conv,
    "nn.functional.conv_transpose1d": _conv_transpose,
    "nn.functional.conv_transpose2d": _conv_transpose,
    "nn.functional.conv_transpose3d": _conv_transpose,
    "nn.functional.linear": lambda x, args, kw: pt.dense(x, args[0], args[1] if len(args) > 1 else kw.get("bias")),
    "nn.functional.max_pool1d": _max_pool(1),
    "nn.functional.max_pool2d": _max_pool(2),
    "nn.functional.max_pool3d": _max_pool(3),
    "nn.functional.avg_pool1d": _avg_pool(1),
    "nn.functional.avg_pool2d": _avg_pool(2),
    "nn.functional.avg_pool3d": _avg_pool(3),
    "nn.functional.max_unpool1d": _max_unpool(1),
    "nn.functional.max_unpool2d": _max_unpool(2),
    "nn.functional.max_unpool3d": _max_unpool(3),
    "nn.functional.cross_entropy": _cross_entropy,
    "log_softmax": _log_softmax,
}
#: Per op, torch's input gradient -> the oracle's, where the two differ by design.
GRADIENT_ORACLE: dict[str, Callable] = {f"nn.functional.max_unpool{d}d": _unpool_gradient(d) for d in (1, 2, 3)}
#: Validations stricter than PyTorch's, by design (a clear error instead of a silent NaN or an
#: extrapolated running average): the ValueError's message start, per reason.
STRICTER = {
    "eps": "eps must be a positive finite number",
    "momentum": "momentum must be in [0, 1]",
    # PyTorch refuses a 1-D x too ("Dimension out of range" for (3,)) except an empty one, shape (0,),
    # which it normalises over a channel axis the tensor does not have: no such axis, no such call.
    "1-D input": "x must have at least 2 dimensions",
}
#: Per op, the reasons its refused samples give (each must occur; every other sample must run).
KNOWN_GAPS = {
    "nn.functional.batch_norm": {"momentum", "1-D input"},
    "nn.functional.instance_norm": {"momentum"},
    "nn.functional.layer_norm": {"eps"},
    "nn.functional.group_norm": {"eps"},
    "nn.functional.rms_norm": {"eps"},
}


def _refusal(exc: Exception) -> str | None:
    """The reason a sample was refused, or None for an unexpected error."""
    if isinstance(exc, Refused):
        return str(exc)
    if isinstance(exc, ValueError):
        return next((reason for reason, text in STRICTER.items() if str(exc).startswith(text)), None)
    return None


INFOS = {}
for _info in op_db:
    if _info.name in OURS and not _info.variant_test_name and _info.name not in INFOS:
        INFOS[_info.name] = _info


def _leaves(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    return []


def test_every_op_has_its_samples():
    assert set(INFOS) == set(OURS)


@pytest.mark.parametrize("name", sorted(OURS))
def test_op_samples_match_torch(name):
    info, ours = INFOS[name], OURS[name]
    compared, reasons = 0, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = list(info.sample_inputs("cpu", torch.float64, requires_grad=True))
    for sample in samples:
        x, args, kw = clone(sample.input), clone(tuple(sample.args)), clone(dict(sample.kwargs))
        try:
            got = ours(x, args, kw)
        except (Refused, ValueError) as exc:
            reason = _refusal(exc)
            if reason is None:
                raise
            reasons.add(reason)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own notes (e.g. the copy an even-kernel "same" conv makes)
            want = info.op(sample.input, *sample.args, **sample.kwargs)
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9, equal_nan=True, msg=lambda m: f"{sample}: {m}")
        if isinstance(want, tuple):  # (y, indices): the gradient flows through y
            got, want = got[0], want[0]
        # every tensor the running statistics were in is updated alike
        for ours_t, theirs_t in zip(_leaves_or_buffers(args, kw), _leaves_or_buffers(sample.args, sample.kwargs)):
            torch.testing.assert_close(ours_t, theirs_t, rtol=1e-7, atol=1e-9, msg=lambda m: f"{sample} state: {m}")
        inputs_ours = [x, *_leaves(args), *_leaves(kw)]
        inputs_theirs = [sample.input, *_leaves(tuple(sample.args)), *_leaves(dict(sample.kwargs))]
        if want.requires_grad and sample.input.requires_grad:
            seed = torch.randn_like(want)
            g_theirs = torch.autograd.grad(want, inputs_theirs, seed, allow_unused=True)
            g_ours = torch.autograd.grad(got, inputs_ours, seed, allow_unused=True)
            if name in GRADIENT_ORACLE:
                g_theirs = (GRADIENT_ORACLE[name](g_theirs[0], sample.args, sample.kwargs), *g_theirs[1:])
            for g, w in zip(g_ours, g_theirs):
                if w is not None:
                    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9, msg=lambda m: f"{sample} grad: {m}")
        compared += 1
    assert compared > 0
    assert reasons == KNOWN_GAPS.get(name, set()), f"{name}: refused for {reasons}"


def _leaves_or_buffers(args, kw) -> list:
    """The tensors a call may update in place that need no gradient (running statistics)."""
    found = [a for a in args if isinstance(a, torch.Tensor) and not a.requires_grad]
    return found + [v for v in kw.values() if isinstance(v, torch.Tensor) and not v.requires_grad]
