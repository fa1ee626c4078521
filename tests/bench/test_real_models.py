"""The real-model benchmark (:mod:`portable_nn.bench.real_models`, ``bench --models``): each installed
model's step computes the same loss and gradients with our layers swapped in (float64, to rounding), a
missing library gives a line saying how to install it, and the command prints its table.  Timings are
never asserted."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from portable_nn.bench import model_steps, real_models

from .test_model_steps import _run

torch = pytest.importorskip("torch")


def _installed(model: real_models.RealModel) -> bool:
    return all(importlib.util.find_spec(lib) is not None for lib in model.requires)


@pytest.mark.parametrize("model", [m for m in real_models.REAL_MODELS if _installed(m)], ids=lambda m: m.name)
def test_ours_computes_the_unmodified_models_step(model):
    """Loss and every gradient to 1e-9, each relative to its own size — or, for a gradient that is
    zero analytically (attention's key bias: softmax ignores a shift shared by every key), to the
    model's largest gradient: both are rounding noise there."""
    (v_ours, g_ours), (v_theirs, g_theirs) = (_run(real_models.REAL_MODEL_STEPS[model.name], c, "float64")
                                              for c in model_steps.CONTENDERS)
    assert model_steps.relative_error(v_ours, v_theirs) <= 1e-9
    assert len(g_ours) == len(g_theirs) > 0  # (tied weights stay tied: the same parameters)
    scale = max(np.linalg.norm(b) for b in g_theirs)
    for k, (a, b) in enumerate(zip(g_ours, g_theirs)):
        error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-6 * scale)
        assert error <= 1e-9, f"{model.name}: gradient {k} {a.shape} differs by {error:.2e}"
    ours, total = real_models.swapped_count(model)
    assert 0 < ours < total


def test_the_workers_find_the_models_steps():
    for name, step in real_models.REAL_MODEL_STEPS.items():
        assert model_steps.find_step(name) is step


def test_a_missing_library_is_one_line_and_resnet18_says_which_code_it_ran(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("timm", "torchvision") else real(name, *a))
    models, lines = real_models.available_models(["resnet18", "efficientnet"])
    assert [m.name for m in models] == ["resnet18 (16,3,64,64)"]
    assert any("efficientnet_b0" in line and "timm not installed" in line and "download.pytorch.org" in line
               for line in lines)
    assert any("resnet18" in line and "portable_nn.bench.torch_models" in line for line in lines)


def test_bench_models_prints_its_table():
    done = subprocess.run([sys.executable, "-m", "portable_nn", "bench", "--models", "lstm", "--quick"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "real models, our layers swapped in" in done.stdout
    assert "LSTM LM" in done.stdout and "2 of 4 modules are portable_nn's" in done.stdout
