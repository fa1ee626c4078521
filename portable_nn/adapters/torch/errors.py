"""Exception types of the drop-in modules: portable_nn's and ``torch.nn``'s at once.

portable_nn's ops raise ``ValueError`` or ``TypeError`` for a bad argument (their documented
types).  Some ``torch.nn`` modules raise ``RuntimeError`` for the same inputs (their checks run
in C++): the cells for mismatched sizes, ``CrossEntropyLoss`` for a bad target or weight, the
pooling modules for a bad input rank or padding.  The drop-ins whose twin does so re-raise our
error as an :class:`InputValueError` or :class:`InputTypeError`, each a subclass of both types, so
code written against either library catches it and the message is ours.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

__all__ = ["InputTypeError", "InputValueError", "raises_like_torch"]


class InputValueError(ValueError, RuntimeError):
    """A bad argument to a drop-in module: a ``ValueError`` (portable_nn) and a ``RuntimeError`` (torch.nn)."""


class InputTypeError(TypeError, RuntimeError):
    """A bad argument's type or dtype: a ``TypeError`` (portable_nn) and a ``RuntimeError`` (torch.nn)."""


F = TypeVar("F", bound=Callable[..., Any])


def raises_like_torch(forward: F) -> F:
    """Decorate a drop-in module's ``forward`` whose ``torch.nn`` twin raises ``RuntimeError``."""

    @wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, RuntimeError):
                raise
            dual = InputValueError if isinstance(exc, ValueError) else InputTypeError
            raise dual(*exc.args).with_traceback(exc.__traceback__) from None

    return wrapped  # type: ignore[return-value]
