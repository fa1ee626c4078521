"""``vjp``: one gradient entry point for every op and every backend.

::

    y, pullback = pnn.vjp(pnn.layer_norm, x, w, b, wrt=("weight", "bias"))
    grads = pullback(dy)            # LayerNormGrads(x=None, weight=..., bias=...)

The forward runs once, on the implementation dispatch selects (one that has a
backward kernel), keeping only the residuals that kernel needs.  The pullback
runs the fused backward for the gradients in ``wrt`` only: a gradient nobody
asked for is neither computed nor allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from . import _arrays, dispatch, plans
from .api._common import Prepared, grads_type, spec_of

__all__ = ["output_infos", "pullback_of", "vjp"]


def _needs(prepared: Prepared, wrt: Any, op_name: str) -> frozenset[str]:
    fields = prepared.grad_fields
    if wrt is None:
        return prepared.given
    names = (wrt,) if isinstance(wrt, str) else tuple(wrt) if isinstance(wrt, Iterable) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(f"wrt must be a name or a tuple of names from {fields}, got {wrt!r}")
    unknown = [n for n in names if n not in fields]
    if unknown:
        raise ValueError(
            f"wrt: {op_name} has no differentiable argument {unknown[0]!r}; expected names from {fields}"
        )
    return frozenset(names) & prepared.given


class _OutputInfo:
    """What a pullback checks a cotangent against: an output's library, shape, dtype and device.

    The pullback keeps these, not the outputs: holding an output until the pullback is dropped
    keeps its memory alive past the point where the caller (or autograd) released it.  Measured
    in a torch Conv2d+BatchNorm2d+ReLU step at (16,64,28,28): the conv output lived through the
    conv's backward, whose buffers then came from fresh heap pages (+1,500 page faults per step,
    +2.5 ms of 13).
    """

    __slots__ = ("device", "dtype", "family", "shape")

    def __init__(self, y: Any) -> None:
        self.family = _arrays.family(y)
        self.shape = tuple(y.shape)
        self.dtype = y.dtype
        self.device = None if self.family == "numpy" else getattr(y, "device", None)

    def zeros(self, xp: Any) -> Any:
        if self.family == "numpy":  # NumPy's own zeros: the wrapper namespace is imported lazily (see _arrays)
            return np.zeros(self.shape, self.dtype)
        if self.device is None:
            return xp.zeros(self.shape, dtype=self.dtype)
        return xp.zeros(self.shape, dtype=self.dtype, device=self.device)


def _cotangents(prepared: Prepared, outputs: tuple[_OutputInfo, ...], cotangent: Any) -> tuple[Any, ...]:
    """One cotangent array per differentiable output, ``None`` replaced by zeros."""
    if prepared.flatten_cotangent is not None:
        cotangent = prepared.flatten_cotangent(cotangent)
    n = prepared.n_diff_outputs
    if n == 1:
        if isinstance(cotangent, (tuple, list)):
            extra = [c for c in cotangent[1:] if c is not None]
            if not cotangent or extra:
                raise ValueError(
                    "this op has one differentiable output: pass its cotangent (or a tuple "
                    "whose other entries are None)"
                )
            cotangent = cotangent[0]
        given = (cotangent,)
    else:
        if not isinstance(cotangent, (tuple, list)) or len(cotangent) != n:
            raise ValueError(f"pass a tuple of {n} cotangents (entries may be None), got {type(cotangent).__name__}")
        given = tuple(cotangent)
    xp = prepared.call.xp
    result = []
    for i, (ct, y) in enumerate(zip(given, outputs)):
        label = "cotangent" if n == 1 else f"cotangent[{i}]"
        if ct is None:
            result.append(y.zeros(xp))
            continue
        if not _arrays.is_array(ct):
            raise TypeError(f"{label} must be an array like the output, got {type(ct).__name__}")
        if _arrays.family(ct) != y.family:
            raise TypeError(
                f"{label} is {_arrays.describe_family(_arrays.family(ct))} but the output is "
                f"{_arrays.describe_family(y.family)}"
            )
        if tuple(ct.shape) != y.shape:
            raise ValueError(f"{label} must have the output's shape {y.shape}, got {tuple(ct.shape)}")
        if ct.dtype != y.dtype:
            raise TypeError(
                f"{label} has dtype {_arrays.dtype_name(xp, ct.dtype)} but the output has "
                f"{_arrays.dtype_name(xp, y.dtype)}"
            )
        result.append(ct)
    return tuple(result)


def _out_buffers(prepared: Prepared, needs: frozenset[str], out: Any) -> dict[str, Any]:
    """Validated preallocated gradient buffers by field name."""
    if out is None:
        return {}
    if hasattr(out, "_asdict"):
        out = out._asdict()
    if not isinstance(out, Mapping):
        raise TypeError("out must be a mapping or a gradients named tuple of preallocated buffers")
    buffers = {}
    for name, buffer in out.items():
        if name not in prepared.grad_fields:
            raise ValueError(f"out: unknown gradient field {name!r}; expected names from {prepared.grad_fields}")
        if buffer is None or name not in needs:
            continue
        buffers[name] = _check_buffer(buffer, prepared.values[name], f"out[{name!r}]", name)
    return buffers


def _check_buffer(buffer: Any, like: Any, label: str, name: str) -> Any:
    """``buffer`` checked against the argument ``like`` it receives the gradient of.

    A structured argument (a list or tuple of arrays, such as an RNN's
    ``params``) takes buffers of the same structure, ``None`` where none is given.
    """
    if isinstance(like, (list, tuple)):
        if not isinstance(buffer, (list, tuple)) or len(buffer) != len(like):
            raise TypeError(f"{label} must be a list or tuple of {len(like)} entries, structured like {name}")
        return [_check_buffer(b, item, f"{label}[{i}]", name) for i, (b, item) in enumerate(zip(buffer, like))]
    if buffer is None:
        return None
    if like is None:
        raise ValueError(f"{label} must be None: the matching entry of {name} is None (it has no gradient)")
    if not _arrays.is_array(buffer) or _arrays.family(buffer) != _arrays.family(like):
        raise TypeError(f"{label} must be an array of the same library as {name}")
    if tuple(buffer.shape) != tuple(like.shape) or buffer.dtype != like.dtype:
        raise ValueError(
            f"{label} must have the shape {tuple(like.shape)} and dtype of {name}, got "
            f"shape {tuple(buffer.shape)}"
        )
    if not _arrays.is_writeable(buffer):
        raise ValueError(f"{label} is not writable")
    return buffer


def _fill(buffer: Any, grad: Any) -> Any:
    """The gradient in the caller's buffer(s): copied in unless the backward wrote there already."""
    if isinstance(buffer, list):
        return type(grad)(_fill(b, g) for b, g in zip(buffer, grad))
    if buffer is None:
        return grad
    if grad is not buffer:
        buffer[...] = grad
    return buffer


def vjp(op: Any, *args: Any, wrt: str | Iterable[str] | None = None, **kwargs: Any) -> tuple[Any, Callable[..., Any]]:
    """Run ``op(*args, **kwargs)`` and return ``(result, pullback)``.

    For an op y = f(a₁, a₂, …) and a cotangent ȳ shaped like y, the pullback
    returns the vector-Jacobian products āᵢ = ȳ · ∂y/∂aᵢ (for several outputs,
    the sum over outputs) — the gradients of a scalar loss L with ∂L/∂y = ȳ.  The
    forward runs once, on an implementation that has a backward kernel (``auto``
    passes forward-only kernels over; a forced backend without one raises
    :class:`BackendUnavailableError`), and keeps only the
    residuals that kernel needs.  The pullback computes only the gradients named
    in ``wrt``: the others are neither computed nor allocated.

    Args:
        op: a public op (``pnn.layer_norm``) or its name (``"layer_norm"``).
        *args: the op's positional arguments, exactly as for a plain call.
        **kwargs: the op's keyword arguments, exactly as for a plain call.
        wrt: the differentiable arguments whose gradients are wanted, one name or
            a tuple of names from the op's gradient fields (each op's docstring
            lists them); ``None`` means every one that was given (not ``None``).

    Returns:
        ``(result, pullback)``.  ``result`` is what the plain call returns
        (running statistics are updated the same way).  ``pullback(cotangent,
        *, out=None)`` returns a named tuple (``LayerNormGrads`` …) with one
        field per differentiable argument in signature order — ``None`` for
        arguments that were ``None`` or not in ``wrt``.  ``cotangent`` is an
        array with the output's shape, library and dtype; ops with several
        differentiable outputs (``moments``, ``lstm_cell``, the sequence ops)
        take a tuple mirroring their result, any entry ``None`` (zero).  ``out``
        maps field names (or takes a gradients named tuple) to preallocated
        buffers, each with its argument's shape and dtype, that receive the
        gradients and are returned in the named tuple.  A pullback may be
        called any number of times; it raises ``TypeError``/``ValueError`` for
        a cotangent or buffer that does not fit.

    Raises:
        TypeError: ``op`` is not a portable_nn op or op name; ``wrt`` is not a
            name or a tuple of names.
        ValueError: a ``wrt`` name that is not one of the op's gradient fields.
        BackendUnavailableError: the configured backend cannot run the call or
            has no backward kernel.

    The op's own argument checks apply as for a plain call (``TypeError`` /
    ``ValueError`` naming the argument).
    """
    spec = spec_of(op)
    plan, leaves, entry = plans.find(spec.name, ("vjp", wrt), args, kwargs)
    prepared = None if plan is None else plan.prepared(leaves)
    if prepared is not None:  # the fast path: a plan of this call's signature (portable_nn.plans)
        needs, cls, infos = plan.extras["vjp"]
        executed = plan.route.run(prepared.call)
        outputs = executed.take_outputs()
        return prepared.finish(outputs, prepared.call), pullback_of(spec.name, prepared, needs, executed, outputs,
                                                                     cls, infos)
    prepared = spec.prepare(*args, **kwargs)
    needs = _needs(prepared, wrt, spec.name)
    route = dispatch.route(prepared.call, need_backward=True, needs=needs)
    executed = route.run(prepared.call)
    outputs = executed.take_outputs()  # the pullback keeps the backward, not the outputs (see _OutputInfo)
    cls = grads_type(spec.name, prepared.grad_fields)
    infos = output_infos(prepared, outputs)
    if entry is not None:  # an output's library, shape and dtype are the signature's: the plan keeps them
        plans.remember(entry, leaves, spec.name, prepared, route, vjp=(needs, cls, infos))
    return prepared.finish(outputs, prepared.call), pullback_of(spec.name, prepared, needs, executed, outputs,
                                                                 cls, infos)


def output_infos(prepared: Prepared, outputs: tuple[Any, ...]) -> tuple[_OutputInfo, ...]:
    """What a pullback checks its cotangents against: each differentiable output's library, shape,
    dtype and device (the signature's: a plan keeps them)."""
    return tuple(_OutputInfo(y) for y in outputs[: prepared.n_diff_outputs])


def pullback_of(op: str, prepared: Prepared, needs: frozenset[str], executed: dispatch.Executed,
                outputs: tuple[Any, ...], cls: type | None = None,
                infos: tuple[_OutputInfo, ...] | None = None) -> Callable[..., Any]:
    """The pullback of a forward that ran (``executed``, whose ``outputs`` the caller took), for
    the gradients ``needs`` (see :func:`vjp`); it keeps the outputs' shapes and dtypes, not the
    outputs (``infos``, and the gradients' named tuple ``cls``, when the caller has them made)."""
    diff_outputs = infos if infos is not None else output_infos(prepared, outputs)
    if cls is None:
        cls = grads_type(op, prepared.grad_fields)
    fields = prepared.grad_fields

    def pullback(cotangent: Any, *, out: Any = None) -> Any:
        cts = _cotangents(prepared, diff_outputs, cotangent)
        buffers = _out_buffers(prepared, needs, out)
        grads = executed.backward(cts, needs, buffers) if needs else {}
        for name, buffer in buffers.items():
            grads[name] = _fill(buffer, grads[name])
        return cls(*[grads.get(name) if name in needs else None for name in fields])

    pullback.__doc__ = f"Pullback of {op}: cotangent(s) of the output(s) -> {cls.__name__}."
    return pullback
