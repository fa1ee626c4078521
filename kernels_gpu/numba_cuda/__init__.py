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

from portable_nn.dispatch import Support, register_builtin

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

for _op in ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"):
    register_builtin(
        _op,
        "numba_cuda",
        forward=f"{_PKG}.norm:norm_forward",
        backward=f"{_PKG}.norm:norm_backward",
        supports=Support(
            dtypes=("float16", "bfloat16", "float32", "float64"),
            layouts=("channels_first", "channels_last"),
            mixed_precision=True,
            description="float32 statistics for half x (float32 params allowed); fused activations",
            **GPU_SUPPORT,
        ),
        priority=NUMBA_CUDA_PRIORITY,
    )

register_builtin(
    "log_softmax",
    "numba_cuda",
    forward=f"{_PKG}.loss:log_softmax_forward",
    backward=f"{_PKG}.loss:log_softmax_backward",
    supports=Support(
        dtypes=("float16", "bfloat16", "float32", "float64"),
        description="any axis; float32 math for half precision",
        **GPU_SUPPORT,
    ),
    priority=NUMBA_CUDA_PRIORITY,
)
