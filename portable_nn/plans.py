"""The fast path: a plan per call signature, made by the first call and reused by the next ones.

A call's full path validates every argument (:mod:`portable_nn.api`), chooses an implementation
(:func:`portable_nn.dispatch.select`), bridges the arrays and runs the kernel: about two hundred
Python calls, 40-150 µs before and after a kernel that may take 2 µs.  For a repeated call of
the same *signature* nearly all of that work would give the same answers, so the first call
keeps them in a :class:`Plan` and the next ones replay it, as cuDNN and FFTW plans or JAX's
C++ dispatch do.

The signature is everything the validation and the choice read, except the arrays' values:

* the op, whether the call is a plain call or a ``vjp`` (and its ``wrt``), how the arguments
  were passed (positions, keyword names);
* for every array: its type, shape, dtype and strides, and its read-only flag (NumPy) or device
  (torch, CuPy), and where it was passed (an array inside a list or tuple counts too);
* for every other argument: its type and value (``eps=1`` and ``eps=1.0`` differ, as do
  ``0.0`` and ``-0.0``);
* the configuration in force: this thread's or task's ``use_backend`` and ``use_threads``
  contexts, ``PORTABLE_NN_BACKEND``, and the generation of the process-wide settings, which
  ``set_backend``, ``set_fallback``, ``set_num_threads``, ``register_kernel``,
  ``unregister_kernel`` and a stored GPU preference move on.

What a plan keeps: the validated call's attributes without its arrays (``Call.params``, layout,
dtype …), where each array of the call sits among the arguments, the op's per-call checks (those
that read values: class labels in range, unpooling indices, running statistics writable and
distinct), the :class:`~portable_nn.dispatch.Route` (implementation, bridge, copies) and how
the result is finished.  It holds no array and no value of the caller's: a cached plan keeps
no memory alive, and the cache is a bounded LRU (:func:`set_cache_size`).

A plan is made only when the full path's answers can be replayed exactly: every array the
implementation receives is one the caller passed (validation made no new array of it), and every
array the caller passed is one the implementation or the gradient receives (none was read into
a parameter, as an array of RNN ``lengths`` is).  Other signatures take the full path on every
call; :func:`portable_nn.explain` says which path a call takes and why.  Arguments of other
types than NumPy, torch and CuPy arrays and Python scalars, tuples and lists (JAX and Dask
arrays, array_api_strict's) take the full path too.

Results are bitwise the full path's: both run the same route's implementation on the same
arrays.  Bad input never reaches a plan: a call whose validation raises makes none, and an
input that differs from a planned one in anything validation reads has another signature.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import _arrays, config, dispatch, threads

__all__ = ["Plan", "cache_info", "clear_cache", "set_cache_size"]

#: Plans kept (least recently used dropped first).  A plan holds a few dicts and tuples, no arrays:
#: ~2 KiB each.
DEFAULT_CACHE_SIZE = 2048


class _Uncacheable(Exception):
    """An argument whose signature cannot be taken cheaply and exactly: the call takes the full path."""


# --------------------------------------------------------------------------- signatures


def _numpy_signature(a: np.ndarray) -> tuple[Any, ...]:
    return a.shape, a.dtype, a.strides, a.flags.writeable


def _torch_signature(t: Any) -> tuple[Any, ...]:
    return t.shape, t.dtype, t.stride(), t.get_device()  # (the device index, -1 on the CPU: an int, cheap)


def _cupy_signature(a: Any) -> tuple[Any, ...]:
    return a.shape, a.dtype, a.strides, a.device.id


#: Array types (exactly these: a subclass may behave otherwise) -> their signature.
_ARRAY_SIGNATURES: dict[type, Callable[[Any], tuple[Any, ...]]] = {np.ndarray: _numpy_signature}
#: Array types :func:`signature` keys inline, with their type first (NumPy's is keyed inline apart).
_INLINE: dict[type, bool] = {}
#: Types keyed by value (immutable, hashable, equal only to equal values of the same type).
_VALUE_TYPES: set[type] = {int, bool, str, type(None)}
#: Types with their own keying: ``keyer(value, key)`` appends the value's key (after its type).
_KEYERS: dict[type, Callable[[Any, list[Any]], None]] = {}


def _activation_key(value: Any, key: list[Any]) -> None:
    # By its fields: a frozen dataclass's own __hash__ is Python code (~1 µs a call).
    key.append(value.name)
    slope = value.slope
    key.append(slope if slope else repr(slope))


#: Types that make a call take the full path.
_UNCACHEABLE: set[type] = set()


def _classify(kind: type, value: Any) -> None:
    """Sort a type met for the first time into the tables above."""
    from .api.activations import Activation

    family = _arrays.family(value) if _arrays.is_array(value) else None
    if family == "torch":
        import torch

        if kind in (torch.Tensor, torch.nn.Parameter):
            _ARRAY_SIGNATURES[kind] = _torch_signature
            _INLINE[kind] = True
            return
    elif family == "cupy":
        import cupy

        if kind is cupy.ndarray:
            _ARRAY_SIGNATURES[kind] = _cupy_signature
            return
    elif family is None and kind is Activation:
        _KEYERS[kind] = _activation_key
        return
    _UNCACHEABLE.add(kind)


def _walk(value: Any, key: list[Any], leaves: list[Any]) -> None:
    """Append ``value``'s signature to ``key`` and the value (and, for a list or tuple, its items)
    to ``leaves``, in order."""
    kind = type(value)
    leaves.append(value)
    array_signature = _ARRAY_SIGNATURES.get(kind)
    if array_signature is not None:
        key.append((kind, *array_signature(value)))  # (as signature() keys an argument of an _INLINE type)
    elif kind in _VALUE_TYPES:
        key.append(kind)
        key.append(value)
    elif kind is float:
        key.append(kind)
        key.append(value if value else repr(value))  # 0.0 == -0.0, yet a momentum of -0.0 is another call
    elif kind is tuple or kind is list:
        key.append(kind)
        key.append(len(value))
        for item in value:
            _walk(item, key, leaves)
    elif kind in _KEYERS:
        key.append(kind)
        _KEYERS[kind](value, key)
    elif kind in _UNCACHEABLE:
        raise _Uncacheable(kind)
    else:
        _classify(kind, value)
        _walk(leaves.pop(), key, leaves)


_ndarray = np.ndarray


def signature(op: str, mode: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[tuple, list[Any]]:
    """The call's signature (see the module docstring) and its leaves (every argument, and the
    items of argument lists and tuples, in order).

    Raises:
        _Uncacheable: an argument of a type the fast path does not key.
    """
    # Positions and keyword names first (a keyword call and a positional one are two signatures),
    # then every value in order.
    key: list[Any] = [op, mode, len(args), tuple(kwargs) if kwargs else ()]
    leaves: list[Any] = []
    append = key.append
    if kwargs:
        args = (*args, *kwargs.values())
    # A NumPy array argument, the commonest, is keyed inline: one tuple, which no other kind of
    # argument's key starts with (theirs start with a type), so keys stay unambiguous; torch
    # tensors are keyed inline too, as (type, shape, dtype, strides, device index).
    for value in args:
        kind = type(value)
        if kind is _ndarray:
            leaves.append(value)
            append((value.shape, value.dtype, value.strides, value.flags.writeable))
        elif kind in _INLINE:
            leaves.append(value)
            append((kind, value.shape, value.dtype, value.stride(), value.get_device()))
        else:
            _walk(value, key, leaves)
    append(config.state())
    append(threads.state())
    return tuple(key), leaves


# --------------------------------------------------------------------------- plans


#: A plan's record of where an array sits: an index into the call's leaves, or None (absent).
_Slot = int | None


def _structure(value: Any, index_of: Mapping[int, int], used: set[int]) -> Any:
    """``value`` (a prepared argument: an array, None, or a list/tuple of them) as leaf indices."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if id(value) in index_of:
            used.add(index_of[id(value)])
        return (type(value), tuple(_structure(v, index_of, used) for v in value))
    index = index_of.get(id(value))
    if index is None:
        raise _Unplannable("validation made a new array from an argument")
    used.add(index)
    return index


def _rebuild(structure: Any, leaves: list[Any]) -> Any:
    if structure is None:
        return None
    if type(structure) is int:
        return leaves[structure]
    kind, items = structure
    return kind(_rebuild(item, leaves) for item in items)


class _Unplannable(Exception):
    """Why a signature cannot have a plan (the message says)."""


class Plan:
    """What the first call of a signature decided, replayed by the later ones.

    Made by :func:`make` from the first call's validation (its
    :class:`~portable_nn.api._common.Prepared`) and :class:`~portable_nn.dispatch.Route`;
    see the module docstring for what it keeps and when a signature has none.
    """

    __slots__ = ("_bare", "checks", "extras", "finish", "flatten_cotangent", "grad_fields", "mutates", "n_diff_outputs",
                 "op", "route", "slots", "template", "values")

    def __init__(self, op: str, prepared: Any, route: dispatch.Route, leaves: list[Any]) -> None:
        index_of: dict[int, int] = {}
        for i, leaf in enumerate(leaves):
            if type(leaf) in _ARRAY_SIGNATURES:
                if id(leaf) in index_of:
                    raise _Unplannable("one array is passed as two arguments")
                index_of[id(leaf)] = i
            elif type(leaf) is list or type(leaf) is tuple:
                index_of.setdefault(id(leaf), i)
        used: set[int] = set()
        call = prepared.call
        slots = []
        for name, value in call.arrays.items():
            if value is None:
                slots.append((name, None))
                continue
            index = index_of.get(id(value))
            if index is None:
                raise _Unplannable(f"validation made a new array for {name}")
            used.add(index)
            slots.append((name, index))
        self.values = tuple((name, _structure(v, index_of, used)) for name, v in prepared.values.items())
        for i, leaf in enumerate(leaves):
            if i not in used and type(leaf) in _ARRAY_SIGNATURES:
                raise _Unplannable("validation reads the values of an array argument")
        self.op = op
        self.slots = tuple(slots)
        self.template = {k: v for k, v in call.__dict__.items() if k not in call.arrays}
        self.template.pop("arrays")
        if not route.bridge.active:  # the call already says what the forward keeps: no copy of it per call
            self.template.update(save=route.save, needs=route.needs)
        self.checks = tuple(prepared.checks)
        self.finish = prepared.finish
        self.grad_fields = prepared.grad_fields
        self.n_diff_outputs = prepared.n_diff_outputs
        self.flatten_cotangent = prepared.flatten_cotangent
        self.mutates = prepared.mutates
        self.route = route
        self._bare = not self.checks and not route.rechecked and not route.selection.declined
        #: What an adapter found out about the signature on its first call (never arrays).
        self.extras: dict[str, Any] = {}

    def call(self, leaves: list[Any]) -> dispatch.Call | None:
        """The validated call for these leaves (of this plan's signature), its per-call checks run;
        ``None`` when the plan's route is not this call's (a kernel added with ``register_kernel``
        answers otherwise for these values: the call then takes the full path)."""
        arrays = {name: None if index is None else leaves[index] for name, index in self.slots}
        call = dispatch.Call.assemble(self.template, arrays)
        for check in self.checks:
            check(call)
        route = self.route
        if route.rechecked and not route.holds_for(call):
            return None
        route.report_fallback(call)
        return call

    def prepared(self, leaves: list[Any]) -> Any:
        """The :class:`~portable_nn.api._common.Prepared` the full path's validation would return
        (``None`` as :meth:`call`)."""
        from .api._common import Prepared

        call = self.call(leaves)
        if call is None:
            return None
        return Prepared(call, self.grad_fields, {name: _rebuild(structure, leaves) for name, structure in self.values},
                        self.n_diff_outputs, self.finish, self.flatten_cotangent, self.mutates, self.checks)

    def run(self, leaves: list[Any]) -> Any:
        """A plain call: the op's result for these leaves (:data:`STALE` as :meth:`call`'s ``None``)."""
        if self._bare:  # no check to run, nothing to re-ask or report: the commonest call, inline
            call = dispatch.Call.assemble(
                self.template, {name: None if index is None else leaves[index] for name, index in self.slots})
        else:
            call = self.call(leaves)
            if call is None:
                return STALE
        return self.finish(self.route.forward(call), call)


#: What :meth:`Plan.run` returns for a call its plan does not serve (it then takes the full path).
STALE = object()


class _Entry:
    """A cache entry: the signature's plan, or why it has none (``plan`` is then ``None``)."""

    __slots__ = ("plan", "reason")

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.reason: str | None = None


_lock = threading.Lock()
_cache_size = DEFAULT_CACHE_SIZE


def _new_entry(key: tuple) -> _Entry:
    return _Entry()


# functools.lru_cache is the LRU: kept in C, a hit costs ~0.1 µs beyond hashing the key.
_entry = functools.lru_cache(maxsize=_cache_size)(_new_entry)


def find(op: str, mode: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """``(plan, leaves, entry)`` for this call: the plan of its signature (``None`` when there is
    none yet, or none can be), the call's leaves, and its cache entry (``None`` when the call's
    arguments are not keyed: it then takes the full path and leaves no plan).  After a full path,
    :func:`remember` leaves the plan in ``entry``.

    ``mode`` is ``None`` for a plain call, ``("vjp", wrt)`` for a ``vjp``; an adapter may use its own.
    """
    if _cache_size == 0:
        return _NOT_KEYED
    if not dispatch._providers_loaded:  # loading the backends registers kernels: a new generation
        dispatch._load_providers()
    try:
        key, leaves = signature(op, mode, args, kwargs)
        entry = _entry(key)
    except (_Uncacheable, TypeError):  # TypeError: an unhashable value inside an argument
        return _NOT_KEYED
    return entry.plan, leaves, entry


_NOT_KEYED = (None, None, None)


def remember(entry: _Entry | None, leaves: list[Any] | None, op: str, prepared: Any, route: dispatch.Route,
             **extras: Any) -> Plan | None:
    """After the full path of a call :func:`find` gave ``(None, leaves, entry)``: make the signature's
    plan (or note why it has none); ``extras`` are what an adapter keeps in :attr:`Plan.extras`.
    Returns the plan (``None`` if there is none)."""
    if entry is None or entry.plan is not None or entry.reason is not None:
        return None if entry is None else entry.plan
    try:
        plan = Plan(op, prepared, route, leaves)
    except _Unplannable as exc:
        entry.reason = str(exc)
        return None
    plan.extras.update(extras)
    entry.plan = plan
    return plan


def plannable(entry: _Entry | None) -> bool:
    """Whether a call of cache entry ``entry`` has a plan or may get one."""
    return entry is not None and entry.reason is None


def refuse(entry: _Entry | None, reason: str) -> None:
    """Note that the signature of ``entry`` has no plan, and why (an adapter's finding)."""
    if entry is not None and entry.plan is None:
        entry.reason = reason


def describe(op: str, mode: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """Which path this call takes, in words (for :func:`portable_nn.explain`); the cache is left as it is."""
    if _cache_size == 0:
        return "full path on every call: the plan cache is off (plans.set_cache_size(0))"
    dispatch._load_providers()
    try:
        key, _ = signature(op, mode, args, kwargs)
        hash(key)
    except _Uncacheable as exc:
        kind = exc.args[0]
        return (f"full path on every call: an argument of type {kind.__module__}.{kind.__qualname__} is not "
                "keyed by the plan cache")
    except TypeError:
        return "full path on every call: an argument holds an unhashable value"
    entry = _entry(key)  # (a signature not seen yet gets its empty entry now, as its call would)
    if entry.plan is None and entry.reason is None:
        return "full path now; the plan it makes serves the next calls of this signature"
    if entry.plan is None:
        return f"full path on every call: this signature has no plan ({entry.reason})"
    return "fast path: a plan of this signature is cached (no validation or selection again)"


def cache_info() -> Any:
    """The plan cache's ``functools`` statistics: ``hits``, ``misses``, ``maxsize``, ``currsize``."""
    return _entry.cache_info()


def clear_cache() -> None:
    """Forget every plan (the next call of each signature takes the full path and plans again)."""
    _entry.cache_clear()


def set_cache_size(n: int) -> None:
    """Keep at most ``n`` plans (least recently used dropped first); ``0`` turns the fast path off.

    Every plan made so far is forgotten.

    Raises:
        TypeError, ValueError: ``n`` is not a non-negative int.
    """
    global _entry, _cache_size
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be a non-negative int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"n must be a non-negative int, got {n}")
    with _lock:
        _entry.cache_clear()
        _cache_size = n
        _entry = functools.lru_cache(maxsize=max(n, 1))(_new_entry)
