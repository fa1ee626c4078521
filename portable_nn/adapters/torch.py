"""PyTorch adapter: portable_nn ops as ``torch.library`` custom ops, and drop-in ``torch.nn`` modules.

Import it as :mod:`portable_nn.torch`.  Two layers:

**Functions** (``portable_nn.torch.layer_norm``, ``conv``, ``lstm`` …) take and return
tensors, with the signatures of the plain ops (``pnn.layer_norm`` …), and are
differentiable with ``torch.autograd``.  Each calls a custom op registered in the
``portable_nn`` namespace (``torch.ops.portable_nn.layer_norm`` …) with

* a forward that runs our kernels through dispatch (CPU tensors reach the Numba
  kernels as zero-copy NumPy views, CUDA tensors the GPU kernels; where the
  ``aten`` backend ranks first — conv, dense, lstm, rnn — PyTorch's own kernel),
* a fake (meta) implementation giving the output shapes, so ``torch.compile``
  traces the op into its graph instead of breaking the graph,
* an autograd formula whose backward is a second custom op
  (``torch.ops.portable_nn.layer_norm_backward``) running our fused backward
  kernel through the :func:`portable_nn.vjp` pullback.

How forward and backward meet: when a gradient will be needed, the forward runs
``pnn.vjp`` with ``wrt`` set to the arguments that require grad, keeps the
pullback (with the residuals our kernel saved) in a table and returns, as an
extra int64 output, a *handle* to it.  The autograd formula passes that handle
to the backward op, which calls the pullback for the gradients
``ctx.needs_input_grad`` asks for: a gradient nobody wants (say the input's of a
first layer) is never computed.  The table entry lives as long as the handle
tensor's memory, that is as long as autograd (eager or compiled) keeps it for
the backward.  If the entry is missing (the op was called directly without
``wrt``, or is re-run by a graph partitioner), the backward op recomputes the
forward with ``pnn.vjp`` restricted to the needed gradients — the same result,
one forward pass dearer.  Backward ops are not themselves differentiable
(no double backward).

Batch and instance norm have a functional custom op (returning the new running
statistics) that carries the autograd formula — PyTorch accepts autograd
formulas only on functional custom ops — and an in-place variant
(``torch.ops.portable_nn.batch_norm_``, schema ``Tensor(a!)? running_mean``)
that updates the running statistics and which ``torch.compile`` decomposes
into the functional op plus a copy.

**Modules** (:class:`LayerNorm`, :class:`BatchNorm2d`, :class:`LSTM`,
:class:`Conv2d`, :class:`Linear` …) subclass the matching ``torch.nn`` classes
(the recurrent ones ``torch.nn.RNNBase``): same constructor arguments and
defaults, parameter and buffer names, initialisation, ``state_dict`` keys and
``train()``/``eval()`` behaviour, so a model swaps them in and loads its
existing weights.  Their forward runs our fused kernels, with extra
keyword-only options the kernels offer (``activation=``, ``channel_axis=``,
GRU ``reset_after=``).  Arguments we cannot honour raise
``NotImplementedError`` naming them.
"""

from __future__ import annotations

import itertools
import numbers
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .. import api as _api
from ..api.activations import ActivationLike, parse_activation
from ..autodiff import vjp

__all__ = [
    "GRU",
    "LSTM",
    "RNN",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "avg_pool",
    "batch_norm",
    "conv",
    "cross_entropy",
    "dense",
    "group_norm",
    "gru",
    "gru_cell",
    "instance_norm",
    "layer_norm",
    "log_softmax",
    "lstm",
    "lstm_cell",
    "max_pool",
    "moments",
    "rms_norm",
    "rnn",
    "rnn_cell",
    "saved_pullbacks",
]

NAMESPACE = "portable_nn"


# =========================================================================== saved pullbacks


@dataclass
class _Saved:
    """A pullback kept for an autograd backward, and the gradients it computes."""

    pullback: Callable[..., Any]
    fields: frozenset[str]


_saved: dict[int, _Saved] = {}
_keys = itertools.count()


def saved_pullbacks() -> int:
    """How many forward results are currently held for a backward pass (for tests and leak checks)."""
    return len(_saved)


def _remember(pullback: Callable[..., Any], fields: frozenset[str]) -> Tensor:
    """Keep ``pullback`` and return its handle: a 0-d int64 CPU tensor holding the table key.

    The tensor's memory is a NumPy scalar whose finaliser drops the table entry,
    so the entry lives exactly as long as any tensor sharing that memory —
    the one autograd saved for the backward, in eager mode or in a compiled
    graph.
    """
    key = next(_keys)
    _saved[key] = _Saved(pullback, fields)
    holder = np.array(key, dtype=np.int64)
    weakref.finalize(holder, _saved.pop, key, None)
    return torch.from_numpy(holder)


def _no_handle() -> Tensor:
    return torch.full((), -1, dtype=torch.int64)


def _fake_handle() -> Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


# =========================================================================== op definitions


def _split_args(args: str) -> list[tuple[str, str]]:
    """``"Tensor x, Tensor? w, int[] s"`` → ``[("Tensor", "x"), ("Tensor?", "w"), ("int[]", "s")]``."""
    parts = []
    for item in args.split(","):
        kind, name = item.strip().rsplit(" ", 1)
        parts.append((kind.strip(), name.split("=")[0]))
    return parts


def _first(result: Any, bound: dict[str, Any]) -> tuple[Any, ...]:
    return (result,)


def _as_tuple(result: Any, bound: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(result)


def _nest_single(cotangents: Sequence[Tensor]) -> Any:
    return cotangents[0]


def _nest_flat(cotangents: Sequence[Tensor]) -> Any:
    return tuple(cotangents)


def _grad_field(name: str, field_name: str, grads: Any) -> Any:
    return getattr(grads, field_name)


def _given_fields(op: _OpDef, bound: dict[str, Any]) -> frozenset[str]:
    """The differentiable arguments that were given (not ``None``)."""
    return frozenset(f for arg, f in op.field_of.items() if bound.get(arg) is not None)


@dataclass
class _OpDef:
    """How one portable_nn op becomes a pair of torch custom ops (forward, backward).

    Attributes:
        name: the op's name in both libraries (``torch.ops.portable_nn.<name>``).
        fn: the portable_nn function.
        args: the schema's argument list (the forward op appends ``bool[]? wrt=None``).
        outputs: how many tensors the forward returns (before the handle).
        n_diff: how many of those leading outputs are differentiable.
        fields: the portable_nn gradient fields.
        to_pnn: ``(bound arguments, recompute) -> (args, kwargs)`` for ``fn``;
            ``recompute=True`` is the backward's recomputation (must not touch
            running statistics).
        fake: output tensors of the right shapes for ``torch.compile`` tracing.
        flatten: the op's result → the tuple of forward outputs.
        nest: the flat cotangents → the pullback's cotangent structure.
        field_of: tensor argument → gradient field (defaults to same names).
        grad_of: ``(argument, field, grads)`` → that argument's gradient(s).
        available: the fields a call can differentiate.
        unsaved: tensor arguments the backward does not need (running
            statistics the forward updates: saving them would trip autograd's
            check for tensors modified in place).
    """

    name: str
    fn: Callable[..., Any]
    args: str
    outputs: int
    n_diff: int
    fields: tuple[str, ...]
    to_pnn: Callable[[dict[str, Any], bool], tuple[tuple[Any, ...], dict[str, Any]]]
    fake: Callable[[dict[str, Any]], tuple[Tensor, ...]]
    flatten: Callable[[Any, dict[str, Any]], tuple[Any, ...]] = _first
    nest: Callable[[Sequence[Tensor]], Any] = _nest_single
    field_of: dict[str, str] = field(default_factory=dict)
    grad_of: Callable[[str, str, Any], Any] = _grad_field
    available: Callable[[_OpDef, dict[str, Any]], frozenset[str]] = _given_fields
    unsaved: Callable[[dict[str, Any]], tuple[str, ...]] = lambda bound: ()

    def __post_init__(self) -> None:
        self.signature = _split_args(self.args)
        self.arg_names = [name for _, name in self.signature]
        self.tensor_args = [(name, kind.startswith("Tensor[]")) for kind, name in self.signature
                            if kind.startswith("Tensor")]
        if not self.field_of:
            self.field_of = {name: name for name, _ in self.tensor_args if name in self.fields}
        self.tensor_args_by_name = dict(self.tensor_args)
        self.has_list_tensors = any(is_list for _, is_list in self.tensor_args)

    def bind(self, args: Sequence[Any], extra: str = "wrt") -> dict[str, Any]:
        """The arguments by name; ``extra`` names the trailing mask (``wrt`` or ``needs``)."""
        return dict(zip([*self.arg_names, extra], args))

    def wanted(self, bound: dict[str, Any], mask: Sequence[bool] | None) -> frozenset[str]:
        """The fields selected by a ``wrt`` mask (one flag per field), among those available."""
        if not mask:
            return frozenset()
        chosen = frozenset(f for f, flag in zip(self.fields, mask) if flag)
        return chosen & self.available(self, bound)


_OPS: dict[str, _OpDef] = {}


def _like(t: Tensor) -> Tensor:
    """A contiguous tensor like ``t``: our kernels return C-contiguous results, and fakes must say so."""
    return t.new_empty(t.shape)


def _fresh(tensors: Sequence[Tensor], inputs: Sequence[Any]) -> list[Tensor]:
    """The tensors, C-contiguous, cloned where one shares memory with an input or an earlier output.

    Custom ops must return new tensors; a kernel may legitimately hand back a
    cotangent or an input unchanged (an identity gradient).  The fake
    implementations promise contiguous results (``torch.compile`` checks).
    """
    tensors = [t.contiguous() for t in tensors]
    taken: set[int] = set()
    for value in inputs:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, Tensor) and t.numel():
                taken.add(t.untyped_storage().data_ptr())
    result = []
    for t in tensors:
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in taken:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            taken.add(ptr)
        result.append(t)
    return result


def _detached(bound: dict[str, Any]) -> dict[str, Any]:
    """The arguments with tensors detached.

    A kept pullback holds its inputs and outputs; holding them without
    autograd metadata means it never holds a graph node, so the saved-pullback
    table can form no reference cycle with the autograd graph that owns the
    handle (which would keep both alive, e.g. after ``retain_graph=True``).
    """
    result = {}
    for name, value in bound.items():
        if isinstance(value, Tensor):
            value = value.detach()
        elif isinstance(value, list) and value and all(isinstance(v, Tensor) for v in value):
            value = [v.detach() for v in value]
        result[name] = value
    return result


def _forward_impl(op: _OpDef, args: Sequence[Any]) -> tuple[Tensor, ...]:
    bound = _detached(op.bind(args))
    wrt = bound.pop("wrt", None)
    want = op.wanted(bound, wrt)
    pargs, pkwargs = op.to_pnn(bound, False)
    if want:
        result, pullback = vjp(op.fn, *pargs, wrt=tuple(f for f in op.fields if f in want), **pkwargs)
        handle = _remember(pullback, want)
    else:
        result = op.fn(*pargs, **pkwargs)
        handle = _no_handle()
    outputs = _fresh([t.detach() for t in op.flatten(result, bound)], args)
    return (*outputs, handle)


def _forward_fake(op: _OpDef, args: Sequence[Any]) -> tuple[Tensor, ...]:
    bound = op.bind(args)
    return (*op.fake(bound), _fake_handle())


def _flat_grads(op: _OpDef, bound: dict[str, Any], grads: Any, want: frozenset[str]) -> list[Tensor]:
    """Gradients of the wanted tensor arguments, flattened in schema order."""
    flat: list[Tensor] = []
    for name, is_list in op.tensor_args:
        field_name = op.field_of.get(name)
        if field_name not in want or bound.get(name) is None or (is_list and not bound[name]):
            continue
        grad = op.grad_of(name, field_name, grads)
        flat.extend(grad if is_list else [grad])
    return flat


def _backward_impl(op: _OpDef, saved: Tensor, cotangents: Sequence[Tensor], args: Sequence[Any]) -> list[Tensor]:
    bound = _detached(op.bind(args, "needs"))
    want = op.wanted(bound, bound.pop("needs"))
    entry = _saved.get(int(saved))
    if entry is not None and want <= entry.fields:
        grads = entry.pullback(op.nest(cotangents))
    else:
        pargs, pkwargs = op.to_pnn(bound, True)
        _, pullback = vjp(op.fn, *pargs, wrt=tuple(f for f in op.fields if f in want), **pkwargs)
        grads = pullback(op.nest(cotangents))
    return _fresh(_flat_grads(op, bound, grads, want), [saved, *cotangents, *args])


def _backward_fake(op: _OpDef, saved: Tensor, cotangents: Sequence[Tensor], args: Sequence[Any]) -> list[Tensor]:
    bound = op.bind(args, "needs")
    want = op.wanted(bound, bound.pop("needs"))
    flat: list[Tensor] = []
    for name, is_list in op.tensor_args:
        value = bound.get(name)
        if op.field_of.get(name) not in want or value is None:
            continue
        flat.extend(_like(t) for t in (value if is_list else [value]))
    return flat


def _setup_context(op: _OpDef, ctx: Any, inputs: Sequence[Any], output: Sequence[Tensor]) -> None:
    bound = op.bind(inputs)
    unsaved = op.unsaved(bound)
    layout, tensors = [], []
    for name, is_list in op.tensor_args:
        value = None if name in unsaved else bound[name]
        if is_list:
            layout.append((name, len(value)))
            tensors.extend(value)
        else:
            layout.append((name, None))
            tensors.append(value)
    ctx.pnn_layout = layout
    ctx.pnn_static = {k: v for k, v in bound.items() if k not in dict(op.tensor_args) and k != "wrt"}
    ctx.save_for_backward(*tensors, output[-1])
    ctx.mark_non_differentiable(*output[op.n_diff:])


def _backward_formula(op: _OpDef, ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
    *saved, handle = ctx.saved_tensors
    flags = dict(zip(op.arg_names, ctx.needs_input_grad))
    bound = dict(ctx.pnn_static)
    position = 0
    for name, count in ctx.pnn_layout:
        if count is None:
            bound[name] = saved[position]
            position += 1
        else:
            bound[name] = list(saved[position:position + count])
            position += count

    def needed(name: str) -> bool:
        flag = flags.get(name, False)
        return any(flag) if isinstance(flag, (list, tuple)) else bool(flag)

    for name, _ in op.tensor_args:
        if name not in op.field_of and needed(name):
            # As PyTorch does for F.cross_entropy's class weights: refuse rather than return a zero gradient.
            raise NotImplementedError(f"{op.name}: the derivative with respect to {name!r} is not implemented")
    want = frozenset(op.field_of[n] for n, _ in op.tensor_args if n in op.field_of and needed(n))
    want &= op.available(op, bound)
    result: dict[str, Any] = {}
    if want:
        mask = [f in want for f in op.fields]
        backward_op = getattr(torch.ops.portable_nn, f"{op.name}_backward")
        call_args = [bound[name] for name in op.arg_names if name != "wrt"]
        flat = iter(backward_op(handle, list(grads[: op.n_diff]), *call_args, mask))
        for name, is_list in op.tensor_args:
            if op.field_of.get(name) not in want or bound[name] is None:
                continue
            if is_list:
                result[name] = [g if f else None for g, f in zip([next(flat) for _ in bound[name]], flags[name])]
            else:
                grad = next(flat)
                result[name] = grad if flags[name] else None
    out = []
    for name in op.arg_names:
        value = result.get(name)
        if value is None and isinstance(bound.get(name), list) and dict(op.tensor_args).get(name):
            value = [None] * len(bound[name])
        out.append(value)
    return (*out, None)  # the wrt mask


def _register(op: _OpDef) -> _OpDef:
    """Define ``portable_nn::<name>`` and ``portable_nn::<name>_backward`` with fake and autograd rules."""
    returns = ", ".join(["Tensor"] * (op.outputs + 1))
    forward = torch.library.custom_op(
        f"{NAMESPACE}::{op.name}",
        lambda *args: _forward_impl(op, args),
        mutates_args=(),
        schema=f"({op.args}, bool[]? wrt=None) -> ({returns})",
    )
    forward.register_fake(lambda *args: _forward_fake(op, args))
    backward = torch.library.custom_op(
        f"{NAMESPACE}::{op.name}_backward",
        lambda saved, cotangents, *args: _backward_impl(op, saved, cotangents, args),
        mutates_args=(),
        schema=f"(Tensor saved, Tensor[] cotangents, {op.args}, bool[] needs) -> Tensor[]",
    )
    backward.register_fake(lambda saved, cotangents, *args: _backward_fake(op, saved, cotangents, args))
    forward.register_autograd(
        lambda ctx, *grads: _backward_formula(op, ctx, *grads),
        setup_context=lambda ctx, inputs, output: _setup_context(op, ctx, inputs, output),
    )
    _OPS[op.name] = op
    return op


def _wrt_mask(op: _OpDef, args: Sequence[Any]) -> list[bool] | None:
    """One flag per gradient field: whether autograd will want it (an argument of it requires grad).

    ``None`` when grad mode is off or nothing requires grad: the forward then
    keeps no pullback.
    """
    if not torch.is_grad_enabled():
        return None
    bound = op.bind(args)
    flags = []
    for f in op.fields:
        flag = False
        for arg, of in op.field_of.items():
            if of != f:
                continue
            value = bound.get(arg)
            values = value if isinstance(value, (list, tuple)) else (value,)
            flag = flag or any(isinstance(v, Tensor) and v.requires_grad for v in values)
        flags.append(flag)
    return flags if any(flags) else None


# =========================================================================== the eager path
#
# A custom op costs hundreds of microseconds of Python per call and per backward (schema binding,
# the generated autograd node, a second custom op for the backward): a resnet18 training step at
# (8,3,64,64) with our modules spent ~20 ms of its 100 ms there (torch's own step: 65 ms).  In
# eager mode, which is where nearly every training loop runs, an op therefore goes through a
# plain ``torch.autograd.Function`` that keeps the pullback itself.  The custom ops stay what
# ``torch.compile``, FX, fake tensors and functorch transforms see: the eager path is taken only
# for plain tensors, outside compilation and functorch transforms, and for ops whose tensors are
# all direct arguments (the sequence ops take lists of weights, which autograd.Function cannot
# see, and keep the custom op).


def _plain_tensors(op: _OpDef, args: Sequence[Any]) -> bool:
    """Whether every tensor argument is a plain (or Parameter) tensor and none is a list."""
    for name, value in zip(op.arg_names, args):
        is_list = op.tensor_args_by_name.get(name)
        if is_list is None or value is None:
            continue
        if is_list or type(value) not in (Tensor, nn.Parameter):
            return False
    return True


#: Whether eligible eager calls bypass the custom ops (see the section comment).  ``False`` sends
#: every call through the custom ops, as ``torch.compile`` sees them (the tests check both paths).
EAGER_PATH = True


def _eager(op: _OpDef, args: Sequence[Any]) -> bool:
    """Whether a call may take the eager path (see the section comment)."""
    if not EAGER_PATH or op.has_list_tensors or torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return _plain_tensors(op, args)


class _EagerOp(torch.autograd.Function):
    """One portable_nn op under autograd without the custom-op machinery: the forward runs
    ``pnn.vjp`` for the fields autograd will want, the backward calls the kept pullback."""

    @staticmethod
    def forward(ctx: Any, op: _OpDef, *args: Any) -> Any:
        bound = _detached(op.bind(args))
        flags = dict(zip(op.arg_names, ctx.needs_input_grad[1:]))
        want = frozenset(op.field_of[n] for n, _ in op.tensor_args if n in op.field_of and flags.get(n))
        want &= op.available(op, bound)
        pargs, pkwargs = op.to_pnn(bound, False)
        ctx.pnn_op, ctx.pnn_want = op, want
        ctx.pnn_given = [name for name, _ in op.tensor_args if bound.get(name) is not None]
        if want:
            result, pullback = vjp(op.fn, *pargs, wrt=tuple(f for f in op.fields if f in want), **pkwargs)
            handle = _remember(pullback, want)
        else:
            result = op.fn(*pargs, **pkwargs)
            handle = _no_handle()
        outputs = _fresh([t.detach() for t in op.flatten(result, bound)], args)
        ctx.mark_non_differentiable(*outputs[op.n_diff:])
        # The pullback lives as long as autograd keeps the handle: torch releases saved tensors right
        # after a node's backward (unless retain_graph), so the residuals go then, as torch.nn's do,
        # not with the whole graph.  Measured: Conv2d+BatchNorm2d+ReLU at (16,64,28,28) kept its conv
        # output alive through the conv backward, which then took fresh heap pages (3,100 page faults
        # per step against torch.nn's 1,650; 15.5 vs 13.0 ms).  The inputs that require grad are kept
        # only to tie a create_graph=True gradient to the graph (see _Once), as the custom op saves them.
        ctx.save_for_backward(handle, *(t for t in args if isinstance(t, Tensor) and t.requires_grad))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        op = ctx.pnn_op
        position = {name: k for k, name in enumerate(op.arg_names)}
        for name in ctx.pnn_given:
            if name not in op.field_of and ctx.needs_input_grad[1 + position[name]]:
                # As PyTorch does for F.cross_entropy's class weights: refuse rather than return a zero gradient.
                raise NotImplementedError(f"{op.name}: the derivative with respect to {name!r} is not implemented")
        result: list[Any] = [None] * (1 + len(op.arg_names))
        if not ctx.pnn_want:
            return tuple(result)
        handle, *inputs = ctx.saved_tensors
        entry = _saved.get(int(handle))
        if entry is None:
            raise RuntimeError(f"portable_nn: the saved state of {op.name} is gone (its backward already ran "
                               "without retain_graph=True)")
        computed = entry.pullback(op.nest(list(grads[: op.n_diff])))
        for name in ctx.pnn_given:
            field_name = op.field_of.get(name)
            if field_name in ctx.pnn_want and ctx.needs_input_grad[1 + position[name]]:
                # Contiguous, as the custom op's gradients are (and as its fake implementation says).
                grad = op.grad_of(name, field_name, computed).contiguous()
                if torch.is_grad_enabled():  # create_graph=True: a second derivative must fail clearly
                    grad = _Once.apply(grad, op.name, *inputs)
                result[1 + position[name]] = grad
        return tuple(result)


class _Once(torch.autograd.Function):
    """The identity on a gradient, refusing to be differentiated (our backward has no derivative)."""

    @staticmethod
    def forward(ctx: Any, grad: Tensor, name: str, *inputs: Tensor) -> Tensor:
        ctx.pnn_name = name
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        raise RuntimeError(f"portable_nn::{ctx.pnn_name}_backward has no derivative: the ops are differentiable "
                           "once (double backward, create_graph=True then a second backward, is not supported)")


def _call(name: str, *args: Any) -> tuple[Tensor, ...]:
    """Call op ``name`` (eagerly when allowed, else as the custom op, which keeps a pullback for the
    arguments that require grad).  Returns the op's outputs (without the custom op's handle)."""
    op = _OPS[name]
    if _eager(op, args):
        return tuple(_EagerOp.apply(op, *args))
    result = getattr(torch.ops.portable_nn, name)(*args, _wrt_mask(op, args))
    return tuple(result[:-1])


# =========================================================================== argument helpers


def _act(activation: ActivationLike) -> tuple[str, float]:
    """An ``activation=`` argument as (name, slope) for a schema."""
    parsed = parse_activation(activation)
    return parsed.name, float(parsed.slope)


def _act_arg(name: str, slope: float) -> Any:
    return ("leaky_relu", slope) if name == "leaky_relu" else name


def _ints(value: Any, name: str) -> list[int]:
    """An int or a sequence of ints as a list (validated later by the op)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return [int(value)]
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
    ):
        return [int(v) for v in value]
    raise TypeError(f"{name} must be an int or a tuple of ints, got {value!r}")


def _int_or_tuple(values: Sequence[int]) -> int | tuple[int, ...]:
    return values[0] if len(values) == 1 else tuple(values)


def _axes(axis: Any) -> list[int]:
    return _ints(axis, "axis")


def _empty_stat(x: Tensor) -> Tensor:
    return x.new_empty(0)


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


# =========================================================================== modules


def _fused_repr(module: Any) -> str:
    """What our modules add to ``torch.nn``'s ``extra_repr``: a fused activation, a channels-last layout."""
    text = "" if module.activation.is_identity else f", activation={module.activation}"
    return text + ("" if getattr(module, "channel_axis", 1) == 1 else ", channel_axis=-1")


def _check_channel_axis(channel_axis: Any) -> int:
    if channel_axis not in (1, -1):
        raise ValueError(f"channel_axis must be 1 (channels first) or -1 (channels last), got {channel_axis!r}")
    return int(channel_axis)


class LayerNorm(nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` running our fused layer-norm kernels.

    y = act((x − mean) / sqrt(var + eps) · weight + bias) over the trailing
    ``normalized_shape`` axes.  Constructor arguments, defaults, parameters
    (``weight`` ones, ``bias`` zeros) and state_dict keys are ``torch.nn``'s.

    Args:
        normalized_shape, eps, elementwise_affine, bias, device, dtype: as in
            ``torch.nn.LayerNorm``.
        activation: keyword-only; an activation fused into the kernel
            (see :mod:`portable_nn.api.activations`), ``"identity"`` by default.
    """

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
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.activation = parse_activation(activation)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` (``(*, *normalized_shape)``) over its trailing axes."""
        k = len(self.normalized_shape)
        if tuple(input.shape[input.ndim - k:]) != tuple(self.normalized_shape):
            raise ValueError(
                f"LayerNorm: expected input with shape (*, {', '.join(map(str, self.normalized_shape))}), "
                f"got {tuple(input.shape)}"
            )
        return layer_norm(input, self.weight, self.bias, axis=tuple(range(-k, 0)), eps=self.eps,
                          activation=self.activation)

    def extra_repr(self) -> str:
        """``torch.nn``'s description plus the fused activation."""
        return super().extra_repr() + _fused_repr(self)


class RMSNorm(nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` running our fused RMS-norm kernels.

    y = x / sqrt(mean(x²) + eps) · weight over the trailing ``normalized_shape``
    axes; ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in PyTorch.
    Constructor arguments, parameters and state_dict keys are ``torch.nn``'s.
    """

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` (``(*, *normalized_shape)``) over its trailing axes."""
        k = len(self.normalized_shape)
        if tuple(input.shape[input.ndim - k:]) != tuple(self.normalized_shape):
            raise ValueError(
                f"RMSNorm: expected input with shape (*, {', '.join(map(str, self.normalized_shape))}), "
                f"got {tuple(input.shape)}"
            )
        eps = torch.finfo(input.dtype).eps if self.eps is None else self.eps
        return rms_norm(input, self.weight, axis=tuple(range(-k, 0)), eps=eps)


class GroupNorm(nn.GroupNorm):
    """Drop-in ``torch.nn.GroupNorm`` running our fused group-norm kernels.

    Args:
        num_groups, num_channels, eps, affine, device, dtype: as in ``torch.nn.GroupNorm``.
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
        activation: ActivationLike = "identity",
        channel_axis: int = 1,
    ) -> None:
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self.activation = parse_activation(activation)
        self.channel_axis = _check_channel_axis(channel_axis)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` ``(N, C, *)`` (or ``(N, *, C)``) per sample and channel group."""
        return group_norm(input, self.num_groups, self.weight, self.bias, eps=self.eps,
                          channel_axis=self.channel_axis, activation=self.activation)

    def extra_repr(self) -> str:
        """``torch.nn``'s description plus the fused activation and a channels-last layout."""
        return super().extra_repr() + _fused_repr(self)


def _batch_norm_forward(module: Any, input: Tensor) -> Tensor:
    """``torch.nn``'s batch-norm module semantics (momentum, cumulative averages, eval) on our kernel."""
    module._check_input_dim(input)
    factor = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    use_batch = module.training or (module.running_mean is None and module.running_var is None)
    keep = not module.training or module.track_running_stats
    return batch_norm(
        input, module.weight, module.bias,
        running_mean=module.running_mean if keep else None, running_var=module.running_var if keep else None,
        training=use_batch, momentum=factor, eps=module.eps, channel_axis=module.channel_axis,
        activation=module.activation,
    )


class _BatchNormMixin:
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

    def extra_repr(self) -> str:
        """``torch.nn``'s description plus the fused activation and a channels-last layout."""
        return super().extra_repr() + _fused_repr(self)  # type: ignore[misc]


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


class _InstanceNormMixin:
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
            x, self.weight, self.bias,  # type: ignore[attr-defined]
            running_mean=self.running_mean, running_var=self.running_var,  # type: ignore[attr-defined]
            use_input_stats=self.training or not self.track_running_stats,  # type: ignore[attr-defined]
            momentum=momentum, eps=self.eps, channel_axis=self.channel_axis,  # type: ignore[attr-defined]
            activation=self.activation,
        )
        return y.squeeze(0) if unbatched else y

    def extra_repr(self) -> str:
        """``torch.nn``'s description plus the fused activation and a channels-last layout."""
        return super().extra_repr() + _fused_repr(self)  # type: ignore[misc]


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


class _ConvMixin:
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
        if padding_mode != "zeros" and self.channel_axis != 1:
            raise NotImplementedError(
                f"padding_mode={padding_mode!r} with channel_axis=-1: only zero padding is supported for "
                "channels-last data (use padding_mode='zeros' or channel_axis=1)"
            )

    def forward(self, input: Tensor) -> Tensor:
        """Convolve ``input`` (batched or not) with the fused bias and activation."""
        padding: Any = self.padding  # type: ignore[attr-defined]
        if self.padding_mode != "zeros":  # type: ignore[attr-defined]
            # As torch.nn does: pad explicitly with the mode, then convolve without padding.
            input = F.pad(input, self._reversed_padding_repeated_twice,  # type: ignore[attr-defined]
                          mode=self.padding_mode)  # type: ignore[attr-defined]
            padding = 0
        return conv(input, self.weight, self.bias, stride=self.stride, padding=padding,  # type: ignore
                    dilation=self.dilation, groups=self.groups,  # type: ignore[attr-defined]
                    activation=self.activation, channel_axis=self.channel_axis)

    def extra_repr(self) -> str:
        """``torch.nn``'s description plus the fused activation and a channels-last layout."""
        return super().extra_repr() + _fused_repr(self)  # type: ignore[misc]


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
        padding_mode: ``"zeros"``, or ``"reflect"``, ``"replicate"``, ``"circular"``,
            which pad with ``F.pad`` first, as PyTorch does.
        device: where the parameters are created.
        dtype: their dtype.
        activation: keyword-only fused activation (default ``"identity"``).
        channel_axis: keyword-only; 1 (``(N, C, L)``, PyTorch's) or -1 for
            channels-last ``(N, L, C)`` data (zero padding only).

    All but the last two are ``torch.nn.Conv1d``'s, with its defaults.

    Weight ``(out_channels, in_channels/groups, *kernel_size)``, initialisation
    and state_dict keys are ``torch.nn``'s.
    """


class Conv2d(_ConvMixin, nn.Conv2d):
    """Drop-in ``torch.nn.Conv2d`` with fused bias and activation; see :class:`Conv1d` for the options."""


class Conv3d(_ConvMixin, nn.Conv3d):
    """Drop-in ``torch.nn.Conv3d`` with fused bias and activation; see :class:`Conv1d` for the options."""


class Linear(nn.Linear):
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

    def extra_repr(self) -> str:
        """``torch.nn``'s description plus the fused activation."""
        return super().extra_repr() + _fused_repr(self)


# --------------------------------------------------------------------------- recurrent modules


def _check_recurrent_args(proj_size: Any) -> None:
    if proj_size:
        raise NotImplementedError(
            f"proj_size={proj_size!r}: LSTM projections are not supported by portable_nn's kernels (use proj_size=0)"
        )


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
        """pnn's list of ``(w_ih, w_hh, b_ih, b_hh)`` per layer and direction, from the registered parameters."""
        names = self._flat_weights_names
        per = 4 if self.bias else 2
        params = []
        for k in range(len(names) // per):
            entry = [getattr(self, name) for name in names[k * per:(k + 1) * per]]
            params.append((*entry, None, None) if per == 2 else tuple(entry))
        return params

    def _sequence(self, x: Tensor, params: list[tuple[Any, ...]], h0: Any, c0: Any, lengths: Any) -> tuple[Any, Any]:
        raise NotImplementedError

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
    ``bias_ih_l{k}[_reverse]``, ``bias_hh_l{k}[_reverse]`` with ``torch.nn``'s
    shapes, initialisation and state_dict keys.  ``forward`` also accepts
    ``PackedSequence`` input and a ``lengths=`` keyword for padded batches.

    Args:
        input_size: features of each input step.
        hidden_size: features of the hidden and cell states.
        num_layers: stacked layers.
        bias: whether the layers have ``bias_ih`` and ``bias_hh``.
        batch_first: whether input and output are ``(N, T, ·)`` rather than ``(T, N, ·)``.
        dropout: dropout between layers in training, through
            ``torch.nn.functional.dropout``.
        bidirectional: whether each layer also runs backwards in time.
        proj_size: must be 0; projections raise ``NotImplementedError``.
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
        _check_recurrent_args(proj_size)
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype)

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
