"""Plain ``torch.nn`` models for the mixed section, and :func:`swap_modules` to put ours in them.

A resnet18 (BasicBlock x [2, 2, 2, 2], 1000 classes, written here so the benchmark needs no
torchvision) and a small LSTM language model.  :func:`swap_modules` replaces every
``torch.nn`` module that :mod:`portable_nn.torch` has a drop-in twin for by that twin, built
with the same arguments and loaded with the same ``state_dict`` — what a user switching an
existing model over does.  Importing this module imports PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["LstmLanguageModel", "ResNet18", "swap_modules", "training_step"]


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """resnet's basic block: two 3x3 conv + BatchNorm, ReLU, and the shortcut (1x1 conv + BN when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv3x3(cin, cout, stride), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = _conv3x3(cout, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """resnet18: 7x7/2 stem, 3x3/2 max pool, four stages of two basic blocks (64, 128, 256, 512), pool, fc."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(64), nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``(N, num_classes)`` of images ``(N, 3, H, W)``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class LstmLanguageModel(nn.Module):
    """Embedding → LSTM → Linear to the vocabulary: next-token logits ``(T, N, vocab)`` of tokens ``(T, N)``."""

    def __init__(self, vocab: int = 1000, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, layers)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position."""
        return self.decoder(self.lstm(self.embedding(tokens))[0])


# --------------------------------------------------------------------------- swapping in ours


def _twins() -> dict[type, Callable[[Any], nn.Module]]:
    """``torch.nn`` class → a builder of our twin with the module's constructor arguments."""
    import portable_nn.torch as pnt

    return {
        nn.Conv2d: lambda m: pnt.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                                        m.dilation, m.groups, m.bias is not None, m.padding_mode),
        nn.BatchNorm2d: lambda m: pnt.BatchNorm2d(m.num_features, m.eps, m.momentum, m.affine,
                                                  m.track_running_stats),
        nn.Linear: lambda m: pnt.Linear(m.in_features, m.out_features, m.bias is not None),
        nn.LayerNorm: lambda m: pnt.LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine,
                                              getattr(m, "bias", None) is not None),
        nn.LSTM: lambda m: pnt.LSTM(m.input_size, m.hidden_size, m.num_layers, m.bias, m.batch_first,
                                    m.dropout, m.bidirectional, m.proj_size),
    }


def _twin(module: nn.Module, twins: dict[type, Callable[[Any], nn.Module]]) -> nn.Module | None:
    """Our twin of ``module`` holding its parameters and buffers, in its mode; ``None`` if we have none."""
    build = twins.get(type(module))  # the exact class: our subclasses are left as they are
    if build is None:
        return None
    ours = build(module)
    # The module's own parameters and buffers, not copies: weights tied to another module (a language
    # model's decoder and its embedding) stay tied, and an optimiser built before the swap still
    # updates what the model uses.
    for name, param in module.named_parameters(recurse=False):
        setattr(ours, name, param)
    for name, buffer in module.named_buffers(recurse=False):
        setattr(ours, name, buffer)
    for name, child in module.named_children():  # (an LSTM's are none; a container's would be swapped too)
        setattr(ours, name, child)
    return ours.train(module.training)


def swap_modules(model: nn.Module) -> nn.Module:
    """Replace, in place, every Conv2d, BatchNorm2d, Linear, LayerNorm and LSTM by ``portable_nn.torch``'s.

    Returns the model (or its twin, when ``model`` itself is such a module).  The twins hold the
    original parameters and buffers (the same tensors: tied weights stay tied, optimisers built
    before the swap keep working).
    """
    twins = _twins()
    top = _twin(model, twins)
    if top is not None:
        return top
    for name, child in list(model.named_children()):
        ours = _twin(child, twins)
        setattr(model, name, ours if ours is not None else swap_modules(child))
    return model


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
    """One SGD step on the cross-entropy of ``model(inputs)`` (class axis last) against ``targets``."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.detach()
