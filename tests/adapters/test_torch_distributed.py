"""portable_nn.torch.SyncBatchNorm: two CPU processes (gloo) against one process over the whole batch,
plus its single-process behaviour, conversion and errors."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
import distributed_testing as dt  # noqa: E402
from torch import nn  # noqa: E402

import portable_nn.torch as pnt  # noqa: E402

RTOL = 1e-10


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario of ``distributed_testing`` run on two spawned ranks; their saved results."""
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    root = tmp_path_factory.mktemp("sync_bn")
    mp.spawn(dt.run, args=(str(root / "store"), str(root)), nprocs=dt.WORLD, join=True)
    return [torch.load(root / f"rank{r}.pt") for r in range(dt.WORLD)]


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL)


def _single_process(name):
    """torch.nn's batch norm over the whole batch: what the scenario compares."""
    last = name == "relu_last"
    x_all, cot = dt.batch(name, channels_last=last)
    x = x_all.clone().requires_grad_(True)
    ref = nn.BatchNorm2d(4, dtype=torch.float64, **dt.torch_options(name))
    dt.set_parameters(ref, name)
    for _ in range(dt.STEPS.get(name, 1)):
        y = ref(x.movedim(-1, 1)).movedim(1, -1) if last else ref(x)
    if last:
        y = torch.relu(y)
    (y * cot).sum().backward()
    return dt.observed(ref, y, x)


@pytest.mark.parametrize("name", list(dt.SPLITS))
def test_two_ranks_match_one_process_over_the_whole_batch(ranks, name):
    expected = _single_process(name)
    assert all(r[name].keys() == expected.keys() for r in ranks)
    _close(torch.cat([r[name]["y"] for r in ranks]), expected["y"])
    _close(torch.cat([r[name]["dx"] for r in ranks]), expected["dx"])
    # Parameter gradients are each rank's local sum (DDP averages them): their sum is the whole batch's.
    for key in ("dweight", "dbias"):
        if key in expected:
            _close(sum(r[name][key] for r in ranks), expected[key])
    for key in ("running_mean", "running_var", "num_batches_tracked"):  # the same on every rank
        if key in expected:
            for r in ranks:
                _close(r[name][key], expected[key])


def test_an_empty_rank_contributes_nothing(ranks):
    assert ranks[0]["empty"]["y"].shape[0] == 0 and ranks[0]["empty"]["dx"].shape[0] == 0
    assert torch.equal(ranks[0]["empty"]["dweight"], torch.zeros(4, dtype=torch.float64))


def test_float32_with_a_large_offset_keeps_its_variance(ranks):
    """Data with mean 1e4 and spread 1 in float32: the merged variance is within 1e-3 of float64's;
    the all_reduce of sums and sums of squares (E[x²] − E[x]²) misses by orders of magnitude."""
    g = torch.Generator().manual_seed(7)
    whole = (torch.randn(64, 3, 8, 8, generator=g, dtype=torch.float64) + 1e4).float().double()
    var = whole.var(dim=(0, 2, 3), unbiased=False)
    for r in ranks:
        assert int(r["offset"]["count"]) == 64 * 64
        torch.testing.assert_close(r["offset"]["var"].double(), var, rtol=1e-3, atol=0)
        assert ((r["offset"]["naive_var"].double() - var).abs() / var).min() > 0.5  # every channel


def test_ddp_training_matches_one_process():
    """The distributed tutorial's example: a small CNN, its batch norm converted, three SGD steps
    under DDP on two ranks with uneven shares, against one process on the whole batches."""
    from portable_nn.examples import data_parallel

    assert data_parallel.compare() < 1e-12


# --------------------------------------------------------------------------- one process


def test_signature_extends_torch_nn_sync_batch_norm():
    ours = inspect.signature(pnt.SyncBatchNorm.__init__).parameters
    theirs = inspect.signature(nn.SyncBatchNorm.__init__).parameters
    for name, p in theirs.items():
        assert name in ours and ours[name].default == p.default and ours[name].kind == p.kind, name


@pytest.mark.parametrize("training", [True, False])
def test_without_a_process_group_it_is_a_plain_batch_norm(training):
    ours, ref = pnt.SyncBatchNorm(3, dtype=torch.float64), nn.BatchNorm2d(3, dtype=torch.float64)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.tensor([0.5, -1.0, 2.0]))
            m.running_var.fill_(2.0)
    ours.train(training)
    ref.train(training)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 3
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1, y2 = ours(x1), ref(x2)
    _close(y1, y2)
    (y1 * x).sum().backward()
    (y2 * x).sum().backward()
    for a, b in ((x1.grad, x2.grad), (ours.weight.grad, ref.weight.grad), (ours.running_mean, ref.running_mean),
                 (ours.running_var, ref.running_var)):
        _close(a, b)


def test_convert_replaces_every_batch_norm_and_shares_its_state():
    inner = pnt.BatchNorm1d(6, activation="relu", channel_axis=-1)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6, affine=False),
                          nn.Sequential(nn.SyncBatchNorm(6, momentum=None), nn.Flatten()), inner)
    keys = model.state_dict().keys()
    weight = inner.weight
    converted = pnt.SyncBatchNorm.convert_sync_batchnorm(model)
    norms = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 3 and all(type(m) is pnt.SyncBatchNorm for m in norms)
    assert converted.state_dict().keys() == keys
    assert converted[3].weight is weight and str(converted[3].activation) == "relu"
    assert converted[3].channel_axis == -1 and converted[2][0].momentum is None and not converted[1].affine
    assert isinstance(pnt.SyncBatchNorm.convert_sync_batchnorm(nn.ReLU()), nn.ReLU)
    # Not a torch.nn.SyncBatchNorm: DistributedDataParallel refuses those in CPU models.
    assert not isinstance(norms[0], nn.SyncBatchNorm)


def test_bad_input_and_arguments():
    with pytest.raises(ValueError, match="channel_axis"):
        pnt.SyncBatchNorm(3, channel_axis=2)
    with pytest.raises(ValueError, match="2D"):
        pnt.SyncBatchNorm(3)(torch.ones(3))
    with pytest.raises(ValueError, match="non-zero"):
        pnt.SyncBatchNorm(3, channel_axis=-1)(torch.ones(2, 4, 0))


@pytest.mark.gpu
def test_two_gpus_match_torch_sync_batch_norm(tmp_path):
    """nccl, one GPU per rank: ours equals ``torch.nn.SyncBatchNorm`` (which runs on GPUs only)."""
    import torch.multiprocessing as mp

    if not torch.cuda.is_available() or torch.cuda.device_count() < dt.WORLD:
        pytest.skip(f"needs {dt.WORLD} CUDA devices")
    mp.spawn(dt.run_cuda, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=dt.WORLD, join=True)
    for rank in range(dt.WORLD):
        result = torch.load(tmp_path / f"cuda{rank}.pt")
        for key, value in result["torch"].items():
            torch.testing.assert_close(result["ours"][key], value, rtol=1e-9, atol=1e-12, msg=key)
