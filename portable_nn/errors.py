"""Exceptions and warnings raised by portable_nn."""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "FallbackWarning"]


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run this call.

    Raised when a backend is *forced* (``set_backend``, ``use_backend``,
    ``PORTABLE_NN_BACKEND``) but is not installed, has no implementation of the
    op, does not support the arrays given (family, device, dtype, layout, sizes),
    or, under ``vjp``, has no backward kernel.  It is also raised under ``auto``
    when ``set_fallback("error")`` is in force and a kernel targeting the arrays
    declined the call.  The message names the op, the backend and the reason
    (for a forced backend, also where the request came from); ``pnn.explain``
    reports the same without raising.  A subclass of ``RuntimeError``.
    """


class FallbackWarning(UserWarning):
    """Under ``auto``, a kernel targeting the arrays declined and a slower one ran.

    Emitted only when ``set_fallback("warn")`` is in force; the message names
    the op, the implementation that ran and why each preferred kernel declined
    (dtype, layout, sizes, no backward kernel).  A subclass of ``UserWarning``,
    so the ``warnings`` filters apply.
    """
