"""portable_nn: fused, differentiable neural-network kernels for any array library.

``import portable_nn as pnn`` then call ``pnn.layer_norm(x, w, b)`` on NumPy,
PyTorch, CuPy, JAX or any array-API array; ``pnn.vjp`` gives gradients.
Importing this package loads neither numba, cupy nor torch.
"""

from __future__ import annotations

from . import api

# The ops: each api family module's __all__.  Imported from the family modules, not from the api
# package: portable_nn.api.conv etc. are also submodules, and documentation tools would otherwise
# render the module instead of the function.
from .api.activations import *  # noqa: F403
from .api.conv import *  # noqa: F403
from .api.dense import *  # noqa: F403
from .api.loss import *  # noqa: F403
from .api.norm import *  # noqa: F403
from .api.pool import *  # noqa: F403
from .api.rnn import *  # noqa: F403
from .autodiff import vjp
from .backends import BackendStatus
from .config import get_backend, get_fallback, set_backend, set_fallback, use_backend
from .dispatch import (
    Call,
    Support,
    available_backends,
    register_kernel,
    unregister_kernel,
)
from .errors import BackendUnavailableError, FallbackWarning
from .introspection import Explanation, capabilities, explain
from .threads import get_num_threads, set_num_threads, use_threads

__version__ = "0.1.0"
"""The version of portable_nn (PEP 440), written here only: pyproject.toml reads it (``dynamic``)."""

__all__ = [
    "BackendStatus",
    "BackendUnavailableError",
    "Call",
    "Explanation",
    "FallbackWarning",
    "Support",
    "__version__",
    "available_backends",
    "capabilities",
    "explain",
    "get_backend",
    "get_fallback",
    "get_num_threads",
    "register_kernel",
    "set_backend",
    "set_fallback",
    "set_num_threads",
    "unregister_kernel",
    "use_backend",
    "use_threads",
    "vjp",
]
__all__ += api.__all__
