"""Drop-in ``torch.nn`` recurrent cells and ``CrossEntropyLoss`` running portable_nn's kernels."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .errors import raises_like_torch
from .functional import cross_entropy, gru_cell, lstm_cell, rnn_cell


def _cell_inputs(cell: nn.Module, input: Tensor, hx: Tensor | None) -> tuple[Tensor, bool]:
    """``torch.nn``'s cell checks: 1-D (unbatched) or 2-D ``input``; zero state when ``hx`` is None."""
    name = type(cell).__name__
    if input.dim() not in (1, 2):
        raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
    if hx is not None and hx.dim() not in (1, 2):
        raise ValueError(f"{name}: Expected hidden to be 1D or 2D, got {hx.dim()}D instead")
    return input, input.dim() == 2


def _zeros(cell: Any, input: Tensor, batched: bool) -> Tensor:
    shape = (input.shape[0], cell.hidden_size) if batched else (cell.hidden_size,)
    return torch.zeros(shape, dtype=input.dtype, device=input.device)


class RNNCell(nn.RNNCell):
    """Drop-in ``torch.nn.RNNCell``: h' = act(x·W_ihᵀ + b_ih + h·W_hhᵀ + b_hh), one fused step.

    Args: as in ``torch.nn.RNNCell`` (``nonlinearity`` ``"tanh"`` or ``"relu"``).
    """

    @raises_like_torch
    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """``(N, input_size)`` or ``(input_size,)`` → h' of the hidden state's shape."""
        input, batched = _cell_inputs(self, input, hx)
        h = _zeros(self, input, batched) if hx is None else hx
        return rnn_cell(input, h, self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh,
                        activation=self.nonlinearity)


class LSTMCell(nn.LSTMCell):
    """Drop-in ``torch.nn.LSTMCell`` (gates i, f, g, o): returns ``(h', c')``.  Args as in ``torch.nn.LSTMCell``."""

    @raises_like_torch
    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``(N, input_size)`` or ``(input_size,)`` and ``(h, c)`` (zeros when None) → ``(h', c')``."""
        input, batched = _cell_inputs(self, input, None if hx is None else hx[0])
        h, c = (_zeros(self, input, batched), _zeros(self, input, batched)) if hx is None else hx
        return lstm_cell(input, h, c, self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)


class GRUCell(nn.GRUCell):
    """Drop-in ``torch.nn.GRUCell`` (gates r, z, n; PyTorch's form).  Args as in ``torch.nn.GRUCell``."""

    @raises_like_torch
    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """``(N, input_size)`` or ``(input_size,)`` → h' of the hidden state's shape."""
        input, batched = _cell_inputs(self, input, hx)
        h = _zeros(self, input, batched) if hx is None else hx
        return gru_cell(input, h, self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Drop-in ``torch.nn.CrossEntropyLoss`` running the fused log-softmax + loss kernel.

    Args: as in ``torch.nn.CrossEntropyLoss`` (``weight``, ``ignore_index``, ``reduction``,
    ``label_smoothing``; the deprecated ``size_average``/``reduce`` map to ``reduction`` as there).
    Classes are axis 1 of ``(N, C, d1, ...)`` input, or axis 0 of unbatched ``(C,)`` input.
    """

    @raises_like_torch
    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        """The loss of ``input`` (logits) against class indices or class probabilities ``target``."""
        return cross_entropy(input, target, axis=1 if input.dim() > 1 else 0, weight=self.weight,
                             ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing)
