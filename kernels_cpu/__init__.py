"""Numba-JIT CPU kernels (backend ``"numba"``), one module per op family.

Importing this package only *declares* the kernels to dispatch: it must not
import numba.  The ``"module:function"`` strings are resolved, and the kernels
compiled (with Numba's on-disk cache), on first use.

Ops without a declaration here run on the array-API reference under ``auto``
(``pnn.explain`` shows it) and raise ``BackendUnavailableError`` when
``numba`` is forced.
"""

from __future__ import annotations

from portable_nn.dispatch import Support, register_builtin

#: What every NumPy-native CPU kernel takes: NumPy arrays and CPU torch tensors
#: (zero-copy views), float32/float64, C-contiguous (strided input is copied,
#: and ``explain`` reports the copy).
CPU_SUPPORT = dict(
    families=("numpy", "torch"),
    devices=("cpu",),
    dtypes=("float32", "float64"),
    contiguous=True,
    mixed_precision=False,
    native="numpy",
)
NUMBA_PRIORITY = 5

for _op in ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"):
    register_builtin(
        _op,
        "numba",
        forward="kernels_cpu.norm:norm_forward",
        backward="kernels_cpu.norm:norm_backward",
        supports=Support(layouts=("channels_first", "channels_last"), **CPU_SUPPORT),
        priority=NUMBA_PRIORITY,
    )

# <rnn registrations>

# <conv registrations>

# <dense registrations>

# <pool registrations>

# <loss registrations>
