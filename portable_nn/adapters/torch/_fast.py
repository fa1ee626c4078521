"""The torch adapter's fast path: an eager call of a signature it has run before.

``portable_nn.torch.layer_norm(t, w, b)`` and the drop-in modules, on plain tensors outside
``torch.compile`` and functorch transforms, run here.  The signature (:mod:`portable_nn.plans`,
keyed with the gradient fields autograd will want) gets a plan on its first call, and later
calls replay it: no schema encoding, no custom op, no second validation or selection.  Three
kinds of call:

* nothing requires a gradient (or grad mode is off): the op's forward, as ``pnn.<op>`` runs it;
* a convolution or dense layer that ``auto`` runs on PyTorch's own kernels (``aten``): its
  forward in the caller's grad mode, so autograd records torch's own backward nodes (as
  :func:`._ops._recorded_by_torch` does on the full path, with :func:`._ops.may_record`);
* otherwise a plain ``autograd.Function`` (:class:`_EagerOp`) whose forward runs the op's ``vjp``
  for the wanted fields and whose backward calls the pullback (or, under ``create_graph=True``,
  differentiates the reference as :class:`._ops._EagerFullOp` does).

Whatever the plan cannot replay takes the adapter's full path (:func:`._ops._call`): lists of
tensors (the sequence ops), running statistics returned rather than updated, a tensor argument
that requires a gradient the op does not define, an output that is not a fresh contiguous tensor
(custom ops must return fresh tensors), signatures without a plan.  Results are the full path's:
the same route runs the same implementation on the same arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ... import dispatch, plans
from ...autodiff import _needs, pullback_of
from . import _ops
from ._defs import encode

#: Returned by :func:`call` for a call the fast path leaves to the full path.
NOT_TAKEN = object()

_PLAIN = (Tensor, nn.Parameter)
_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
# Whether the running backward keeps the graph (retain_graph); a torch without it keeps the residuals
# as long as the graph instead (still released with it, never read after a freed backward).
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


def _wanted(op: _ops._OpDef, values: dict[str, Any], grad: bool) -> tuple[str, ...] | None:
    """The gradient fields autograd will want (their tensors require grad), in field order; ``None``
    when the call is not the fast path's: a tensor of another type than a plain one or a
    Parameter, or a tensor that requires a gradient the op does not define."""
    want = []
    for name, is_list in op.tensor_args:
        value = values.get(name)
        if value is None:
            continue
        if is_list or type(value) not in _PLAIN:
            return None
        if grad and value.requires_grad:
            if op.field_of.get(name) != name:
                return None  # the full path raises NotImplementedError for it in the backward
            want.append(name)
    return tuple(f for f in op.fields if f in want)


def _made_fresh(outputs: Sequence[Any], values: dict[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """The outputs as the full path returns them — contiguous, cloned where one shares memory with
    an input or an earlier output (:func:`._ops._fresh`; ``None`` outputs kept) — and whether they
    already were.  Checked on a signature's first call: what decides it (the implementation and
    the layouts) is the signature's."""
    present = [t for t in outputs if t is not None]
    fresh = _ops._fresh(present, list(values.values()))
    made = iter(fresh)
    return tuple(None if t is None else next(made) for t in outputs), all(a is b for a, b in zip(fresh, present))


def call(spec: Any, values: dict[str, Any]) -> Any:
    """The result of the adapter's function for op ``spec`` with arguments ``values`` (by name), or
    :data:`NOT_TAKEN` when the full path must run it."""
    op = _ops._OPS[spec.name]
    if not _ops.EAGER_PATH or op.has_list_tensors or _compiling() or _functorch_active():
        return NOT_TAKEN
    if spec.updates and values.get("return_stats") is not False:
        return NOT_TAKEN
    grad = torch.is_grad_enabled()
    want = _wanted(op, values, grad)
    if want is None:
        return NOT_TAKEN
    plan, leaves, entry = plans.find(spec.name, ("torch", want), (), values)
    if plan is not None:
        if not want or plan.extras["recorded"]:  # the op's forward, as pnn.<op> runs a planned call
            result = plan.run(leaves)
            return NOT_TAKEN if result is plans.STALE else result
        return _apply(spec, op, values, want, plan, leaves, entry)
    if not plans.plannable(entry):
        return NOT_TAKEN
    return _first_call(spec, op, values, want, leaves, entry)


def _first_call(spec: Any, op: _ops._OpDef, values: dict[str, Any], want: tuple[str, ...], leaves: list[Any],
                entry: Any) -> Any:
    """A signature's first call: validated and routed in full, its plan left behind."""
    try:
        prepared = spec.prepare(**values)
    except Exception:
        return NOT_TAKEN
    call_ = prepared.call
    if not want:
        route = dispatch.route(call_)
        outputs, fresh = _made_fresh(route.forward(call_), values)
        if fresh:
            plans.remember(entry, leaves, spec.name, prepared, route, recorded=False)
        else:
            plans.refuse(entry, "its outputs are not fresh contiguous tensors (the adapter copies them)")
        return prepared.finish(outputs, call_)
    if _ops.may_record(op.name, values.get("x"), values.get("channel_axis", 1)) and _ops.selects_aten(call_):
        route = dispatch.route(call_, need_backward=True, recorded=True)
        outputs = route.forward(call_)
        plans.remember(entry, leaves, spec.name, prepared, route, recorded=True)
        return prepared.finish(outputs, call_)
    return _apply(spec, op, values, want, None, leaves, entry, prepared)


class _Job:
    """What :class:`_EagerOp`'s forward runs: a call of a planned signature, or its first call."""

    __slots__ = ("entry", "leaves", "op", "plan", "prepared", "spec", "values", "want")

    def __init__(self, spec: Any, op: _ops._OpDef, values: dict[str, Any], want: tuple[str, ...], plan: Any,
                 leaves: list[Any], entry: Any, prepared: Any) -> None:
        self.spec, self.op, self.values, self.want = spec, op, values, want
        self.plan, self.leaves, self.entry, self.prepared = plan, leaves, entry, prepared


def _apply(spec: Any, op: _ops._OpDef, values: dict[str, Any], want: tuple[str, ...], plan: Any, leaves: list[Any],
           entry: Any, prepared: Any = None) -> Any:
    tensors = [values[name] for name in want]  # (field names are the tensor arguments' here)
    flat = _EagerOp.apply(_Job(spec, op, values, want, plan, leaves, entry, prepared), *tensors)
    return flat[0] if len(flat) == 1 else tuple(flat)


class _Eager:
    """What the forward of a signature's calls keeps beside its pullback, the same for every call
    of it (so a plan keeps it, ``plan.extras["eager"]``): the gradients computed, the other tensor
    arguments kept for a ``create_graph=True`` backward, the non-tensor arguments."""

    __slots__ = ("needs", "others", "static")

    def __init__(self, spec: Any, op: _ops._OpDef, values: dict[str, Any], want: tuple[str, ...],
                 needs: frozenset[str], mutates: bool) -> None:
        self.needs = needs
        # The running statistics a call updated in place are not kept: the reference then normalises
        # with the batch's, and updates nothing.
        skip = spec.updates if mutates else ()
        self.others = tuple(name for name, _ in op.tensor_args
                            if name not in want and name not in skip and isinstance(values.get(name), Tensor))
        self.static = {k: None if k in skip else v for k, v in values.items() if not isinstance(v, Tensor) or k in skip}


class _EagerOp(torch.autograd.Function):
    """One op under autograd: the forward runs its ``vjp`` (on the plan when there is one), the
    backward its executed forward's backward (kept on the node, ``ctx.pnn_kept``, and dropped when
    autograd frees the saved tensors: after a backward without ``retain_graph``, or with the graph)."""

    @staticmethod
    def forward(ctx: Any, job: _Job, *tensors: Tensor) -> Any:
        plan = job.plan
        # (None: a kernel added with register_kernel now declines the call)
        call = None if plan is None else plan.call(job.leaves)
        if call is not None:
            # A planned call: no Prepared, no pullback closure — what they would hold is the plan's.
            eager = plan.extras["eager"]
            executed = plan.route.run(call)
            result = plan.finish(executed.take_outputs(), call)
            return _keep(ctx, job, tensors, executed, eager, result)
        spec = job.spec
        prepared = job.prepared if job.prepared is not None else spec.prepare(**job.values)
        needs = _needs(prepared, job.want, spec.name)
        route = dispatch.route(prepared.call, need_backward=True, needs=needs)
        executed = route.run(prepared.call)
        eager = _Eager(spec, job.op, job.values, job.want, needs, prepared.mutates)
        if plan is None:
            executed.outputs, fresh = _made_fresh(executed.outputs, job.values)
            if not fresh:
                plans.refuse(job.entry, "its outputs are not fresh contiguous tensors (the adapter copies them)")
            elif prepared.flatten_cotangent is not None:
                plans.refuse(job.entry, "its cotangents are nested (the full path's pullback unnests them)")
            else:
                plans.remember(job.entry, job.leaves, spec.name, prepared, route, recorded=False, needs=needs,
                               eager=eager)
        outputs = executed.take_outputs()
        result = prepared.finish(outputs, prepared.call)
        if prepared.flatten_cotangent is not None:
            executed = pullback_of(spec.name, prepared, needs, executed, outputs)
        return _keep(ctx, job, tensors, executed, eager, result)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        # Autograd's own checks first: a second backward through a freed graph, an input modified in
        # place since the forward (its version moved): PyTorch's errors, as for its own ops.
        saved = ctx.saved_tensors
        spec, op, want, needs = ctx.pnn_job
        result: list[Any] = [None] * (1 + len(want))
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients through the reference
            values = dict(ctx.pnn_static)
            values.update(zip((*want, *ctx.pnn_others), saved))
            bound = op.bind(encode(spec, values))
            computed = _ops._differentiable_grads(op, bound, grads[: op.n_diff],
                                                  {name: ctx.needs_input_grad[1 + k] for k, name in enumerate(want)})
            for k, name in enumerate(want):
                result[1 + k] = computed.get(name)
            return tuple(result)
        kept = ctx.pnn_kept
        if not _keep_graph():
            # Freed with autograd's saved tensors (PyTorch's own compiled backward does the same):
            # the residuals do not outlive this backward, though the graph may.
            ctx.pnn_kept = None
        if type(kept) is dispatch.Executed:
            # Autograd's cotangents are the outputs' shapes and dtypes (zeros for an unused output):
            # the pullback's checks of a user's cotangent have nothing to catch here.
            computed = kept.backward(grads[: op.n_diff], needs, {}) if needs else {}
            pick = computed.get
        else:
            pick = kept(op.nest(list(grads[: op.n_diff])))._asdict().get
        flags = ctx.needs_input_grad
        for k, name in enumerate(want):
            if flags[1 + k] and name in needs:
                grad = pick(name)
                result[1 + k] = None if grad is None else grad.contiguous()
        return tuple(result)


def _keep(ctx: Any, job: _Job, tensors: tuple[Tensor, ...], executed: Any, eager: _Eager, result: Any) -> Any:
    """Keep on ``ctx`` what the backward needs — the executed forward (or a pullback), and the
    tensors, saved for autograd's version checks and a ``create_graph=True`` backward — and return
    the forward's flat outputs.

    The executed forward sits on ``ctx`` itself: a handle tensor into a table, freed with the saved
    tensors (what the custom ops need), cost 20-30 µs of a 300 µs LayerNorm(64) step on a Zen 3.
    """
    flat = result if isinstance(result, tuple) else (result,)
    op = job.op
    if len(flat) > op.n_diff:
        ctx.mark_non_differentiable(*flat[op.n_diff:])
    ctx.pnn_kept = executed
    ctx.pnn_job = (job.spec, op, job.want, eager.needs)
    ctx.pnn_others = eager.others
    ctx.pnn_static = eager.static
    values = job.values
    ctx.save_for_backward(*tensors, *(values[name] for name in eager.others))
    return flat
