"""The array-API reference implementations (every array library; the test oracle).

Registering them here imports nothing heavy: dispatch resolves the
``"module:function"`` strings on first use.
"""

from __future__ import annotations

from ..dispatch import Support, register_builtin

REFERENCE_PRIORITY = -1
_ANY = Support(description="array-API standard only")

_NORM = "portable_nn.reference.norm"
for _op in ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"):
    register_builtin(
        _op, "reference", forward=f"{_NORM}:norm_forward", backward=f"{_NORM}:norm_backward",
        supports=_ANY, priority=REFERENCE_PRIORITY,
    )
register_builtin(
    "moments", "reference", forward=f"{_NORM}:moments_forward", backward=f"{_NORM}:moments_backward",
    supports=_ANY, priority=REFERENCE_PRIORITY,
)

# The other op families follow one naming rule: portable_nn.reference.<family>:<op>_forward/_backward.
_FAMILIES = {
    "rnn": ("rnn_cell", "lstm_cell", "gru_cell", "rnn", "lstm", "gru"),
    "conv": ("conv",),
    "dense": ("dense",),
    "pool": ("max_pool", "avg_pool"),
    "loss": ("log_softmax", "cross_entropy"),
}
for _family, _ops in _FAMILIES.items():
    for _op in _ops:
        _module = f"portable_nn.reference.{_family}"
        register_builtin(
            _op, "reference", forward=f"{_module}:{_op}_forward", backward=f"{_module}:{_op}_backward",
            supports=_ANY, priority=REFERENCE_PRIORITY,
        )
