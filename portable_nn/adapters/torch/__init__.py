"""PyTorch adapter: portable_nn ops as ``torch.library`` custom ops, and drop-in ``torch.nn`` modules.

Import it as :mod:`portable_nn.torch`.  Two layers:

**Functions** (``portable_nn.torch.layer_norm``, ``conv``, ``lstm`` …) take and return
tensors, with the signatures of the plain ops (``pnn.layer_norm`` …), and are
differentiable with ``torch.autograd``.  Each calls a custom op registered in the
``portable_nn`` namespace (``torch.ops.portable_nn.layer_norm`` …) with

* a forward that runs our kernels through dispatch (CPU tensors reach the Numba
  kernels as zero-copy NumPy views, CUDA tensors the GPU kernels; where the
  ``aten`` backend ranks first — conv, dense, lstm, rnn — PyTorch's own kernel),
* a fake (meta) implementation giving the output shapes, so ``torch.compile``
  traces the op into its graph instead of breaking the graph,
* an autograd formula whose backward is a second custom op
  (``torch.ops.portable_nn.layer_norm_backward``) running our fused backward
  kernel through the :func:`portable_nn.vjp` pullback.

How forward and backward meet: when a gradient will be needed, the forward runs
``pnn.vjp`` with ``wrt`` set to the arguments that require grad, keeps the
pullback (with the residuals our kernel saved) in a table and returns, as an
extra int64 output, a *handle* to it.  The autograd formula passes that handle
to the backward op, which calls the pullback for the gradients
``ctx.needs_input_grad`` asks for: a gradient nobody wants (say the input's of a
first layer) is never computed.  The table entry lives as long as the handle
tensor's memory, that is as long as autograd (eager or compiled) keeps it for
the backward.  If the entry is missing (the op was called directly without
``wrt``, or is re-run by a graph partitioner), the backward op recomputes the
forward with ``pnn.vjp`` restricted to the needed gradients — the same result,
one forward pass dearer.

In eager mode (plain tensors, no ``torch.compile``, no functorch transform) the custom-op
machinery is skipped: an op runs as a plain ``autograd.Function`` keeping the pullback
itself, and a conv, transposed conv or dense call that runs on ``aten`` is recorded by
autograd directly, as torch.nn's would be (``_ops.TORCH_DIFFERENTIABLE``).

Higher-order derivatives (double backward: a gradient penalty, a Hessian-vector product,
``torch.autograd.gradgradcheck``) work on both paths, to any order.  Our backward kernels return
numbers, not graphs, so a backward that autograd runs with ``create_graph=True`` differentiates the
array-API reference instead (PyTorch's own kernels, the ``aten`` backend, for ``conv``,
``conv_transpose`` and ``dense``): it reruns the op's forward on the saved tensors, under autograd,
and returns ``torch.autograd.grad`` of it (``create_graph=True``), a graph of plain torch ops.  That
backward costs a recomputed forward and its autograd backward — up to several times the fused
kernel — while a plain backward (``create_graph=False``, every ordinary training step) runs
the fused kernel as before.  Running statistics are updated once, by the forward.

Batch and instance norm have a functional custom op (returning the new running
statistics) that carries the autograd formula — PyTorch accepts autograd
formulas only on functional custom ops — and an in-place variant
(``torch.ops.portable_nn.batch_norm_``, schema ``Tensor(a!)? running_mean``)
that updates the running statistics and which ``torch.compile`` decomposes
into the functional op plus a copy.

**Modules** (:class:`LayerNorm`, :class:`BatchNorm2d`, :class:`LSTM`,
:class:`Conv2d`, :class:`Linear` …) subclass the matching ``torch.nn`` classes
(the recurrent ones ``torch.nn.RNNBase``): same constructor arguments and
defaults, parameter and buffer names, initialisation, ``state_dict`` keys and
``train()``/``eval()`` behaviour, so a model swaps them in and loads its
existing weights.  Their forward runs our fused kernels, with extra
keyword-only options the kernels offer (``activation=``, ``channel_axis=``,
GRU ``reset_after=``).  Arguments we cannot honour raise
``NotImplementedError`` naming them.  Bad inputs raise what the ``torch.nn`` twin raises
(``ValueError``, or an error that is both ``ValueError``/``TypeError`` and ``RuntimeError`` where
the twin raises ``RuntimeError``: :mod:`portable_nn.adapters.torch.errors`).

:func:`convert` turns a whole model's ``torch.nn`` layers into these modules in place (the same
parameters: tied weights stay tied, an optimizer keeps working), fusing the activations that
follow a layer in an ``nn.Sequential``.

:class:`SyncBatchNorm` (with ``convert_sync_batchnorm``) normalises with the statistics of a
data-parallel job's whole batch, merged across the ``torch.distributed`` process group, on CPU
(``gloo``) as well as CUDA (``nccl``) tensors: :mod:`portable_nn.adapters.torch.distributed`.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the adapter's one requirement, checked before anything else)
except ImportError as _missing:  # pragma: no cover - exercised in a process without PyTorch
    raise ImportError(
        "portable_nn.torch needs PyTorch: pip install 'portable_nn[torch]' (or a torch wheel; "
        "pin a CPU build, e.g. torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, to avoid a "
        "multi-GB CUDA download)"
    ) from _missing

from ...api import merge_moments
from .. import keep_public_path
from . import (
    _defs,  # noqa: F401  (defines and registers the custom ops)
    functional,
)
from ._ops import saved_pullbacks
from .cells import CrossEntropyLoss, GRUCell, LSTMCell, RNNCell
from .convert import convert
from .distributed import SyncBatchNorm
from .errors import InputTypeError, InputValueError
from .functional import *  # noqa: F403  (one function per portable_nn op, generated from its description)
from .modules import (
    GRU,
    LSTM,
    RNN,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    Linear,
    RMSNorm,
)
from .pooling import (
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    MaxUnpool1d,
    MaxUnpool2d,
    MaxUnpool3d,
)

__all__ = [
    "GRU",
    "LSTM",
    "RNN",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "CrossEntropyLoss",
    "GRUCell",
    "GroupNorm",
    "InputTypeError",
    "InputValueError",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LSTMCell",
    "LayerNorm",
    "Linear",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "MaxUnpool1d",
    "MaxUnpool2d",
    "MaxUnpool3d",
    "RMSNorm",
    "RNNCell",
    "SyncBatchNorm",
    "convert",
    "merge_moments",
    "saved_pullbacks",
]
__all__ += functional.__all__

keep_public_path(globals())
