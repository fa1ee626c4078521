"""Each portable_nn op as a pair of torch custom ops, derived from its description (:class:`OpSpec`).

Nothing here is written per op.  The op's argument kinds (its annotations, see
:mod:`portable_nn.api._types`) give the custom op's schema through :data:`KINDS`, one entry per
kind with the schema slots it takes and how a value crosses them (``encode`` on the way in,
``decode`` back to the portable_nn argument).  The op's outputs, gradient fields and in-place
updates give the rest.  The fake (meta) implementation that ``torch.compile`` traces with runs the
op itself, on the reference backend, on the fake tensors: the api's own validation and shape
planning decide the output shapes, so they cannot drift from what the kernels return.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ... import backends, config
from ...api._common import OpSpec, all_specs
from ._ops import NAMESPACE, _act, _act_arg, _ints, _OpDef, _register

# =========================================================================== argument kinds


class Unencodable(TypeError):
    """A value the schema cannot carry; the caller lets portable_nn's validation name the problem."""


def _int_list(value: Any, name: str) -> list[int]:
    try:
        return _ints(value, name)
    except TypeError as exc:
        raise Unencodable(str(exc)) from None


def _int_or_tuple(values: Sequence[int] | None) -> int | tuple[int, ...] | None:
    if values is None:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _scalar(kind: type) -> Callable[[Any, str], tuple[Any, ...]]:
    def encode(value: Any, name: str) -> tuple[Any, ...]:
        if isinstance(value, bool) and kind is not bool:
            raise Unencodable(f"{name} must be {kind.__name__}, got {value!r}")
        if kind is bool and not isinstance(value, bool) and value not in (0, 1):
            raise Unencodable(f"{name} must be True or False, got {value!r}")
        if kind is float and isinstance(value, numbers.Real):
            return (float(value),)
        if kind is int and isinstance(value, numbers.Integral):
            return (int(value),)
        if kind is bool or isinstance(value, kind):
            return (kind(value),)
        raise Unencodable(f"{name} must be {kind.__name__}, got {type(value).__name__}")

    return encode


def _encode_padding(value: Any, name: str) -> tuple[Any, ...]:
    """An int (``[p]``), ``"same"``/``"valid"`` (the form), or per axis ints or pairs (flat pairs)."""
    if isinstance(value, str):
        return [], value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return [int(value)], "explicit"
    if not isinstance(value, (list, tuple)) or not value:
        raise Unencodable(f"padding must be an int, a tuple, 'same' or 'valid', got {value!r}")
    flat: list[int] = []
    for entry in value:
        pair = _int_list(entry, "padding")
        if len(pair) not in (1, 2):
            raise Unencodable(f"padding entries must be an int or a (low, high) pair, got {entry!r}")
        flat.extend(pair * 2 if len(pair) == 1 else pair)
    return flat, "explicit"


def _decode_padding(flat: list[int], form: str) -> Any:
    if form != "explicit":
        return form
    if len(flat) == 1:
        return flat[0]
    return tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))


def _encode_params(params: Any, name: str) -> tuple[Any, ...]:
    """pnn's list of ``(w_ih, w_hh, b_ih, b_hh[, w_hr])`` → flat weights, biases and projections.

    A tensor list cannot hold ``None``: the op takes all biases or none, and a missing bias among
    present ones becomes a constant zero tensor.  Projections (LSTM ``w_hr``) are all or none.
    """
    if not isinstance(params, (list, tuple)) or not params or not all(
        isinstance(p, (list, tuple)) and len(p) in (4, 5) and all(w is None or isinstance(w, Tensor) for w in p)
        for p in params
    ):
        raise Unencodable("params must be a list of (w_ih, w_hh, b_ih, b_hh) tuples (LSTM: or (w_ih, w_hh, b_ih, "
                          "b_hh, w_hr)), one per layer and direction")
    projections = [p[4] for p in params if len(p) == 5]
    if projections and (len(projections) != len(params) or any(w is None for w in projections)):
        raise Unencodable("params entries must all be 4-tuples or all 5-tuples with a w_hr tensor")
    weights = [w for p in params for w in (p[0], p[1])]
    bias_values = [b for p in params for b in (p[2], p[3])]
    if all(b is None for b in bias_values):
        return weights, [], projections
    biases = []
    for k, b in enumerate(bias_values):
        if b is None:
            w_hh = params[k // 2][1]
            b = w_hh.new_zeros(w_hh.shape[0])
        biases.append(b)
    return weights, biases, projections


def _decode_params(weights: Sequence[Tensor], biases: Sequence[Tensor],
                   projections: Sequence[Tensor]) -> list[tuple[Any, ...]]:
    params = []
    for k in range(len(weights) // 2):
        b_ih, b_hh = (biases[2 * k], biases[2 * k + 1]) if biases else (None, None)
        entry = (weights[2 * k], weights[2 * k + 1], b_ih, b_hh)
        params.append((*entry, projections[k]) if projections else entry)
    return params


def _encode_lengths(value: Any, name: str) -> tuple[Any, ...]:
    if value is None:
        return (None,)
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.ndim != 1:
            raise Unencodable("lengths must be a 1-D integer tensor or a sequence of ints")
        return ([int(v) for v in value.tolist()],)
    return (_int_list(list(value) if isinstance(value, (list, tuple)) else value, "lengths"),)


def _optional(encode: Callable[[Any, str], tuple[Any, ...]]) -> Callable[[Any, str], tuple[Any, ...]]:
    return lambda value, name: (None,) if value is None else encode(value, name)


def _tensor(optional: bool) -> Callable[[Any, str], tuple[Any, ...]]:
    def encode(value: Any, name: str) -> tuple[Any, ...]:
        if (value is None and optional) or isinstance(value, Tensor):
            return (value,)
        raise Unencodable(f"{name} must be a tensor, got {type(value).__name__}")

    return encode


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Kind:
    """How one kind of argument crosses a custom op's schema.

    Attributes:
        slots: the schema's ``(type, name)`` per slot; ``"{}"`` stands for the argument's name.
        encode: ``(value, name) -> one value per slot`` (``Unencodable`` for what the schema cannot carry).
        decode: the slot values back to the portable_nn argument.
    """

    slots: tuple[tuple[str, str], ...]
    encode: Callable[[Any, str], tuple[Any, ...]]
    decode: Callable[..., Any] = _identity

    def names(self, argument: str) -> tuple[str, ...]:
        return tuple(slot.format(argument) for _, slot in self.slots)


_AXES = Kind((("int[]", "{}"),), lambda v, n: (_int_list(v, n),), _int_or_tuple)
_AXES_OPTIONAL = Kind((("int[]?", "{}"),), _optional(_AXES.encode), _int_or_tuple)

#: Every argument kind (:data:`portable_nn.api._types.KINDS`) and its schema slots.
KINDS: dict[str, Kind] = {
    "Array": Kind((("Tensor", "{}"),), _tensor(False)),
    "Array | None": Kind((("Tensor?", "{}"),), _tensor(True)),
    "Axes": _AXES,
    "Axes | None": _AXES_OPTIONAL,
    "IntOrTuple": _AXES,
    "IntOrTuple | None": _AXES_OPTIONAL,
    # an int and a 1-tuple differ for a pooling window (every spatial axis vs one): a flag keeps which
    "Window": Kind((("int[]", "{}"), ("bool", "{}_per_axis")),
                   lambda v, n: (_int_list(v, n), isinstance(v, (tuple, list))),
                   lambda values, per_axis: tuple(values) if per_axis else values[0]),
    # the second slot says which form the padding takes ("explicit", "same", "valid"); what the padding
    # holds (conv's padding_mode) is an argument of its own
    "Padding": Kind((("int[]", "{}"), ("str", "{}_form")), _encode_padding, _decode_padding),
    "ActivationLike": Kind((("str", "{}"), ("float", "slope")), lambda v, n: _act(v), _act_arg),
    "RnnParams": Kind((("Tensor[]", "weights"), ("Tensor[]", "biases"), ("Tensor[]", "projections")),
                      _encode_params, _decode_params),
    "Lengths | None": Kind((("int[]?", "{}"),), _encode_lengths),
    "int": Kind((("int", "{}"),), _scalar(int)),
    "int | None": Kind((("int?", "{}"),), _optional(_scalar(int))),
    "float": Kind((("float", "{}"),), _scalar(float)),
    "bool": Kind((("bool", "{}"),), _scalar(bool)),
    "str": Kind((("str", "{}"),), _scalar(str)),
}

#: The argument that chooses between updating running statistics in place and returning them; the
#: adapter decides it (functional op, or its in-place variant), so it is not in the schema.
RETURN_STATS = "return_stats"


# =========================================================================== an op's definition


def schema_arguments(spec: OpSpec) -> list[tuple[str, str, str]]:
    """The schema's ``(type, slot name, argument)`` triples, in the op's signature order."""
    slots = []
    for name, kind in spec.arguments.items():
        if spec.updates and name == RETURN_STATS:
            continue
        if kind not in KINDS:
            raise TypeError(f"portable_nn.torch: {spec.name}'s argument {name} has kind {kind!r}, which has no "
                            "schema; add it to portable_nn.adapters.torch._defs.KINDS")
        for (schema_type, _), slot in zip(KINDS[kind].slots, KINDS[kind].names(name)):
            slots.append((schema_type, slot, name))
    return slots


def encode(spec: OpSpec, values: dict[str, Any]) -> list[Any]:
    """The schema's argument values for a call's (bound) arguments; ``Unencodable`` if one cannot cross."""
    encoders = _ENCODERS[spec.name]
    flat: list[Any] = []
    for name, encode_one in encoders:
        value = values[name]
        if encode_one is None:  # a tensor slot (the commonest: kept inline, this runs on every call)
            if value is not None and not isinstance(value, Tensor):
                raise Unencodable(f"{name} must be a tensor, got {type(value).__name__}")
            flat.append(value)
        else:
            flat.extend(encode_one(value, name))
    return flat


def _encoders(spec: OpSpec) -> list[tuple[str, Callable[[Any, str], tuple[Any, ...]] | None]]:
    """Each schema argument's name and encoder (``None`` for a tensor slot)."""
    return [(name, None if kind in ("Array", "Array | None") else KINDS[kind].encode)
            for name, kind in spec.arguments.items() if not (spec.updates and name == RETURN_STATS)]


#: Every op's encoders, made at import: a table filled on first use is state ``torch.compile``
#: guards on (a first eager call after a compile would then recompile the model).
_ENCODERS: dict[str, list[tuple[str, Callable[[Any, str], tuple[Any, ...]] | None]]] = {}


def _decoder(spec: OpSpec) -> Callable[[dict[str, Any]], dict[str, Any]]:
    direct, converted = [], []  # one-slot identity kinds are copied as they are (most arguments)
    for name, kind in spec.arguments.items():
        if spec.updates and name == RETURN_STATS:
            continue
        slots = KINDS[kind].names(name)
        if KINDS[kind].decode is _identity and slots == (name,):
            direct.append(name)
        else:
            converted.append((name, KINDS[kind].decode, slots))

    def decode(bound: dict[str, Any]) -> dict[str, Any]:
        kwargs = {name: bound[name] for name in direct}
        for name, decode_one, slots in converted:
            kwargs[name] = decode_one(*(bound[slot] for slot in slots))
        if spec.updates:
            kwargs[RETURN_STATS] = True  # the functional op: the new statistics are outputs
        return kwargs

    return decode


def _flatten_tree(tree: Any, value: Any) -> list[Any]:
    if isinstance(tree, tuple):
        return [leaf for t, v in zip(tree, value) for leaf in _flatten_tree(t, v)]
    return [value]


def _nest_tree(tree: Any, flat: Sequence[Any]) -> tuple[Any, int]:
    if isinstance(tree, tuple):
        items, used = [], 0
        for t in tree:
            item, n = _nest_tree(t, flat[used:])
            items.append(item)
            used += n
        return tuple(items), used
    return flat[0], 1


def nest_outputs(spec: OpSpec, flat: Sequence[Any]) -> Any:
    """The op's result structure (``spec.outputs``) from its flat outputs."""
    return _nest_tree(spec.outputs, flat)[0]


def result_of(spec: OpSpec, flat: Sequence[Any], values: dict[str, Any]) -> Any:
    """What the op returns for a call with arguments ``values``: the nested outputs, without the
    optional outputs it did not request (the bare first output when none is requested)."""
    nested = nest_outputs(spec, flat)
    if not spec.optional_outputs:
        return nested
    requested = spec.requested(values)
    kept = tuple(item for name, item in zip(spec.outputs, nested) if name in requested)
    return kept if len(kept) > 1 else kept[0]


def _placeholder(like: Tensor) -> Tensor:
    """An output the call did not request (an optional output): empty, int64 (they are indices)."""
    return like.new_empty(0, dtype=torch.int64)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def updated(spec: OpSpec, bound: dict[str, Any], outputs: Sequence[Tensor]) -> bool:
    """Whether the functional op's statistics outputs are new statistics (not empty placeholders)."""
    first = bound.get(spec.updates[0]) if spec.updates else None
    return first is not None and outputs[len(spec.output_names)].shape == first.shape


def _flattener(spec: OpSpec) -> Callable[[Any, dict[str, Any]], tuple[Any, ...]]:
    n = len(spec.output_names)

    def flatten(result: Any, bound: dict[str, Any]) -> tuple[Any, ...]:
        if spec.optional_outputs:  # the requested outputs, and an empty placeholder for each other one
            requested = spec.requested(bound)
            got = iter(result if len(requested) > 1 else (result,))
            flat = [next(got) if name in requested else None for name in spec.output_names]
            return tuple(_placeholder(flat[0]) if t is None else t for t in flat)  # the first is never optional
        if not spec.updates:
            return (result,) if n == 1 else tuple(_flatten_tree(spec.outputs, result))
        main = _flatten_tree(spec.outputs, result[0] if n == 1 else result[:n])
        # Statistics that were not updated come back as the caller's own (or None): outputs must be
        # new tensors, so an unchanged statistic is an empty placeholder.
        stats = [_empty(main[0]) if new is None or new is bound.get(name) else new
                 for name, new in zip(spec.updates, result[n:])]
        return (*main, *stats)

    return flatten


def _faker(spec: OpSpec, to_pnn: Callable[[dict[str, Any]], dict[str, Any]],
           flatten: Callable[[Any, dict[str, Any]], tuple[Any, ...]]) -> Callable[[dict[str, Any]], tuple[Tensor, ...]]:
    """The fake implementation: the op itself on the fake tensors, on the reference backend.

    The api validates and plans the call, the reference computes it symbolically; the outputs are
    then described as the kernels return them (new, C-contiguous).
    """
    oracle = backends.oracle_name()

    def fake(bound: dict[str, Any]) -> tuple[Tensor, ...]:
        with config.use_backend(**{spec.name: oracle}):
            result = spec.function(**to_pnn(bound))
        return tuple(t.new_empty(t.shape) for t in flatten(result, bound))

    return fake


def _fields(spec: OpSpec) -> dict[str, str]:
    """Tensor slot → gradient field (the RNN ``weights``/``biases`` slots both give ``params``)."""
    result = {}
    for name, kind in spec.arguments.items():
        if name in spec.grad_fields:
            for slot in KINDS[kind].names(name):
                result[slot] = name
    return result


def _grad_of(slot: str, field_name: str, grads: Any) -> Any:
    if slot in ("weights", "biases"):  # the RnnParams slots: one entry per layer and direction
        j = 0 if slot == "weights" else 2
        return [g for entry in getattr(grads, field_name) for g in (entry[j], entry[j + 1])]
    if slot == "projections":
        return [entry[4] for entry in getattr(grads, field_name)]
    return getattr(grads, field_name)


def _available(op: _OpDef, bound: dict[str, Any]) -> frozenset[str]:
    """The fields a call can differentiate: given, floating-point tensors (integer class targets have none)."""
    found = set()
    for slot, field_name in op.field_of.items():
        value = bound.get(slot)
        if isinstance(value, Tensor):
            if value.is_floating_point():
                found.add(field_name)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) and v.is_floating_point() for v in value):
            found.add(field_name)
    return frozenset(found)


def definition(spec: OpSpec) -> _OpDef:
    """The custom-op definition of ``spec``."""
    args = ", ".join(f"{schema_type} {slot}" for schema_type, slot, _ in schema_arguments(spec))
    decode = _decoder(spec)
    flatten = _flattener(spec)
    n_main = len(spec.output_names)
    n_diff = spec.n_diff_outputs
    # Cotangents come for the differentiable outputs only; optional outputs take None (as pullbacks accept).
    missing = [None] * (n_main - n_diff)

    def to_pnn(bound: dict[str, Any], recompute: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (), decode(bound)

    return _OpDef(
        spec.name, spec.function, args, n_main + len(spec.updates), n_diff, spec.grad_fields, to_pnn,
        _faker(spec, decode, flatten), flatten=flatten,
        nest=lambda cts: nest_outputs(spec, [*cts, *missing]),
        field_of=_fields(spec), grad_of=_grad_of, available=_available,
        # Statistics the forward updated in place must not be saved (autograd would see them modified);
        # ``updated`` is false for ops that update nothing.
        unsaved=lambda bound, outputs: spec.updates if updated(spec, bound, outputs) else (),
    )


# =========================================================================== in-place variants
#
# PyTorch takes autograd formulas only on functional custom ops, so an op that updates arguments in
# place (batch and instance norm's running statistics) gets a composite in-place variant
# ``<name>_``: under autograd and torch.compile it decomposes into the functional op and a copy.

_inplace_lib = torch.library.Library(NAMESPACE, "FRAGMENT")


def store_updates(spec: OpSpec, bound: dict[str, Any], outputs: Sequence[Tensor]) -> None:
    """Copy the functional op's new statistics into the caller's (when they were updated)."""
    if updated(spec, bound, outputs):
        with torch.no_grad():
            for name, new in zip(spec.updates, outputs[len(spec.output_names):]):
                bound[name].copy_(new)


def _define_inplace(spec: OpSpec, args: str) -> None:
    for alias, name in zip("abcdefgh", spec.updates):
        args = args.replace(f"Tensor? {name}", f"Tensor({alias}!)? {name}")
    _inplace_lib.define(f"{spec.name}_({args}, bool[]? wrt=None) -> Tensor")
    slots = [slot for _, slot, _ in schema_arguments(spec)]

    def inplace(*args: Any) -> Tensor:
        *values, wrt = args
        outputs = getattr(torch.ops.portable_nn, spec.name)(*values, wrt)
        store_updates(spec, dict(zip(slots, values)), outputs)
        return outputs[0]

    _inplace_lib.impl(f"{spec.name}_", inplace, "CompositeImplicitAutograd")


for _spec in all_specs():
    _ENCODERS[_spec.name] = _encoders(_spec)
    _def = _register(definition(_spec))
    if _spec.updates:
        _define_inplace(_spec, _def.args)
del _spec, _def
