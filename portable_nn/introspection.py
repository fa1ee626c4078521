"""What dispatch would do, without running anything: ``pnn.explain`` and ``pnn.capabilities``.

:func:`explain` reports which implementation a call runs, which copies it needs and why every
other candidate was passed over; :func:`capabilities` is the op × backend table built from the
implementations' own :class:`~portable_nn.dispatch.Support` declarations (``python -m portable_nn
info`` and the documentation print it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _arrays, config, plans
from .dispatch import Call, _candidate_reason, backend_status, implementations, op_names, select
from .errors import BackendUnavailableError


@dataclass
class Explanation:
    """What :func:`explain` found: the implementation that would run and why.

    ``str()`` gives a readable multi-line report.

    Attributes:
        op: the op name.
        backend: the backend whose implementation would run (``""`` when the
            call would raise).
        requested: the configured backend, ``"auto"`` unless forced.
        source: where the request came from (``"default"``, ``"set_backend"``,
            ``"use_backend (conv=numba)"``, the environment variable …).
        copies: names of the arrays dispatch would copy to C order first.
            The call's input maps (``call.input_maps``, such as conv's padding
            modes), which run before the implementation, are listed by ``str()``.
        passed_over: ``(backend, reason)`` for every other implementation, in
            preference order: why it declined or that it ranks lower.
        fallback: whether a kernel that targets these arrays declined the call
            (what ``set_fallback`` warns or errors about).
        call: the validated :class:`Call`.
        error: the :class:`BackendUnavailableError` message
            the call would raise, or ``None``.
        path: which path a plain call of these arguments takes: the fast path (a plan of its
            signature is cached, :mod:`portable_nn.plans`), the full path now and a plan for
            the next calls, or the full path on every call and why.
    """

    op: str
    backend: str
    requested: str
    source: str
    copies: list[str]
    passed_over: list[tuple[str, str]]
    fallback: bool
    call: Call
    error: str | None = None
    path: str = ""

    @property
    def implementation(self) -> str:
        """The chosen implementation as ``"op[backend]"``, e.g. ``"layer_norm[numba]"``."""
        return f"{self.op}[{self.backend}]"

    def __str__(self) -> str:
        c = self.call
        lines = [
            f"{self.op} on {_arrays.describe_family(c.family)} (device {c.device}, dtype {c.dtype}"
            + (f", layout {c.layout})" if c.layout else ")"),
            f"  backend requested: {self.requested} (from {self.source})",
        ]
        if self.error is not None:
            lines.append(f"  would raise BackendUnavailableError: {self.error}")
            return "\n".join(lines)
        lines.append(f"  runs: {self.implementation}")
        lines.append(
            "  copies: "
            + (", ".join(f"{n} made C-contiguous" for n in self.copies) if self.copies else "none")
        )
        for name, input_map in c.input_maps.items():  # applied before the implementation runs (any backend)
            lines.append(f"  input map: {name} {input_map}")
        if self.path:
            lines.append(f"  path: {self.path}")
        if self.fallback:
            lines.append("  fallback: a kernel for these arrays declined the call")
        for backend, reason in self.passed_over:
            lines.append(f"  passed over {backend}: {reason}")
        return "\n".join(lines)


def explain_call(call: Call) -> Explanation:
    """The :class:`Explanation` for an already validated call."""
    requested, source = config.get_backend(call.op)
    try:
        sel = select(call, report=False)
    except BackendUnavailableError as exc:
        return Explanation(call.op, "", requested, source, [], [], False, call, str(exc))
    passed = list(sel.passed_over)
    seen = {b for b, _ in passed} | {sel.impl.backend}
    for impl in implementations(call.op):
        if impl.backend not in seen:
            reason, _ = _candidate_reason(impl, call, False)
            if reason is None:
                reason = (f"not requested ({requested} forced by {source})" if requested != "auto"
                          else f"lower priority than {sel.impl.backend}")
            passed.append((impl.backend, reason))
    return Explanation(call.op, sel.impl.backend, requested, source, sel.copies, passed, sel.fallback, call)


def explain(op: Any, *args: Any, **kwargs: Any) -> Explanation:
    """Which implementation ``op(*args, **kwargs)`` would run, and why.

    Nothing is computed: the arguments are validated as the op would, then
    dispatch reports its choice under the current configuration, any
    contiguous copies, and why every other candidate was passed over.  A forced
    backend that cannot run the call is reported in ``error`` rather than
    raised, and ``set_fallback`` does not warn or raise here.

    Args:
        op: a public op (``pnn.layer_norm``) or its name.
        *args: the op's positional arguments, as for a plain call.
        **kwargs: the op's keyword arguments, as for a plain call.

    Returns:
        An :class:`Explanation`; ``str()`` of it is a readable report and
        ``.implementation`` names the choice, e.g. ``"layer_norm[numba]"``;
        ``.path`` says whether the call takes the fast path (a cached plan of its
        signature) or the full one, and why.

    Raises:
        TypeError: ``op`` is not a portable_nn op, or an argument has a type the
            op rejects.
        ValueError: an argument value the op rejects.
    """
    from .api._common import spec_of

    spec = spec_of(op)
    prepared = spec.prepare(*args, **kwargs)
    report = explain_call(prepared.call)
    report.path = plans.describe(spec.name, None, args, kwargs)
    return report


def capabilities() -> list[dict[str, str]]:
    """The op × backend table, from the implementations' own declarations.

    Built from each registered implementation's :class:`Support`, the same
    declarations dispatch checks, so it cannot drift from the code; ``python -m
    portable_nn info`` prints it.

    Returns:
        One dict of strings per (op, implementation), ops in a fixed order and
        implementations in ``auto`` preference order (reference last), with
        keys ``op``, ``backend``, ``arrays`` (families and devices, e.g.
        ``"numpy/torch on cpu"``), ``dtypes``, ``layouts``, ``notes``
        (contiguity, zero-copy bridges, forward-only, the kernel's
        description) and ``available`` (``"yes"``/``"no"`` on this machine).
    """
    rows = []
    for op in op_names():
        for impl in implementations(op):
            s = impl.supports
            notes = []
            if s.contiguous:
                notes.append("copies strided or byte-swapped input to native C order")
            if s.native == "numpy":
                notes.append("torch CPU tensors zero-copy")
            elif s.native == "cupy":
                notes.append("torch CUDA tensors zero-copy, on torch's stream")
            if impl.backward is None:
                notes.append("forward only")
            if s.description:
                notes.append(s.description)
            rows.append(
                {
                    "op": op,
                    "backend": impl.backend,
                    "arrays": (
                        ("/".join(s.families) if s.families else "any")
                        + " on "
                        + ("/".join(s.devices) if s.devices else "any device")
                    ),
                    "dtypes": ", ".join(s.dtypes) if s.dtypes else "all floating",
                    "layouts": ", ".join(s.layouts) if s.layouts else "all",
                    "notes": "; ".join(notes),
                    "available": "yes" if backend_status(impl.backend) else "no",
                }
            )
    return rows


def format_capabilities(rows: Iterable[Mapping[str, str]] | None = None) -> str:
    """The capability table as aligned text (used by ``python -m portable_nn info``)."""
    rows = list(capabilities() if rows is None else rows)
    columns = ("op", "backend", "arrays", "dtypes", "layouts", "available", "notes")
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns).rstrip()]
    lines.append("  ".join("-" * widths[c] for c in columns))
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns).rstrip() for r in rows]
    return "\n".join(lines)
