"""Statistics and normalisation layers: signatures, validation, documentation.

Each op validates its arguments once, resolves axes into a *plan* (how ``x``
is viewed, which axes are reduced, how parameters broadcast) and hands the
call to dispatch.  Implementations: ``portable_nn/reference/norm.py`` (every
array library), ``kernels_cpu/norm.py`` and ``kernels_gpu/norm.py`` where
present; ``pnn.capabilities()`` lists which backend takes which case.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .. import _arrays
from ..kernel_plans import MIDDLE_AXES, SCATTERED_AXES
from ._common import (
    Prepared,
    all_outputs,
    channel_layout,
    check_array,
    check_bool,
    check_distinct,
    check_fraction,
    check_int,
    check_layer_arrays,
    check_min_ndim,
    check_positive_float,
    check_same_library,
    check_shape,
    check_writable,
    floating_dtype,
    make_call,
    normalize_axes,
    public_op,
)
from ._types import Array, Axes
from .activations import ActivationLike, parse_activation

__all__ = [
    "batch_norm",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "merge_moments",
    "moments",
    "rms_norm",
]

#: The running statistics batch and instance norm update in place (unless return_stats=True).
_RUNNING = ("running_mean", "running_var")
_NORM_FIELDS = ("x", "weight", "bias")


# --------------------------------------------------------------------------- shared validation


def _channel_plan(x: Any, channel_axis: Any) -> tuple[int, str, int, tuple[int, ...]]:
    """(channel axis, layout, channels, per-channel parameter broadcast shape)."""
    axis, layout = channel_layout(channel_axis, x.ndim)
    if axis == 0:
        raise ValueError("channel_axis must not be 0: axis 0 is the batch axis (use 1 or -1)")
    channels = int(x.shape[axis])
    param_shape = tuple(channels if i == axis else 1 for i in range(x.ndim))
    return axis, layout, channels, param_shape


def _check_running(x: Any, running_mean: Any, running_var: Any, channels: int) -> None:
    if (running_mean is None) != (running_var is None):
        given = "running_mean" if running_var is None else "running_var"
        missing = "running_var" if running_var is None else "running_mean"
        raise ValueError(f"{given} was given without {missing}; pass both running statistics or neither")
    _per_channel(x, running_mean, "running_mean", channels)
    _per_channel(x, running_var, "running_var", channels)


def _per_channel(x: Any, value: Any, name: str, channels: int) -> None:
    """``ValueError`` unless ``value`` has one entry per channel; channels-last data gets a hint."""
    if value is None or tuple(value.shape) == (channels,):
        return
    hint = ""
    if getattr(value, "ndim", 0) == 1 and x.ndim > 2 and int(x.shape[-1]) == int(value.shape[0]):
        hint = (f"; x's last axis has {int(x.shape[-1])} entries: for channels-last data (N, ..., C) pass "
                "channel_axis=-1")
    raise ValueError(
        f"{name} must have shape ({channels},) (one value per channel, x has shape {tuple(x.shape)}), "
        f"got {tuple(value.shape)}{hint}"
    )


def _common_params(eps: Any, activation: Any) -> dict[str, Any]:
    return {"eps": check_positive_float(eps, "eps"), "activation": parse_activation(activation)}


def _normalised_axes(axis: Any, x: Any) -> tuple[tuple[int, ...], str | None]:
    """The sorted axes ``axis`` names and the layout they make (``None`` when trailing)."""
    axes = normalize_axes(axis, x.ndim, "axis")
    if axes == tuple(range(x.ndim - len(axes), x.ndim)):
        return axes, None
    if axes == tuple(range(axes[0], axes[0] + len(axes))):
        return axes, MIDDLE_AXES
    return axes, SCATTERED_AXES


def _param_shape(x: Any, axes: tuple[int, ...]) -> tuple[int, ...]:
    """How a layer or RMS norm's parameters (the normalised axes' shape) broadcast against ``x``."""
    return tuple(int(n) if i in axes else 1 for i, n in enumerate(x.shape))


def _finish_in_place(outputs: tuple[Any, ...], call: Any) -> Any:
    """A norm's result with running statistics updated in place, last (after every computation)."""
    y, new_mean, new_var = outputs
    if new_mean is not None:
        call.running_mean[...] = new_mean
        call.running_var[...] = new_var
    return y


def _finish_returning_stats(outputs: tuple[Any, ...], call: Any) -> Any:
    """A norm's result with ``return_stats=True``: ``(y, running_mean, running_var)``, the given
    statistics where none were computed."""
    y, new_mean, new_var = outputs
    return (
        y,
        call.running_mean if new_mean is None else new_mean,
        call.running_var if new_var is None else new_var,
    )


def _running_stats_writable(call: Any) -> None:
    """The per-call check of a norm that updates its running statistics in place: both writable
    (a flag a torch tensor's signature does not carry) and not the same array."""
    check_writable(call.running_mean, "running_mean")
    check_writable(call.running_var, "running_var")
    check_distinct({"running_mean": call.running_mean, "running_var": call.running_var})


def _norm_params(
    *,
    axes: tuple[int, ...],
    view_shape: tuple[int, ...],
    param_shape: tuple[int, ...],
    use_batch_stats: bool,
    center: bool = True,
    update_running: bool = False,
    stats_batch_axis: int | None = None,
    momentum: float = 0.0,
    mixed: bool,
    **extra: Any,
) -> dict[str, Any]:
    """The normalised arguments every norm implementation receives (see reference/norm.py)."""
    return {
        "axes": axes,
        "view_shape": view_shape,
        "param_shape": param_shape,
        "stat_param_shape": param_shape,
        "use_batch_stats": use_batch_stats,
        "center": center,
        "update_running": update_running,
        "stats_batch_axis": stats_batch_axis,
        "momentum": momentum,
        "mixed_precision": mixed,
        **extra,
    }


def _prepare_running_norm(
    kind: str, x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, *, channel_axis: Any,
    eps: Any, activation: Any, momentum: Any, return_stats: Any, use_stats: Any, use_stats_name: str,
    min_ndim: tuple[int, str], first_axis: int, stats_batch_axis: int | None, too_few: str,
) -> Prepared:
    """Validate and plan batch_norm or instance_norm: per-channel parameters and running statistics.

    Statistics are over the axes from ``first_axis`` on but the channel axis (0: batch norm, 1:
    instance norm, whose running statistics then average over the batch, ``stats_batch_axis``);
    ``use_stats`` (named ``use_stats_name``) chooses them over the running ones, which are updated
    in place when given, or returned with ``return_stats``; ``too_few`` (formatted with the shape)
    refuses statistics of a single value.
    """
    named = {"x": x, "weight": weight, "bias": bias, "running_mean": running_mean, "running_var": running_var}
    _, family, device, dtype, mixed = check_layer_arrays(named, ("weight", "bias", "running_mean", "running_var"))
    check_min_ndim(x, "x", *min_ndim)
    axis, layout, channels, param_shape = _channel_plan(x, channel_axis)
    _per_channel(x, weight, "weight", channels)
    _per_channel(x, bias, "bias", channels)
    _check_running(x, running_mean, running_var, channels)
    params = _common_params(eps, activation)
    use_stats = check_bool(use_stats, use_stats_name)
    momentum = check_fraction(momentum, "momentum")
    return_stats = check_bool(return_stats, "return_stats")
    axes = tuple(i for i in range(first_axis, x.ndim) if i != axis)
    count = 1
    for i in axes:
        count *= int(x.shape[i])
    if not use_stats and running_mean is None:
        raise ValueError(f"running_mean and running_var are required when {use_stats_name}=False")
    if use_stats and count == 1:
        raise ValueError(too_few.format(shape=tuple(x.shape)))
    update = use_stats and running_mean is not None
    in_place = update and not return_stats
    params.update(
        _norm_params(axes=axes, view_shape=tuple(x.shape), param_shape=param_shape, use_batch_stats=use_stats,
                     update_running=update, stats_batch_axis=stats_batch_axis, momentum=momentum, mixed=mixed,
                     kind=kind, channel_axis=axis)
    )
    call = make_call(kind, named, params, family=family, device=device, dtype=dtype, layout=layout)
    checks = (_running_stats_writable,) if in_place else ()
    for check in checks:
        check(call)
    return Prepared(
        call,
        _NORM_FIELDS,
        {"x": x, "weight": weight, "bias": bias},
        finish=_finish_returning_stats if return_stats else _finish_in_place,
        mutates=in_place,
        checks=checks,
    )


# --------------------------------------------------------------------------- moments


@public_op(grad_fields=("x",), outputs=("mean", "var"))
def moments(x: Array, axis: Axes | None = None, *, keepdims: bool = False, correction: float = 0) -> tuple[Any, Any]:
    """Mean and variance of ``x`` over ``axis``, computed stably.

    With n the number of reduced elements (``x.size`` for ``axis=None``):

        mean = Σ x / n,    var = Σ (x − mean)² / (n − correction)

    from shifted two-pass sums (never E[x²] − E[x]²), so data with a large
    offset keeps its precision.  Partial results of disjoint parts combine with
    :func:`merge_moments`.

    Args:
        x: floating array, any shape.
        axis: int, tuple of ints, or ``None`` for all axes.
        keepdims: keep reduced axes with size 1.
        correction: 0 for the population variance, 1 for the unbiased one (any
            non-negative number).

    Returns:
        ``(mean, var)`` with ``x``'s shape less the reduced axes (size 1 with
        ``keepdims``); float32 for float16/bfloat16 ``x``, else ``x``'s dtype.
        An empty reduction gives NaN mean; the variance is NaN when
        ``n <= correction``.

    Raises:
        TypeError: a non-array or non-floating ``x``, a non-int axis, a non-number
            ``correction``.
        ValueError: an axis out of range or repeated, a negative or non-finite
            ``correction``.

    Gradients:
        ``vjp`` fields: ``(x,)``; the pullback takes ``(dmean, dvar)`` (either may be
        ``None``): dx = dmean / n + dvar · 2 (x − mean) / (n − correction).

    Backends:
        ``reference`` (every array library, device and floating dtype); ``numba``
        (NumPy and CPU torch, float32/float64, any axes without a transpose);
        ``cupy`` and ``numba_cuda`` (CuPy and CUDA torch, float16/bfloat16 with
        float32 statistics, float32, float64).  Dask arrays run chunk by chunk
        (lazily): each chunk's moments on its library's kernel, the partial
        statistics merged with :func:`merge_moments` in a Dask tree reduction;
        ``vjp``, dtypes no kernel takes and ``use_backend("reference")`` run the
        reference on the whole Dask array.  ``pnn.explain`` reports which
        implementation a call runs.
    """
    check_array(x, "x")
    family, device = check_same_library({"x": x})
    xp = _arrays.namespace(x)
    dtype = floating_dtype(xp, x, "x")
    axes = normalize_axes(axis, x.ndim, "axis")
    if isinstance(correction, bool) or not isinstance(correction, numbers.Real):
        raise TypeError(f"correction must be a non-negative number, got {type(correction).__name__}")
    if not (math.isfinite(correction) and correction >= 0):
        raise ValueError(f"correction must be a non-negative finite number, got {correction!r}")
    params = {"axes": axes, "keepdims": check_bool(keepdims, "keepdims"), "correction": float(correction)}
    call = make_call("moments", {"x": x}, params, family=family, device=device, dtype=dtype)
    return Prepared(call, ("x",), {"x": x}, n_diff_outputs=2, finish=all_outputs)


def merge_moments(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """Combine the partial statistics ``(n, mean, m2)`` of two disjoint parts (Chan et al.).

    ``m2`` is the sum of squared deviations, Σ (x − mean)² (``var * n`` for the
    population variance, so var = m2 / (n − correction) afterwards).  With
    δ = mean_b − mean_a and n = n_a + n_b:

        mean = mean_a + δ · n_b / n,   m2 = m2_a + m2_b + δ² · n_a · n_b / n

    Counts may be Python numbers or arrays broadcasting with the means; a part
    with ``n = 0`` contributes nothing (its mean and m2 may be NaN).  Works on
    any array-API arrays (not dispatched, no ``vjp``); count arrays take the
    statistics' dtype for the ratios.

    Args:
        a: the first part's ``(n_a, mean_a, m2_a)``, a tuple or list of three.
        b: the second part's ``(n_b, mean_b, m2_b)``, with means and m2 of the
            same library as ``a``'s.

    Returns:
        ``(n, mean, m2)`` of the union; ``n = n_a + n_b``.

    Raises:
        TypeError: ``a`` or ``b`` is not a 3-tuple, a count that is neither a
            number nor an array, a mean or m2 that is neither, or arrays from
            different libraries.
        ValueError: a negative or non-finite count, shapes that do not
            broadcast together, arrays on different devices.
    """
    for which, part in (("a", a), ("b", b)):
        if not isinstance(part, (tuple, list)) or len(part) != 3:
            raise TypeError(f"merge_moments: {which} must be a tuple (n, mean, m2)")
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    named = {"n_a": n_a, "mean_a": mean_a, "m2_a": m2_a, "n_b": n_b, "mean_b": mean_b, "m2_b": m2_b}
    for name, value in named.items():
        _check_statistic(value, name)
    arrays = {name: v for name, v in named.items() if _arrays.is_array(v)}
    if arrays:
        check_same_library(arrays)
        shapes = {name: tuple(v.shape) for name, v in arrays.items()}
        try:
            np.broadcast_shapes(*shapes.values())
        except ValueError:
            listing = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
            raise ValueError(f"merge_moments: the statistics' shapes do not broadcast together: {listing}") from None
    n = n_a + n_b
    # Ratios of counts are formed in the statistics' dtype: integer count arrays would otherwise
    # divide with their own (non-standard) true division and promote or demote the statistics.
    dtype_of = next((v for v in (mean_a, mean_b) if _arrays.is_array(v)), None)
    fn_a, fn_b, fn = (_counts_as(c, dtype_of) for c in (n_a, n_b, n))
    if _arrays.is_array(fn):
        xp = _arrays.namespace(fn)
        safe_n = xp.where(fn > 0, fn, xp.ones_like(fn))
    else:
        safe_n = fn if fn > 0 else 1
    delta = mean_b - mean_a
    mean = mean_a + delta * (fn_b / safe_n)
    m2 = m2_a + m2_b + delta * delta * (fn_a * fn_b / safe_n)
    # An empty part's statistics are undefined (NaN from ``moments``): take the other part's as is.
    a_empty, b_empty = fn_a == 0, fn_b == 0
    mean = _where(b_empty, mean_a, _where(a_empty, mean_b, mean))
    m2 = _where(b_empty, m2_a, _where(a_empty, m2_b, m2))
    return n, mean, m2


def _check_statistic(value: Any, name: str) -> None:
    """A count, mean or m2 of :func:`merge_moments`: an array, or a (finite, non-negative for counts) number."""
    if _arrays.is_array(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = "count" if name.startswith("n_") else "statistic"
        raise TypeError(f"merge_moments: {name} (a {what}) must be a number or an array, got {type(value).__name__}")
    if name.startswith("n_") and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"merge_moments: {name} must be a non-negative finite count, got {value!r}")


def _where(condition: Any, if_true: Any, if_false: Any) -> Any:
    """``if_true`` where ``condition``; a plain ``if`` for Python booleans, ``xp.where`` for arrays."""
    if not _arrays.is_array(condition):
        return if_true if condition else if_false
    xp = _arrays.namespace(condition)
    return xp.where(condition, if_true, if_false)


def _counts_as(count: Any, like: Any) -> Any:
    """A count array in the dtype of the statistics array ``like`` (Python numbers unchanged)."""
    if like is None or not _arrays.is_array(count):
        return count
    xp = _arrays.namespace(count)
    return xp.astype(count, like.dtype)


# --------------------------------------------------------------------------- batch norm


@public_op(grad_fields=_NORM_FIELDS, updates=_RUNNING)
def batch_norm(
    x: Array,
    *,
    weight: Array | None = None,
    bias: Array | None = None,
    running_mean: Array | None = None,
    running_var: Array | None = None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
    return_stats: bool = False,
) -> Any:
    """Batch normalisation with a fused activation.

    Per channel c, over every other axis (batch and spatial):

        y = act((x − mean_c) / sqrt(var_c + eps) · weight_c + bias_c)

    with the batch's statistics (population variance) when ``training``, else
    the running ones.  In training with running statistics, PyTorch's update
    r ← (1 − momentum) · r + momentum · s runs, with the unbiased batch variance
    going into ``running_var``.

    Args:
        x: ``(N, C, *spatial)`` (or ``(N, *spatial, C)`` with ``channel_axis=-1``),
            at least 2-D.
        weight: ``(C,)`` scale, or ``None`` for none.
        bias: ``(C,)`` shift, or ``None`` for none.
        running_mean: ``(C,)`` running mean, keyword-only; given together with
            ``running_var``.  Updated in place when training unless
            ``return_stats``; required when not training.
        running_var: ``(C,)`` running variance, keyword-only, as ``running_mean``.
        training: normalise with the batch statistics (and update the running
            ones); ``False`` normalises with the running statistics.
        momentum: weight of the new batch statistics in the update, in [0, 1].
        eps: added to the variance, > 0.
        channel_axis: the channel axis: 1 (channels first, the default), -1
            (channels last) or any other axis but 0, the batch axis.
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`ACTIVATIONS`).
        return_stats: mutate nothing and return the new running statistics
            instead.

    Returns:
        ``y`` (``x``'s dtype and shape), or ``(y, new_running_mean,
        new_running_var)`` with ``return_stats=True`` (the given running
        statistics unchanged when not training).  float16/bfloat16 ``x`` may come
        with float32 parameters and statistics; statistics are then float32.

    Raises:
        ValueError: shapes that do not fit, ``channel_axis=0``, only one of the
            running statistics, none when ``training=False``, one value per
            channel when training, read-only or identical running statistics
            to update in place, ``eps <= 0``, ``momentum`` outside [0, 1], an
            unknown activation, arrays on different devices.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, dtype mixes other than float16/bfloat16 ``x`` with float32
            parameters, non-bool flags or non-numeric scalars.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``.  With g = dy ⊙ act'(z) (z the
        pre-activation), w = weight (1 when ``None``), x̂ = (x − mean_c) / sqrt(var_c +
        eps) and means over the channel's elements: dbias_c = Σ g, dweight_c = Σ g ⊙ x̂;
        in training dx = (g·w − mean(g·w) − x̂ · mean(g·w ⊙ x̂)) / sqrt(var_c + eps),
        with running statistics dx = g·w / sqrt(var_c + eps).

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64; channels first or last, other channel axes run
        on the reference); GPU kernels (``cupy``: CUDA C compiled through CuPy's
        ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors, where
        ``pnn.capabilities()`` lists them.  Dask arrays run chunk by chunk (lazily):
        the batch statistics from each chunk's ``moments`` merged with
        :func:`merge_moments`, then each chunk normalised by the kernel's inference
        form with them; running statistics (Dask arrays too) come back as lazy Dask
        arrays with ``return_stats=True``, else are assigned in place lazily (Dask's
        item assignment); ``vjp`` and ``use_backend("reference")`` run the reference
        on the whole Dask array.  ``pnn.explain`` reports which one a call runs and
        why the others were passed over.
    """
    return _prepare_running_norm(
        "batch_norm", x, weight, bias, running_mean, running_var, channel_axis=channel_axis, eps=eps,
        activation=activation, momentum=momentum, return_stats=return_stats, use_stats=training,
        use_stats_name="training", min_ndim=(2, "(N, C, ...)"), first_axis=0, stats_batch_axis=None,
        too_few="x of shape {shape} has one value per channel; batch statistics need more than 1 value per "
                "channel when training",
    )


# --------------------------------------------------------------------------- layer norm, rms norm


@public_op(grad_fields=_NORM_FIELDS)
def layer_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    axis: Axes = -1,
    eps: float = 1e-5,
    activation: ActivationLike = "identity",
) -> Any:
    """Layer normalisation over ``axis`` with a fused activation.

    Per position of the other axes, over the axes named by ``axis`` — usually the
    trailing ones (PyTorch's ``normalized_shape``), or the channel axis of
    channels-first data (``axis=1`` of NCHW: ConvNeXt's ``LayerNorm2d``), or any set
    — with elementwise weight and bias:

        y = act((x − mean) / sqrt(var + eps) · weight + bias)

    with the population variance.

    Args:
        x: any shape with at least the normalised axes.
        weight: the normalised shape ``x.shape[axis]`` (the named axes' sizes, in
            axis order), or ``None`` for no scale.
        bias: the normalised shape, or ``None`` for no shift.
        axis: int or tuple naming the normalised axes: ``-1``, ``(-2, -1)``,
            ``1`` (the channels of ``(N, C, *spatial)``), ``(0, 2)`` …
        eps: added to the variance, > 0.
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`ACTIVATIONS`).

    Returns:
        ``y`` with ``x``'s shape and dtype.  float16/bfloat16 ``x`` may come with
        float32 ``weight``/``bias`` (statistics in float32).

    Raises:
        ValueError: axes out of range or repeated; a weight or bias that is
            not the normalised shape; ``eps <= 0``; an unknown activation;
            arrays on different devices.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, dtype mixes other than float16/bfloat16 ``x`` with float32
            parameters, non-bool flags or non-numeric scalars.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``.  With g = dy ⊙ act'(z), w = weight (1
        when ``None``), x̂ = (x − mean) / sqrt(var + eps) and means over the normalised
        axes: dbias = Σ g and dweight = Σ g ⊙ x̂ over the other axes, dx = (g·w −
        mean(g·w) − x̂ · mean(g·w ⊙ x̂)) / sqrt(var + eps).

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype, any axes); ``numba`` (CPU kernels for NumPy arrays and CPU torch
        tensors, zero-copy, float32 and float64: trailing axes, and a block of
        consecutive axes followed by kept ones such as NCHW's channels, in place
        without a transpose); GPU kernels (``cupy``: CUDA C compiled through CuPy's
        ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors, trailing
        axes, where ``pnn.capabilities()`` lists them.  ``pnn.explain`` reports which
        one a call runs and why the others were passed over.
    """
    _, family, device, dtype, mixed = check_layer_arrays({"x": x, "weight": weight, "bias": bias}, ("weight", "bias"))
    check_min_ndim(x, "x", 1, "the normalised axes")
    axes, layout = _normalised_axes(axis, x)
    normalized = tuple(int(x.shape[i]) for i in axes)
    check_shape(weight, "weight", normalized, "the shape of the normalised axes of x")
    check_shape(bias, "bias", normalized, "the shape of the normalised axes of x")
    params = _common_params(eps, activation)
    params.update(
        _norm_params(axes=axes, view_shape=tuple(x.shape), param_shape=_param_shape(x, axes),
                     use_batch_stats=True, mixed=mixed, kind="layer_norm")
    )
    call = make_call("layer_norm", {"x": x, "weight": weight, "bias": bias}, params,
                     family=family, device=device, dtype=dtype, layout=layout)
    return Prepared(call, _NORM_FIELDS, {"x": x, "weight": weight, "bias": bias})


@public_op(grad_fields=("x", "weight"))
def rms_norm(x: Array, weight: Array | None = None, *, axis: Axes = -1, eps: float = 1e-6,
             activation: ActivationLike = "identity") -> Any:
    """Root-mean-square normalisation over ``axis`` with a fused activation.

    Per position of the other axes, over the axes named by ``axis`` (usually the
    trailing ones; any set, as in :func:`layer_norm`):

        y = act(x / sqrt(mean(x²) + eps) · weight)

    (no centring, no bias — as ``torch.nn.functional.rms_norm`` followed by the activation).

    Args:
        x: any shape with at least the normalised axes.
        weight: the normalised shape ``x.shape[axis]``, or ``None`` for no scale.
        axis: int or tuple naming the normalised axes (see :func:`layer_norm`).
        eps: added to the mean square, > 0.
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`portable_nn.ACTIVATIONS`), ``"identity"`` by default.

    Returns:
        ``y`` with ``x``'s shape and dtype.  float16/bfloat16 ``x`` may come with
        a float32 ``weight`` (statistics in float32).

    Raises:
        ValueError: axes out of range or repeated; a weight that is not the
            normalised shape; ``eps <= 0``; arrays on different devices.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, dtype mixes other than float16/bfloat16 ``x`` with float32
            parameters, non-bool flags or non-numeric scalars.

    Gradients:
        ``vjp`` fields: ``(x, weight)``.  With r = 1 / sqrt(mean(x²) + eps), w = weight
        (1 when ``None``), x̂ = x · r, g = dy ⊙ act'(x̂ · w) and means over the normalised
        axes: dweight = Σ g ⊙ x̂ over the other axes, dx = r · (g·w − x̂ · mean(g·w ⊙ x̂)).

    Backends:
        as :func:`layer_norm`'s: the reference any axes, ``numba`` trailing axes and a
        block of consecutive axes followed by kept ones, the GPU kernels trailing axes.
    """
    _, family, device, dtype, mixed = check_layer_arrays({"x": x, "weight": weight}, ("weight",))
    check_min_ndim(x, "x", 1, "the normalised axes")
    axes, layout = _normalised_axes(axis, x)
    normalized = tuple(int(x.shape[i]) for i in axes)
    check_shape(weight, "weight", normalized, "the shape of the normalised axes of x")
    params = _common_params(eps, activation)
    params.update(
        _norm_params(axes=axes, view_shape=tuple(x.shape), param_shape=_param_shape(x, axes),
                     use_batch_stats=True, center=False, mixed=mixed, kind="rms_norm")
    )
    call = make_call("rms_norm", {"x": x, "weight": weight, "bias": None}, params,
                     family=family, device=device, dtype=dtype, layout=layout)
    return Prepared(call, ("x", "weight"), {"x": x, "weight": weight})


# --------------------------------------------------------------------------- group norm


@public_op(grad_fields=_NORM_FIELDS)
def group_norm(
    x: Array,
    num_groups: int,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
) -> Any:
    """Group normalisation with a fused activation.

    The C channels are split into ``num_groups`` groups of C / num_groups
    consecutive channels; each sample's group is normalised over its channels
    and spatial positions, then scaled and shifted per channel:

        y = act((x − mean_{n,g}) / sqrt(var_{n,g} + eps) · weight_c + bias_c)

    with the population variance (``torch.nn.functional.group_norm`` plus the
    activation).

    Args:
        x: ``(N, C, *spatial)`` (or ``(N, *spatial, C)`` with ``channel_axis=-1``),
            at least 2-D.
        num_groups: the number of groups, >= 1, dividing C.
        weight: ``(C,)`` scale, or ``None`` for none.
        bias: ``(C,)`` shift, or ``None`` for none.
        eps: added to the variance, > 0.
        channel_axis: the channel axis: 1 (channels first, the default), -1
            (channels last) or any other axis but 0, the batch axis.
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`ACTIVATIONS`).

    Returns:
        ``y`` with ``x``'s shape and dtype.  float16/bfloat16 ``x`` may come with
        float32 ``weight``/``bias`` (statistics in float32).

    Raises:
        ValueError: ``num_groups`` < 1 or not dividing C, weight or bias not
            ``(C,)``, ``channel_axis=0``, ``eps <= 0``, an unknown activation,
            arrays on different devices.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, dtype mixes other than float16/bfloat16 ``x`` with float32
            parameters, non-bool flags or non-numeric scalars.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``.  With g = dy ⊙ act'(z), w = weight (1
        when ``None``), x̂ the normalised x and means over each (sample, group): dbias_c
        = Σ g and dweight_c = Σ g ⊙ x̂ over the batch and spatial axes, dx = (g·w −
        mean(g·w) − x̂ · mean(g·w ⊙ x̂)) / sqrt(var_{n,g} + eps).

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64; channels first or last, other channel axes run
        on the reference); GPU kernels (``cupy``: CUDA C compiled through CuPy's
        ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors, where
        ``pnn.capabilities()`` lists them.  ``pnn.explain`` reports which one a call
        runs and why the others were passed over.
    """
    _, family, device, dtype, mixed = check_layer_arrays({"x": x, "weight": weight, "bias": bias}, ("weight", "bias"))
    check_min_ndim(x, "x", 2, "(N, C, ...)")
    axis, layout, channels, _ = _channel_plan(x, channel_axis)
    groups = check_int(num_groups, "num_groups", minimum=1)
    if channels % groups:
        raise ValueError(f"num_groups ({groups}) must divide the number of channels ({channels})")
    _per_channel(x, weight, "weight", channels)
    _per_channel(x, bias, "bias", channels)
    params = _common_params(eps, activation)
    shape = tuple(int(s) for s in x.shape)
    view = (*shape[:axis], groups, channels // groups, *shape[axis + 1 :])
    axes = tuple(i for i in range(1, len(view)) if i != axis)
    param_shape = tuple(view[i] if i in (axis, axis + 1) else 1 for i in range(len(view)))
    params.update(
        _norm_params(axes=axes, view_shape=view, param_shape=param_shape, use_batch_stats=True,
                     mixed=mixed, kind="group_norm", num_groups=groups, channel_axis=axis)
    )
    call = make_call("group_norm", {"x": x, "weight": weight, "bias": bias}, params,
                     family=family, device=device, dtype=dtype, layout=layout)
    return Prepared(call, _NORM_FIELDS, {"x": x, "weight": weight, "bias": bias})


# --------------------------------------------------------------------------- instance norm


@public_op(grad_fields=_NORM_FIELDS, updates=_RUNNING)
def instance_norm(
    x: Array,
    *,
    weight: Array | None = None,
    bias: Array | None = None,
    running_mean: Array | None = None,
    running_var: Array | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    channel_axis: int = 1,
    activation: ActivationLike = "identity",
    return_stats: bool = False,
) -> Any:
    """Instance normalisation with a fused activation.

    Each sample's channel is normalised over its spatial positions, then scaled
    and shifted per channel; for sample n and channel c:

        y = act((x − mean_{n,c}) / sqrt(var_{n,c} + eps) · weight_c + bias_c)

    with the population variance.  With running statistics and
    ``use_input_stats``, they are updated as PyTorch does,
    r ← (1 − momentum) · r + momentum · s, with s the batch average of the
    per-instance mean and unbiased variance.  With ``use_input_stats=False``
    the running statistics normalise instead (mean_c, var_c for every sample).

    Args:
        x: ``(N, C, *spatial)`` with at least one spatial axis (or
            ``(N, *spatial, C)`` with ``channel_axis=-1``).
        weight: ``(C,)`` scale, or ``None`` for none.
        bias: ``(C,)`` shift, or ``None`` for none.
        running_mean: ``(C,)`` running mean, keyword-only, optional; given
            together with ``running_var``.  Updated in place when
            ``use_input_stats`` unless ``return_stats``; required when not.
        running_var: ``(C,)`` running variance, keyword-only, as ``running_mean``.
        use_input_stats: normalise with each instance's statistics (and update
            the running ones); ``False`` uses the running statistics.
        momentum: weight of the new statistics in the update, in [0, 1].
        eps: added to the variance, > 0.
        channel_axis: the channel axis: 1 (channels first, the default), -1
            (channels last) or any other axis but 0, the batch axis.
        activation: fused activation, a name or an :class:`Activation` (see
            :data:`ACTIVATIONS`).
        return_stats: mutate nothing and return the new running statistics
            instead.

    Returns:
        ``y`` with ``x``'s shape and dtype, or ``(y, new_running_mean,
        new_running_var)`` with ``return_stats=True``.  float16/bfloat16 ``x``
        may come with float32 parameters and statistics.

    Raises:
        ValueError: ``x`` with fewer than 3 dimensions, shapes that do not fit,
            ``channel_axis=0``, only one of the running statistics, none when
            ``use_input_stats=False``, a single spatial element with
            ``use_input_stats``, read-only or identical running statistics to
            update in place, ``eps <= 0``, ``momentum`` outside [0, 1], an
            unknown activation, arrays on different devices.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, dtype mixes other than float16/bfloat16 ``x`` with float32
            parameters, non-bool flags or non-numeric scalars.

    Gradients:
        ``vjp`` fields: ``(x, weight, bias)``.  With g = dy ⊙ act'(z), w = weight (1
        when ``None``), x̂ the normalised x and means over each instance's spatial
        positions: dbias_c = Σ g and dweight_c = Σ g ⊙ x̂ over the batch and spatial
        axes; with input statistics dx = (g·w − mean(g·w) − x̂ · mean(g·w ⊙ x̂)) /
        sqrt(var_{n,c} + eps), with running statistics dx = g·w / sqrt(var_c + eps).

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64; channels first or last, other channel axes run
        on the reference); GPU kernels (``cupy``: CUDA C compiled through CuPy's
        ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors, where
        ``pnn.capabilities()`` lists them.  ``pnn.explain`` reports which one a call
        runs and why the others were passed over.
    """
    return _prepare_running_norm(
        "instance_norm", x, weight, bias, running_mean, running_var, channel_axis=channel_axis, eps=eps,
        activation=activation, momentum=momentum, return_stats=return_stats, use_stats=use_input_stats,
        use_stats_name="use_input_stats", min_ndim=(3, "(N, C, *spatial) with at least one spatial axis"),
        first_axis=1, stats_batch_axis=0,
        too_few="x of shape {shape} has 1 spatial element; instance statistics need more than 1 spatial "
                "element when use_input_stats=True",
    )
