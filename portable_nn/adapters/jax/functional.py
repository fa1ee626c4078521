"""The functions of ``portable_nn.jax``, generated from each op's description (:class:`OpSpec`).

Each has the signature, defaults and documentation of the portable_nn op it wraps; the op's argument
kinds say which arguments are traced arrays and which are static (see :func:`split_arguments`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...api._common import OpSpec, all_specs
from ...api._types import ARRAY_KINDS
from .. import op_function
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
             "backward; every argument that is not an array is static (fixed at trace time)."]
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


__all__: list[str] = []
for _spec in all_specs():
    globals()[_spec.name] = _make(_spec)
    __all__.append(_spec.name)
del _spec
