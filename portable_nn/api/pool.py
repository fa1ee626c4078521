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

from .. import _arrays
from ._common import (
    Prepared,
    check_array,
    check_bool,
    check_int,
    check_same_library,
    floating_dtype,
    make_call,
    per_axis,
    public_op,
    spatial_layout,
)
from ._types import Array, IntOrTuple, Window

__all__ = ["avg_pool", "max_pool"]

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
    strides = win if stride is None else per_axis(stride, d, "stride", 1)
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


@public_op(grad_fields=_POOL_FIELDS)
def max_pool(
    x: Array,
    window: Window,
    *,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    ceil_mode: bool = False,
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
        stride: int or per-axis tuple, >= 1; ``None`` means ``window``.
        padding: int or per-axis tuple, 0 <= padding <= window // 2 (implicit −∞).
        dilation: int or per-axis tuple, >= 1: spacing of the window positions.
        ceil_mode: round the output size up (the last window must still start
            inside the input or the left padding), as PyTorch does.
        channel_axis: 1 (channels first) or -1 (channels last), counted in the
            batched layout.

    Returns:
        ``y`` with ``x``'s dtype; each spatial size becomes
        ``floor((L + 2·padding − dilation·(window − 1) − 1) / stride) + 1``
        (``ceil`` with ``ceil_mode``).

    Raises:
        ValueError: a window larger than the padded input, a non-positive
            window, stride or dilation, padding above ``window // 2``, tuple
            arguments of the wrong length, an unsupported ``channel_axis``.
        TypeError: non-array or non-floating ``x``, non-int geometry arguments.

    Gradients:
        ``vjp`` fields: ``(x,)``.  Each window's cotangent goes to the first
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
    call = make_call("max_pool", {"x": x}, params, family=family, device=device, dtype=dtype, layout=layout)
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
        stride: int or per-axis tuple, >= 1; ``None`` means ``window``.
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
