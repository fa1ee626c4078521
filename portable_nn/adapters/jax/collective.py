"""Batch statistics across devices: ``batch_norm`` and ``moments`` with ``axis_name=``.

Inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap(..., axis_name=...)`` each device (or mapped
example) holds part of the batch.  With ``axis_name`` naming that mapped axis, the statistics are
the whole batch's, as ``jax.lax.pmean`` would average them: each part's count, mean and sum of
squared deviations M2 (two passes in ``jax.numpy``) are combined by Chan's merge, in two
``jax.lax.psum`` rounds over the mapped axis:

    N = Σ nᵢ,   mean = Σ nᵢ·meanᵢ / N,   M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ − mean)²

— deviations from the merged mean, never E[x²] − E[x]² (Flax's and Keras's synchronised batch
norms merge sums and sums of squares, which loses every digit of the variance of float32 data
whose mean is large against its spread).  The result is identical on every device.

Everything here is ``jax.numpy`` and ``jax.lax`` (the reference's formulas for the normalisation
and the fused activation), which XLA fuses and JAX differentiates: gradients flow through the
exchange (JAX transposes the sums) and the statistics.  Running statistics
(``return_stats=True``) come from the merged statistics, so every device computes the same new
values.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from ...api._common import normalize_axes, normalize_axis, spec_of
from ...api.activations import parse_activation
from ...kernel_plans import momentum_update
from ...reference import activations as reference_activations


def _check_axis_name(axis_name: Any) -> None:
    if not isinstance(axis_name, Hashable) or isinstance(axis_name, (bool, float)):
        raise TypeError(f"axis_name must be the name of a mapped axis (a str, or a tuple of them), got "
                        f"{type(axis_name).__name__}")


def merge_across(mean: Any, m2: Any, count: Any, axis_name: Any) -> tuple[Any, Any, Any]:
    """``(N, mean, M2)`` of the whole batch from this part's ``(mean, M2)`` over ``count`` values,
    merged over the mapped axis ``axis_name`` (parts with no values contribute nothing).

    Two ``psum`` rounds: N and Σ nᵢ·meanᵢ give the mean, then Σ (M2ᵢ + nᵢ·(meanᵢ − mean)²) the
    spread — Chan's merge of every part at once.  Sums (not an ``all_gather``) leave results JAX
    knows are the same on every device (``shard_map``'s replication check accepts ``P()``).
    """
    import jax.numpy as jnp
    from jax import lax

    counts = jnp.zeros_like(mean) + count  # varying along the mapped axis, like the statistics
    present = counts > 0
    means = jnp.where(present, mean, 0)
    total = lax.psum(counts, axis_name)
    merged = lax.psum(counts * means, axis_name) / jnp.maximum(total, 1)
    spread = lax.psum(jnp.where(present, m2, 0) + counts * (means - merged) ** 2, axis_name)
    return total, merged, spread


def local_moments(x: Any, axes: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
    """This part's mean and M2 over ``axes`` (kept), in ``dtype``: two passes in ``jax.numpy``,
    the mean and then Σ(x − mean)² (stable; JAX differentiates it).  Not the adapter's ``moments``,
    whose custom derivatives JAX 0.10 cannot differentiate inside ``shard_map``."""
    import jax.numpy as jnp

    xc = x.astype(dtype)
    mean = jnp.mean(xc, axis=axes, keepdims=True) if xc.size else jnp.zeros_like(jnp.sum(xc, axes, keepdims=True))
    return mean, jnp.sum((xc - mean) ** 2, axis=axes, keepdims=True)


def _stats_dtype(x: Any) -> Any:
    """float32 statistics for half data (as the kernels keep them), else the data's dtype."""
    import jax.numpy as jnp

    return jnp.float32 if x.dtype in (jnp.float16, jnp.bfloat16) else x.dtype


def synced_moments(x: Any, axis: Any, keepdims: bool, correction: float, axis_name: Any) -> tuple[Any, Any]:
    """``moments`` over ``axis`` of the whole batch mapped over ``axis_name`` (see the module)."""
    import jax.numpy as jnp

    _check_axis_name(axis_name)
    spec_of("moments").prepare(x, axis, keepdims=keepdims, correction=correction)  # the op's own checks
    axes = normalize_axes(axis, x.ndim)
    count = math.prod(int(x.shape[a]) for a in axes)
    mean, m2 = local_moments(x, axes, _stats_dtype(x))
    total, mean, m2 = merge_across(mean, m2, count, axis_name)
    var = m2 / (total - correction)
    if not keepdims:
        mean, var = jnp.squeeze(mean, axes), jnp.squeeze(var, axes)
    return mean, var


def synced_batch_norm(x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool,
                      momentum: float, eps: float, channel_axis: int, activation: Any, return_stats: bool,
                      axis_name: Any) -> Any:
    """``batch_norm`` with the statistics of the whole batch mapped over ``axis_name`` (see the
    module); the caller has checked that batch statistics are used."""
    import jax
    import jax.numpy as jnp

    _check_axis_name(axis_name)
    spec_of("batch_norm").prepare(x, weight=weight, bias=bias, running_mean=running_mean, running_var=running_var,
                                  training=training, momentum=momentum, eps=eps, channel_axis=channel_axis,
                                  activation=activation, return_stats=return_stats)
    act = parse_activation(activation)
    channel = normalize_axis(channel_axis, x.ndim, "channel_axis")
    axes = tuple(a for a in range(x.ndim) if a != channel)
    count = math.prod(int(x.shape[a]) for a in axes)
    mean, m2 = local_moments(x, axes, _stats_dtype(x))
    total, mean, m2 = merge_across(mean, m2, count, axis_name)
    var = m2 / jnp.maximum(total, 1)
    compute = mean.dtype
    shape = [1] * x.ndim
    shape[channel] = int(x.shape[channel])
    z = (x.astype(compute) - mean) * jax.lax.rsqrt(var + jnp.asarray(eps, compute))
    if weight is not None:
        z = z * weight.astype(compute).reshape(shape)
    if bias is not None:
        z = z + bias.astype(compute).reshape(shape)
    y = reference_activations.apply(jnp, z, act).astype(x.dtype)
    if not return_stats:
        return y
    new_mean = new_var = None
    if running_mean is not None:
        new_mean, new_var = momentum_update(
            jnp, running_mean.astype(compute), running_var.astype(compute),
            jax.lax.stop_gradient(mean).reshape(1, -1), jax.lax.stop_gradient(var).reshape(1, -1), momentum,
            jax.lax.stop_gradient(total).reshape(-1))
        new_mean, new_var = new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype)
    return y, new_mean, new_var
