"""Small helpers every reference module uses."""

from __future__ import annotations

from typing import Any

import array_api_compat


def compute_dtype(xp: Any, x: Any) -> Any:
    """float32 for half-precision data, else the data's own dtype."""
    # Compare against the namespace's own half dtypes; ``dtype == None`` is
    # True for NumPy float64, so absent dtypes must be skipped, not compared.
    for name in ("float16", "bfloat16"):
        half = getattr(xp, name, None)
        if half is not None and x.dtype == half:
            return xp.float32
    return x.dtype


def device(a: Any) -> Any:
    """The array's device, for allocating new arrays beside it."""
    return array_api_compat.device(a)


def store(out: dict[str, Any] | None, name: str, value: Any) -> Any:
    """``value``, written into the caller's buffer ``out[name]`` when one was given."""
    buffer = out.get(name) if out else None
    if buffer is None:
        return value
    buffer[...] = value
    return buffer


def index_dtype(xp: Any) -> Any:
    """The namespace's default integer dtype for indices (int64, or int32 for 32-bit JAX)."""
    try:
        return xp.__array_namespace_info__().default_dtypes()["indexing"]
    except (AttributeError, KeyError, TypeError):
        return xp.int64
