"""Public ops: one module per op family (signature, validation, docstring, dispatch)."""

from __future__ import annotations

from .activations import ACTIVATIONS, Activation
from .norm import batch_norm, group_norm, instance_norm, layer_norm, merge_moments, moments, rms_norm

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "batch_norm",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "merge_moments",
    "moments",
    "rms_norm",
]
