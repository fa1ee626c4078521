"""The options part of a kernel's capability note (``Support.description``), derived from its op.

A kernel package registers one implementation for several ops (the norms, the pools, the cells…);
a note written once for all of them would claim one op's options under another (``lengths`` for a
cell, ``ignore_index`` for ``log_softmax``).  :func:`options` reads the op's own description (its
:class:`~portable_nn.api._common.OpSpec`) instead, so a note names only what that op takes; the
kernel package appends what is particular to its implementation.  A test checks every claim of
every note against its op.
"""

from __future__ import annotations

from .api._common import spec_of

__all__ = ["options"]


def options(op: str) -> str:
    """What ``op``'s kernels take, as a note's leading phrase."""
    spec = spec_of(op)
    args = spec.arguments
    parts: list[str] = []
    if "params" in args:
        parts.append("stacked, bidirectional, batch_first, lengths")
    elif spec.family == "rnn":
        parts.append("batched or not")
    if op in ("rnn", "rnn_cell"):
        parts.append("tanh or relu")
    if "reset_after" in args:
        parts.append("both GRU forms")
    if op == "lstm":
        parts.append("LSTM projections")
    if "window" in args:
        geometry = "/".join(name for name in ("stride", "padding", "dilation", "ceil_mode") if name in args)
        parts.append(f"1-3-D, batched or not, every {geometry}")
        parts += [name for name in ("return_indices", "count_include_pad", "divisor_override", "output_size")
                  if name in args]
    if "indices" in args:
        parts.append("duplicate indices: the last entry wins")
    if "ignore_index" in args:
        parts.append("any class axis, integer or probability targets, class weights, ignore_index, smoothing")
    elif spec.family == "loss":
        parts.append("any axis")
    if spec.family == "norm" and "activation" in args:
        parts.append("fused activation")
    return ", ".join(parts)
