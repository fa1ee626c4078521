"""PyTorch's own kernels for torch tensors (backend ``"aten"``), one module per op family.

Where the array library already has a fast kernel for an op, this backend calls it: oneDNN's
(or cuDNN's) convolution through ``aten::convolution`` and ``aten::convolution_backward``,
PyTorch's fused recurrent layers (``torch._VF.lstm`` …, what ``nn.LSTM`` runs) and its GEMM
for the dense layer; fused activations are torch's elementwise ops after the library kernel.
It takes torch tensors only, on the CPU and on CUDA, and runs at PyTorch's own thread count
(``torch.set_num_threads``; ``pnn.set_num_threads`` bounds portable_nn's numba kernels).  It is
unrelated to ``portable_nn.torch``, the autograd adapter that makes every backend's ops
differentiable by ``loss.backward()``.

Importing this package only *declares* the kernels: it must not import torch (dispatch
imports it to list the backends, and ``python -m portable_nn info`` must stay light).  The
``"module:function"`` strings are resolved on first use.

Arguments PyTorch's kernels cannot express are declined through each declaration's
``Support`` (``check`` predicate, ``mixed_precision=False``): under ``auto`` the call goes to
the next backend and ``pnn.explain`` says why; with ``aten`` forced it raises
``BackendUnavailableError``.  NumPy (and every other non-torch) array is declined by family.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from portable_nn.backends import Backend
from portable_nn.dispatch import Support, register_builtin

#: What every PyTorch kernel takes: torch tensors on the CPU or a CUDA device, in the dtypes
#: PyTorch's kernels have for these ops, any strides (torch handles them).  No half data with
#: float32 weights: PyTorch's kernels want one dtype.
ATEN_SUPPORT = dict(
    families=("torch",),
    devices=("cpu", "cuda"),
    dtypes=("float16", "bfloat16", "float32", "float64"),
    mixed_precision=False,
)

# Priorities under ``auto``: above numba's 5 only for the ops where PyTorch's kernel measured faster
# than the numba kernel on CPU torch tensors; elsewhere 2, below every native kernel (the GPU ones
# included) and above the reference.  Static: nothing is timed at call time.  Measured with
# ``python -m kernels_aten.measure`` (forward + backward through pnn.vjp, float32 CPU tensors,
# 2 threads, the user's environment, best of 2 runs' medians; Intel Xeon with AVX-512/AMX under
# KVM, 2 cores; torch 2.13), ms aten vs numba:
#
#   conv 3x3 64->64 at (32, 64, 28, 28), pad 1, bias + relu        25.1 vs 41.4   (aten 1.65x)
#   the same channels last, (32, 28, 28, 64)                       20.6 vs 38.8   (aten 1.88x)
#   conv 5x5 6->16 at (128, 6, 12, 12), bias + relu                 1.84 vs 2.75  (aten 1.50x)
#   lstm 2 layers, I = H = 64, N = 256, T = 50                     52.1 vs 39.5   (numba 1.32x)
#   gru, same shape                                                69.6 vs 33.5   (numba 2.08x)
#   rnn (tanh), same shape                                         20.0 vs 12.9   (numba 1.54x)
#   dense 784->512 at N = 256, bias + relu                          2.83 vs 5.17  (aten 1.82x)
#   dense 64->64 at N = 256, bias + relu                            0.190 vs 0.227 (aten 1.20x)
#   dense 784->32 at N = 128, bias + relu                           0.270 vs 0.392 (aten 1.45x)
#   dense 32->10 at N = 128                                         0.103 vs 0.129 (aten 1.25x)
#
# (An earlier measurement, before the numba sequences ran their time loops in batch blocks on both
# threads, had aten ahead for lstm and rnn.)  The cells are not declared: ``torch.lstm_cell``/
# ``gru_cell`` recorded by autograd (as the sequences are) measured no faster than numba at N = 256,
# I = H = 64 (lstm_cell 0.88 vs 0.85 ms, gru_cell 0.80 vs 0.66 ms), so they would only add a second
# path to test.
#
# On CUDA tensors the same order puts aten's cuDNN convolution and GEMM ahead of the cupy (4) and
# numba_cuda (3) kernels, and its recurrences too (4.5: behind numba's 5, so nothing changes on the
# CPU): cuDNN's fused LSTM took 0.19 ms forward and 1.4 ms forward + backward for 2 layers,
# I = H = 64, N = 256, T = 50 on an H200, where the GPU kernels launch a step at a time from Python
# (cupy 9.5 and 18.7 ms).
#
# conv_transpose: oneDNN's transposed convolution against numba's (fwd / bwd ms, float32, 2 threads,
# isolated processes, bias + relu): 2x2 stride 2 (16,128,32,32)->64 12.5 / 20.9 vs 14.5 / 26.7,
# 3x3 stride 2 (16,64,32,32)->32 4.95 / 7.67 vs 9.56 / 16.1 (aten 1.2-2.1x).
FASTER_THAN_NUMBA = 6
AHEAD_OF_GPU_KERNELS = 4.5
NOT_FASTER = 2
PRIORITY = {"conv": FASTER_THAN_NUMBA, "conv_transpose": FASTER_THAN_NUMBA, "lstm": AHEAD_OF_GPU_KERNELS,
            "rnn": AHEAD_OF_GPU_KERNELS,
            "gru": AHEAD_OF_GPU_KERNELS, "dense": FASTER_THAN_NUMBA}


def _probe() -> tuple[bool, str]:
    """torch installed (looked up, not imported: probing must not load torch)."""
    if importlib.util.find_spec("torch") is None:
        return False, "the torch package is not installed"
    return True, "torch installed; PyTorch's own kernels, for torch tensors only"


BACKEND = Backend("aten", probe=_probe, priority=NOT_FASTER, arrays="torch",
                  description="PyTorch's own kernels (oneDNN, cuDNN, its fused RNNs) for torch tensors")


def _gru_form(call: Any) -> str | None:
    """PyTorch's GRU is the ``reset_after=True`` form only."""
    if call.kind == "gru" and not call.reset_after:
        return (
            "has PyTorch's GRU, reset_after=True only (n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))), "
            "not reset_after=False"
        )
    return None


register_builtin(
    "conv",
    BACKEND.name,
    forward="kernels_aten.conv:conv_forward",
    backward="kernels_aten.conv:conv_backward",
    supports=Support(
        layouts=("channels_first", "channels_last"),
        description="oneDNN convolution (PyTorch's im2col for float64; cuDNN on CUDA) + torch activation; "
        "every conv argument; asymmetric (low, high) padding pads a copy of x first; channels last "
        "as a permuted view, no copy",
        **ATEN_SUPPORT,
    ),
    priority=PRIORITY["conv"],
)

register_builtin(
    "conv_transpose",
    BACKEND.name,
    forward="kernels_aten.conv:conv_transpose_forward",
    backward="kernels_aten.conv:conv_transpose_backward",
    supports=Support(
        layouts=("channels_first", "channels_last"),
        description="oneDNN transposed convolution (PyTorch's own for float64; cuDNN on CUDA) + torch activation; "
        "every argument; channels last as a permuted view",
        **ATEN_SUPPORT,
    ),
    priority=PRIORITY["conv_transpose"],
)

#: What each sequence op runs; all take every argument but GRU's reset_after=False.
_SEQUENCE = {
    "lstm": "PyTorch's fused LSTM (oneDNN on CPU for float32/bfloat16, cuDNN on CUDA), projections included",
    "rnn": "PyTorch's fused Elman RNN, tanh or relu (cuDNN on CUDA)",
    "gru": "PyTorch's fused GRU, reset_after=True only (cuDNN on CUDA)",
}

for _op, _what in _SEQUENCE.items():
    register_builtin(
        _op,
        BACKEND.name,
        forward="kernels_aten.rnn:sequence_forward",
        backward="kernels_aten.rnn:sequence_backward",
        supports=Support(
            check=_gru_form if _op == "gru" else None,
            description=f"{_what}, backward by autograd through it; stacked, bidirectional, batch_first, "
            "lengths (packed sequences)",
            **ATEN_SUPPORT,
        ),
        priority=PRIORITY[_op],
    )

register_builtin(
    "dense",
    BACKEND.name,
    forward="kernels_aten.dense:dense_forward",
    backward="kernels_aten.dense:dense_backward",
    supports=Support(
        description="F.linear (a GEMM with the bias) + torch activation; any leading shape",
        **ATEN_SUPPORT,
    ),
    priority=PRIORITY["dense"],
)
