"""CUDA C kernels launched through CuPy RawModule (backend ``"cupy"``).

Importing this package only declares the kernels to dispatch: it must not import CuPy.  The
``"module:function"`` strings are resolved on first use; each family's ``.cu`` source is
compiled by NVRTC (through CuPy, cached on disk by CuPy) the first time one of its kernels runs
on a device.  Launchers take CuPy arrays; dispatch hands them zero-copy CuPy views of CUDA torch
tensors (bfloat16 as ``uint16`` bits) and runs them on torch's current stream.
"""

from __future__ import annotations

import importlib.util

from portable_nn.backends import Backend
from portable_nn.dispatch import Support, register_builtin
from portable_nn.kernel_checks import int32_pool_positions, int64_ignore_index
from portable_nn.kernel_notes import options

#: What every CUDA C kernel takes: CuPy arrays and CUDA torch tensors, C-contiguous (strided
#: input is copied, and ``explain`` reports the copy).
GPU_SUPPORT = dict(
    families=("cupy", "torch"),
    devices=("cuda",),
    contiguous=True,
    native="cupy",
)
CUPY_PRIORITY = 4


def _probe() -> tuple[bool, str]:
    """CuPy installed and seeing at least one GPU."""
    if importlib.util.find_spec("cupy") is None:
        return False, "the cupy package is not installed"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"cupy finds no GPU ({type(exc).__name__}: {exc})"
    if count == 0:
        return False, "cupy finds no GPU"
    return True, f"cupy sees {count} GPU(s)"


BACKEND = Backend("cupy", probe=_probe, priority=CUPY_PRIORITY, arrays="cupy",
                  description="CUDA C kernels through CuPy RawModule: CuPy arrays and CUDA torch tensors (zero-copy)")


register_builtin(
    "moments",
    BACKEND.name,
    forward="kernels_gpu.cuda_c.norm:moments_forward",
    backward="kernels_gpu.cuda_c.norm:moments_backward",
    supports=Support(
        dtypes=("float32", "float64", "float16", "bfloat16"),
        description="any axes, keepdims, any correction, no transpose; float32 mean/var for half x; "
        "shifted sums, deterministic block reductions",
        **GPU_SUPPORT,
    ),
    priority=CUPY_PRIORITY,
)

for _op in ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"):
    register_builtin(
        _op,
        BACKEND.name,
        forward="kernels_gpu.cuda_c.norm:norm_forward",
        backward="kernels_gpu.cuda_c.norm:norm_backward",
        supports=Support(
            dtypes=("float32", "float64", "float16", "bfloat16"),
            layouts=("channels_first", "channels_last"),
            mixed_precision=True,
            description=f"{options(_op)}; float16/bfloat16 x with float32 statistics (float32 parameters "
            "allowed); deterministic block reductions".lstrip("; "),
            **GPU_SUPPORT,
        ),
        priority=CUPY_PRIORITY,
    )

#: Pooling ops: their entry points in pool.py (<entry>_forward/_backward) and how the backward works.
_POOLS = {"max_pool": ("pool", "; gather backward"), "avg_pool": ("pool", "; gather backward"),
          "max_unpool": ("unpool", " (atomicMax claim, then gather)")}
for _op, (_entry, _how) in _POOLS.items():
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"kernels_gpu.cuda_c.pool:{_entry}_forward",
        backward=f"kernels_gpu.cuda_c.pool:{_entry}_backward",
        supports=Support(
            dtypes=("float32", "float64", "float16", "bfloat16"),
            layouts=("channels_first", "channels_last"),
            check=int32_pool_positions,
            description=f"{options(_op)}{_how}",
            **GPU_SUPPORT,
        ),
        priority=CUPY_PRIORITY,
    )


for _op in ("log_softmax", "cross_entropy"):
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"kernels_gpu.cuda_c.loss:{_op}_forward",
        backward=f"kernels_gpu.cuda_c.loss:{_op}_backward",
        supports=Support(
            dtypes=("float32", "float64", "float16", "bfloat16"),
            check=int64_ignore_index if _op == "cross_entropy" else None,
            description=options(_op),
            **GPU_SUPPORT,
        ),
        priority=CUPY_PRIORITY,
    )

register_builtin(
    "dense",
    BACKEND.name,
    forward="kernels_gpu.cuda_c.dense:dense_forward",
    backward="kernels_gpu.cuda_c.dense:dense_backward",
    supports=Support(
        dtypes=("float32", "float64"),
        mixed_precision=False,
        description="any leading shape; cuBLAS GEMMs, fused bias+activation epilogue and bias gradient",
        **GPU_SUPPORT,
    ),
    priority=CUPY_PRIORITY,
)

#: What the convolutions take (conv_transpose runs conv's own kernels, so it takes the same).
_CONV_SUPPORT = dict(
    dtypes=("float32", "float64"),
    layouts=("channels_first", "channels_last"),
    mixed_precision=False,
    **GPU_SUPPORT,
)

register_builtin(
    "conv",
    BACKEND.name,
    forward="kernels_gpu.cuda_c.conv:conv_forward",
    backward="kernels_gpu.cuda_c.conv:conv_backward",
    supports=Support(
        **_CONV_SUPPORT,
        description="1-3-D, batched or not, every stride/padding/dilation/groups; im2col + cuBLAS, gather col2im",
    ),
    priority=CUPY_PRIORITY,
)

register_builtin(
    "conv_transpose",
    BACKEND.name,
    forward="kernels_gpu.cuda_c.conv:conv_transpose_forward",
    backward="kernels_gpu.cuda_c.conv:conv_transpose_backward",
    supports=Support(
        **_CONV_SUPPORT,
        description="1-3-D, batched or not, every stride/padding/output_padding/dilation/groups; conv's "
        "cuBLAS column products + gather col2im, then the fused bias+activation epilogue",
    ),
    priority=CUPY_PRIORITY,
)

for _op in ("rnn_cell", "lstm_cell", "gru_cell"):
    register_builtin(
        _op,
        BACKEND.name,
        forward="kernels_gpu.cuda_c.rnn:cell_forward",
        backward="kernels_gpu.cuda_c.rnn:cell_backward",
        supports=Support(
            dtypes=("float32", "float64"),
            mixed_precision=False,
            description=f"{options(_op)}; cuBLAS products + one fused kernel per pass",
            **GPU_SUPPORT,
        ),
        priority=CUPY_PRIORITY,
    )

for _op in ("rnn", "lstm", "gru"):
    register_builtin(
        _op,
        BACKEND.name,
        forward="kernels_gpu.cuda_c.rnn:sequence_forward",
        backward="kernels_gpu.cuda_c.rnn:sequence_backward",
        supports=Support(
            dtypes=("float32", "float64"),
            mixed_precision=False,
            description=f"{options(_op)}; input projection of all steps in one GEMM, per step one cuBLAS GEMM "
            "+ one fused kernel (+ one GEMM with an LSTM projection); deterministic",
            **GPU_SUPPORT,
        ),
        priority=CUPY_PRIORITY,
    )
