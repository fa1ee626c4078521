"""Exceptions and warnings raised by portable_nn."""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "FallbackWarning"]


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run this call.

    Raised when a backend is *forced* (``set_backend``, ``use_backend``,
    ``PORTABLE_NN_BACKEND``) but is not installed, has no implementation of the
    op, or does not support the arrays given (family, device, dtype, layout). It
    is also raised under ``auto`` when ``set_fallback("error")`` is in force and
    the preferred kernel for the arrays declined the call.
    """


class FallbackWarning(UserWarning):
    """Under ``auto``, the preferred kernel declined and a slower one ran.

    Emitted only when ``set_fallback("warn")`` is in force.
    """
