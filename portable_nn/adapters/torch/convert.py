"""``portable_nn.torch.convert(model)``: a whole model's ``torch.nn`` layers on our kernels, in one line.

Every submodule whose type is exactly a ``torch.nn`` class we have a drop-in for (``nn.LayerNorm``,
``nn.BatchNorm2d``, ``nn.Conv2d``, ``nn.Linear``, ``nn.LSTM``, ``nn.MaxPool2d`` …: the classes of
:mod:`portable_nn.torch` with the same name) becomes an instance of ours *in place*: its class is
changed and our keyword-only options are set to their defaults.  Nothing is rebuilt, so nothing
is copied or re-created:

* the parameters and buffers are the same tensor objects — weights tied between layers (GPT-2's
  ``lm_head`` and ``wte``, BERT's decoder and its embeddings) stay tied, an optimizer built before
  the conversion keeps updating them, ``state_dict`` keys and values are unchanged;
* hooks, ``training``, the device and the dtype stay as they were.

Subclasses of those ``torch.nn`` classes (timm's ``LayerNorm2d``, a model's own ``nn.Linear``
subclass) are left alone: their ``forward`` is theirs, and swapping their class would drop it.

Hugging Face transformers' RMS norms (``LlamaRMSNorm``, ``T5LayerNorm`` and the classes copied
from them: Mistral's, Qwen's, Phi-3's …) become our ``RMSNorm`` with their ``variance_epsilon`` —
those whose ``forward`` is, to the character, Llama's or T5's (``x · rsqrt(mean(x²) + eps) ·
weight``); others, such as Gemma's (``1 + weight``), are left alone.  They compute in float32;
ours in the input's precision (float32 for half inputs), so a float64 model's results move by
float32's rounding.

With ``fuse=True`` (the default), an activation module that directly follows a converted layer
in an ``nn.Sequential`` (``Conv2d, BatchNorm2d, ReLU``: the ``ReLU`` after the batch norm) is fused
into that layer's kernel — the layer gets ``activation=`` and the activation's slot becomes an
``nn.Identity`` — which is where the fused kernels save a pass over memory.  Only ``nn.Sequential``
is fused: elsewhere the order of calls lives in a ``forward`` we cannot see.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
from typing import Any

from torch import nn

from ...api.activations import Activation, parse_activation
from . import cells, modules, pooling

__all__ = ["convert"]


def _drop_ins() -> dict[type, type]:
    """``torch.nn`` class -> ours, for each of our drop-in modules named as the ``torch.nn`` class it
    replaces (the names are the one fact: a new drop-in module joins by existing)."""
    table = {}
    for namespace in (modules, pooling, cells):
        for name, ours in vars(namespace).items():
            theirs = getattr(nn, name, None)
            if isinstance(ours, type) and isinstance(theirs, type) and issubclass(ours, nn.Module) \
                    and ours is not theirs and ours.__module__ == namespace.__name__:
                table[theirs] = ours
    return table


_DROP_INS = _drop_ins()


def _options(cls: type) -> dict[str, Any]:
    """Our module's keyword-only constructor options and their defaults (``activation``,
    ``channel_axis``, GRU's ``reset_after`` …; the norms' ``bias=`` too, which only decides whether
    the parameter is made), as the constructor would store them."""
    options = {}
    for param in inspect.signature(cls.__init__).parameters.values():
        if param.kind is inspect.Parameter.KEYWORD_ONLY:
            options[param.name] = parse_activation(param.default) if param.name == "activation" else param.default
    return options


def _activation_of(module: nn.Module) -> Activation | None:
    """The fused activation equal to the ``torch.nn`` activation module ``module`` (exactly that class:
    a subclass may compute something else), or ``None`` when it is not one."""
    kind = type(module)
    simple = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.SiLU: "silu", nn.Hardswish: "hardswish",
              nn.Hardsigmoid: "hardsigmoid", nn.ReLU6: "relu6", nn.Mish: "mish"}
    if kind in simple:
        return parse_activation(simple[kind])
    if kind is nn.GELU:
        return parse_activation("gelu_tanh" if module.approximate == "tanh" else "gelu")
    if kind is nn.LeakyReLU:
        return parse_activation(("leaky_relu", float(module.negative_slope)))
    if kind is nn.ELU:
        return parse_activation(("elu", float(module.alpha)))
    return None


def _fusable(module: nn.Module) -> bool:
    """Whether ``module`` is one of ours that takes an activation and has none yet."""
    return isinstance(getattr(module, "activation", None), Activation) and module.activation.is_identity


@functools.cache
def _known_rms_forward(kind: type) -> bool:
    """Whether transformers class ``kind``'s forward is Llama's or T5's RMS norm, character for character."""
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        from transformers.models.t5.modeling_t5 import T5LayerNorm

        known = {inspect.getsource(LlamaRMSNorm.forward), inspect.getsource(T5LayerNorm.forward)}
        return inspect.getsource(kind.forward) in known
    except (ImportError, AttributeError, OSError, TypeError):
        return False


def _transformers_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is one of transformers' RMS norms that our RMSNorm computes (see the module
    docstring): looked for only when transformers is imported already."""
    kind = type(module)
    if "transformers" not in sys.modules or not kind.__module__.startswith("transformers."):
        return False
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.ndim == 1
            and isinstance(getattr(module, "variance_epsilon", None), float) and _known_rms_forward(kind))


def _become_rms_norm(module: nn.Module) -> None:
    """A transformers RMS norm becomes our RMSNorm: nn.RMSNorm's attributes from its own."""
    module.__class__ = modules.RMSNorm
    module.normalized_shape = (int(module.weight.shape[0]),)
    module.eps = float(module.variance_epsilon)
    module.elementwise_affine = True
    module.activation = parse_activation("identity")
    module.channel_axis = None


def convert(model: nn.Module, *, fuse: bool = True) -> nn.Module:
    """Run ``model``'s ``torch.nn`` layers on portable_nn's kernels: convert it in place and return it.

    Each submodule (``model`` itself included) whose type is exactly a ``torch.nn`` class with a
    drop-in twin in :mod:`portable_nn.torch` becomes that twin, keeping its parameters, buffers,
    hooks and mode, and so do transformers' Llama- and T5-style RMS norms (see the module
    docstring); with ``fuse``, activation modules that follow a converted layer in an
    ``nn.Sequential`` are fused into it.

    Args:
        model: any ``torch.nn.Module``; changed in place.
        fuse: keyword-only; fold an ``nn.ReLU``/``SiLU``/``GELU``/``Sigmoid``/``Tanh``/``LeakyReLU``/
            ``Hardswish``/``Hardsigmoid``/``ReLU6``/``Mish``/``ELU`` that directly follows a converted
            layer with an ``activation=`` option (norms, convolutions, Linear) in an
            ``nn.Sequential`` into that layer, its slot becoming ``nn.Identity`` (default ``True``).

    Returns:
        ``model`` itself, converted.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (checked before anything changes).

    Example::

        model = torchvision.models.resnet18()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        portable_nn.torch.convert(model)   # same parameters: the optimizer still drives them
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for module in list(model.modules()):
        ours = _DROP_INS.get(type(module))
        if ours is None and _transformers_rms_norm(module):
            _become_rms_norm(module)
        elif ours is not None:
            module.__class__ = ours
            for name, value in _options(ours).items():
                if name not in module._parameters:  # (``bias=``: a constructor choice, already made)
                    setattr(module, name, value)
    if fuse:
        # A layer used in more than one place may be followed by an activation in one of them only.
        uses: dict[int, int] = {}
        for _, module in model.named_modules(remove_duplicate=False):
            uses[id(module)] = uses.get(id(module), 0) + 1
        for module in list(model.modules()):
            if type(module) is nn.Sequential:
                _fuse_sequential(module, uses)
    return model


def _fuse_sequential(seq: nn.Sequential, uses: dict[int, int]) -> None:
    """Fold each activation module of ``seq`` into the converted layer right before it (a layer that
    the model holds once: ``uses`` counts each module's places)."""
    names = list(seq._modules)
    for before, name in itertools.pairwise(names):
        layer, act_module = seq._modules[before], seq._modules[name]
        activation = None if act_module is None else _activation_of(act_module)
        if activation is not None and layer is not None and _fusable(layer) and uses.get(id(layer)) == 1:
            layer.activation = activation
            seq._modules[name] = nn.Identity()
