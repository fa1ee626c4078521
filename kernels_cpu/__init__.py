"""Numba-JIT CPU kernels (backend ``"numba"``), one module per op family.

Importing this package only *declares* the kernels to dispatch: it must not
import numba.  The ``"module:function"`` strings are resolved, and the kernels
compiled (with Numba's on-disk cache), on first use.

Ops without a declaration here run on the array-API reference under ``auto``
(``pnn.explain`` shows it) and raise ``BackendUnavailableError`` when
``numba`` is forced.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from portable_nn.backends import Backend
from portable_nn.dispatch import Support, register_builtin
from portable_nn.kernel_checks import int32_pool_positions, int64_ignore_index
from portable_nn.kernel_notes import options
from portable_nn.kernel_plans import MIDDLE_AXES

#: What every NumPy-native CPU kernel takes: NumPy arrays and CPU torch tensors
#: (zero-copy views), float32/float64, C-contiguous (strided input is copied,
#: and ``explain`` reports the copy).  The ops declared with it take nothing else.
CPU_SUPPORT = dict(
    families=("numpy", "torch"),
    devices=("cpu",),
    dtypes=("float32", "float64"),
    contiguous=True,
    mixed_precision=False,
    native="numpy",
)
#: The same with float16/bfloat16 data too (NumPy float16, ml_dtypes bfloat16 as JAX gives, CPU
#: torch float16/bfloat16 tensors), with parameters of the data's dtype or float32: the kernels
#: read and write the half-precision bits and compute in float32 (``kernels_cpu._half``).
HALF_SUPPORT = {**CPU_SUPPORT, "dtypes": ("float32", "float64", "float16", "bfloat16"), "mixed_precision": True}
#: The kernels that compute in float32 throughout (convolution, dense, pooling, losses,
#: recurrences) take half-precision calls through this module: widened to float32 on entry,
#: rounded back on exit.  The norms read and write half-precision data in their loops instead.
WIDENED = "kernels_cpu._widened"
WIDENED_NOTE = "; float16/bfloat16 widened to float32 on entry, rounded on exit"
NUMBA_PRIORITY = 5
#: Entered around each forward and backward of the kernels that call BLAS (dense, convolution,
#: recurrences): BLAS at one thread for the call's duration.  The norms, moments, pooling and losses
#: call no BLAS and go without it (entering and leaving it cost ~5 us: a tenth of a small layer_norm).
CPU_SCOPE = "kernels_cpu._runtime:call_scope"


def _probe() -> tuple[bool, str]:
    """Available wherever numba installs; nothing is imported or compiled here."""
    if importlib.util.find_spec("numba") is None:
        return False, "the numba package is not installed"
    return True, "numba installed; kernels compile on first use"


BACKEND = Backend("numba", probe=_probe, priority=NUMBA_PRIORITY, arrays="numpy",
                  description="Numba-JIT CPU kernels: NumPy arrays and CPU torch tensors (zero-copy), "
                              "float32/float64 and float16/bfloat16 (float32 arithmetic)",
                  compile_variants="kernels_cpu._runtime:every_variant")

register_builtin(
    "moments",
    BACKEND.name,
    forward="kernels_cpu.norm:moments_forward",
    backward="kernels_cpu.norm:moments_backward",
    supports=Support(
        description="any axes (int, tuple, None), keepdims, any correction; float64 shifted sums, no transpose",
        **CPU_SUPPORT,
    ),
    priority=NUMBA_PRIORITY,
)

def _middle_axes_in_full_precision(call: Any) -> str | None:
    """The layer/RMS norm kernels over middle axes (``kernels_cpu._norm_middle``) take float32/float64."""
    if call.layout == MIDDLE_AXES and call.dtype not in CPU_SUPPORT["dtypes"]:
        return f"runs {MIDDLE_AXES} in float32/float64 only, not {call.dtype}"
    return None


for _op in ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"):
    _axes_norm = _op in ("layer_norm", "rms_norm")
    register_builtin(
        _op,
        BACKEND.name,
        forward="kernels_cpu.norm:norm_forward",
        backward="kernels_cpu.norm:norm_backward",
        plan="kernels_cpu.norm:norm_plan",
        supports=Support(layouts=("channels_first", "channels_last", *((MIDDLE_AXES,) if _axes_norm else ())),
                         check=_middle_axes_in_full_precision if _axes_norm else None,
                         description="float16/bfloat16 read and written in the loops (float32 arithmetic, float64 "
                                     "statistics)" + ("; trailing axes, or a block of axes followed by kept ones "
                                                      "(float32/float64) without a transpose" if _axes_norm else ""),
                         **HALF_SUPPORT),
        priority=NUMBA_PRIORITY,
    )

for _op, _kind in (("rnn_cell", "cell"), ("lstm_cell", "cell"), ("gru_cell", "cell"),
                   ("rnn", "sequence"), ("lstm", "sequence"), ("gru", "sequence")):
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"{WIDENED}:{_kind}_forward",
        backward=f"{WIDENED}:{_kind}_backward",
        supports=Support(
            description=options(_op) + WIDENED_NOTE,
            **HALF_SUPPORT,
        ),
        priority=NUMBA_PRIORITY,
        scope=CPU_SCOPE,
    )

register_builtin(
    "conv",
    BACKEND.name,
    forward=f"{WIDENED}:conv_forward",
    backward=f"{WIDENED}:conv_backward",
    supports=Support(
        layouts=("channels_first", "channels_last"),
        description="1-3-D, batched or not, every stride/padding/dilation/groups (depthwise included)" + WIDENED_NOTE,
        **HALF_SUPPORT,
    ),
    priority=NUMBA_PRIORITY,
    scope=CPU_SCOPE,
)

register_builtin(
    "conv_transpose",
    BACKEND.name,
    forward=f"{WIDENED}:conv_transpose_forward",
    backward=f"{WIDENED}:conv_transpose_backward",
    supports=Support(
        layouts=("channels_first", "channels_last"),
        description="1-3-D, batched or not, every stride/padding/output_padding/dilation/groups: the conv "
        "kernels' column products and scatter, then a bias + activation pass" + WIDENED_NOTE,
        **HALF_SUPPORT,
    ),
    priority=NUMBA_PRIORITY,
    scope=CPU_SCOPE,
)

register_builtin(
    "dense",
    BACKEND.name,
    forward=f"{WIDENED}:dense_forward",
    backward=f"{WIDENED}:dense_backward",
    supports=Support(description="any leading shape (1-D x and zero rows included)" + WIDENED_NOTE, **HALF_SUPPORT),
    priority=NUMBA_PRIORITY,
    scope=CPU_SCOPE,
)


#: Pooling ops and their kernels' entry points (kernels_cpu.pool:<entry>_forward/_backward).
_POOLS = {"max_pool": "pool", "avg_pool": "pool", "max_unpool": "unpool"}
for _op, _entry in _POOLS.items():
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"{WIDENED}:{_entry}_forward",
        backward=f"{WIDENED}:{_entry}_backward",
        supports=Support(
            layouts=("channels_first", "channels_last"),
            # max_unpool keeps its positions in int64: no plane-size limit
            check=None if _op == "max_unpool" else int32_pool_positions,
            description=options(_op) + WIDENED_NOTE,
            **HALF_SUPPORT,
        ),
        priority=NUMBA_PRIORITY,
    )


for _op in ("log_softmax", "cross_entropy"):
    register_builtin(
        _op,
        BACKEND.name,
        forward=f"{WIDENED}:{_op}_forward",
        backward=f"{WIDENED}:{_op}_backward",
        supports=Support(
            check=int64_ignore_index if _op == "cross_entropy" else None,
            description=options(_op) + WIDENED_NOTE,
            **HALF_SUPPORT,
        ),
        priority=NUMBA_PRIORITY,
    )
