"""Synchronised batch norm on CPU processes: ``python -m portable_nn.bench.distributed``.

Two processes (``gloo`` on localhost, one thread each) time one training step's batch norm,
forward and backward, on their own ``(N, C, H, W)`` float32 part of the batch, three ways in
the same run, interleaved round by round:

* ``portable_nn.torch.SyncBatchNorm`` — statistics of the whole batch (one ``all_gather`` of
  (n, mean, M2) per channel forward, one ``all_reduce`` of two sums per channel backward);
* ``torch.nn.BatchNorm2d`` — what data-parallel training uses without synchronisation
  (each process's own statistics, no communication; ``torch.nn.SyncBatchNorm`` refuses CPU
  tensors);
* plain PyTorch synchronisation — a differentiable ``all_reduce`` of the per-channel count,
  sum and sum of squares, var = E[x²] − E[x]², the rest
  in ``torch`` operations under autograd (what a hand-written CPU SyncBatchNorm would be; its
  variance loses precision on data with a large mean).

Each figure is the median over rounds of a burst's time per step, on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2


class _AllReduceSum(torch.autograd.Function):
    """A summing ``all_reduce`` that autograd differentiates (its adjoint is the same sum)."""

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        dist.all_reduce(out)
        return out


def _naive_sync_batch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-PyTorch synchronised batch norm: one differentiable all_reduce of count, Σx, Σx²."""
    axes = (0, 2, 3)
    count = torch.full_like(weight, x.numel() / x.shape[1])
    sums = _AllReduceSum.apply(torch.stack([count, x.sum(dim=axes), (x * x).sum(dim=axes)]))
    mean = sums[1] / sums[0]
    var = sums[2] / sums[0] - mean * mean
    shape = (1, -1, 1, 1)
    return (x - mean.reshape(shape)) * torch.rsqrt(var + eps).reshape(shape) * weight.reshape(shape) + bias.reshape(
        shape)


def _contenders(channels: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from portable_nn.torch import SyncBatchNorm

    ours = SyncBatchNorm(channels)
    unsynced = nn.BatchNorm2d(channels)
    weight = nn.Parameter(torch.ones(channels))
    bias = nn.Parameter(torch.zeros(channels))
    return {
        "portable_nn.torch.SyncBatchNorm": ours,
        "torch.nn.BatchNorm2d (not synchronised)": unsynced,
        "PyTorch all_reduce of Σx, Σx²": lambda x: _naive_sync_batch_norm(x, weight, bias, 1e-5),
    }


def _step(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor) -> None:
    x.grad = None
    module(x).backward(dy)


def _rank(rank: int, store: str, shape: tuple[int, ...], rounds: int, steps: int, out: str) -> None:
    import portable_nn

    # One thread per process for everyone, as torchrun sets it (OMP_NUM_THREADS=1), which both read.
    torch.set_num_threads(1)
    portable_nn.set_num_threads(1)
    os.environ.setdefault("PORTABLE_NN_COMPILE_NOTICE", "0")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(shape, generator=g).requires_grad_(True)
        dy = torch.randn(shape, generator=g)
        contenders = _contenders(shape[1])
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for module in contenders.values():  # warm-up: compilation, first calls
            for _ in range(3):
                _step(module, x, dy)
        for _ in range(rounds):
            for name, module in contenders.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    _step(module, x, dy)
                times[name].append((time.perf_counter() - start) / steps)
        if rank == 0:
            torch.save({name: statistics.median(t) for name, t in times.items()}, out)
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def measure(shape: tuple[int, ...] = (16, 64, 28, 28), rounds: int = 7, steps: int = 10) -> dict[str, float]:
    """Seconds per forward+backward step on rank 0 of two processes, per contender (see the module)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), shape, rounds, steps, out), nprocs=WORLD, join=True)
        return torch.load(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m portable_nn.bench.distributed",
        description="Synchronised batch norm, forward and backward, on two CPU processes (gloo): portable_nn's "
                    "SyncBatchNorm against torch.nn.BatchNorm2d unsynchronised and a plain-PyTorch all_reduce.")
    parser.add_argument("--shape", default="16,64,28,28", help="each process's (N, C, H, W) part (default 16,64,28,28)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="steps per burst (default 10)")
    args = parser.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    results = measure(shape, args.rounds, args.steps)
    ours = results["portable_nn.torch.SyncBatchNorm"]
    print(f"batch norm forward+backward, {WORLD} processes (gloo, 1 thread each), float32 {shape} per process")
    print("| contender | ms per step | vs SyncBatchNorm |")
    print("|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / ours:.2f}x |")


if __name__ == "__main__":
    main()
