"""portable_nn for JAX: ``import portable_nn.jax as pnj``.

Every op of :mod:`portable_nn` as a JAX function whose reverse mode is
portable_nn's fused backward kernel; they work under ``jax.jit``, ``jax.grad``
and ``jax.vmap``, and in forward mode and to any order (``jax.jvp``,
``jax.hessian``), which differentiate the array-API reference.  Which kernels run (the Numba CPU
kernels through ``jax.pure_callback``, or the array-API reference traced with
``jax.numpy``) is explained in :mod:`portable_nn.adapters.jax`; ``explain``
tells for one call.  Needs JAX (``pip install jax``).
"""

from __future__ import annotations

# The adapter module defines the public names and their ``__all__``; this module is its public face.
from .adapters.jax import *  # noqa: F403
from .adapters.jax import __all__  # noqa: F401
