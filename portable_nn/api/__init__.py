"""Public ops: one module per op family (signature, validation, docstring, dispatch)."""

from __future__ import annotations

from .activations import ACTIVATIONS, Activation
from .conv import conv
from .dense import dense
from .loss import cross_entropy, log_softmax
from .norm import batch_norm, group_norm, instance_norm, layer_norm, merge_moments, moments, rms_norm
from .pool import avg_pool, max_pool
from .rnn import gru, gru_cell, lstm, lstm_cell, rnn, rnn_cell

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "avg_pool",
    "batch_norm",
    "conv",
    "cross_entropy",
    "dense",
    "group_norm",
    "gru",
    "gru_cell",
    "instance_norm",
    "layer_norm",
    "log_softmax",
    "lstm",
    "lstm_cell",
    "max_pool",
    "merge_moments",
    "moments",
    "rms_norm",
    "rnn",
    "rnn_cell",
]
