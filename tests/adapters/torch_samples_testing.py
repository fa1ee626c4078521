"""Helpers of the tests that run PyTorch's own test samples (OpInfo, ModuleInfo) through portable_nn.torch."""

from __future__ import annotations

from typing import Any

import torch


def clone(value: Any) -> Any:
    """A sample's arguments with fresh tensors (same values and ``requires_grad``), so that our call
    and PyTorch's each get their own leaves and buffers."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(clone(v) for v in value)
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value
