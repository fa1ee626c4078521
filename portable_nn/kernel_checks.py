"""``Support.check`` predicates shared by the kernel packages (CPU and both GPU flavours).

Each takes a validated :class:`~portable_nn.dispatch.Call` and returns why a kernel
declines it, or ``None`` to accept; dispatch then falls back (``auto``) or raises
(a forced backend), and ``explain`` quotes the reason.
"""

from __future__ import annotations

from typing import Any


def int32_pool_positions(call: Any) -> str | None:
    """Pooling kernels keep the argmax as an int32 flat position within one plane."""
    positions = 1
    for size in call.in_size:
        positions *= size
    return None if positions < 2**31 else "keeps int32 argmax positions: planes of 2**31 positions or more"


def int64_ignore_index(call: Any) -> str | None:
    """Loss kernels take ``ignore_index`` as a 64-bit integer."""
    ignore = call.params.get("ignore_index", 0)
    return None if -(2**63) <= ignore < 2**63 else f"takes an int64 ignore_index, not {ignore}"

