"""portable_nn for JAX: ``import portable_nn.jax as pnj``.

Every op of :mod:`portable_nn` as a JAX function with a ``jax.custom_vjp``
whose backward is portable_nn's fused backward kernel; they work under
``jax.jit``, ``jax.grad`` and ``jax.vmap``.  Which kernels run (the Numba CPU
kernels through ``jax.pure_callback``, or the array-API reference traced with
``jax.numpy``) is explained in :mod:`portable_nn.adapters.jax`; ``explain``
tells for one call.  Needs JAX (``pip install jax``).
"""

from __future__ import annotations

from .adapters.jax import (
    Route,
    avg_pool,
    batch_norm,
    conv,
    cross_entropy,
    dense,
    explain,
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
    reference_autodiff,
    rms_norm,
    rnn,
    rnn_cell,
)

__all__ = [
    "Route",
    "avg_pool",
    "batch_norm",
    "conv",
    "cross_entropy",
    "dense",
    "explain",
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
    "reference_autodiff",
    "rms_norm",
    "rnn",
    "rnn_cell",
]
