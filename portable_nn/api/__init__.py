"""Public ops: one module per op family (signature, validation, docstring, dispatch)."""

from __future__ import annotations

from .activations import ACTIVATIONS, Activation
from .loss import cross_entropy, log_softmax
from .norm import batch_norm, group_norm, instance_norm, layer_norm, merge_moments, moments, rms_norm
from .pool import avg_pool, max_pool

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "avg_pool",
    "batch_norm",
    "cross_entropy",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "log_softmax",
    "max_pool",
    "merge_moments",
    "moments",
    "rms_norm",
]
