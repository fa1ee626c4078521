"""Memory formats through the torch adapter (``portable_nn.adapters.torch._layout``): channels_last
in, channels_last out, values and gradients equal to torch.nn's, no copy inside."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import portable_nn as pnn  # noqa: E402
import portable_nn.torch as pnt  # noqa: E402
from portable_nn.adapters.torch import _layout  # noqa: E402

DT = torch.float64
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def _x(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=DT, generator=gen)


def _pairs():
    """(ours, torch.nn's twin, input shape) for every module whose op keeps the memory format."""
    return [
        (pnt.Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1), (2, 4, 6, 5)),
        (pnt.Conv2d(4, 4, 3, groups=4, stride=2, activation="relu"), None, (2, 4, 7, 7)),
        (pnt.Conv3d(3, 4, 2), nn.Conv3d(3, 4, 2), (2, 3, 3, 4, 5)),
        (pnt.ConvTranspose2d(4, 3, 2, stride=2), nn.ConvTranspose2d(4, 3, 2, stride=2), (2, 4, 3, 5)),
        (pnt.BatchNorm2d(4), nn.BatchNorm2d(4), (3, 4, 5, 6)),
        (pnt.BatchNorm3d(3), nn.BatchNorm3d(3), (2, 3, 3, 4, 2)),
        (pnt.GroupNorm(2, 4), nn.GroupNorm(2, 4), (2, 4, 5, 6)),
        (pnt.InstanceNorm2d(4, affine=True), nn.InstanceNorm2d(4, affine=True), (2, 4, 5, 6)),
        (pnt.MaxPool2d(2), nn.MaxPool2d(2), (2, 4, 6, 6)),
        (pnt.AvgPool2d(3, stride=2, padding=1), nn.AvgPool2d(3, stride=2, padding=1), (2, 4, 7, 6)),
        (pnt.MaxPool3d(2), nn.MaxPool3d(2), (2, 3, 4, 4, 4)),
    ]


@pytest.mark.parametrize("case", range(len(_pairs())))
def test_channels_last_in_channels_last_out(case):
    ours, theirs, shape = _pairs()[case]
    ours = ours.to(DT)
    fmt = CL[len(shape)]
    x = _x(*shape).to(memory_format=fmt).requires_grad_(True)
    y = ours(x)
    assert y.is_contiguous(memory_format=fmt) and not y.is_contiguous(), type(ours).__name__
    g = _x(*y.shape, seed=1).to(memory_format=fmt)
    y.backward(g)
    assert x.grad.is_contiguous(memory_format=fmt)
    param_grads = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    # The same module on the contiguous copy: the same numbers, contiguous.
    xc = x.detach().contiguous().requires_grad_(True)
    ours_again = ours(xc)
    assert ours_again.is_contiguous()
    ours_again.backward(g.contiguous())
    torch.testing.assert_close(y, ours_again, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xc.grad, rtol=1e-12, atol=1e-12)
    if theirs is not None:
        theirs = theirs.to(DT)
        theirs.load_state_dict(ours.state_dict())
        xt = x.detach().clone().requires_grad_(True)
        yt = theirs(xt)  # (torch.nn keeps the format where its kernel has one: not float64 conv3d, instance_norm)
        yt.backward(g)
        torch.testing.assert_close(y, yt, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(x.grad, xt.grad, rtol=1e-10, atol=1e-12)
        for p, q in zip(param_grads, theirs.parameters()):
            torch.testing.assert_close(p, q.grad, rtol=1e-10, atol=1e-12)


def test_running_statistics_and_indices_keep_their_shapes():
    """Only the outputs of the data's rank go back through the view: batch_norm's returned statistics
    and max_pool's indices (positions in each plane, whatever the layout) are the channels-first call's."""
    x = _x(2, 3, 4, 4).to(memory_format=torch.channels_last)
    rm, rv = torch.zeros(3, dtype=DT), torch.ones(3, dtype=DT)
    y, new_rm, new_rv = pnt.batch_norm(x, running_mean=rm, running_var=rv, return_stats=True)
    y_c, rm_c, rv_c = pnt.batch_norm(x.contiguous(), running_mean=rm, running_var=rv, return_stats=True)
    assert y.is_contiguous(memory_format=torch.channels_last) and new_rm.shape == (3,)
    torch.testing.assert_close((y, new_rm, new_rv), (y_c, rm_c, rv_c), rtol=1e-12, atol=1e-12)
    out, idx = pnt.max_pool(x, 2, return_indices=True)
    out_c, idx_c = pnt.max_pool(x.contiguous(), 2, return_indices=True)
    assert idx.is_contiguous(memory_format=torch.channels_last) and torch.equal(idx, idx_c)
    back = pnt.max_unpool(out, idx, 2)
    assert back.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(back, pnt.max_unpool(out_c, idx_c, 2))
    torch.testing.assert_close(back, nn.functional.max_unpool2d(out_c, idx_c, 2))
    # output_size as a full (N, C, H, W) shape, as torch.nn's MaxUnpool2d takes it: read in x's order
    sized = pnt.max_unpool(out, idx, 2, output_size=(2, 3, 5, 5))
    torch.testing.assert_close(sized, nn.functional.max_unpool2d(out_c, idx_c, 2, output_size=(2, 3, 5, 5)))


def test_which_tensors_count_as_channels_last():
    """Torch's reading: channels_last strides and not contiguous ones, or both (one channel) with the
    channel stride 1 that ``.to(memory_format=torch.channels_last)`` gives; 4-D and 5-D only."""
    assert _layout.is_channels_last(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert _layout.is_channels_last(torch.zeros(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d))
    assert not _layout.is_channels_last(torch.zeros(2, 3, 4, 5))
    assert not _layout.is_channels_last(torch.zeros(2, 3, 4, 5)[..., ::2])
    assert _layout.is_channels_last(torch.zeros(2, 1, 4, 5).to(memory_format=torch.channels_last))
    assert not _layout.is_channels_last(torch.zeros(2, 1, 4, 5))
    assert not _layout.is_channels_last(torch.zeros(2, 3, 1, 1).to(memory_format=torch.channels_last))
    assert not _layout.is_channels_last(torch.zeros(3, 4, 5))
    one_channel = pnt.Conv2d(1, 2, 3).to(DT)
    y = one_channel(_x(2, 1, 5, 5).to(memory_format=torch.channels_last))
    assert y.is_contiguous(memory_format=torch.channels_last)
    twin = nn.Conv2d(1, 2, 3).to(DT)
    assert twin(_x(2, 1, 5, 5).to(memory_format=torch.channels_last)).is_contiguous(memory_format=torch.channels_last)


def test_calls_the_format_does_not_name_are_left_alone():
    """Unbatched input (a 3-D convolution of a 4-D tensor), an explicit ``channel_axis=-1`` and
    other ops' calls are not rewritten."""
    x = _x(3, 4, 5, 6).to(memory_format=torch.channels_last)  # as unbatched (C, D, H, W)
    w = _x(2, 3, 2, 2, 2)
    assert _layout.channels_last_call("conv", {"x": x, "weight": w, "channel_axis": 1}) is None
    torch.testing.assert_close(pnt.conv(x, w), nn.functional.conv3d(x, w), rtol=1e-10, atol=1e-12)
    assert _layout.channels_last_call("max_pool", {"x": x, "window": (2, 2, 2), "channel_axis": 1}) is None
    assert _layout.channels_last_call("batch_norm", {"x": x, "channel_axis": -1}) is None
    assert _layout.channels_last_call("layer_norm", {"x": x}) is None
    moved = _layout.channels_last_call("batch_norm", {"x": x, "channel_axis": 1})
    assert moved["channel_axis"] == -1 and moved["x"].is_contiguous() and moved["x"].data_ptr() == x.data_ptr()


def _data_copies(block, x):
    """The copies of data-sized tensors (x's size or more) in a forward and backward of ``block``."""
    block(x).sum().backward()  # (first calls: plans made)
    with torch.profiler.profile(record_shapes=True) as prof:
        y = block(x)
        y.sum().backward()
    assert y.is_contiguous(memory_format=torch.channels_last)
    copies = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")  # (aten::to: a no-op here)
    return [(e.name, e.input_shapes) for e in prof.events()
            if e.name in copies and e.input_shapes and e.input_shapes[0]
            and math.prod(e.input_shapes[0]) >= x.numel()]


def test_no_copy_inside_a_channels_last_block():
    """Conv2d + BatchNorm2d(relu) on channels_last data, forward and backward: no data-sized tensor is
    copied (torch.nn's block copies none either; the weights' own format changes are torch's)."""
    x = torch.randn(4, 8, 10, 10).to(memory_format=torch.channels_last).requires_grad_(True)
    ours = nn.Sequential(pnt.Conv2d(8, 8, 3, padding=1), pnt.BatchNorm2d(8, activation="relu"))
    theirs = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    assert _data_copies(theirs, x) == []
    assert _data_copies(ours, x) == []
    with pnn.use_backend("numba"):  # our convolution kernel (not torch's) too
        assert _data_copies(ours, x) == []


def test_the_reference_backend_keeps_the_format_too():
    x = _x(2, 3, 4, 4).to(memory_format=torch.channels_last)
    with pnn.use_backend("reference"):
        y = pnt.group_norm(x, 3)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, nn.functional.group_norm(x.contiguous(), 3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_norm_modules_over_the_channel_axis(module):
    """``LayerNorm(C, channel_axis=1)`` is timm's LayerNorm2d (permute, LayerNorm, permute back) without
    the permutes: values and gradients equal, on contiguous and channels_last data (whose channel
    norm runs as the trailing-axis norm of its view, and stays channels_last)."""
    ours = getattr(pnt, module)(6, channel_axis=1, **({"eps": 1e-6} if module == "RMSNorm" else {})).to(DT)
    theirs = getattr(nn, module)(6, **({"eps": 1e-6} if module == "RMSNorm" else {})).to(DT)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    theirs.load_state_dict(ours.state_dict())
    assert "channel_axis=1" in repr(ours)
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = _x(2, 6, 4, 5).to(memory_format=fmt).requires_grad_(True)
        xt = x.detach().clone().requires_grad_(True)
        y = ours(x)
        yt = theirs(xt.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        assert y.is_contiguous(memory_format=fmt)
        g = _x(*y.shape, seed=3)
        y.backward(g)
        yt.backward(g)
        torch.testing.assert_close(y, yt, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, xt.grad, rtol=1e-11, atol=1e-12)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-11, atol=1e-12)
            p.grad = q.grad = None
    with pytest.raises(ValueError, match=r"expected input with shape \(\*, 6, \*\)"):
        ours(_x(2, 4, 6, 5))
    with pytest.raises(TypeError, match="channel_axis"):
        getattr(pnt, module)(6, channel_axis=1.0)
