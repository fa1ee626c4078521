"""The functions of ``portable_nn.torch``, generated from each op's description (:class:`OpSpec`).

Each has the signature, defaults and documentation of the portable_nn op it wraps, takes and
returns tensors and is differentiable by autograd: it encodes its arguments into its custom op's
schema (:mod:`._defs`) and calls the op (eagerly through a plain ``autograd.Function`` where that
is allowed, see :mod:`._ops`).  An op that updates running statistics in place (batch and
instance norm) calls the in-place variant, or, with ``return_stats=True``, returns the new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...api._common import OpSpec, all_specs
from .. import op_function
from . import _fast, _layout
from ._defs import RETURN_STATS, Unencodable, encode, nest_outputs, result_of, store_updates, updated
from ._ops import _OPS, _call, _eager, _wrt_mask


def _docstring(spec: OpSpec) -> str:
    summary, _, details = spec.doc.partition("\n")
    fields = ", ".join(f"``{f}``" for f in spec.grad_fields)
    notes = [f"{summary.rstrip('.')} — :func:`portable_nn.{spec.name}` on tensors.", "",
             f"Differentiable by ``torch.autograd`` with respect to {fields}, through portable_nn's fused "
             f"backward (custom op ``portable_nn::{spec.name}``; ``torch.compile`` traces it), and to any order: "
             "a ``create_graph=True`` backward differentiates the array-API reference instead (PyTorch's own "
             "kernels for convolutions and dense layers)."]
    return "\n".join(notes) + "\n" + details


def _with_updates(spec: OpSpec, schema_args: list[Any], values: dict[str, Any], return_stats: bool) -> Any:
    """An op that updates running statistics: in place through ``<name>_``, or functional with ``return_stats``."""
    op = _OPS[spec.name]
    bound = op.bind(schema_args)
    if not return_stats and not _eager(op, schema_args):
        return getattr(torch.ops.portable_nn, f"{spec.name}_")(*schema_args, _wrt_mask(op, schema_args))
    outputs = _call(spec.name, *schema_args)
    n = len(spec.output_names)
    if not return_stats:
        # As the in-place op's composite implementation: the functional op, then the copy.
        store_updates(spec, bound, outputs)
        return nest_outputs(spec, outputs[:n])
    if not updated(spec, bound, outputs):
        return (*outputs[:n], *(values[name] for name in spec.updates))
    return tuple(outputs)


def _make(spec: OpSpec) -> Callable[..., Any]:
    laid_out = _layout.laid_out_ops()

    def run(values: dict[str, Any]) -> Any:
        if spec.name in laid_out:
            moved = _layout.channels_last_call(spec.name, values)
            if moved is not None:  # channels_last data: the channels-last call on its view, and back
                return _layout.restore(run(moved), values["x"].dim())
        result = _fast.call(spec, values)  # a signature run before (see _fast)
        if result is not _fast.NOT_TAKEN:
            return result
        try:
            schema_args = encode(spec, values)
        except Unencodable as exc:
            spec.function(**values)  # portable_nn's validation names the problem, in its own words
            raise TypeError(f"{spec.name}: {exc}") from None
        if spec.updates:
            return_stats = values[RETURN_STATS]
            if not isinstance(return_stats, bool):
                raise TypeError(f"{RETURN_STATS} must be True or False, got {return_stats!r}")
            return _with_updates(spec, schema_args, values, return_stats)
        return result_of(spec, _call(spec.name, *schema_args), values)

    return op_function(spec, "portable_nn.torch", _docstring(spec), run)


__all__: list[str] = []
for _spec in all_specs():
    globals()[_spec.name] = _make(_spec)
    __all__.append(_spec.name)
del _spec
