"""The small-model steps (:mod:`portable_nn.bench.model_steps`): every step builds for both contenders,
and both compute the same loss and gradients — to 1e-4 relative in float32 where they are different
implementations (pnn.vjp chains against autograd, the demo against its torch.nn twin), to rounding in
float64 where ours is the same torch.nn model with our modules swapped in.  Timings are never asserted."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from portable_nn.bench import model_steps

torch = pytest.importorskip("torch")

#: Steps whose contenders share one torch.nn model (ours with our modules swapped in): compared in float64.
SHARED_WEIGHTS = ("transformer", "resnet18")


def _run(step: model_steps.ModelStep, contender: str, dtype: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """One step of ``contender``: its value and gradients as float64 NumPy arrays (copied: buffers get reused)."""
    with contextlib.ExitStack() as stack:
        value, grads = step.build(contender, stack, dtype)()
        return model_steps.as_numpy(value), [model_steps.as_numpy(g) for g in grads]


def assert_same_step(step: model_steps.ModelStep, dtype: str, rtol: float) -> None:
    """Both contenders' values and gradients agree to ``rtol`` (relative to each array's norm), shape by shape."""
    (v_ours, g_ours), (v_theirs, g_theirs) = (_run(step, c, dtype) for c in model_steps.CONTENDERS)
    assert v_ours.shape == v_theirs.shape and model_steps.relative_error(v_ours, v_theirs) <= rtol
    assert len(g_ours) == len(g_theirs) > 0
    for k, (a, b) in enumerate(zip(g_ours, g_theirs)):
        assert a.shape == b.shape, (k, a.shape, b.shape)
        error = model_steps.relative_error(a, b)
        assert error <= rtol, f"{step.name}: gradient {k} {a.shape} differs by {error:.2e} (relative)"


@pytest.mark.parametrize("step", model_steps.MODEL_STEPS, ids=lambda s: s.name)
def test_both_contenders_compute_the_same_step(step):
    if any(s in step.name for s in SHARED_WEIGHTS):
        assert_same_step(step, "float64", 1e-10)
    else:
        assert_same_step(step, "float32", 1e-4)


def test_the_check_fails_when_one_contender_differs():
    mlp = model_steps.select_steps(["784-32-10 gradient, batch 32"])[0]

    def doctored(contender, stack, dtype="float32"):
        step = mlp.build(contender, stack, dtype)
        if contender == "ours":
            return step
        return lambda: (lambda value, grads: (value, [grads[0] * 1.001, *grads[1:]]))(*step())

    with pytest.raises(AssertionError, match="gradient 0"):
        assert_same_step(model_steps.ModelStep("doctored", doctored), "float32", 1e-4)


def test_the_sections_steps_are_all_there():
    names = [s.name for s in model_steps.MODEL_STEPS]
    for wanted in ("MLP 784-32-10 gradient, batch 32", "MLP 784-32-10 gradient, batch 128",
                   "LeNet-5 gradient, batch 32", "LeNet-5 gradient, batch 128", "demo CNN", "demo LSTM",
                   "transformer", "resnet18"):
        assert sum(wanted in n for n in names) == 1, wanted
    assert [s.name for s in model_steps.MODEL_STEPS if s.slow] == [n for n in names if "resnet18" in n]
    assert model_steps.select_steps(["lenet"]) == [s for s in model_steps.MODEL_STEPS if "LeNet" in s.name]
    assert model_steps.select_steps(["no such model"]) == []


def test_a_failing_worker_is_noted_and_its_step_left_out():
    notes: list[str] = []
    ghost = model_steps.ModelStep("no such step", lambda *a: None)
    timed = model_steps.measure_isolated([ghost], {"PATH": "/usr/bin:/bin"}, rounds=1, repeats=1, burst_s=0.001,
                                         quick=True, notes=notes)
    assert timed == {} and len(notes) == 2 and all("no such step" in n and "exit status" in n for n in notes)


@pytest.mark.parametrize("quick", [False, True], ids=["a process per step", "quick: a process per contender"])
def test_contenders_alternate_process_by_process(monkeypatch, quick):
    started: list[tuple[tuple[str, ...], str, bool]] = []

    def fake_process(spec, env):
        started.append((tuple(spec["steps"]), spec["contender"], spec["warm"]))
        return {name: 0.001 if spec["contender"] == "ours" else 0.003 for name in spec["steps"]}

    monkeypatch.setattr(model_steps, "_run_process", fake_process)
    steps = model_steps.MODEL_STEPS[:2]
    timed = model_steps.measure_isolated(steps, {}, rounds=2, repeats=1, burst_s=0.001, quick=quick)
    assert timed == {s.name: {"ours": 0.001, "theirs": 0.003} for s in steps}
    batches = [(s.name,) for s in steps] if not quick else [tuple(s.name for s in steps)]
    assert started == [(b, c, not quick) for b in batches for _ in range(2) for c in ("ours", "theirs")]
