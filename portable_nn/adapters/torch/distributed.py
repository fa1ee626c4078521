"""Batch norm over the global batch of a data-parallel job: :class:`SyncBatchNorm` on ``torch.distributed``.

Each process (rank) holds part of the batch.  The forward computes its part's per-channel
statistics with our ``moments`` kernel — the count n, the mean and M2 = Σ (x − mean)² — and one
``all_gather`` of a (3C,) vector per rank hands every rank every part; Chan's merge
(:func:`portable_nn.merge_moments`, in rank order, so every rank gets the same bits) gives the
global mean and variance:

    N = Σ nᵢ,   mean = Σ nᵢ·meanᵢ / N,   M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ − mean)²

— deviations from the merged mean, never E[x²] − E[x]² (what an all_reduce of sums and sums of
squares would give, and which loses the variance of float32 data whose mean is large against its
spread).  A rank with an empty batch contributes n = 0, nothing else.  The normalisation (and a
fused activation) is our batch-norm kernel given those global statistics.

The backward runs our fused batch-norm backward with the statistics held fixed, which yields
g = dy·act′, the local sums Σ g and Σ g·x̂ (the parameter gradients) and dx₀ = r·w·g; one
``all_reduce`` of the (2C,) vector of sums gives their global values, and the statistics' part of
the input gradient is one per-channel affine correction:

    dx = dx₀ − r·w/N · (Σ g + (x − mean)·r·Σ g·x̂)

The parameter gradients stay local sums, as ``torch.nn.SyncBatchNorm`` returns them
(``DistributedDataParallel`` then averages them over ranks).  The running statistics are updated
from the global ones (the variance unbiased over N), identically on every rank.

Unlike ``torch.nn.SyncBatchNorm``, which refuses CPU tensors, this runs on any tensors our ops
take: CPU tensors with the ``gloo`` backend, CUDA tensors with ``nccl``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ...api import batch_norm as core_batch_norm
from ...api import merge_moments, moments
from ...api.activations import ActivationLike
from ...autodiff import vjp
from ...kernel_plans import momentum_update
from .modules import _batch_norm_forward, _BatchNormMixin, momentum_factor


def _group_size(process_group: Any) -> int:
    """Ranks in the group when ``torch.distributed`` is running, else 1 (nothing to synchronise)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(process_group)


def _stats_dtype(x: Tensor) -> torch.dtype:
    """float32 statistics for half data (as the kernels keep them), else the data's dtype."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def global_moments(x: Tensor, channel: int, process_group: Any) -> tuple[int, Tensor, Tensor]:
    """``(N, mean, M2)`` per channel over every rank's ``x`` (reduced over all axes but ``channel``).

    One ``all_gather`` of this rank's ``(n, mean, M2)``, then Chan's merge in rank order.
    """
    c = x.shape[channel]
    axes = tuple(a for a in range(x.ndim) if a != channel)
    n = math.prod(x.shape[a] for a in axes)
    dtype = _stats_dtype(x)
    local = torch.zeros(3, c, dtype=dtype, device=x.device)
    local[0] = n
    if n:
        mean, var = moments(x.detach(), axes)
        local[1] = mean
        local[2] = var * n
    parts = [torch.empty_like(local) for _ in range(_group_size(process_group))]
    torch.distributed.all_gather(parts, local, group=process_group)
    total, mean, m2 = parts[0][0], parts[0][1], parts[0][2]
    for part in parts[1:]:
        total, mean, m2 = merge_moments((total, mean, m2), (part[0], part[1], part[2]))
    return int(total[0].item()), mean, m2


class _SyncBatchNormFunction(torch.autograd.Function):
    """The synchronised forward and backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, momentum: float, eps: float, activation: Any, channel_axis: int,
                process_group: Any) -> Tensor:
        channel = channel_axis % x.ndim
        count, mean, m2 = global_moments(x, channel, process_group)
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {count} over every rank "
                             f"(this rank's input size {list(x.shape)})")
        var = m2 / count
        if running_mean is not None and running_var is not None:
            new_mean, new_var = momentum_update(torch, running_mean.to(mean.dtype), running_var.to(mean.dtype),
                                                mean[None], var[None], momentum, count)
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
        c = x.shape[channel]
        # The kernel needs the parameters to give the sums Σ g (dbias) and Σ g·x̂ (dweight) the
        # input gradient is built from, so absent ones are ones and zeros here.
        w = weight if weight is not None else torch.ones(c, dtype=mean.dtype, device=x.device)
        b = bias if bias is not None else torch.zeros(c, dtype=mean.dtype, device=x.device)
        y, pullback = vjp(core_batch_norm, x, weight=w, bias=b, running_mean=mean, running_var=var, training=False,
                          eps=eps, channel_axis=channel_axis, activation=activation, wrt=("x", "weight", "bias"))
        ctx.pullback = pullback
        ctx.process_group = process_group
        ctx.count = count
        ctx.channel = channel
        ctx.has_params = (weight is not None, bias is not None)
        ctx.save_for_backward(x, w, mean, var.add(eps).rsqrt())
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        x, w, mean, rstd = ctx.saved_tensors
        grads = ctx.pullback(dy)
        ctx.pullback = None
        dx = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([grads.bias.to(mean.dtype), grads.weight.to(mean.dtype)])
            torch.distributed.all_reduce(sums, group=ctx.process_group)
            c = mean.shape[0]
            sum_g, sum_gxh = sums[:c], sums[c:]
            scale = rstd * w.to(mean.dtype) / ctx.count
            shape = [1] * x.ndim
            shape[ctx.channel] = c
            offset = (scale * sum_g).reshape(shape)
            slope = (scale * rstd * sum_gxh).reshape(shape)
            # x − mean first (exact enough at any offset), then in place: one buffer, not three.
            correction = x.to(mean.dtype) - mean.reshape(shape)
            torch.addcmul(offset, correction, slope, out=correction)
            dx = grads.x
            if dx.dtype == mean.dtype:
                dx.sub_(correction)
            else:
                dx = (dx.to(mean.dtype) - correction).to(x.dtype)
        has_weight, has_bias = ctx.has_params
        dweight = grads.weight if has_weight and ctx.needs_input_grad[1] else None
        dbias = grads.bias if has_bias and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None, None, None, None


class SyncBatchNorm(_BatchNormMixin, nn.modules.batchnorm._BatchNorm):
    """Drop-in ``torch.nn.SyncBatchNorm``: batch norm with the statistics of the whole data-parallel
    batch, on our kernels, for CPU (``gloo``) and CUDA (``nccl``) tensors alike.

    It has ``torch.nn.SyncBatchNorm``'s constructor, parameters, buffers, state_dict keys and
    ``convert_sync_batchnorm``, and the base class they share (``torch.nn``'s ``_BatchNorm``),
    but is not a subclass of it: ``DistributedDataParallel`` refuses any ``torch.nn.SyncBatchNorm``
    instance in a CPU model ("SyncBatchNorm layers only work with GPU modules", torch 2.13),
    which would rule out the CPU clusters this class exists for.

    In training mode with ``torch.distributed`` initialised and more than one rank in
    ``process_group``, every rank normalises with the mean and variance of the union of the ranks'
    batches (merged stably, see :mod:`portable_nn.adapters.torch.distributed`; uneven batch sizes
    and empty batches are fine) and updates ``running_mean``/``running_var`` from them;
    gradients flow through the exchange.  Otherwise (evaluation, one rank, no process group)
    it is a plain batch norm, as ``torch.nn.SyncBatchNorm`` is.  Constructor arguments,
    parameters, buffers and state_dict keys are ``torch.nn.SyncBatchNorm``'s.

    Args:
        num_features: the number of channels C.
        eps: added to the variance for stability.
        momentum: weight of the batch statistics in the running averages; ``None`` for a
            cumulative average.
        affine: whether to learn ``weight`` (ones) and ``bias`` (zeros).
        track_running_stats: whether to keep running statistics (evaluation then uses them).
        process_group: the ranks whose batches are merged (default: every rank).
        device: where the parameters and buffers are created.
        dtype: their dtype.
        bias: keyword-only; ``False`` drops the learned shift.
        activation: keyword-only fused activation (default ``"identity"``).
        channel_axis: keyword-only; 1 (PyTorch's layout) or -1 for channels-last data.

    Every rank must call the forward (and the backward) the same number of times: each is a
    collective operation, as with ``torch.nn.SyncBatchNorm``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        activation: ActivationLike = "identity",
        channel_axis: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias,
                         activation=activation, channel_axis=channel_axis)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_non_zero_input_channels(self, input: Tensor) -> None:
        if input.shape[self.channel_axis] == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` per channel with the statistics of every rank's batch (see the class)."""
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        group = self.process_group if self.process_group is not None else (
            torch.distributed.group.WORLD if torch.distributed.is_available() else None)
        if not (use_batch and self.training and _group_size(group) > 1):
            return _batch_norm_forward(self, input)
        factor = momentum_factor(self)
        keep = self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if keep else None, self.running_var if keep else None,
            factor, self.eps, self.activation, self.channel_axis, group)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """``module`` with every batch norm in it (``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm``
        and ours) replaced by a :class:`SyncBatchNorm` sharing its parameters and buffers.

        Our modules keep their fused activation and channel axis.  Returns the converted module
        (``module`` itself when it is not a batch norm; its children are converted in place).
        """
        output = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            output = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                         process_group, bias=module.bias is not None or not module.affine,
                         activation=getattr(module, "activation", "identity"),
                         channel_axis=getattr(module, "channel_axis", 1))
            if module.affine:
                with torch.no_grad():
                    output.weight = module.weight
                    output.bias = module.bias
            output.running_mean = module.running_mean
            output.running_var = module.running_var
            output.num_batches_tracked = module.num_batches_tracked
            output.training = module.training
            if hasattr(module, "qconfig"):
                output.qconfig = module.qconfig
        for name, child in module.named_children():
            output.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return output
