"""The custom-op machinery of the torch adapter: saved pullbacks, op definitions (``_OpDef``),
their registration as ``torch.library`` custom ops with fakes and autograd formulas, the
eager path (a plain ``autograd.Function``) that bypasses them outside compilation, and the
differentiable backward that ``create_graph=True`` takes (higher-order derivatives)."""

from __future__ import annotations

import itertools
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ... import backends, dispatch
from ...api._common import spec_of
from ...api.activations import ActivationLike, parse_activation
from ...autodiff import vjp
from ...kernel_codes import PARAMETER_DEFAULTS

NAMESPACE = "portable_nn"


# =========================================================================== saved pullbacks


class _Saved:
    """A pullback kept for an autograd backward, and the gradients it computes."""

    __slots__ = ("fields", "pullback")

    def __init__(self, pullback: Callable[..., Any], fields: frozenset[str]) -> None:
        self.pullback = pullback
        self.fields = fields


_saved: dict[int, _Saved] = {}
_keys = itertools.count()


def saved_pullbacks() -> int:
    """How many forward results are currently held for a backward pass (for tests and leak checks)."""
    return len(_saved)


class _Key(bytearray):
    """The memory of a handle (a table key's 8 bytes) that drops the table entry when freed."""

    __slots__ = ("key",)

    def __del__(self) -> None:
        _saved.pop(self.key, None)


def _remember(pullback: Callable[..., Any], fields: frozenset[str]) -> Tensor:
    """Keep ``pullback`` and return its handle: a 0-d int64 CPU tensor holding the table key.

    The tensor's memory is a :class:`_Key` whose finaliser drops the table entry, so the entry
    lives exactly as long as any tensor sharing that memory — the one autograd saved for the
    backward, in eager mode or in a compiled graph.  (A ``weakref.finalize`` on a NumPy scalar did
    the same in 5.4 µs a call, a tenth of a small layer's forward; this takes 2.)
    """
    key = next(_keys)
    _saved[key] = _Saved(pullback, fields)
    memory = _Key(key.to_bytes(8, sys.byteorder, signed=True))
    memory.key = key
    return torch.from_numpy(np.frombuffer(memory, dtype=np.int64).reshape(()))


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
        unsaved: ``(bound arguments, outputs) ->`` the tensor arguments the
            backward does not need (running statistics the forward updated:
            saving them would trip autograd's check for tensors modified in place).
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
    unsaved: Callable[[dict[str, Any], Sequence[Tensor]], tuple[str, ...]] = lambda bound, outputs: ()

    def __post_init__(self) -> None:
        self.signature = _split_args(self.args)
        self.arg_names = [name for _, name in self.signature]
        self.position = {name: k for k, name in enumerate(self.arg_names)}
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


# =========================================================================== higher-order derivatives
#
# Our backward kernels compute numbers, not autograd graphs: the gradients they return have no
# derivative.  A backward that autograd runs with ``create_graph=True`` (grad mode is then on inside
# it) must return gradients that are themselves differentiable — for a gradient penalty, a
# Hessian-vector product, ``torch.autograd.gradgradcheck``.  Such a backward differentiates the
# array-API reference instead: it reruns the op's forward through the reference on the saved,
# history-carrying tensors, under autograd, and takes ``torch.autograd.grad`` of it with the incoming
# cotangents and ``create_graph=True``.  The gradients are then a graph of plain torch ops,
# differentiable to any order.  The price is one reference forward and its autograd backward in place
# of the fused backward kernel (the kernel forward already ran).  A plain backward
# (``create_graph=False``) never takes this path.


def _reference_impl(name: str) -> dispatch.Implementation:
    """The array-API reference implementation of op ``name``."""
    return next(i for i in dispatch.implementations(name) if backends.is_oracle(i.backend))


class _AutogradNamespace:
    """The reference's array namespace for tensors under autograd: torch's, except that ``asarray``
    of a tensor keeps its autograd history.

    ``torch.asarray(t)`` returns a tensor cut from ``t``'s history in PyTorch before 2.13 (which then
    warns that it keeps it); the reference calls ``asarray`` on its own results (to turn NumPy's
    scalars into 0-d arrays), where a cut would silently drop a derivative.
    """

    def __init__(self, xp: Any) -> None:
        self._xp = xp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._xp, name)

    def asarray(self, obj: Any, /, *, dtype: Any = None, device: Any = None, copy: bool | None = None,
                **kwargs: Any) -> Any:
        if not isinstance(obj, Tensor):
            return self._xp.asarray(obj, dtype=dtype, device=device, copy=copy, **kwargs)
        result = obj if dtype is None else obj.to(dtype)
        result = result if device is None else result.to(device)
        return result.clone() if copy and result is obj else result


def reference_outputs(op: _OpDef, bound: dict[str, Any]) -> tuple[Tensor, ...]:
    """The op's differentiable outputs y = f(args) computed by the array-API reference on the
    tensors of ``bound`` (the schema's arguments by name), recorded by autograd.

    Dispatch runs every implementation under ``torch.no_grad()``; this calls the reference's forward
    directly, in the caller's grad mode.  ``bound`` must hold no running statistic the forward
    updated (``_OpDef.unsaved``): with them absent, a training-mode norm normalises with the batch's
    statistics as before and updates nothing a second time.
    """
    _, kwargs = op.to_pnn(bound, True)
    prepared = spec_of(op.fn).prepare(**kwargs)
    # The call's input maps (conv's padding modes) are applied here, as dispatch would, under autograd.
    call = prepared.call.replace(xp=_AutogradNamespace(prepared.call.xp)).mapped()
    outputs, _ = _recompute_impl(op.name, call).forward_fn()(call)
    return tuple(outputs[: op.n_diff])


def _recompute_impl(name: str, call: dispatch.Call) -> dispatch.Implementation:
    """What a ``create_graph`` backward differentiates: the ``aten`` implementation of the ops in
    :data:`TORCH_DIFFERENTIABLE` where it takes the call (its dtype, device, layout), else the reference."""
    if _autograd_differentiates_aten(name, call.device != "cpu" and call.dtype == "float32"):
        for impl in dispatch.implementations(name):
            if impl.backend == "aten" and dispatch._candidate_reason(impl, call, False)[0] is None:
                return impl
    return _reference_impl(name)


def _differentiable_grads(op: _OpDef, bound: dict[str, Any], cotangents: Sequence[Tensor | None],
                          flags: dict[str, Any]) -> dict[str, Any]:
    """āᵢ = (∂y/∂aᵢ)ᵀ ȳ for the arguments aᵢ flagged in ``flags`` (name → bool, or one bool per tensor
    of a list argument), as graphs of torch ops through the reference (``create_graph``).

    Each differentiated tensor enters the reference through its own view, so an argument passed twice
    (the same tensor as ``w_ih`` and ``w_hh``) gets its own partial derivative, as autograd expects.
    Returns ``{name: gradient, or a list for a list argument}``; ``None`` where an argument has no
    gradient (not flagged, or y does not depend on it).
    """
    args = dict(bound)
    inputs: list[Tensor] = []
    slots: list[tuple[str, int | None]] = []
    with torch.enable_grad():
        for name, is_list in op.tensor_args:
            value, flag = bound.get(name), flags.get(name)
            if value is None or not flag:
                continue
            if is_list:
                views = list(value)
                for k, (t, wanted) in enumerate(zip(value, flag)):
                    if wanted and t.requires_grad:
                        views[k] = t.view_as(t)
                        inputs.append(views[k])
                        slots.append((name, k))
                args[name] = views
            elif value.requires_grad:
                args[name] = value.view_as(value)
                inputs.append(args[name])
                slots.append((name, None))
        outputs = reference_outputs(op, args)
        pairs = [(y, ct) for y, ct in zip(outputs, cotangents) if ct is not None and y.requires_grad]
        grads: Sequence[Tensor | None] = [None] * len(inputs)
        if pairs and inputs:
            grads = torch.autograd.grad([y for y, _ in pairs], inputs, [ct for _, ct in pairs],
                                        create_graph=True, allow_unused=True)
    result: dict[str, Any] = {}
    for (name, k), grad in zip(slots, grads):
        if k is None:
            result[name] = grad
        else:
            result.setdefault(name, [None] * len(bound[name]))[k] = grad
    return result


def _setup_context(op: _OpDef, ctx: Any, inputs: Sequence[Any], output: Sequence[Tensor]) -> None:
    bound = op.bind(inputs)
    unsaved = op.unsaved(bound, output)
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
    if want and torch.is_grad_enabled():  # create_graph=True: differentiable gradients (see above)
        wanted = {name: flags[name] for name, _ in op.tensor_args if op.field_of.get(name) in want}
        result = _differentiable_grads(op, bound, grads[: op.n_diff], wanted)
    elif want:
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
# for plain tensors, outside compilation and functorch transforms.  The sequence ops take lists of
# weights, which autograd.Function does not see inside a list: their tensors are spread into its
# arguments (_spread).


#: Ops whose ``aten`` implementation (PyTorch's own kernels, called as torch ops) autograd
#: differentiates to any order.  Where ``auto`` (or the configuration) chooses ``aten`` for an
#: eager call of one, the call runs it directly under autograd (:func:`_recorded_by_torch`): the
#: same kernels without our pullback machinery, whose Python cost (~250 µs a layer forward and
#: backward) was 3x torch.nn's whole step for a small Linear or Conv2d.  A ``create_graph``
#: backward of the others' custom ops recomputes through them too: a WGAN-GP penalty step through
#: two 3x3 Conv2d at (16, 32, 32, 32) took 31 ms so, 110 ms through the reference's convolution in
#: array-API ops (torch.nn: 27 ms; 2-core Xeon, AVX-512).  (The recurrences are left out:
#: PyTorch's fused RNN kernels have no double backward.)
TORCH_DIFFERENTIABLE = ("conv", "conv_transpose", "dense")


def _autograd_differentiates_aten(name: str, float32_on_gpu: bool) -> bool:
    """Whether autograd's derivative of ``name``'s ``aten`` forward is what its backward computes:
    one of :data:`TORCH_DIFFERENTIABLE`, except a float32 convolution on a GPU, whose ``aten``
    kernels run cuDNN without TF32 (``kernels_aten.conv``) where autograd's backward would follow
    ``torch.backends.cudnn.allow_tf32``, on by default."""
    return name in TORCH_DIFFERENTIABLE and (name == "dense" or not float32_on_gpu)


def may_record(name: str, x: Any, channel_axis: Any) -> bool:
    """Whether autograd may record an eager call of op ``name`` itself, as far as the tensors say:
    one of :data:`TORCH_DIFFERENTIABLE`, channels first, and not a float32 convolution on a GPU.

    Decided from the tensors before any validation, so the calls that take the pullback path do
    not validate twice.  Channels-last results and gradients would come back as permuted views
    where torch's kernel returns channels first (float64, 1-D); the custom op (and so
    torch.compile) returns them contiguous, as the pullback path does — for ``channels_last``
    tensors too, which reach the op as channels-last calls on their view (:mod:`._layout`).
    """
    return (name in TORCH_DIFFERENTIABLE and isinstance(x, Tensor) and channel_axis == 1
            and _autograd_differentiates_aten(name, x.device.type != "cpu" and x.dtype == torch.float32))


def selects_aten(call: dispatch.Call) -> bool:
    """Whether the configuration runs ``call`` (with a backward) on ``aten``: autograd then records it."""
    return dispatch.select(call, need_backward=True, report=False).impl.backend == "aten"


def _recorded_by_torch(op: _OpDef, args: Sequence[Any]) -> tuple[Tensor, ...] | None:
    """The outputs of an eager call that runs on ``aten`` (see :data:`TORCH_DIFFERENTIABLE`),
    computed under the caller's autograd, which differentiates them; ``None`` when the call
    selects another implementation or is channels last (it then takes the pullback path)."""
    if op.name not in TORCH_DIFFERENTIABLE:
        return None
    bound = op.bind(args)
    if not may_record(op.name, bound.get("x"), bound.get("channel_axis", 1)):
        return None
    _, kwargs = op.to_pnn(bound, False)
    prepared = spec_of(op.fn).prepare(**kwargs)
    call = prepared.call
    if not selects_aten(call):
        return None
    executed = dispatch.run(call, need_backward=True, recorded=True)
    return tuple(op.flatten(prepared.finish(executed.take_outputs(), call), bound))


def _plain_tensors(op: _OpDef, args: Sequence[Any]) -> bool:
    """Whether every tensor argument (each tensor of a list argument) is a plain (or Parameter) tensor."""
    plain = (Tensor, nn.Parameter)
    for name, value in zip(op.arg_names, args):
        is_list = op.tensor_args_by_name.get(name)
        if is_list is None or value is None:
            continue
        if is_list:
            if not all(type(t) in plain for t in value):
                return False
        elif type(value) not in plain:
            return False
    return True


def _spread(op: _OpDef, args: Sequence[Any]) -> tuple[tuple[int, ...] | None, tuple[Any, ...]]:
    """The arguments with each list argument's tensors spread in its place (autograd.Function sees
    only direct tensor arguments), and the lists' lengths (−1 for an argument that is not a list);
    ``(None, args)`` for an op without list arguments."""
    if not op.has_list_tensors:
        return None, tuple(args)
    lengths: list[int] = []
    flat: list[Any] = []
    for name, value in zip(op.arg_names, args):
        if op.tensor_args_by_name.get(name) and value is not None:
            lengths.append(len(value))
            flat.extend(value)
        else:
            lengths.append(-1)
            flat.append(value)
    return tuple(lengths), tuple(flat)


def _gathered(lengths: tuple[int, ...] | None, flat: Sequence[Any]) -> list[Any]:
    """The inverse of :func:`_spread`: the arguments, list arguments as lists; each argument's
    first position in ``flat`` is ``starts[k]`` of :func:`_starts`."""
    if lengths is None:
        return list(flat)
    args: list[Any] = []
    at = 0
    for n in lengths:
        if n < 0:
            args.append(flat[at])
            at += 1
        else:
            args.append(list(flat[at : at + n]))
            at += n
    return args


def _starts(lengths: tuple[int, ...] | None, count: int) -> list[int]:
    """Each argument's first position among the spread arguments (see :func:`_spread`)."""
    if lengths is None:
        return list(range(count))
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += 1 if n < 0 else n
    return starts


#: Whether eligible eager calls bypass the custom ops (see the section comment).  ``False`` sends
#: every call through the custom ops, as ``torch.compile`` sees them (the tests check both paths).
EAGER_PATH = True


def _eager(op: _OpDef, args: Sequence[Any]) -> bool:
    """Whether a call may take the eager path (see the section comment)."""
    if not EAGER_PATH or torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return _plain_tensors(op, args)


class _EagerFullOp(torch.autograd.Function):
    """One portable_nn op under autograd without the custom-op machinery: the forward runs
    ``pnn.vjp`` for the fields autograd will want, the backward calls the kept pullback (or, under
    ``create_graph=True``, differentiates the reference: see the higher-order section).

    ``apply(op, lengths, *flat)``: the arguments as :func:`_spread` gives them, the tensors of a
    list argument (the sequence ops' weights) spread in its place, so that autograd sees each."""

    @staticmethod
    def forward(ctx: Any, op: _OpDef, lengths: tuple[int, ...] | None, *flat: Any) -> Any:
        args = _gathered(lengths, flat)
        bound = _detached(op.bind(args))
        flags = _flags(op, lengths, ctx.needs_input_grad[2:], _starts(lengths, len(flat)))
        want = frozenset(op.field_of[n] for n, _ in op.tensor_args if n in op.field_of and any(flags.get(n, ())))
        want &= op.available(op, bound)
        pargs, pkwargs = op.to_pnn(bound, False)
        ctx.pnn_op, ctx.pnn_want, ctx.pnn_lengths = op, want, lengths
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
        # per step against torch.nn's 1,650; 15.5 vs 13.0 ms).  The tensor arguments are saved too, as
        # the custom op saves them, for a create_graph=True backward, which recomputes through the
        # reference from them (but not running statistics this call updated: the caller writes
        # them in place next, which autograd would report as a modified saved tensor).
        unsaved = op.unsaved(bound, outputs)
        ctx.pnn_kept = [name for name in ctx.pnn_given if name not in unsaved]
        ctx.pnn_static = tuple(None if isinstance(a, (Tensor, list)) else a for a in args)
        saved = [handle]
        for name in ctx.pnn_kept:
            value = args[op.position[name]]
            saved.extend(value if isinstance(value, list) else (value,))
        ctx.save_for_backward(*saved)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        op, lengths = ctx.pnn_op, ctx.pnn_lengths
        position = op.position
        count = len(ctx.needs_input_grad) - 2
        starts = _starts(lengths, count)
        flags = _flags(op, lengths, ctx.needs_input_grad[2:], starts)
        for name in ctx.pnn_given:
            if name not in op.field_of and any(flags.get(name, ())):
                # As PyTorch does for F.cross_entropy's class weights: refuse rather than return a zero gradient.
                raise NotImplementedError(f"{op.name}: the derivative with respect to {name!r} is not implemented")
        result: list[Any] = [None] * (2 + count)
        if not ctx.pnn_want:
            return tuple(result)
        handle, *kept = ctx.saved_tensors
        wanted = [name for name in ctx.pnn_given if op.field_of.get(name) in ctx.pnn_want and any(flags[name])]
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients (see the higher-order section)
            bound = dict(zip(op.arg_names, ctx.pnn_static))
            at = 0
            for name in ctx.pnn_kept:
                n = lengths[position[name]] if lengths is not None else -1
                bound[name] = kept[at] if n < 0 else list(kept[at : at + n])
                at += 1 if n < 0 else n
            computed = _differentiable_grads(op, bound, grads[: op.n_diff],
                                             {name: flags[name] if lengths and lengths[position[name]] >= 0 else True
                                              for name in wanted})
            _place(result, starts, position, wanted, computed.get)
            return tuple(result)
        entry = _saved.get(int(handle))
        if entry is None:
            raise RuntimeError(f"portable_nn: the saved state of {op.name} is gone (its backward already ran "
                               "without retain_graph=True)")
        computed = entry.pullback(op.nest(list(grads[: op.n_diff])))
        # Contiguous, as the custom op's gradients are (and as its fake implementation says).
        _place(result, starts, position, wanted,
               lambda name: _contiguous(op.grad_of(name, op.field_of[name], computed)))
        return tuple(result)


def _flags(op: _OpDef, lengths: tuple[int, ...] | None, needs: Sequence[bool], starts: list[int]) -> dict[str, Any]:
    """Whether autograd wants each tensor argument's gradient: ``(flag,)`` for a tensor, one flag per
    tensor for a list argument (``needs``: autograd's flags for the spread arguments, each argument's
    first at ``starts``, :func:`_starts`)."""
    result: dict[str, Any] = {}
    for name, _ in op.tensor_args:
        k = op.position[name]
        n = -1 if lengths is None else lengths[k]
        result[name] = tuple(needs[starts[k] : starts[k] + n]) if n >= 0 else (needs[starts[k]],)
    return result


def _contiguous(grad: Any) -> Any:
    if isinstance(grad, list):
        return [None if g is None else g.contiguous() for g in grad]
    return None if grad is None else grad.contiguous()


def _place(result: list[Any], starts: list[int], position: dict[str, int], names: Sequence[str],
           gradient: Callable[[str], Any]) -> None:
    """Write each named argument's gradient (a list for a list argument) at its spread positions of
    ``result``, whose first two entries are ``apply``'s op and lengths."""
    for name in names:
        grad = gradient(name)
        at = 2 + starts[position[name]]
        if isinstance(grad, (list, tuple)):
            result[at : at + len(grad)] = grad
        else:
            result[at] = grad


#: The autograd nodes of the eager path: the fast path's (``_fast._EagerOp``) and, for signatures
#: without a plan, ``_EagerFullOp``.
EAGER_NODES = ("_EagerOpBackward", "_EagerFullOpBackward")


def is_eager_node(node: Any) -> bool:
    """Whether an autograd node is one of the eager path's (not a custom op's, not torch's own)."""
    return type(node).__name__ in EAGER_NODES


def _call(name: str, *args: Any) -> tuple[Tensor, ...]:
    """Call op ``name`` (eagerly when allowed, else as the custom op, which keeps a pullback for the
    arguments that require grad).  Returns the op's outputs (without the custom op's handle)."""
    op = _OPS[name]
    if _eager(op, args):
        recorded = _recorded_by_torch(op, args)
        if recorded is not None:
            return recorded
        lengths, flat = _spread(op, args)
        return tuple(_EagerFullOp.apply(op, lengths, *flat))
    result = getattr(torch.ops.portable_nn, name)(*args, _wrt_mask(op, args))
    return tuple(result[:-1])


# =========================================================================== argument helpers


def _act(activation: ActivationLike) -> tuple[str, float]:
    """An ``activation=`` argument as (name, parameter) for a schema (the parameter: leaky_relu's slope,
    elu's alpha, ignored by the others)."""
    parsed = parse_activation(activation)
    return parsed.name, float(parsed.slope)


def _act_arg(name: str, slope: float) -> Any:
    return (name, slope) if name in PARAMETER_DEFAULTS else name


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


