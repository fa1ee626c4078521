"""Backend selection: global setting, context-local overrides, environment variable.

Precedence, highest first:

1. the innermost active ``use_backend(...)`` context (per-op entry, then its default),
   then the enclosing contexts in turn;
2. ``set_backend(...)`` (per-op entry, then its default);
3. the ``PORTABLE_NN_BACKEND`` environment variable (``"numba"`` or
   ``"layer_norm=numba,lstm_cell=reference"``, optionally with a default entry
   such as ``"reference,conv=numba"``);
4. ``"auto"``.

Context overrides live in a :class:`contextvars.ContextVar`, so they are private
to the thread or asyncio task that entered them.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENV_VAR",
    "get_backend",
    "get_fallback",
    "set_backend",
    "set_fallback",
    "use_backend",
]

ENV_VAR = "PORTABLE_NN_BACKEND"


def __getattr__(name: str) -> object:
    # BUILTIN_BACKENDS: the backends the installed packages declare (portable_nn.backends), reference first;
    # kept for code that read the former constant.
    if name == "BUILTIN_BACKENDS":
        from . import backends, dispatch

        dispatch.backend_names()
        return tuple(backends.declared())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
FALLBACK_MODES = ("allow", "warn", "error")


@dataclass(frozen=True, eq=False)
class _Layer:
    """One level of configuration: a default backend and per-op overrides.

    Compared and hashed by identity (``eq=False``): every change makes a new layer, and the plan
    cache keys calls by the layers in force (:func:`state`), which a key then keeps alive.
    """

    default: str | None = None
    per_op: Mapping[str, str] = field(default_factory=dict)
    source: str = ""

    def lookup(self, op: str) -> tuple[str, str] | None:
        if op in self.per_op:
            return self.per_op[op], f"{self.source} ({op}={self.per_op[op]})"
        if self.default is not None:
            return self.default, self.source
        return None


_context_layers: contextvars.ContextVar[tuple[_Layer, ...]] = contextvars.ContextVar(
    "portable_nn_backend_layers", default=()
)
_global_lock = threading.Lock()
_global_layer = _Layer(source="set_backend")
_fallback_mode = "allow"
_env_cache: tuple[str, _Layer] | None = None

#: Bumped by every process-wide setting that can change what a call runs (set_backend,
#: set_fallback, set_num_threads, kernels registered or removed, a stored GPU preference): part of
#: :func:`state`, so no plan made under an earlier setting is reused (:mod:`portable_nn.plans`).
_generation = 0


def bump_generation() -> None:
    """Mark every plan made so far as stale (a process-wide setting changed)."""
    global _generation
    _generation += 1


def _environ_reader(name: str) -> Any:
    """A function returning the raw value of the environment variable ``name`` (``None`` if unset).

    ``os.environ.get`` costs ~1 µs (key and value re-encoded each time), as much as the rest of a
    plan-cache lookup; CPython's ``os.environ`` keeps the encoded mapping in ``_data``, which it
    reads itself, so the raw value is read there (the undecoded value only needs to change when
    the variable does).  Elsewhere, the public mapping.
    """
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and callable(encode):
        key = encode(name)
        return lambda: data.get(key)
    return lambda: os.environ.get(name)


_read_env = _environ_reader(ENV_VAR)


def state() -> tuple[Any, ...]:
    """What of the configuration a call's plan depends on, cheaply: the active ``use_backend``
    layers of this thread or task, the raw ``PORTABLE_NN_BACKEND``, and the generation of the
    process-wide settings.  Equal states select alike (the ``use_threads`` context is keyed by
    :mod:`portable_nn.threads`)."""
    return _context_layers.get(), _read_env(), _generation


def _known_backend_names() -> tuple[str, ...]:
    from . import dispatch

    return ("auto", *dispatch.backend_names())


def _known_ops() -> tuple[str, ...]:
    from . import dispatch

    return dispatch.op_names()


def _check_backend(name: object, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a backend name (str), got {type(name).__name__}")
    known = _known_backend_names()
    if name not in known:
        raise ValueError(f"{what}: unknown backend {name!r}; expected one of {', '.join(known)}")
    return name


def _check_per_op(per_op: Mapping[str, object]) -> dict[str, str]:
    ops = _known_ops()
    checked = {}
    for op, name in per_op.items():
        if op not in ops:
            raise ValueError(f"unknown op {op!r} in backend override; expected one of {', '.join(ops)}")
        checked[op] = _check_backend(name, f"backend for {op}")
    return checked


def set_backend(name: str | None = None, /, **per_op: str) -> None:
    """Set the process-wide backend, and/or per-op backends.

    Applies to every thread.  Context-local :func:`use_backend` overrides take
    precedence over this; this takes precedence over the ``PORTABLE_NN_BACKEND``
    environment variable.  A forced backend that cannot run a call raises
    :class:`BackendUnavailableError` rather than falling back;
    ``"auto"`` runs the first implementation that accepts the call (see
    :func:`portable_nn.explain`).

    Args:
        name: ``"auto"``, ``"reference"``, ``"numba"``, ``"numba_cuda"``, ``"cupy"``,
            ``"aten"`` or a backend added with :func:`portable_nn.register_kernel`. ``None``
            leaves the default unchanged when per-op entries are given, and
            otherwise clears every global setting (the environment variable
            then applies again).  Positional-only.
        **per_op: ``op=backend`` overrides, e.g. ``set_backend(lstm_cell="reference")``.
            A value of ``None`` removes that op's override.

    Raises:
        TypeError: a backend name that is not a string.
        ValueError: an unknown backend or op name.
    """
    global _global_layer
    removals = {op for op, value in per_op.items() if value is None}
    checked = _check_per_op({op: v for op, v in per_op.items() if v is not None})
    for op in removals:
        _check_per_op({op: "auto"})
    with _global_lock:
        bump_generation()
        if name is None and not per_op:
            _global_layer = _Layer(source="set_backend")
            return
        default = _global_layer.default if name is None else _check_backend(name, "backend")
        merged = {k: v for k, v in _global_layer.per_op.items() if k not in removals}
        merged.update(checked)
        _global_layer = _Layer(default=default, per_op=merged, source="set_backend")


@contextlib.contextmanager
def use_backend(name: str | None = None, /, **per_op: str) -> Iterator[None]:
    """Context manager selecting a backend for the current thread / asyncio task.

    ``with pnn.use_backend("numba"):`` forces Numba for every op inside the block;
    ``with pnn.use_backend(lstm_cell="reference"):`` overrides one op and leaves
    the others to the enclosing configuration. Contexts nest; the innermost wins
    (its per-op entries, then its default, then the enclosing contexts), and all
    of them take precedence over :func:`set_backend` and ``PORTABLE_NN_BACKEND``.
    The override lives in a :class:`contextvars.ContextVar`: other threads and
    asyncio tasks are unaffected, and leaving the block restores the previous
    configuration even when it raises.

    Args:
        name: the default backend inside the block (``"auto"``, ``"reference"``,
            ``"numba"``, ``"numba_cuda"``, ``"cupy"``, ``"aten"`` or a registered name), or
            ``None`` to leave the enclosing default in force.  Positional-only.
        **per_op: ``op=backend`` overrides for single ops, e.g.
            ``use_backend(conv="numba")``.

    Returns:
        A context manager; ``with`` yields ``None``.

    Raises:
        TypeError: a backend name that is not a string.
        ValueError: an unknown backend or op name (checked on entry, before the
            block runs).
    """
    default = None if name is None else _check_backend(name, "backend")
    layer = _Layer(default=default, per_op=_check_per_op(per_op), source="use_backend")
    token = _context_layers.set((layer, *_context_layers.get()))
    try:
        yield
    finally:
        _context_layers.reset(token)


def _parse_env(text: str) -> _Layer:
    default = None
    per_op: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" in item:
            op, _, name = (s.strip() for s in item.partition("="))
            per_op[op] = name
        else:
            default = item
    source = f"environment {ENV_VAR}={text!r}"
    if default is not None:
        _check_backend(default, source)
    _check_per_op_env(per_op, source)
    return _Layer(default=default, per_op=per_op, source=source)


def _check_per_op_env(per_op: Mapping[str, str], source: str) -> None:
    ops = _known_ops()
    for op, name in per_op.items():
        if op not in ops:
            raise ValueError(f"{source}: unknown op {op!r}; expected one of {', '.join(ops)}")
        _check_backend(name, source)


def _env_layer() -> _Layer | None:
    global _env_cache
    text = (_read_env() or "")
    text = (os.fsdecode(text) if isinstance(text, bytes) else text).strip()
    if not text:
        return None
    cached = _env_cache
    if cached is not None and cached[0] == text:
        return cached[1]
    layer = _parse_env(text)
    _env_cache = (text, layer)
    return layer


def get_backend(op: str) -> tuple[str, str]:
    """The backend requested for ``op`` and where the request came from.

    Walks the precedence order: the active :func:`use_backend` contexts (innermost
    first), :func:`set_backend`, the ``PORTABLE_NN_BACKEND`` environment variable,
    then ``"auto"``.  This is the *request*; which implementation actually runs a
    given call is what :func:`portable_nn.explain` reports.

    Args:
        op: an op name, such as ``"layer_norm"``.

    Returns:
        ``(backend, source)``: the requested backend name (``"auto"`` when nothing
        is configured) and a description of the setting it came from, e.g.
        ``"use_backend (layer_norm=numba)"``, ``"set_backend"``,
        ``"environment PORTABLE_NN_BACKEND='numba'"`` or ``"default"``.

    Raises:
        ValueError: ``PORTABLE_NN_BACKEND`` names an unknown backend or op.
    """
    for layer in _context_layers.get():
        found = layer.lookup(op)
        if found is not None:
            return found
    found = _global_layer.lookup(op)
    if found is not None:
        return found
    env = _env_layer()
    if env is not None:
        found = env.lookup(op)
        if found is not None:
            return found
    return "auto", "default"


def set_fallback(mode: str) -> None:
    """What happens under ``auto`` when the preferred kernel declines a call.

    A *fallback* is a call whose arrays a kernel targets (family and device match
    its :class:`Support`) but which it declines (dtype, layout,
    sizes, no backward for ``vjp``), so a slower implementation runs.  The setting
    is process-wide; forced backends never fall back.

    Args:
        mode: ``"allow"`` (default: run the next candidate silently; ``explain``
            still reports it), ``"warn"`` (emit :class:`FallbackWarning`) or
            ``"error"`` (raise :class:`BackendUnavailableError`).

    Raises:
        ValueError: an unknown mode.
    """
    global _fallback_mode
    if mode not in FALLBACK_MODES:
        raise ValueError(f"fallback mode must be one of {', '.join(FALLBACK_MODES)}, got {mode!r}")
    _fallback_mode = mode
    bump_generation()


def get_fallback() -> str:
    """The current fallback mode (see :func:`set_fallback`).

    Returns:
        ``"allow"`` (the default), ``"warn"`` or ``"error"``.
    """
    return _fallback_mode
