"""portable_nn: fused, differentiable neural-network kernels for any array library.

``import portable_nn as pnn`` then call ``pnn.layer_norm(x, w, b)`` on NumPy,
PyTorch, CuPy, JAX or any array-API array; ``pnn.vjp`` gives gradients.
Importing this package loads neither numba, cupy nor torch.
"""

from __future__ import annotations

from .api import (
    ACTIVATIONS,
    Activation,
    avg_pool,
    batch_norm,
    cross_entropy,
    group_norm,
    gru,
    gru_cell,
    instance_norm,
    layer_norm,
    log_softmax,
    lstm,
    lstm_cell,
    max_pool,
    merge_moments,
    moments,
    rms_norm,
    rnn_cell,
)

# Imported from their modules, not from the package: ``portable_nn.api.conv`` etc. are also
# submodules, and documentation tools would otherwise render the module instead of the function.
from .api.conv import conv
from .api.dense import dense
from .api.rnn import rnn
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
    "ACTIVATIONS",
    "Activation",
    "BackendStatus",
    "BackendUnavailableError",
    "Call",
    "Explanation",
    "FallbackWarning",
    "Support",
    "__version__",
    "available_backends",
    "avg_pool",
    "batch_norm",
    "capabilities",
    "conv",
    "cross_entropy",
    "dense",
    "explain",
    "get_backend",
    "get_fallback",
    "get_num_threads",
    "group_norm",
    "gru",
    "gru_cell",
    "instance_norm",
    "layer_norm",
    "log_softmax",
    "lstm",
    "lstm_cell",
    "max_pool",
    "merge_moments",
    "moments",
    "register_kernel",
    "rms_norm",
    "rnn",
    "rnn_cell",
    "set_backend",
    "set_fallback",
    "set_num_threads",
    "unregister_kernel",
    "use_backend",
    "use_threads",
    "vjp",
]
