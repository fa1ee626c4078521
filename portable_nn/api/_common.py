"""Shared validation and the op descriptions (:class:`OpSpec`) of the public API.

Every public op is one function decorated with :func:`public_op`: its signature, argument
kinds and docstring are the op's, and its body validates and normalises the arguments once
(raising ``TypeError`` / ``ValueError`` that name the argument), returning a :class:`Prepared`
whose :class:`~portable_nn.dispatch.Call` goes to dispatch.  ``finish`` turns the
implementation's outputs into what the caller gets back, and is the only place where anything
the caller passed is mutated (running statistics), after every computation has succeeded.
The :class:`OpSpec` the decorator builds is the op's one description: dispatch, ``vjp``,
``explain`` and both framework adapters derive what they need from it.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _arrays, dispatch, plans
from ._types import ARRAY_KINDS

_GRAD_TYPES: dict[tuple[str, tuple[str, ...]], type] = {}


def grads_type(op: str, fields: tuple[str, ...]) -> type:
    """The named-tuple class of ``op``'s gradients (one field per differentiable argument)."""
    key = (op, fields)
    cls = _GRAD_TYPES.get(key)
    if cls is None:
        name = "".join(part.capitalize() for part in op.split("_")) + "Grads"
        cls = _GRAD_TYPES[key] = namedtuple(name, fields)  # type: ignore[misc]
    return cls


def all_outputs(outputs: tuple[Any, ...], call: dispatch.Call) -> tuple[Any, ...]:
    """The :attr:`Prepared.finish` of ops that return every output as a flat tuple."""
    return tuple(outputs)


@dataclass(slots=True)
class Prepared:
    """A validated call, ready for dispatch.

    Attributes:
        call: what implementations receive.
        grad_fields: the op's differentiable arguments, in signature order.
        values: those arguments as passed (``None`` where not given).
        n_diff_outputs: how many leading outputs take a cotangent.
        finish: ``finish(outputs, call)`` turns the implementation's outputs into the
            caller's result (``call`` is this call: its arrays are the caller's).
        mutates: whether ``finish`` updates arguments in place (running statistics
            without ``return_stats``).
        checks: the checks that read more than the call's signature (argument values,
            which arrays are the same one): ``check(call)`` raises for bad input.  The op's
            validation runs them once; a call that reuses a plan of its signature
            (:mod:`portable_nn.plans`) runs only these.
        flatten_cotangent: for ops whose result nests outputs (lstm's
            ``(outputs, (h_n, c_n))``), turns the caller's cotangent, which
            mirrors the result, into the flat tuple of ``n_diff_outputs``
            entries that the implementation's outputs have; ``None`` when the
            cotangent is already flat.
    """

    call: dispatch.Call
    grad_fields: tuple[str, ...]
    values: dict[str, Any]
    n_diff_outputs: int = 1
    finish: Callable[[tuple[Any, ...], dispatch.Call], Any] = field(default=lambda outputs, call: outputs[0])
    flatten_cotangent: Callable[[Any], Any] | None = None
    mutates: bool = False
    checks: tuple[Callable[[dispatch.Call], None], ...] = ()

    @property
    def given(self) -> frozenset[str]:
        return frozenset(name for name in self.grad_fields if self.values.get(name) is not None)


@dataclass(frozen=True)
class OpSpec:
    """A public op, described once; everything else about the op is derived from it.

    Built by :func:`public_op` from the decorated function, whose signature (argument names,
    kinds — the annotations, see :mod:`portable_nn.api._types` — and defaults) and docstring are
    the op's own.  Dispatch's op list, the reference's lookup, ``vjp``, ``explain`` and both
    adapters' functions (``portable_nn.torch``'s custom-op schemas, ``portable_nn.jax``'s split
    into traced and static arguments) read it.

    Attributes:
        name: the op's name (the function's).
        prepare: the decorated function: validates the arguments and returns a :class:`Prepared`.
        grad_fields: its differentiable arguments (``vjp``'s fields), in signature order.
        outputs: the structure of its result: a name (one array), or a tuple of names and
            nested tuples (``("outputs", ("h_n", "c_n"))`` for ``lstm``).
        updates: arguments it updates in place after the computation (running statistics), which
            ``return_stats=True`` returns instead (the result is then ``(outputs, *updates)``).
        optional_outputs: outputs returned only on request: pairs (output name, the bool argument
            that requests it) — ``(("indices", "return_indices"),)`` for ``max_pool``.  They are the last
            of ``outputs``, take no cotangent, and the result is the bare first output when
            none is requested.
    """

    name: str
    prepare: Callable[..., Prepared]
    grad_fields: tuple[str, ...]
    outputs: Any = "y"
    updates: tuple[str, ...] = ()
    optional_outputs: tuple[tuple[str, str], ...] = ()
    #: The public op users call (set by :func:`public_op`).
    function: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The op's signature (annotations are argument kinds, as strings)."""
        return inspect.signature(self.prepare)

    @functools.cached_property
    def arguments(self) -> dict[str, str]:
        """Argument name -> its kind (one of :data:`portable_nn.api._types.KINDS`), in signature order."""
        return {name: str(p.annotation) for name, p in self.signature.parameters.items()}

    @property
    def arrays(self) -> tuple[str, ...]:
        """The arguments that hold arrays (kinds in :data:`portable_nn.api._types.ARRAY_KINDS`)."""
        return tuple(name for name, kind in self.arguments.items() if kind in ARRAY_KINDS)

    @property
    def family(self) -> str:
        """The op family: the api module that declares it (``"norm"``, ``"rnn"`` …)."""
        return self.prepare.__module__.rpartition(".")[2]

    @property
    def doc(self) -> str:
        """The op's docstring."""
        return inspect.getdoc(self.prepare) or ""

    @property
    def output_names(self) -> tuple[str, ...]:
        """The names of the flat outputs, in order (with ``return_stats``, the updates follow)."""
        return tuple(_leaves(self.outputs))

    @property
    def n_diff_outputs(self) -> int:
        """How many leading outputs take a cotangent (every output but the optional ones)."""
        return len(self.output_names) - len(self.optional_outputs)

    def requested(self, values: Mapping[str, Any]) -> tuple[str, ...]:
        """The output names a call with arguments ``values`` returns (optional ones only on request)."""
        flags = dict(self.optional_outputs)
        return tuple(name for name in self.output_names if name not in flags or values.get(flags[name]) is True)


def _leaves(tree: Any) -> Iterator[str]:
    if isinstance(tree, tuple):
        for item in tree:
            yield from _leaves(item)
    else:
        yield tree


def public_op(
    *, grad_fields: tuple[str, ...], outputs: Any = "y", updates: tuple[str, ...] = (),
    optional_outputs: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Prepared]], Callable[..., Any]]:
    """Declare a public op: the decorated function validates its arguments and returns a :class:`Prepared`.

    The op users call has the function's name, signature and docstring; it runs the validation,
    dispatches the call and returns the :class:`Prepared`'s ``finish`` of the outputs.  The
    :class:`OpSpec` describing it is attached (``_pnn_spec``) and the op is declared to dispatch,
    so no list of ops is written anywhere else.

    Args:
        grad_fields: the differentiable arguments (``vjp``'s fields), in signature order.
        outputs: the result's structure (see :attr:`OpSpec.outputs`).
        updates: the arguments updated in place unless ``return_stats=True``.
        optional_outputs: outputs returned on request (see :attr:`OpSpec.optional_outputs`).
    """

    def declare(prepare: Callable[..., Prepared]) -> Callable[..., Any]:
        spec = OpSpec(prepare.__name__, prepare, tuple(grad_fields), outputs, tuple(updates),
                      tuple((optional_outputs or {}).items()))

        name = spec.name

        @functools.wraps(prepare)
        def op(*args: Any, **kwargs: Any) -> Any:
            plan, leaves, entry = plans.find(name, None, args, kwargs)
            if plan is not None:  # the fast path: a plan of this call's signature
                result = plan.run(leaves)
                if result is not plans.STALE:
                    return result
            try:
                prepared = prepare(*args, **kwargs)
            except TypeError as exc:
                _explain_binding(spec, args, kwargs, exc)
                raise
            call = prepared.call
            route = dispatch.route(call)
            result = prepared.finish(route.forward(call), call)
            if entry is not None:
                plans.remember(entry, leaves, name, prepared, route)
            return result

        op._pnn_spec = spec  # type: ignore[attr-defined]
        object.__setattr__(spec, "function", op)  # frozen: the op exists only once the spec does
        _SPECS[spec.name] = spec
        dispatch.declare_op(spec.name, spec.family)
        return op

    return declare


def call_form(spec: OpSpec) -> str:
    """How to call the op: ``batch_norm(x, *, weight=None, bias=None, …)`` (names and defaults only)."""
    parts, keyword_only = [], False
    for name, p in spec.signature.parameters.items():
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        parts.append(name if p.default is p.empty else f"{name}={p.default!r}")
    return f"{spec.name}({', '.join(parts)})"


def _explain_binding(spec: OpSpec, args: tuple[Any, ...], kwargs: dict[str, Any], exc: TypeError) -> None:
    """Re-raise Python's argument-binding ``TypeError`` with the op's call form (any other error: return).

    Only on failure: a call that binds never pays for this.
    """
    try:
        spec.signature.bind(*args, **kwargs)
    except TypeError as binding:
        hint = ""
        if any(isinstance(a, (tuple, list)) and a and all(_arrays.is_array(v) for v in a) for a in args):
            hint = " (a tuple of arrays was given where one array is expected: pass the arrays as separate arguments)"
        raise TypeError(f"{spec.name}: {binding}; call it as {call_form(spec)}{hint}") from exc


_SPECS: dict[str, OpSpec] = {}


def all_specs() -> tuple[OpSpec, ...]:
    """Every public op's :class:`OpSpec`, in the order the api declares them."""
    from .. import api  # noqa: F401  - registers every op

    return tuple(_SPECS.values())


def spec_of(op: Any) -> OpSpec:
    """The :class:`OpSpec` of a public op given as the function or its name."""
    spec = getattr(op, "_pnn_spec", None)
    if spec is None and isinstance(op, str):
        from .. import api  # noqa: F401  - registers every op

        spec = _SPECS.get(op)
    if spec is None:
        known = ", ".join(sorted(_SPECS))
        # An array (a common slip: vjp(x, ...) for vjp(op, x, ...)) is named by its type, not printed whole.
        given = f"{_arrays.describe_family(_arrays.family(op))} of shape {tuple(op.shape)}" if _arrays.is_array(op) \
            else repr(op) if len(repr(op)) <= 80 else f"a {type(op).__name__}"
        raise TypeError(
            f"op must be a portable_nn op (such as pnn.layer_norm) or its name; got {given}. Known ops: {known}"
        )
    return spec


# --------------------------------------------------------------------------- arrays


def check_array(value: Any, name: str, *, optional: bool = False) -> Any:
    """``value`` if it is an array (or ``None`` when ``optional``), else ``TypeError``."""
    if type(value) is np.ndarray:  # the common case, neither masked nor foreign: no further checks
        return value
    if value is None and optional:
        return None
    if not _arrays.is_array(value):
        kind = "None" if value is None else type(value).__name__
        raise TypeError(
            f"{name} must be an array (NumPy, PyTorch, CuPy, JAX or any array-API library), got {kind}"
        )
    if _arrays.is_masked(value):
        raise TypeError(
            f"{name} is a masked array, and portable_nn's ops read no masks (the masked entries would count): "
            f"pass {name}.filled(value), or the unmasked entries only"
        )
    return value


def check_same_library(named: Mapping[str, Any]) -> tuple[str, str]:
    """The common (family, device) of the arrays in ``named``, ignoring ``None`` entries.

    Raises:
        TypeError: arrays from different libraries.
        ValueError: arrays on different devices.
    """
    present = [(name, value) for name, value in named.items() if value is not None]
    kinds = {type(value) for _, value in present}
    if len(kinds) == 1:  # the common case: one type, so one library; NumPy arrays are all on the CPU
        if np.ndarray in kinds:
            return "numpy", "cpu"
        first = present[0][1]
        if _arrays.family(first) == "torch" and all(value.device == first.device for _, value in present):
            return "torch", _arrays.device_of(first)
    families = {name: _arrays.family(value) for name, value in present}
    if len(set(families.values())) > 1:
        listing = ", ".join(f"{n} is {_arrays.describe_family(f)}" for n, f in families.items())
        raise TypeError(f"arrays from different libraries in one call: {listing}; pass arrays of one library")
    devices = {name: _arrays.device_of(value) for name, value in present}
    # A JAX tracer has no device ("none"): it takes the device of the arrays it meets.
    known = {name: d for name, d in devices.items() if d != "none"}
    if len(set(known.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in known.items())
        raise ValueError(f"arrays on different devices in one call: {listing}; move them to one device")
    first = present[0][0]
    return families[first], next(iter(known.values()), devices[first])


def floating_dtype(xp: Any, value: Any, name: str) -> str:
    """The dtype name of ``value``; ``TypeError`` unless it is floating point."""
    dname = _arrays.dtype_name(xp, value.dtype)
    if dname not in _arrays.FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype ({', '.join(_arrays.FLOAT_DTYPES)}), got {dname}"
        )
    return dname


def check_layer_arrays(named: dict[str, Any], optional: tuple[str, ...]) -> tuple[Any, str, str, str, bool]:
    """The checks every op with parameters starts with: arrays (those in ``optional`` may be None),
    one library and device, floating x, parameters of x's dtype or the allowed mix.

    Returns ``(xp, family, device, x dtype name, mixed precision)``.
    """
    for name, value in named.items():
        check_array(value, name, optional=name in optional)
    family, device = check_same_library(named)
    x = named["x"]
    xp = _arrays.namespace(x)
    dtype = floating_dtype(xp, x, "x")
    params = {k: v for k, v in named.items() if k != "x"}
    mixed = check_param_dtypes(xp, dtype, params)
    return xp, family, device, dtype, mixed


def check_param_dtypes(xp: Any, x_dtype: str, named: Mapping[str, Any], x_name: str = "x") -> bool:
    """Check parameters share ``x``'s dtype, or are float32 for half ``x``.

    Returns whether the call is mixed precision (half ``x``, float32 parameters).
    """
    mixed = None
    for name, value in named.items():
        if value is None:
            continue
        dname = floating_dtype(xp, value, name)
        if dname == x_dtype:
            this_mixed = False
        elif x_dtype in _arrays.HALF_DTYPES and dname == "float32":
            this_mixed = True
        else:
            allowed = f"{x_dtype}" + (" or float32" if x_dtype in _arrays.HALF_DTYPES else "")
            raise TypeError(
                f"{name} has dtype {dname} but {x_name} has {x_dtype}; expected {allowed} "
                "(the only dtype mix allowed is float16/bfloat16 data with float32 parameters)"
            )
        if mixed is None:
            mixed = this_mixed
        elif mixed != this_mixed:
            raise TypeError(
                f"{name} has dtype {dname}, unlike the other parameters; give all parameters "
                f"the dtype {x_dtype} or all float32"
            )
    return bool(mixed)


def check_shape(value: Any, name: str, expected: Sequence[int], what: str = "") -> None:
    """``ValueError`` unless ``value.shape == expected``."""
    if value is not None and tuple(value.shape) != tuple(expected):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(value.shape)}")


def check_min_ndim(value: Any, name: str, minimum: int, what: str) -> None:
    if value.ndim < minimum:
        raise ValueError(f"{name} must have at least {minimum} dimensions ({what}), got shape {tuple(value.shape)}")


def check_writable(value: Any, name: str) -> None:
    """``ValueError`` for a running statistic that cannot be updated in place."""
    if value is not None and not _arrays.is_writeable(value):
        raise ValueError(
            f"{name} is not writable ({_arrays.describe_family(_arrays.family(value))}); "
            "pass return_stats=True to get the updated statistics returned instead"
        )


def check_distinct(named: Mapping[str, Any]) -> None:
    """``ValueError`` if two outputs updated in place are the same array."""
    present = [(n, v) for n, v in named.items() if v is not None]
    for i, (name_a, a) in enumerate(present):
        for name_b, b in present[i + 1 :]:
            if a is b:
                raise ValueError(f"{name_a} and {name_b} must be different arrays; they are updated in place")


# --------------------------------------------------------------------------- scalars


def check_positive_float(value: Any, name: str) -> float:
    if type(value) is float and 0.0 < value < math.inf:  # the common case, without the ABC checks
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive float, got {type(value).__name__}")
    value = float(value)
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return value


def check_fraction(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__}")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def check_bool(value: Any, name: str) -> bool:
    if value is True or value is False:
        return value
    if not isinstance(value, bool) and not (hasattr(value, "__index__") and value in (0, 1)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    if type(value) is int and (minimum is None or value >= minimum):  # the common case, without the ABC checks
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def per_axis(value: Any, d: int, name: str, minimum: int) -> tuple[int, ...]:
    """An int, a length-``d`` tuple/list of ints, or a one-element one (for every axis, as PyTorch
    reads it) as a tuple of ``d`` ints >= ``minimum``."""
    if isinstance(value, (tuple, list)):
        if len(value) not in (1, d):
            raise ValueError(
                f"{name} must be an int or a tuple of {d} ints (one per spatial axis), got {tuple(value)!r}"
            )
        items = tuple(value) * (d if len(value) == 1 else 1)
    else:
        items = (value,) * d
    return tuple(check_int(v, name, minimum=minimum) for v in items)


def normalize_axis(axis: Any, ndim: int, name: str = "axis") -> int:
    """``axis`` as a non-negative int; ``ValueError`` when out of range."""
    if type(axis) is int and -ndim <= axis < ndim:  # the common case, without the ABC checks
        return axis % ndim
    axis = check_int(axis, name)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an input with {ndim} dimensions")
    return axis % ndim


def normalize_axes(axis: Any, ndim: int, name: str = "axis") -> tuple[int, ...]:
    """An int, tuple of ints or ``None`` (all axes) as a sorted tuple of non-negative ints."""
    if axis is None:
        return tuple(range(ndim))
    if type(axis) is int and -ndim <= axis < ndim:  # the common case, without the per-item checks
        return (axis % ndim,)
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = tuple(normalize_axis(a, ndim, name) for a in items)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{name} contains repeated axes: {axis!r}")
    return tuple(sorted(axes))


def channel_layout(channel_axis: Any, ndim: int) -> tuple[int, str]:
    """Resolve ``channel_axis`` (1 or -1, or any axis) to (axis, layout name)."""
    axis = normalize_axis(channel_axis, ndim, "channel_axis")
    if axis == 1:
        return axis, "channels_first"
    if axis == ndim - 1:
        return axis, "channels_last"
    return axis, "channels_other"


def spatial_layout(x: Any, d: int, channel_axis: Any, what: str) -> tuple[bool, str, int, tuple[int, ...]]:
    """Resolve the layout of a windowed op's input with ``d`` spatial axes.

    ``x`` is ``(N, C, *spatial)`` / ``(N, *spatial, C)`` or the same without ``N``
    (unbatched); ``channel_axis`` (1 or -1) refers to the batched layout, as in PyTorch.

    Returns:
        ``(batched, layout, channel axis of x, spatial axes of x)``.
    """
    if x.ndim not in (d + 1, d + 2):
        raise ValueError(
            f"x must have {d + 2} dimensions (N, C, *spatial) or {d + 1} (unbatched) for {what}, "
            f"got shape {tuple(x.shape)}"
        )
    axis = normalize_axis(channel_axis, d + 2, "channel_axis")
    if axis == 1:
        layout = "channels_first"
    elif axis == d + 1:
        layout = "channels_last"
    else:
        raise ValueError(f"channel_axis must be 1 (channels first) or -1 (channels last), got {channel_axis!r}")
    lead = x.ndim - d - 1  # 1 for batched input, 0 for unbatched
    first_spatial = lead + 1 if layout == "channels_first" else lead
    channel = lead if layout == "channels_first" else x.ndim - 1
    return x.ndim == d + 2, layout, channel, tuple(range(first_spatial, first_spatial + d))


def make_call(
    op: str,
    arrays: Mapping[str, Any],
    params: Mapping[str, Any],
    *,
    family: str,
    device: str,
    dtype: str,
    layout: str | None = None,
    input_maps: Mapping[str, dispatch.InputMap] | None = None,
) -> dispatch.Call:
    """A :class:`~portable_nn.dispatch.Call` with the namespace of ``arrays``.

    ``input_maps`` (array name -> :class:`~portable_nn.dispatch.InputMap`) are linear maps
    dispatch applies to those arrays before the implementation runs, taking their
    gradients back through the adjoints; ``params`` then describe the mapped arrays.
    """
    first = next(v for v in arrays.values() if v is not None)
    xp = _arrays.namespace(first)
    return dispatch.Call(op, arrays, params, xp=xp, family=family, device=device, dtype=dtype, layout=layout,
                         input_maps=input_maps)
