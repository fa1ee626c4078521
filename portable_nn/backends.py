"""Backends that declare themselves.

A backend is a package of kernels.  It states what it is in a :class:`Backend` — its name, a
cheap availability probe, the default priority of its kernels under ``auto`` and the arrays its
kernels take natively — and publishes that declaration under the ``portable_nn.backends``
entry-point group of its distribution::

    [project.entry-points."portable_nn.backends"]
    numba = "kernels_cpu:BACKEND"

Loading an entry point imports the package, which registers its kernels with
:func:`portable_nn.dispatch.register_builtin`; nothing else in portable_nn lists backends.  A
third-party distribution joins the same way.  The array-API reference is part of portable_nn
itself (:data:`ORACLE`): always loaded, always last under ``auto``.

A package that fails to import only removes its backend; :func:`load_errors` keeps the reason,
which ``available_backends()`` and ``python -m portable_nn info`` report.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ENTRY_POINT_GROUP",
    "ORACLE",
    "Backend",
    "BackendStatus",
    "declared",
    "is_oracle",
    "load",
    "load_errors",
    "native_backends",
    "oracle_name",
]

#: The entry-point group backend packages publish their :class:`Backend` under.
ENTRY_POINT_GROUP = "portable_nn.backends"
#: The module of the array-API reference, the oracle every other backend is checked against.
ORACLE = "portable_nn.reference"


@dataclass(frozen=True)
class Backend:
    """What a kernel package says about itself.

    Attributes:
        name: the backend name users select (``set_backend("numba")``); the entry point's name.
        probe: ``probe() -> (available, reason)``, e.g. ``(False, "the numba package is not
            installed")``.  It must stay cheap and import nothing heavy (``info`` calls it): look
            packages up with ``importlib.util.find_spec``, ask for a GPU only when one may exist.
        priority: the default priority of its kernels under ``auto`` (highest first); also the order
            backends are listed in.  A kernel may declare another for one op.
        arrays: the array library its kernels take natively (``"numpy"``, ``"cupy"``, ``"torch"``, or
            ``"any"``): what the demo and the benchmarks hand it.
        description: one line for ``info``.
        compile_variants: ``"module:function"`` of a context manager under which calls run the
            kernel variants only large calls reach (the parallel ones), or ``""``: ``python -m
            portable_nn compile`` runs its small samples under it as well, so that those are
            compiled ahead of time too.
    """

    name: str
    probe: Callable[[], tuple[bool, str]]
    priority: int = 0
    arrays: str = "numpy"
    description: str = ""
    compile_variants: str = ""


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run on this machine, and if not, why not.

    Truthy exactly when the backend is available, so
    ``if pnn.available_backends()["cupy"]:`` reads naturally; ``str()`` gives
    ``"cupy: unavailable (the cupy package is not installed)"``.

    Attributes:
        name: the backend name (``"numba"`` …).
        available: whether it can run here: its package imports and, for GPU
            backends, a CUDA driver and device are present.
        reason: why (not): ``"numba installed; kernels compile on first use"``,
            ``"no CUDA driver (libcuda) on this machine"`` …
    """

    name: str
    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available

    def __str__(self) -> str:
        return f"{self.name}: {'available' if self.available else 'unavailable'} ({self.reason})"


_declared: dict[str, Backend] = {}
_errors: dict[str, str] = {}
_oracle: list[str] = []  # the oracle's backend name, once loaded


def load() -> None:
    """Import the oracle and every package published under :data:`ENTRY_POINT_GROUP`.

    Dispatch calls it once, under its registry lock, before the first selection.
    """
    oracle = importlib.import_module(ORACLE).BACKEND
    _accept(ORACLE, oracle)
    _oracle[:] = [oracle.name]
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in _declared or entry.name in _errors:
            continue  # the same distribution seen twice on sys.path
        try:
            declared_backend = entry.load()
        except Exception as exc:  # any import failure only removes this backend
            _errors[entry.name] = f"{entry.value} failed to load: {type(exc).__name__}: {exc}"
            continue
        _accept(entry.value, declared_backend, entry.name)


def _accept(where: str, backend: object, name: str | None = None) -> None:
    if not isinstance(backend, Backend):
        _errors[name or where] = f"{where} is not a portable_nn.backends.Backend"
    elif name is not None and backend.name != name:
        _errors[name] = f"{where} declares backend {backend.name!r} under the entry point name {name!r}"
    else:
        _declared[backend.name] = backend


def declared() -> dict[str, Backend]:
    """The loaded backends by name, the oracle first, then by descending priority."""
    order = sorted(_declared.values(), key=lambda b: (b.name not in _oracle, -b.priority, b.name))
    return {b.name: b for b in order}


def oracle_name() -> str:
    """The backend name of the array-API reference (loaded on first use)."""
    if not _oracle:
        from . import dispatch

        dispatch.backend_names()
    return _oracle[0]


def is_oracle(name: str) -> bool:
    """Whether ``name`` is the array-API reference, which ``auto`` always tries last."""
    return name in _oracle


def load_errors() -> dict[str, str]:
    """Entry points that failed to load: name -> why."""
    return dict(_errors)


def native_backends(arrays: str) -> tuple[str, ...]:
    """The loaded backends whose kernels take ``arrays`` (``"cupy"`` …) natively, in listing order
    (:func:`portable_nn.dispatch.backends_taking` loads them first)."""
    return tuple(name for name, b in declared().items() if b.arrays == arrays)
