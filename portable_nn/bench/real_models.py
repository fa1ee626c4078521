"""Real models with our layers: ``python -m portable_nn bench --models``.

Well-known models built from their own libraries' code — torchvision, timm, Hugging Face
transformers, with random weights and small configurations (nothing is downloaded) — and a small
LSTM language model.  Each is timed for one training step (forward, loss, backward) as it is
(``theirs``) and with every ``torch.nn`` module that ``portable_nn.torch`` has a drop-in twin for
swapped in (``ours``, :func:`~portable_nn.bench.torch_models.swap_modules`: Conv2d, BatchNorm2d,
Linear, LayerNorm, LSTM), each contender in its own fresh process, alternated over rounds, in the
user's environment (:func:`~portable_nn.bench.model_steps.measure_isolated`), then both
interleaved in this process.

A model whose library is not installed gets one line saying so and how to install it
(transformers comes with ``pip install 'portable_nn[bench]'``; timm needs torchvision's CPU
wheel, see :data:`INSTALL`); resnet18 falls back to the copy of torchvision's architecture in
:mod:`portable_nn.bench.torch_models` and says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .model_steps import ModelStep, StepFn, _autograd_step, _labels, _swapped, _tensor

__all__ = ["REAL_MODELS", "RealModel", "available_models", "swapped_count"]


@dataclass(frozen=True)
class RealModel:
    """One model: its name, the libraries it needs, and ``make(dtype) -> (model, loss(model) -> scalar)``
    (the inputs in ``dtype``; the model is converted to it by the step)."""

    name: str
    requires: tuple[str, ...]
    make: Callable[[str], tuple[Any, Callable[[Any], Any]]]

    def step(self) -> ModelStep:
        """The model's training step for either contender (see the module docstring)."""

        def build(contender: str, stack: contextlib.ExitStack, dtype: str = "float32") -> StepFn:
            import torch

            torch.manual_seed(0)
            model, loss = self.make(dtype)
            model = _swapped(model, contender, dtype)
            model.train()
            # The parameters the loss depends on (BERT's pooler, say, takes no part in its MLM loss).
            params = list(model.parameters())
            grads = torch.autograd.grad(loss(model), params, allow_unused=True)
            return _autograd_step(lambda: loss(model), [p for p, g in zip(params, grads) if g is not None])

        return ModelStep(self.name, build, slow=True)


def _images(shape: tuple[int, ...], classes: int, dtype: str) -> Callable[[Any], Any]:
    """The cross-entropy loss of a classifier on random images of ``shape``."""
    import torch
    import torch.nn.functional as F

    images = _tensor(np.random.default_rng(0), shape, dtype)
    targets = torch.from_numpy(_labels(shape[0], classes))
    return lambda model: F.cross_entropy(model(images), targets)


def _resnet18(dtype: str) -> tuple[Any, Callable[[Any], Any]]:
    if importlib.util.find_spec("torchvision") is not None:
        import torchvision

        model = torchvision.models.resnet18(num_classes=100)
    else:
        from .torch_models import ResNet18

        model = ResNet18(num_classes=100)
    return model, _images((16, 3, 64, 64), 100, dtype)


def _timm(name: str, image: int, **kwargs: Any) -> Callable[[str], tuple[Any, Callable[[Any], Any]]]:
    def make(dtype: str) -> tuple[Any, Callable[[Any], Any]]:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=100, **kwargs)
        return model, _images((16, 3, image, image), 100, dtype)

    return make


def _tokens(batch: int, length: int, vocab: int) -> Any:
    import torch

    return torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (batch, length)))


def _bert(dtype: str) -> tuple[Any, Callable[[Any], Any]]:
    """A BERT-small masked language model (hidden 256, 4 layers, 4 heads), batch 8 x 128 tokens."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    tokens = _tokens(8, 128, 1000)
    return BertForMaskedLM(config), lambda model: model(input_ids=tokens, labels=tokens).loss


def _gpt2(dtype: str) -> tuple[Any, Callable[[Any], Any]]:
    """A GPT-2-small causal language model (width 256, 4 layers, 4 heads), batch 8 x 128 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1000, n_positions=128, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    tokens = _tokens(8, 128, 1000)
    return GPT2LMHeadModel(config), lambda model: model(input_ids=tokens, labels=tokens).loss


def _lstm_lm(dtype: str) -> tuple[Any, Callable[[Any], Any]]:
    """The LSTM language model of :mod:`portable_nn.bench.torch_models` (width 256, 2 layers), 35 x 16 tokens."""
    import torch.nn.functional as F

    from .torch_models import LstmLanguageModel

    tokens = _tokens(35, 16, 1000)
    return LstmLanguageModel(1000, 256, 2), lambda model: F.cross_entropy(
        model(tokens[:-1]).reshape(-1, 1000), tokens[1:].reshape(-1))


#: How to install each optional library.  timm needs torchvision, whose wheels on PyPI are CUDA
#: builds pinned to a CUDA torch.  This hint was a command, `pip install timm torchvision --index-url
#: https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple`: on 2026-12-07 it
#: replaced torch 2.13.0+cpu by torch 2.14.1+cu130 and its CUDA libraries, and with torch pinned it
#: installed a CUDA torchvision that does not load beside the CPU torch.  So it says what is needed
#: instead of giving a command that can do harm.
INSTALL = {
    "transformers": "pip install 'portable_nn[bench]'",
    "timm": "timm needs a torchvision built for this torch ({torch}): PyPI's torchvision wheels are CUDA builds "
            "that replace a CPU torch or do not load beside it; install the torchvision wheel of the same release "
            "from https://download.pytorch.org/whl/cpu (for a CPU torch), then pip install timm",
}


def _install_hint(library: str) -> str:
    """How to install ``library``, with the torch in use where the hint pins it."""
    import torch

    return INSTALL[library].format(torch=torch.__version__)

REAL_MODELS = [
    RealModel("resnet18 (16,3,64,64)", (), _resnet18),
    RealModel("efficientnet_b0 (16,3,64,64)", ("timm",), _timm("efficientnet_b0", 64)),
    RealModel("mobilenetv3_small_100 (16,3,64,64)", ("timm",), _timm("mobilenetv3_small_100", 64)),
    RealModel("convnext_atto (16,3,64,64)", ("timm",), _timm("convnext_atto", 64)),
    RealModel("vit_tiny (16,3,32,32), patch 8", ("timm",),
              _timm("vit_tiny_patch16_224", 32, img_size=32, patch_size=8)),
    RealModel("BERT-small MLM (8x128 tokens)", ("transformers",), _bert),
    RealModel("GPT-2-small LM (8x128 tokens)", ("transformers",), _gpt2),
    RealModel("LSTM LM (35x16 tokens, width 256)", (), _lstm_lm),
]

#: The models' steps, by name (the benchmark's worker processes find them here).
REAL_MODEL_STEPS = {m.name: m.step() for m in REAL_MODELS}


def available_models(selectors: Sequence[str] | None = None) -> tuple[list[RealModel], list[str]]:
    """The models ``selectors`` (name substrings, case-insensitive; all when ``None``) name whose
    libraries are installed, and a line for each one that is not (and for resnet18 without torchvision)."""
    wanted = [s.lower() for s in selectors] if selectors else None
    chosen, lines = [], []
    for model in REAL_MODELS:
        if wanted is not None and not any(w in model.name.lower() for w in wanted):
            continue
        missing = [lib for lib in model.requires if importlib.util.find_spec(lib) is None]
        if missing:
            lines.append(f"{model.name}: skipped, {' and '.join(missing)} not installed "
                         f"({'; '.join(_install_hint(lib) for lib in missing)})")
            continue
        if model.make is _resnet18 and importlib.util.find_spec("torchvision") is None:
            lines.append(f"{model.name}: torchvision not installed, ran the copy of its architecture in "
                         "portable_nn.bench.torch_models")
        chosen.append(model)
    return chosen, lines


def swapped_count(model: RealModel) -> tuple[int, int]:
    """(modules swapped for ours, modules in all) of ``model``."""
    import torch

    import portable_nn.torch as pnt

    from .torch_models import swap_modules

    torch.manual_seed(0)
    built = swap_modules(model.make("float32")[0])
    ours = tuple(getattr(pnt, name) for name in ("Conv2d", "BatchNorm2d", "Linear", "LayerNorm", "LSTM"))
    modules = list(built.modules())
    return sum(isinstance(m, ours) for m in modules), len(modules)


def main(args: Any) -> int:
    """``python -m portable_nn bench --models [NAMES]``: the models' table (``--rounds``, ``--repeats``,
    ``--isa``, ``--quick`` as for the other sections)."""
    import argparse

    from .overhead import ROUNDS, print_model_table, split_selectors

    if importlib.util.find_spec("torch") is None:
        print("bench --models: PyTorch is not installed (pip install 'portable_nn[bench]')")
        return 2
    selectors = None if args.models in (None, "all") else split_selectors(args.models)
    models, lines = available_models(selectors)
    quick = bool(getattr(args, "quick", False))
    settings = argparse.Namespace(rounds=args.rounds or (1 if quick else ROUNDS - 1), quick=quick,
                                  in_process=not quick, models=None)
    repeats = args.repeats or (2 if quick else 5)
    if models:
        print_model_table(settings, (getattr(args, "isa", None) or "native").split(","), repeats,
                          steps=[REAL_MODEL_STEPS[m.name] for m in models],
                          title="real models, our layers swapped in (training step: forward, loss, backward)")
        for model in models:
            ours, total = swapped_count(model)
            lines.append(f"{model.name}: {ours} of {total} modules are portable_nn's")
    for line in lines:
        print(f"  {line}")
    return 0
