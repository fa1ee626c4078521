"""The kinds of argument a public op takes, named once.

The public ops annotate their parameters with these names, and the names are the op descriptor's
argument kinds (:attr:`portable_nn.api._common.OpSpec.arguments`): the adapters read them to
know which arguments are arrays and how to carry each one (``portable_nn.torch`` derives its
custom-op schemas from them, ``portable_nn.jax`` its split into traced arrays and static
arguments).  An op that needs a new kind of argument adds it here and to both adapters' tables;
a test checks every annotation of every op is a known kind.

For users and type checkers they are plain aliases (``Array`` is ``Any``: any array-API array).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .activations import ActivationLike

__all__ = ["KINDS", "ActivationLike", "Array", "Axes", "IntOrTuple", "Lengths", "Padding", "RnnParams", "Window"]

#: An array of any array-API library (NumPy, PyTorch, CuPy, JAX …).
Array = Any
#: An axis or a tuple of axes.
Axes = int | tuple[int, ...]
#: One int for every spatial axis, or one per axis.
IntOrTuple = int | tuple[int, ...]
#: A pooling window: an int (every spatial axis; their number follows from x's rank) or a tuple
#: (one per spatial axis: its length is their number, so a 1-tuple pools unbatched (C, L) input).
Window = int | tuple[int, ...]
#: Convolution padding: an int, ``"same"``/``"valid"``, or per axis an int or a ``(low, high)`` pair.
Padding = int | str | tuple[int | tuple[int, int], ...]
#: A stacked recurrent layer's weights: per layer and direction ``(w_ih, w_hh, b_ih, b_hh)``.
RnnParams = Sequence[tuple[Any, ...]]
#: Per-sample sequence lengths: an integer array or a sequence of ints.
Lengths = Any

#: Every argument kind, as it appears in the ops' annotations.
KINDS = frozenset({
    "Array", "Array | None", "Axes", "Axes | None", "IntOrTuple", "IntOrTuple | None", "Window", "Padding",
    "ActivationLike", "RnnParams", "Lengths | None", "int", "int | None", "float", "bool", "str",
})
#: The kinds that hold arrays (what a framework traces or differentiates).
ARRAY_KINDS = frozenset({"Array", "Array | None", "RnnParams"})
