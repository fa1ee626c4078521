"""Data-parallel training with synchronised batch norm on CPU processes (``gloo``).

``python -m portable_nn.examples.data_parallel`` trains a small CNN for a few steps on two
processes, each with its own (uneven) share of every batch, its batch norm converted to
:class:`portable_nn.torch.SyncBatchNorm` and the model wrapped in ``DistributedDataParallel``;
then trains the same model in one process on the whole batches, and prints the largest
difference between the two results (float64: rounding only).  The distributed tutorial runs it.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from portable_nn.torch import SyncBatchNorm

WORLD = 2
#: Per training step, the batch sizes of rank 0 and rank 1: uneven on purpose.
SPLITS = ((3, 5), (4, 2), (1, 6))


def make_model() -> nn.Module:
    """The model, with a plain ``torch.nn.BatchNorm2d``, seeded: every process builds the same one."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5)).double()


def whole_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch: 6x6 RGB images and labels of 5 classes, seeded."""
    g = torch.Generator().manual_seed(100 + step)
    n = sum(SPLITS[step])
    return torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def train(rank: int, store: str, out: str) -> None:
    """One process of the job: join the group, convert the batch norms, train on this rank's share."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        model = nn.parallel.DistributedDataParallel(SyncBatchNorm.convert_sync_batchnorm(make_model()))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, sizes in enumerate(SPLITS):
            images, labels = whole_batch(step)
            start = sum(sizes[:rank])
            x, t = images[start : start + sizes[rank]], labels[start : start + sizes[rank]]
            optimizer.zero_grad()
            # DDP averages the ranks' gradients: each rank's loss is its share of the whole
            # batch's mean loss, times the number of ranks.
            loss = F.cross_entropy(model(x), t, reduction="sum") * WORLD / sum(sizes)
            loss.backward()
            optimizer.step()
        if rank == 0:
            torch.save(model.module.state_dict(), out)
        dist.barrier()  # neither process tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def train_one_process() -> dict[str, torch.Tensor]:
    """The same training in one process on the whole batches, with ``torch.nn.BatchNorm2d``."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(len(SPLITS)):
        images, labels = whole_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return model.state_dict()


def compare() -> float:
    """Train on :data:`WORLD` processes and in one; the largest absolute difference of any parameter or buffer."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "model.pt")
        mp.spawn(train, args=(os.path.join(tmp, "store"), out), nprocs=WORLD, join=True)
        distributed = torch.load(out)
    single = train_one_process()
    return max(float((distributed[k].double() - v.double()).abs().max()) for k, v in single.items())


if __name__ == "__main__":
    print(f"largest difference from one process over the whole batches: {compare():.1e}")
