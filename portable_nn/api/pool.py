"""Pooling: ``max_pool`` and ``avg_pool``, 1-D to 3-D — signatures, validation, documentation.

Both ops resolve the window geometry once, here, with PyTorch's rules:

* the number of spatial axes ``d`` is ``len(window)`` for a tuple window, else
  ``x.ndim - 2``; ``x`` is ``(N, C, *spatial)`` (or ``(N, *spatial, C)`` with
  ``channel_axis=-1``), or the same without ``N`` (unbatched, tuple window);
* per spatial axis, with effective window ``e = dilation·(window − 1) + 1``::

      out = floor((L + 2·padding − e + (stride − 1 if ceil_mode else 0)) / stride) + 1

  and in ``ceil_mode`` the last window must start inside the input or the left
  padding (else ``out`` drops by one);
* ``padding <= window // 2``.

Implementations receive the resolved geometry (spatial axes of ``x``, per-axis
window, stride, dilation, output sizes, low and high padding — the high side
includes the extra room ``ceil_mode`` needs) and, for ``avg_pool``, the per-axis
divisors.  Implementations: ``portable_nn/reference/pool.py`` (every array
library) and kernels where present (``pnn.capabilities()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _arrays
from ._common import (
    Prepared,
    all_outputs,
    check_array,
    check_bool,
    check_int,
    check_same_library,
    check_shape,
    floating_dtype,
    make_call,
    per_axis,
    public_op,
    spatial_layout,
)
from ._types import Array, IntOrTuple, Window

__all__ = ["avg_pool", "max_pool", "max_unpool"]

_POOL_FIELDS = ("x",)



def _spatial_count(x: Any, window: Any) -> int:
    if isinstance(window, (tuple, list)):
        d = len(window)
        if not 1 <= d <= 3:
            raise ValueError(f"window must have 1 to 3 entries (1-D to 3-D pooling), got {tuple(window)!r}")
        return d
    d = x.ndim - 2
    if not 1 <= d <= 3:
        raise ValueError(
            f"with an int window, x must be (N, C, *spatial) with 1 to 3 spatial axes (3 to 5 dimensions), "
            f"got shape {tuple(x.shape)}; pass a tuple window for unbatched input"
        )
    return d


def _pool_plan(
    x: Any,
    window: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: Any,
    channel_axis: Any,
) -> tuple[str, str, str, dict[str, Any], str]:
    """Validate a pooling call; returns ``(family, device, dtype, params, layout)``."""
    check_array(x, "x")
    family, device = check_same_library({"x": x})
    xp = _arrays.namespace(x)
    dtype = floating_dtype(xp, x, "x")
    d = _spatial_count(x, window)
    batched, layout, _, spatial_axes = spatial_layout(x, d, channel_axis, f"{d}-D pooling")

    win = per_axis(window, d, "window", 1)
    strides = _strides(stride, win, d)
    pads = per_axis(padding, d, "padding", 0)
    dil = per_axis(dilation, d, "dilation", 1)
    ceil_mode = check_bool(ceil_mode, "ceil_mode")

    in_size = tuple(int(x.shape[a]) for a in spatial_axes)
    out_size = []
    pad_hi = []
    for i in range(d):
        k, s, p, dl, n = win[i], strides[i], pads[i], dil[i], in_size[i]
        if p > k // 2:
            raise ValueError(
                f"padding must be at most half the window (padding <= window // 2, as PyTorch requires); "
                f"got padding={p} for window={k} on spatial axis {i}"
            )
        eff = dl * (k - 1) + 1
        numerator = n + 2 * p - eff + (s - 1 if ceil_mode else 0)
        out = numerator // s + 1
        if ceil_mode and out > 0 and (out - 1) * s >= n + p:
            out -= 1  # the last window must start inside the input or the left padding
        if out < 1:
            what = f"window={k}" + (f" with dilation={dl} (effective size {eff})" if dl > 1 else "")
            raise ValueError(
                f"{what} is larger than the padded input ({n} + 2·{p} = {n + 2 * p}) on spatial axis {i} "
                f"of x with shape {tuple(x.shape)}: the pooling has no output"
            )
        out_size.append(out)
        need = (out - 1) * s + eff
        pad_hi.append(p + max(0, need - (n + 2 * p)))
    params = {
        "spatial_axes": spatial_axes,
        "window": win,
        "stride": strides,
        "padding": pads,
        "dilation": dil,
        "ceil_mode": ceil_mode,
        "batched": batched,
        "in_size": in_size,
        "out_size": tuple(out_size),
        "pad_lo": pads,
        "pad_hi": tuple(pad_hi),
    }
    return family, device, dtype, params, layout


def _strides(stride: Any, window: tuple[int, ...], d: int) -> tuple[int, ...]:
    """The per-axis strides: the window's for ``None`` or an empty tuple (PyTorch's "omitted")."""
    if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):
        return window
    return per_axis(stride, d, "stride", 1)


def _check_divisor_override(value: Any) -> int | None:
    if value is None:
        return None
    value = check_int(value, "divisor_override")
    if value == 0:
        raise ValueError("divisor_override must be a nonzero int or None, got 0")
    return value


def _avg_divisors(
    params: dict[str, Any], count_include_pad: bool, divisor_override: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """Per spatial axis, the divisor of every output position (PyTorch's rule); their product divides.

    The window counts the positions it covers inside the padded input (with
    ``count_include_pad``) or inside the input itself; positions beyond the
    padded input, which only ``ceil_mode`` creates, never count.  A
    ``divisor_override`` is the first axis's divisor everywhere, the others' 1.
    """
    if divisor_override is not None:
        ones = [(1,) * out for out in params["out_size"]]
        return ((divisor_override,) * params["out_size"][0], *ones[1:])
    result = []
    for k, s, p, n, out in zip(
        params["window"], params["stride"], params["padding"], params["in_size"], params["out_size"]
    ):
        divs = []
        for j in range(out):
            start = j * s - p
            end = min(start + k, n + p)
            count = end - start if count_include_pad else min(end, n) - max(start, 0)
            divs.append(max(count, 1))
        result.append(tuple(divs))
    return tuple(result)


# --------------------------------------------------------------------------- max_pool


@public_op(grad_fields=_POOL_FIELDS, outputs=("y", "indices"), optional_outputs={"indices": "return_indices"})
def max_pool(
    x: Array,
    window: Window,
    *,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
    channel_axis: int = 1,
) -> Any:
    """Max pooling over 1 to 3 spatial axes (PyTorch's ``max_pool1d/2d/3d``).

    y[n, c, o] = max over the window positions o·stride − padding + t·dilation
    (t = 0 … window − 1 per axis) that lie inside x; padded positions never win.

    Args:
        x: ``(N, C, *spatial)``, or ``(N, *spatial, C)`` with ``channel_axis=-1``,
            or either without ``N`` (unbatched; then ``window`` must be a tuple).
        window: int (every spatial axis; the number of spatial axes is then
            ``x.ndim - 2``) or a tuple of 1 to 3 ints (one per spatial axis).
        stride: int or per-axis tuple, >= 1; ``None`` (or ``()``, as PyTorch
            reads it) means ``window``.
        padding: int or per-axis tuple, 0 <= padding <= window // 2 (implicit −∞).
        dilation: int or per-axis tuple, >= 1: spacing of the window positions.
        ceil_mode: round the output size up (the last window must still start
            inside the input or the left padding), as PyTorch does.
        return_indices: also return where each maximum is (see Returns).
        channel_axis: 1 (channels first) or -1 (channels last), counted in the
            batched layout.

    Returns:
        ``y`` with ``x``'s dtype; each spatial size becomes
        ``floor((L + 2·padding − dilation·(window − 1) − 1) / stride) + 1``
        (``ceil`` with ``ceil_mode``).  With ``return_indices=True``, ``(y, indices)``:
        ``indices`` has ``y``'s shape and holds, per output, the flat position of the
        window's maximum (the one the gradient goes to) within its sample's and
        channel's spatial plane — ``h·W + w`` in 2-D, ``(d·H + h)·W + w`` in 3-D —
        whatever ``channel_axis`` is, as PyTorch defines them (``max_unpool`` takes
        them back); int64 (int32 under JAX without x64); −1 for a window that covers
        only padding.

    Raises:
        ValueError: a window larger than the padded input, a non-positive
            window, stride or dilation, padding above ``window // 2``, tuple
            arguments of the wrong length, an unsupported ``channel_axis``.
        TypeError: non-array or non-floating ``x``, non-int geometry arguments.

    Gradients:
        ``vjp`` fields: ``(x,)``; ``indices`` takes no cotangent (the pullback takes
        ``dy`` or ``(dy, None)``).  Each window's cotangent goes to the first
        maximum of the window in row-major window order (ties go to the earliest
        position), as PyTorch does; dx sums them.  NaN propagates: a window holding
        NaN outputs NaN and its gradient goes to a NaN position (the last one in
        window order, like PyTorch's CPU kernels).  A window that covers only
        padding outputs −∞ and passes no gradient.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64; channels first or last); GPU kernels (``cupy``:
        CUDA C compiled through CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays
        and CUDA torch tensors, where ``pnn.capabilities()`` lists them.
        ``pnn.explain`` reports which one a call runs and why the others were passed
        over.
    """
    family, device, dtype, params, layout = _pool_plan(
        x, window, stride, padding, dilation, ceil_mode, channel_axis
    )
    params["return_indices"] = return_indices = check_bool(return_indices, "return_indices")
    call = make_call("max_pool", {"x": x}, params, family=family, device=device, dtype=dtype, layout=layout)
    if return_indices:
        return Prepared(call, _POOL_FIELDS, {"x": x}, finish=all_outputs)
    return Prepared(call, _POOL_FIELDS, {"x": x})


# --------------------------------------------------------------------------- avg_pool


@public_op(grad_fields=_POOL_FIELDS)
def avg_pool(
    x: Array,
    window: Window,
    *,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    channel_axis: int = 1,
) -> Any:
    """Average pooling over 1 to 3 spatial axes (PyTorch's ``avg_pool1d/2d/3d``).

    y[n, c, o] = Σ_window x / divisor, with zero padding.  The divisor is
    ``divisor_override`` when given, else the number of window positions inside
    the padded input with ``count_include_pad=True`` (positions beyond it, which
    only ``ceil_mode`` creates, do not count), or inside the input itself with
    ``count_include_pad=False`` — exactly PyTorch's rule.

    Args:
        x: ``(N, C, *spatial)``, or ``(N, *spatial, C)`` with ``channel_axis=-1``,
            or either without ``N`` (unbatched; then ``window`` must be a tuple).
        window: int (the number of spatial axes is then ``x.ndim - 2``) or a
            tuple of 1 to 3 ints.
        stride: int or per-axis tuple, >= 1; ``None`` (or ``()``, as PyTorch
            reads it) means ``window``.
        padding: int or per-axis tuple, 0 <= padding <= window // 2.
        ceil_mode: round the output size up, as PyTorch does.
        count_include_pad: whether padded positions count in the divisor.
        divisor_override: a nonzero int dividing every window's sum instead of
            the count (then ``count_include_pad`` has no effect), or ``None``.
        channel_axis: 1 (channels first) or -1 (channels last), counted in the
            batched layout.

    Returns:
        ``y`` with ``x``'s dtype (float16/bfloat16 are summed in float32); each
        spatial size is ``floor((L + 2·padding − window) / stride) + 1``
        (``ceil`` with ``ceil_mode``).

    Raises:
        ValueError: a window larger than the padded input, a non-positive
            window or stride, padding above ``window // 2``, tuple arguments of
            the wrong length, an unsupported ``channel_axis``, ``divisor_override=0``.
        TypeError: non-array or non-floating ``x``, non-int geometry arguments or
            ``divisor_override``.

    Gradients:
        ``vjp`` fields: ``(x,)``; dx spreads dy / divisor over each window.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64; channels first or last); GPU kernels (``cupy``:
        CUDA C compiled through CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays
        and CUDA torch tensors, where ``pnn.capabilities()`` lists them.
        ``pnn.explain`` reports which one a call runs and why the others were passed
        over.
    """
    family, device, dtype, params, layout = _pool_plan(
        x, window, stride, padding, 1, ceil_mode, channel_axis
    )
    count_include_pad = check_bool(count_include_pad, "count_include_pad")
    params["count_include_pad"] = count_include_pad
    params["divisor_override"] = _check_divisor_override(divisor_override)
    params["divisors"] = _avg_divisors(params, count_include_pad, params["divisor_override"])
    call = make_call("avg_pool", {"x": x}, params, family=family, device=device, dtype=dtype, layout=layout)
    return Prepared(call, _POOL_FIELDS, {"x": x})


# --------------------------------------------------------------------------- max_unpool

_INDEX_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _unpool_size(
    x: Any, spatial_axes: tuple[int, ...], win: tuple[int, ...], strides: tuple[int, ...],
    pads: tuple[int, ...], output_size: Any,
) -> tuple[int, ...]:
    """The output's spatial sizes: PyTorch's default, or ``output_size`` within a stride of it."""
    d = len(win)
    default = tuple((int(x.shape[a]) - 1) * s + k - 2 * p for a, k, s, p in zip(spatial_axes, win, strides, pads))
    if output_size is None:
        sizes = default
    else:
        if not isinstance(output_size, (tuple, list)):
            output_size = (output_size,) * d
        if len(output_size) == x.ndim and len(output_size) != d:
            output_size = tuple(output_size[a] for a in spatial_axes)  # a full shape, as PyTorch accepts
        if len(output_size) != d:
            raise ValueError(
                f"output_size must have {d} entries (one per spatial axis) or {x.ndim} (x's full shape), "
                f"got {tuple(output_size)!r}"
            )
        sizes = tuple(check_int(v, "output_size") for v in output_size)
        for i, (size, base, s) in enumerate(zip(sizes, default, strides)):
            if not base - s < size < base + s:
                raise ValueError(
                    f"output_size {sizes} is invalid on spatial axis {i}: it must lie strictly between "
                    f"{base - s} and {base + s} (the default size {base} ± stride {s})"
                )
    for i, size in enumerate(sizes):
        if size < 1:
            raise ValueError(
                f"max_unpool has no output on spatial axis {i}: (L − 1)·stride + window − 2·padding = {size} "
                f"for x with shape {tuple(x.shape)}"
            )
    return sizes


def _indices_in_plane(call: Any) -> None:
    """The per-call check of ``max_unpool`` (it reads the values): every index in the output's plane."""
    plane = 1
    for size in call.out_size:
        plane *= size
    _check_unpool_indices(call.xp, call.indices, plane)


def _check_unpool_indices(xp: Any, indices: Any, plane: int) -> None:
    """``ValueError`` naming ``indices`` if one lies outside [0, plane) (reads the values)."""
    if indices.size == 0 or not _arrays.has_values(indices):
        return
    if isinstance(indices, np.ndarray):
        xp = np
    low, high = int(xp.min(indices)), int(xp.max(indices))
    if low < 0 or high >= plane:
        raise ValueError(
            f"indices must be flat positions in [0, {plane}) (the output's spatial plane), "
            f"got values in [{low}, {high}]"
        )


@public_op(grad_fields=_POOL_FIELDS)
def max_unpool(
    x: Array,
    indices: Array,
    window: Window,
    *,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    output_size: IntOrTuple | None = None,
    channel_axis: int = 1,
) -> Any:
    """Partial inverse of ``max_pool`` (PyTorch's ``max_unpool1d/2d/3d``): each value back at its index.

    y[n, c, indices[n, c, o]] = x[n, c, o] and zero elsewhere: ``indices`` are flat
    positions within each sample's and channel's spatial plane of ``y``, as
    ``max_pool(..., return_indices=True)`` returns them.

    Args:
        x: ``(N, C, *spatial)``, or ``(N, *spatial, C)`` with ``channel_axis=-1``,
            or either without ``N`` (unbatched; then ``window`` must be a tuple).
        indices: an integer array of ``x``'s shape, each in ``[0, Π output_size)``.
        window: the pooling window that produced ``x``: an int (the number of
            spatial axes is then ``x.ndim - 2``) or a tuple of 1 to 3 ints.
        stride: int or per-axis tuple, >= 1; ``None`` (or ``()``, as PyTorch
            reads it) means ``window``.
        padding: int or per-axis tuple, >= 0.
        output_size: the output's spatial sizes (int, one per spatial axis, or
            ``x``'s full rank as PyTorch accepts); each must lie strictly within
            a stride of the default ``(L − 1)·stride + window − 2·padding``.
        channel_axis: 1 (channels first) or -1 (channels last), counted in the
            batched layout.

    Returns:
        ``y`` with ``x``'s dtype and layout, the spatial sizes above.  When two
        entries of a plane share an index, the one that comes last in row-major
        order of ``x``'s spatial positions is written (on every backend, so
        results are deterministic; PyTorch leaves this unspecified on the GPU).

    Raises:
        ValueError: ``indices`` of another shape or outside ``[0, Π output_size)``
            (checked on the values, except under JAX tracing, where out-of-range
            entries are dropped), a bad ``output_size``, a non-positive window or
            stride, negative padding, an unsupported ``channel_axis``.
        TypeError: non-array ``x`` or ``indices``, non-floating ``x``, non-integer
            ``indices``, non-int geometry arguments.

    Gradients:
        ``vjp`` fields: ``(x,)``: dx = dy at each entry's index for the entry
        that was written, 0 for entries a duplicate overwrote — the derivative of
        the forward above.  (PyTorch gives every duplicate the cotangent, which
        its own gradient checks skip; without duplicates, as after a max_pool
        whose windows do not overlap, the two agree.)

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64; channels first or last); GPU kernels (``cupy``:
        CUDA C compiled through CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays
        and CUDA torch tensors, where ``pnn.capabilities()`` lists them.
        ``pnn.explain`` reports which one a call runs and why the others were passed
        over.
    """
    check_array(x, "x")
    check_array(indices, "indices")
    family, device = check_same_library({"x": x, "indices": indices})
    xp = _arrays.namespace(x)
    dtype = floating_dtype(xp, x, "x")
    index_dtype = _arrays.dtype_name(xp, indices.dtype)
    if index_dtype not in _INDEX_DTYPES:
        raise TypeError(f"indices must have an integer dtype (int64, as max_pool returns them), got {index_dtype}")
    d = _spatial_count(x, window)
    batched, layout, _, spatial_axes = spatial_layout(x, d, channel_axis, f"{d}-D unpooling")
    check_shape(indices, "indices", tuple(int(s) for s in x.shape), "x's shape")
    win = per_axis(window, d, "window", 1)
    strides = _strides(stride, win, d)
    pads = per_axis(padding, d, "padding", 0)
    out_size = _unpool_size(x, spatial_axes, win, strides, pads, output_size)
    params = {
        "spatial_axes": spatial_axes,
        "window": win,
        "stride": strides,
        "padding": pads,
        "batched": batched,
        "in_size": tuple(int(x.shape[a]) for a in spatial_axes),
        "out_size": out_size,
    }
    call = make_call(
        "max_unpool", {"x": x, "indices": indices}, params, family=family, device=device, dtype=dtype, layout=layout
    )
    _indices_in_plane(call)
    return Prepared(call, _POOL_FIELDS, {"x": x}, checks=(_indices_in_plane,))
