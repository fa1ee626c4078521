"""Numba-CUDA kernels (backend ``"numba_cuda"``); declarations only, no numba import here.

Each op family has a module of ``@cuda.jit`` kernels and host launchers (same file names as
``kernels_cpu/``); ``_runtime`` holds the launch, dtype and array-module helpers that let the
same launchers run on CuPy arrays on a GPU and on NumPy arrays in Numba's CUDA simulator.
The ``"module:function"`` strings below are imported, and kernels compiled (with Numba's
on-disk cache), on first use.

Ops without a declaration here run on another backend under ``auto`` and raise
``BackendUnavailableError`` when ``numba_cuda`` is forced.
"""

from __future__ import annotations

import ctypes.util
import importlib.util

from portable_nn.backends import Backend
from portable_nn.dispatch import Support, register_builtin
from portable_nn.kernel_checks import int32_pool_positions, int64_ignore_index
from portable_nn.kernel_notes import options

#: What every Numba-CUDA kernel takes: CuPy arrays (and CUDA torch tensors, as zero-copy CuPy
#: views), C-contiguous (strided input is copied, and ``explain`` reports the copy).
GPU_SUPPORT = dict(
    families=("cupy", "torch"),
    devices=("cuda",),
    contiguous=True,
    native="cupy",
)
NUMBA_CUDA_PRIORITY = 3
_PKG = "kernels_gpu.numba_cuda"


def _probe() -> tuple[bool, str]:
    """A CUDA driver and a device numba.cuda can use (numba.cuda loads only where libcuda exists)."""
    if importlib.util.find_spec("numba") is None:
        return False, "the numba package is not installed"
    if ctypes.util.find_library("cuda") is None:
        return False, "no CUDA driver (libcuda) on this machine"
    try:
        from numba import cuda

        if not cuda.is_available():
            return False, "numba.cuda finds no usable GPU"
    except Exception as exc:  # pragma: no cover - needs a broken CUDA install
        return False, f"numba.cuda failed: {exc}"
    return True, "numba.cuda sees a GPU"


BACKEND = Backend("numba_cuda", probe=_probe, priority=NUMBA_CUDA_PRIORITY, arrays="cupy",
                  description="Numba-CUDA GPU kernels: CuPy arrays and CUDA torch tensors (zero-copy)")

register_builtin(
    "moments",
    BACKEND.name,
    forward=f"{_PKG}.norm:moments_forward",
    backward=f"{_PKG}.norm:moments_backward",
    supports=Support(
        dtypes=("float16", "bfloat16", "float32", "float64"),
        description="any axes, keepdims, any correction, no transpose; float32 mean/var for half x; "
                    "float64 shifted sums, deterministic",
        **GPU_SUPPORT,
    ),
    priority=NUMBA_CUDA_PRIORITY,
)

for _op in ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"):
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"{_PKG}.norm:norm_forward",
        backward=f"{_PKG}.norm:norm_backward",
        supports=Support(
            dtypes=("float16", "bfloat16", "float32", "float64"),
            layouts=("channels_first", "channels_last"),
            mixed_precision=True,
            description=f"{options(_op)}; float32 statistics for half x (float32 params allowed)".lstrip("; "),
            **GPU_SUPPORT,
        ),
        priority=NUMBA_CUDA_PRIORITY,
    )

register_builtin(
    "log_softmax",
    BACKEND.name,
    forward=f"{_PKG}.loss:log_softmax_forward",
    backward=f"{_PKG}.loss:log_softmax_backward",
    supports=Support(
        dtypes=("float16", "bfloat16", "float32", "float64"),
        description=f"{options('log_softmax')}; float32 math for half precision",
        **GPU_SUPPORT,
    ),
    priority=NUMBA_CUDA_PRIORITY,
)


#: Pooling ops: their entry points in pool.py (<entry>_forward/_backward) and how the backward works.
_POOLS = {"max_pool": ("pool", "; gather backward"), "avg_pool": ("pool", "; gather backward"),
          "max_unpool": ("unpool", " (atomic-max claim)")}
for _op, (_entry, _how) in _POOLS.items():
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"{_PKG}.pool:{_entry}_forward",
        backward=f"{_PKG}.pool:{_entry}_backward",
        supports=Support(
            dtypes=("float16", "bfloat16", "float32", "float64"),
            layouts=("channels_first", "channels_last"),
            check=int32_pool_positions,
            description=f"{options(_op)}{_how}",
            **GPU_SUPPORT,
        ),
        priority=NUMBA_CUDA_PRIORITY,
    )


register_builtin(
    "cross_entropy",
    BACKEND.name,
    forward=f"{_PKG}.loss:cross_entropy_forward",
    backward=f"{_PKG}.loss:cross_entropy_backward",
    supports=Support(
        dtypes=("float16", "bfloat16", "float32", "float64"),
        mixed_precision=True,
        check=int64_ignore_index,
        description=f"{options('cross_entropy')}; deterministic two-pass reductions",
        **GPU_SUPPORT,
    ),
    priority=NUMBA_CUDA_PRIORITY,
)

register_builtin(
    "dense",
    BACKEND.name,
    forward=f"{_PKG}.dense:dense_forward",
    backward=f"{_PKG}.dense:dense_backward",
    supports=Support(
        dtypes=("float16", "bfloat16", "float32", "float64"),
        mixed_precision=True,
        description="GEMM through CuPy (float32 for half data) + fused bias/activation epilogue; "
                    "deterministic bias gradient",
        **GPU_SUPPORT,
    ),
    priority=NUMBA_CUDA_PRIORITY,
)

#: What the convolutions take (conv_transpose runs conv's own kernels, so it takes the same).
_CONV_SUPPORT = dict(
    dtypes=("float16", "bfloat16", "float32", "float64"),
    layouts=("channels_first", "channels_last"),
    mixed_precision=True,
    **GPU_SUPPORT,
)

register_builtin(
    "conv",
    BACKEND.name,
    forward=f"{_PKG}.conv:conv_forward",
    backward=f"{_PKG}.conv:conv_backward",
    supports=Support(
        **_CONV_SUPPORT,
        description="1-3-D, batched or not, every stride/padding/dilation/groups; im2col + CuPy GEMM + fused "
                    "epilogue, gather col2im (deterministic)",
    ),
    priority=NUMBA_CUDA_PRIORITY,
)

register_builtin(
    "conv_transpose",
    BACKEND.name,
    forward=f"{_PKG}.conv:conv_transpose_forward",
    backward=f"{_PKG}.conv:conv_transpose_backward",
    supports=Support(
        **_CONV_SUPPORT,
        description="1-3-D, batched or not, every stride/padding/output_padding/dilation/groups; conv's CuPy "
                    "GEMM + gather col2im, then the fused bias+activation epilogue (deterministic)",
    ),
    priority=NUMBA_CUDA_PRIORITY,
)

for _op, _kind in (("rnn_cell", "cell"), ("lstm_cell", "cell"), ("gru_cell", "cell"),
                   ("rnn", "sequence"), ("lstm", "sequence"), ("gru", "sequence")):
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"{_PKG}.rnn:{_kind}_forward",
        backward=f"{_PKG}.rnn:{_kind}_backward",
        supports=Support(
            dtypes=("float32", "float64"),
            mixed_precision=False,
            description=f"{options(_op)}; one GEMM + one fused kernel per step (+ one GEMM with an LSTM "
                        "projection)",
            **GPU_SUPPORT,
        ),
        priority=NUMBA_CUDA_PRIORITY,
    )
