"""The rank side of the two-process ``SyncBatchNorm`` tests (``torch.multiprocessing.spawn`` target).

Each rank joins a ``gloo`` group through a file store, runs every scenario on its slice of one
seeded global batch and saves what it saw; the test process compares the ranks' results with one
process over the whole batch (``tests/adapters/test_torch_distributed.py``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
#: Per-rank batch sizes of each scenario (uneven, and one rank with nothing).
SPLITS = {"uneven": (3, 5), "empty": (0, 8), "relu_last": (5, 3), "cumulative": (2, 4), "no_affine": (4, 1),
          "no_bias": (1, 6)}
#: Each scenario's module options (torch.nn.BatchNorm2d's, plus ours for relu_last).
OPTIONS = {"uneven": {}, "empty": {}, "relu_last": {"activation": "relu", "channel_axis": -1},
           "cumulative": {"momentum": None}, "no_affine": {"affine": False, "track_running_stats": False},
           "no_bias": {"bias": False}}
#: Steps (forward calls) per scenario: the cumulative average needs two.
STEPS = {"cumulative": 2}


def torch_options(name: str) -> dict[str, object]:
    """The scenario's options that torch.nn.BatchNorm2d takes too."""
    return {k: v for k, v in OPTIONS[name].items() if k not in ("activation", "channel_axis")}


def batch(name: str, channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch and cotangent of a scenario (float64, seeded by its name)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    n = sum(SPLITS[name])
    shape = (n, 5, 4, 4) if channels_last else (n, 4, 5, 4)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 2
    return x, torch.randn(shape, generator=g, dtype=torch.float64)


def parameters(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(map(ord, name)) + 1)
    return torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)


def part(whole: torch.Tensor, split: tuple[int, ...], rank: int) -> torch.Tensor:
    start = sum(split[:rank])
    return whole[start : start + split[rank]]


def set_parameters(module: nn.Module, name: str) -> None:
    """The scenario's weight and bias, where the module has them."""
    w, b = parameters(name)
    with torch.no_grad():
        if module.weight is not None:
            module.weight.copy_(w)
        if module.bias is not None:
            module.bias.copy_(b)


def observed(module: nn.Module, y: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a scenario compares: output, input gradient, and the parameters' gradients and the
    running statistics where the module has them."""
    seen = {"y": y.detach(), "dx": x.grad}
    for key, value in (("dweight", module.weight), ("dbias", module.bias)):
        if value is not None:
            seen[key] = value.grad
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        value = getattr(module, key)
        if value is not None:
            seen[key] = value.clone()
    return seen


def _norm_scenario(name: str, rank: int) -> dict[str, torch.Tensor]:
    from portable_nn.torch import SyncBatchNorm

    x_all, cot_all = batch(name, channels_last=name == "relu_last")
    split = SPLITS[name]
    x = part(x_all, split, rank).clone().requires_grad_(True)
    module = SyncBatchNorm(4, dtype=torch.float64, **OPTIONS[name])
    set_parameters(module, name)
    for _ in range(STEPS.get(name, 1)):
        y = module(x)
    (y * part(cot_all, split, rank)).sum().backward()
    return observed(module, y, x)


def _offset_scenario(rank: int) -> dict[str, torch.Tensor]:
    """float32 data with mean 1e4 and spread 1: the merged variance, and the one an all_reduce of
    sums and sums of squares gives (E[x²] − E[x]², what the test shows failing)."""
    from portable_nn.adapters.torch.distributed import global_moments

    g = torch.Generator().manual_seed(7)
    whole = (torch.randn(64, 3, 8, 8, generator=g, dtype=torch.float64) + 1e4).float()
    x = whole[:24] if rank == 0 else whole[24:]
    count, mean, m2 = global_moments(x, 1, dist.group.WORLD)
    sums = torch.stack([x.sum(dim=(0, 2, 3)), (x * x).sum(dim=(0, 2, 3))])
    dist.all_reduce(sums)
    naive = sums[1] / count - (sums[0] / count) ** 2
    return {"count": torch.tensor(count), "mean": mean, "var": m2 / count, "naive_var": naive}


def run(rank: int, store: str, out: str) -> None:
    """The spawn target: every scenario on this rank, results saved to ``out/rank{rank}.pt``."""
    os.environ.setdefault("PORTABLE_NN_COMPILE_NOTICE", "0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        results = {name: _norm_scenario(name, rank) for name in SPLITS}
        results["offset"] = _offset_scenario(rank)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def run_cuda(rank: int, store: str, out: str) -> None:
    """The GPU spawn target (``nccl``, one GPU per rank): ours against ``torch.nn.SyncBatchNorm``
    on the uneven split, results saved to ``out/cuda{rank}.pt``."""
    from portable_nn.torch import SyncBatchNorm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        x_all, cot_all = batch("uneven")
        split = SPLITS["uneven"]
        results = {}
        for label, cls in (("ours", SyncBatchNorm), ("torch", nn.SyncBatchNorm)):
            x = part(x_all, split, rank).cuda().requires_grad_(True)
            module = cls(4, dtype=torch.float64, device="cuda")
            w, b = parameters("uneven")
            with torch.no_grad():
                module.weight.copy_(w)
                module.bias.copy_(b)
            y = module(x)
            (y * part(cot_all, split, rank).cuda()).sum().backward()
            seen = {"y": y, "dx": x.grad, "dweight": module.weight.grad, "dbias": module.bias.grad,
                    "running_var": module.running_var}
            results[label] = {k: v.detach().cpu() for k, v in seen.items()}
        torch.save(results, os.path.join(out, f"cuda{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
