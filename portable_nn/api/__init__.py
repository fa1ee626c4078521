"""Public ops: one module per op family (signature, validation, docstring, dispatch).

Each family module lists its public names in its ``__all__``; nothing else lists them.
"""

from __future__ import annotations

from . import activations, conv, dense, loss, norm, pool, rnn

__all__ = [*activations.__all__, *conv.__all__, *dense.__all__, *loss.__all__, *norm.__all__, *pool.__all__,
           *rnn.__all__]

from .activations import *  # noqa: F403
from .conv import *  # noqa: F403
from .dense import *  # noqa: F403
from .loss import *  # noqa: F403
from .norm import *  # noqa: F403
from .pool import *  # noqa: F403
from .rnn import *  # noqa: F403
