"""The numbers the API and every kernel package share, in one dependency-free module.

Kernels receive an activation as a small integer code (and leaky_relu's slope) rather than its
name, so one compiled kernel serves every activation.  The codes are defined here only: the
API's :data:`portable_nn.ACTIVATIONS` is this module's :data:`ACTIVATION_CODES`, the Numba
kernels compare against these names (Numba folds module constants into the compiled code), and
the CUDA C header ``kernels_gpu/cuda_c/common.cuh`` spells the same codes as ``PNN_ACT_*``
macros, which a test checks against this module.

Nothing here imports NumPy, the API or any kernel package.
"""

from __future__ import annotations

from typing import Any

IDENTITY = 0
RELU = 1
SIGMOID = 2
TANH = 3
GELU = 4
GELU_TANH = 5
SILU = 6
LEAKY_RELU = 7
HARDSWISH = 8
HARDSIGMOID = 9
RELU6 = 10
MISH = 11
ELU = 12

#: Every activation name and its code (the table is documented at :data:`portable_nn.ACTIVATIONS`).
ACTIVATION_CODES: dict[str, int] = {
    "identity": IDENTITY,
    "relu": RELU,
    "sigmoid": SIGMOID,
    "tanh": TANH,
    "gelu": GELU,
    "gelu_tanh": GELU_TANH,
    "silu": SILU,
    "leaky_relu": LEAKY_RELU,
    "hardswish": HARDSWISH,
    "hardsigmoid": HARDSIGMOID,
    "relu6": RELU6,
    "mish": MISH,
    "elu": ELU,
}

#: The activations with a parameter, and its default: leaky_relu's negative slope, elu's alpha
#: (PyTorch's defaults).  Kernels receive it as ``slope`` whatever its name.
PARAMETER_DEFAULTS: dict[str, float] = {"leaky_relu": 0.01, "elu": 1.0}

#: Activations whose derivative is a function of the output alone: their backward keeps only
#: y = act(z), not the pre-activation z.
OUTPUT_DERIVATIVE = frozenset({"identity", "relu", "sigmoid", "tanh"})


def keeps_output_only(act: Any) -> bool:
    """Whether a backward through activation ``act`` (anything with ``name`` and ``slope``, such as
    :class:`portable_nn.Activation`) can work from y alone: :data:`OUTPUT_DERIVATIVE`, and
    leaky_relu with a positive slope (y > 0 exactly when z > 0)."""
    return act.name in OUTPUT_DERIVATIVE or (act.name == "leaky_relu" and act.slope > 0)


# Recurrent cells.  The Python kernel packages (kernels_cpu, numba_cuda) take one code per cell form,
# so one compiled function serves every form; the CUDA C kernels take the cell family (rnn, lstm,
# gru: the first three codes, ``KIND_*`` in ``kernels_gpu/cuda_c/rnn.cu``, checked by a test) with
# the nonlinearity and the GRU form passed separately.  One numbering serves both.
RNN_TANH = 0  # the rnn family
LSTM = 1
GRU = 2  # PyTorch's form: reset_after=True
RNN_RELU = 3
GRU_ORIGINAL = 4  # reset_after=False

#: Cell family -> its code, as the CUDA C kernels take it.
CELL_FAMILIES: dict[str, int] = {"rnn": RNN_TANH, "lstm": LSTM, "gru": GRU}

#: Gates per cell kind: the rows of w_ih and w_hh are this many blocks of the hidden size.
GATES: dict[int, int] = {RNN_TANH: 1, RNN_RELU: 1, LSTM: 4, GRU: 3, GRU_ORIGINAL: 3}
