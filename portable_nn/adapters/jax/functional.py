"""The functions of ``portable_nn.jax``, generated from each op's description (:class:`OpSpec`).

Each has the signature, defaults and documentation of the portable_nn op it wraps; the op's argument
kinds say which arguments are traced arrays and which are static (see :func:`split_arguments`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from ...api._common import OpSpec, all_specs, spec_of
from ...api._types import ARRAY_KINDS
from .. import op_function
from . import collective
from ._ops import _is_jax_array, _is_tracer, register_op, run_op


def _params_tree(params: Any) -> Any:
    """``params`` as a list of tuples (JAX pytrees); anything else is left for validation."""
    if isinstance(params, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in params):
        return [tuple(p) for p in params]
    return params


def split_arguments(spec: OpSpec, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The call's arguments as ``(arrays, static)``, by their kinds.

    Array kinds are traced (the RNN ``params`` as a list of tuples); sequence ``lengths`` are traced
    when they are a traced value and static otherwise (read at trace time); everything else is a
    static Python value.
    """
    arrays: dict[str, Any] = {}
    static: dict[str, Any] = {}
    for name, kind in spec.arguments.items():
        value = values[name]
        if kind == "RnnParams":
            arrays[name] = _params_tree(value)
        elif kind in ARRAY_KINDS:
            arrays[name] = value
        elif kind == "Lengths | None" and _is_tracer(value):
            arrays[name] = value
        elif kind == "Lengths | None" and _is_jax_array(value):
            static[name] = np.asarray(value)
        else:
            static[name] = value
    return arrays, static


def _docstring(spec: OpSpec) -> str:
    summary, _, details = spec.doc.partition("\n")
    fields = ", ".join(f"``{f}``" for f in spec.grad_fields)
    notes = [f"{summary.rstrip('.')} — :func:`portable_nn.{spec.name}` for JAX arrays.", "",
             f"Differentiable by ``jax.grad``/``jax.vjp`` with respect to {fields}, through portable_nn's "
             "backward, and in forward mode and to any order (``jax.jvp``, ``jax.hessian``) through the "
             "reference; every argument that is not an array is static (fixed at trace time)."]
    if spec.updates:
        notes += ["", "JAX arrays are immutable: updating the running statistics needs ``return_stats=True``, "
                  "which returns ``(y, new_running_mean, new_running_var)``; the new statistics carry no "
                  "gradient."]
    return "\n".join(notes) + "\n" + details


def _make(spec: OpSpec) -> Callable[..., Any]:
    def run(values: dict[str, Any]) -> Any:
        arrays, static = split_arguments(spec, values)
        return run_op(spec.name, arrays, static)

    op = op_function(spec, "portable_nn.jax", _docstring(spec), run)
    op._pnj_op = spec.name  # type: ignore[attr-defined]
    register_op(spec.name, lambda *args, _capture, **kwargs: _capture_call(spec, _capture, args, kwargs))
    return op


def _capture_call(spec: OpSpec, capture: list, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Validate and plan a call without running it (for :func:`explain`)."""
    try:
        bound = spec.signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{spec.name}: {exc}") from None
    bound.apply_defaults()
    arrays, static = split_arguments(spec, bound.arguments)
    run_op(spec.name, arrays, static, capture)


_AXIS_NAME_DOC = """
    ``axis_name`` (this adapter only): the name of a mapped axis (``jax.shard_map``, ``jax.pmap``,
    ``jax.vmap(..., axis_name=...)``) over which the batch is split; the statistics are then the
    whole batch's, merged stably across it (:mod:`portable_nn.adapters.jax.collective`), the same
    on every device, and gradients flow through the merge.  ``None`` (the default): this part's.
"""


def _with_axis_name(name: str, synced: Callable[..., Any],
                    uses_batch: Callable[[dict[str, Any]], bool]) -> Callable[..., Any]:
    """The generated op ``name`` with a keyword-only ``axis_name`` added (statistics across devices)."""
    local = globals()[name]
    spec = spec_of(name)
    extra = inspect.Parameter("axis_name", inspect.Parameter.KEYWORD_ONLY, default=None)
    signature = spec.signature.replace(parameters=[*spec.signature.parameters.values(), extra])

    @functools.wraps(local)
    def op(*args: Any, axis_name: Any = None, **kwargs: Any) -> Any:
        if axis_name is None:
            return local(*args, **kwargs)
        try:
            bound = spec.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
        bound.apply_defaults()
        if not uses_batch(bound.arguments):  # running statistics: nothing to merge
            return local(*args, **kwargs)
        return synced(**bound.arguments, axis_name=axis_name)

    op.__signature__ = signature  # type: ignore[attr-defined]
    op.__doc__ = (local.__doc__ or "") + _AXIS_NAME_DOC
    return op


__all__: list[str] = []
for _spec in all_specs():
    globals()[_spec.name] = _make(_spec)
    __all__.append(_spec.name)
del _spec
globals()["moments"] = _with_axis_name("moments", collective.synced_moments, lambda a: True)
globals()["batch_norm"] = _with_axis_name(
    "batch_norm", collective.synced_batch_norm, lambda a: bool(a["training"]) or a["running_mean"] is None)
