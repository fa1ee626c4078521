"""The demo (``python -m portable_nn demo``): the CLI smoke run, determinism, and its pieces.

The subprocess runs use ``--quick`` (512 training images, 2 epochs); the unit tests check the
optimisers against hand computations (and PyTorch when installed), the fixed data split, the
models' gradients against finite differences in float64, and the evaluation mode.
"""

from __future__ import annotations

import importlib.util
import io
import math
import re
import subprocess
import sys

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import directional_check
from portable_nn import examples
from portable_nn.examples import data, models, optim, progress, train
from portable_nn.examples.report import Outcome

if importlib.util.find_spec("sklearn") is None:  # not importorskip: importing scikit-learn takes seconds
    pytest.skip("the demo's data set comes with scikit-learn (the examples extra)", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _single_threaded_blas():
    """As in the demo: spinning BLAS threads would make the tiny products here many times slower."""
    with train.single_threaded_blas():
        yield

CPU_BACKENDS = [b for b in ("reference", "numba") if pnn.available_backends()[b]]


# --------------------------------------------------------------------------- the command line


def _run_quick() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "portable_nn", "demo", "--quick"], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def quick_runs() -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return _run_quick(), _run_quick()


def _table_rows(text: str) -> dict[tuple[str, str], list[str]]:
    """``(backend, model) → cells`` of the results table (a continuation row inherits the backend)."""
    body = text.split("\nresults ")[1]
    rows, backend = {}, None
    for line in body.splitlines():
        cells = line.split()
        if len(cells) >= 7 and cells[-1].endswith("%") and ("CNN" in cells or "LSTM" in cells):
            if cells[0] not in ("CNN", "LSTM"):
                backend = cells[0]
                cells = [c for c in cells if c != "*"][2:]
            rows[(backend, cells[0])] = cells
    return rows


def _printed_numbers(text: str) -> list[str]:
    """Every loss and accuracy the run prints (not its timings)."""
    return re.findall(r"loss (\d+\.\d+)|held-out +(\d+\.\d+)%|(\d+\.\d{6}) ", text)


def test_quick_demo_runs_and_prints_the_table(quick_runs):
    out = quick_runs[0]
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("scikit-learn", "1,797", "512 train / 450 held out", "CNN", "LSTM", "parameters",
                   "\nresults ", "first step", "s/epoch", "held-out", "goals"):
        assert needle in text, needle
    rows = _table_rows(text)
    for backend, status in pnn.available_backends().items():
        if status and backend in CPU_BACKENDS:
            assert (backend, "CNN") in rows and (backend, "LSTM") in rows, backend
        elif not status:
            assert re.search(rf"^\s+{backend}\s+unavailable: ", text, re.M), backend
    # two epochs on 512 images already learn something (chance is 10%)
    first = rows[(CPU_BACKENDS[-1], "CNN")]
    assert float(first[-1].rstrip("%")) > 50.0
    assert float(rows[(CPU_BACKENDS[-1], "LSTM")][-1].rstrip("%")) > 20.0


def test_quick_demo_backends_agree(quick_runs):
    """Every CPU backend starts from the same parameters and batches: same first-epoch loss."""
    rows = _table_rows(quick_runs[0].stdout)
    for model in ("CNN", "LSTM"):
        losses = [float(rows[(b, model)][-3]) for b in CPU_BACKENDS]
        assert max(losses) - min(losses) <= 1e-4 * max(losses), (model, losses)


def test_quick_demo_is_deterministic(quick_runs):
    a, b = (_printed_numbers(r.stdout) for r in quick_runs)
    assert len(a) >= 12
    assert a == b


def test_unavailable_backend_is_a_clear_error():
    missing = [b for b, s in pnn.available_backends().items() if not s]
    if not missing:
        pytest.skip("every backend is available here")
    out = subprocess.run([sys.executable, "-m", "portable_nn", "demo", "--quick", "--backend", missing[0]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"--backend {missing[0]}" in out.stderr


def _demo_in_process(argv: list[str], capsys) -> tuple[int, str]:
    import argparse

    parser = argparse.ArgumentParser()
    examples.add_demo_arguments(parser)
    rc = examples.run_demo(parser.parse_args(argv))
    return rc, capsys.readouterr().out


@pytest.mark.parametrize(("error", "label", "expected_rc"), [
    (pnn.BackendUnavailableError("reference: no kernel for conv"), "unsupported", 0),
    (RuntimeError("kernel crashed"), "failed", 1),
])
def test_a_failing_compared_backend_is_reported(monkeypatch, capsys, error, label, expected_rc):
    if len(CPU_BACKENDS) < 2:
        pytest.skip("needs a second CPU backend")
    real = train.train

    def flaky(name, digits, cfg, backend, *args, **kwargs):
        if backend == "reference":
            raise error
        return real(name, digits, cfg, backend, *args, **kwargs)

    monkeypatch.setattr(train, "train", flaky)
    rc, text = _demo_in_process(["--quick", "--backend", "numba", "--compare", "epoch", "--epochs", "1"], capsys)
    assert rc == expected_rc
    assert re.search(rf"^  reference +numpy +CNN +{label}$", text, re.M)
    assert str(error) in text.split("\nresults ")[1]
    assert re.search(r"^  numba \* +numpy +CNN ", text, re.M)  # the first backend's rows are all there


def _outcome(accuracy: float | None, error: str | None = None, unsupported: bool = False) -> Outcome:
    stats = None
    if accuracy is not None:
        stats = train.RunStats("CNN", "numba", 1, epochs=[train.EpochStats(1, 0.1, accuracy, 0.1)])
    return Outcome("cnn", "numba", stats=stats, error=error, goal=0.97, unsupported=unsupported)


def test_exit_status():
    met, missed = _outcome(0.98), _outcome(0.90)
    assert examples.exit_status([met, met], "default") == 0
    assert examples.exit_status([met, missed], "default") == 3
    assert examples.exit_status([met, missed], "custom") == 0
    assert examples.exit_status([met, missed], "quick") == 0
    assert examples.exit_status([met, met, _outcome(None, "boom")], "default") == 1
    assert examples.exit_status([met, met, _outcome(None, "no kernel", True)], "default") == 0
    assert examples.exit_status([_outcome(None, "no kernel", True), met], "quick") == 2


# --------------------------------------------------------------------------- optimisers


def test_sgd_momentum_matches_a_hand_computation():
    p = np.array([1.0, -2.0])
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    g1, g2 = np.array([0.5, 1.0]), np.array([-1.0, 2.0])
    opt.step([g1])
    np.testing.assert_allclose(p, [1.0 - 0.1 * 0.5, -2.0 - 0.1 * 1.0])  # b1 = g1
    opt.step([g2])
    b2 = 0.9 * g1 + g2
    np.testing.assert_allclose(p, [0.95 - 0.1 * b2[0], -2.1 - 0.1 * b2[1]])
    before = p.copy()
    opt.step([g2], lr=0.5)  # a schedule's learning rate replaces the base one for that step
    np.testing.assert_allclose(p, before - 0.5 * (0.9 * b2 + g2))


def test_adam_matches_a_hand_computation():
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    p = np.array([0.5, -1.5, 3.0], np.float64)
    opt = optim.Adam([p], lr=lr, betas=(b1, b2), eps=eps)
    grads = [np.array([0.1, -0.2, 0.3]), np.array([-0.4, 0.5, 0.05])]
    expected = [0.5, -1.5, 3.0]
    m, v = [0.0] * 3, [0.0] * 3
    for t, g in enumerate(grads, start=1):
        opt.step([g])
        for i in range(3):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            expected[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
        np.testing.assert_allclose(p, expected, rtol=1e-12)
    # the first Adam step moves each parameter by lr against its gradient's sign
    q = np.zeros(2)
    optim.Adam([q], lr=0.01).step([np.array([3.0, -1e-3])])
    np.testing.assert_allclose(q, [-0.01, 0.01], rtol=1e-4)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_optimizers_match_torch(name):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    p = rng.standard_normal((3, 4))
    tp = torch.tensor(p.copy(), requires_grad=True)
    ours = optim.make_optimizer(name, [p], 0.05)
    theirs = torch.optim.SGD([tp], lr=0.05, momentum=0.9) if name == "sgd" else torch.optim.Adam([tp], lr=0.05)
    for _ in range(4):
        g = rng.standard_normal((3, 4))
        ours.step([g])
        tp.grad = torch.tensor(g)
        theirs.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_cosine_schedule():
    assert optim.cosine_lr(0.2, 0, 10) == 0.2
    assert optim.cosine_lr(0.2, 5, 10) == pytest.approx(0.1)
    assert optim.cosine_lr(0.2, 10, 10) == pytest.approx(0.0, abs=1e-15)


# --------------------------------------------------------------------------- data


def test_split_is_fixed_stratified_and_independent_of_the_seed():
    _, labels, _ = data.read_digits()
    np.random.seed(123)  # global NumPy state must not matter either
    train_a, test_a = data.stratified_split(labels, data.HELD_OUT_FRACTION)
    np.random.seed(7)
    train_b, test_b = data.stratified_split(labels, data.HELD_OUT_FRACTION)
    np.testing.assert_array_equal(train_a, train_b)
    np.testing.assert_array_equal(test_a, test_b)
    assert len(set(train_a) | set(test_a)) == len(labels) == len(train_a) + len(test_a)
    counts, held = np.bincount(labels), np.bincount(labels[test_a])
    np.testing.assert_array_equal(held, [round(data.HELD_OUT_FRACTION * c) for c in counts])
    # another split seed gives another split: the fixed seed is what makes it fixed
    assert not np.array_equal(np.sort(data.stratified_split(labels, 0.25, seed=1)[1]), np.sort(test_a))
    # the loaded data uses that split, whatever the training seed
    digits = data.load(np.float64)
    np.testing.assert_array_equal(digits.y_test, labels[test_a])
    assert digits.x_train.shape == (len(train_a), 1, 8, 8)
    assert abs(digits.x_train.mean()) < 1e-12 and abs(digits.x_train.std() - 1) < 1e-12


def test_bundled_file_reads_like_load_digits():
    from sklearn.datasets import load_digits

    images, labels, version = data.read_digits()
    bunch = load_digits()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)
    import sklearn

    assert version == sklearn.__version__


def test_batches_cover_an_epoch_and_never_leave_one_image_alone():
    rng = np.random.default_rng(0)
    for n, size in [(10, 3), (9, 4), (8, 4), (1, 4)]:
        parts = data.batches(n, size, rng)
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))
        assert all(len(p) >= 2 for p in parts) or n == 1
    # the batch order depends on (seed, model, epoch) only
    a = data.batches(100, 32, train.model_rng(3, "cnn", 4))
    b = data.batches(100, 32, train.model_rng(3, "cnn", 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- models


def _small_batch(n: int = 6) -> tuple[np.ndarray, np.ndarray]:
    digits = data.load(np.float64)
    return digits.x_train[:n], digits.y_train[:n]


def _gradient_check(model: models.Model, backend: str) -> None:
    x, y = _small_batch()
    state = {k: v.copy() for k, v in model.state.items()}

    def loss(**params):
        return np.asarray(type(model)(dict(params), {k: v.copy() for k, v in state.items()}).loss_and_grads(x, y))

    with pnn.use_backend(backend):
        model.loss_and_grads(x, y)
        directional_check(loss, model.params, model.grads, np.ones(()), directions=3, h=1e-6, tol=1e-6)
    assert all(np.any(g != 0) for g in model.grads.values())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cnn_loss_gradient_matches_finite_differences(backend):
    _gradient_check(models.CNN.init(np.random.default_rng(0), np.float64, channels=(4, 6), hidden=8), backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_lstm_loss_gradient_matches_finite_differences(backend):
    _gradient_check(models.RowLSTM.init(np.random.default_rng(0), np.float64, hidden=8), backend)


def test_gradient_buffers_are_reused():
    model = models.CNN.init(np.random.default_rng(0), np.float64, channels=(4, 6), hidden=8)
    buffers = {k: id(v) for k, v in model.grads.items()}
    x, y = _small_batch()
    model.loss_and_grads(x, y)
    first = {k: v.copy() for k, v in model.grads.items()}
    model.loss_and_grads(x, y)
    assert {k: id(v) for k, v in model.grads.items()} == buffers
    for k, g in model.grads.items():  # written, not accumulated: the same batch gives the same gradient
        np.testing.assert_allclose(g, first[k], rtol=1e-12, atol=1e-15, err_msg=k)


def test_evaluation_uses_running_statistics():
    model = models.CNN.init(np.random.default_rng(0), np.float64, channels=(4, 6), hidden=8)
    x, y = _small_batch(8)
    before = {k: v.copy() for k, v in model.state.items()}
    model.loss_and_grads(x, y)  # training updates the running statistics in place
    assert any(not np.array_equal(before[k], v) for k, v in model.state.items())
    # with running statistics an image's scores do not depend on the rest of its batch
    np.testing.assert_allclose(model.logits(x[:1]), model.logits(x)[:1], rtol=1e-12)
    trained = model.logits(x)
    model.state["bn1.running_mean"] += 1.0
    assert not np.allclose(model.logits(x), trained)


def test_training_learns_and_is_reproducible():
    digits = data.load(np.float32).subset(256)
    cfg = train.TrainConfig(epochs=2, seed=5)
    _, a = train.train("lstm", digits, cfg, "reference")
    _, b = train.train("lstm", digits, cfg, "reference")
    assert [(e.loss, e.accuracy) for e in a.epochs] == [(e.loss, e.accuracy) for e in b.epochs]
    assert a.epochs[1].loss < a.epochs[0].loss
    _, c = train.train("lstm", digits, train.TrainConfig(epochs=2, seed=6), "reference")
    assert c.epochs[0].loss != a.epochs[0].loss  # the seed matters


def test_progress_bar_degrades_without_a_terminal():
    plain = io.StringIO()
    bar = progress.Progress(4, "  epoch 1/1", plain)
    for i in range(4):
        bar.update(i + 1, 0.5)
    bar.finish("  epoch 1/1  done")
    assert plain.getvalue() == "  epoch 1/1  done\n"  # a log gets the summary alone, no carriage return

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    pytest.importorskip("tqdm")
    tty = Terminal()
    bar = progress.Progress(4, "  epoch 1/1", tty)
    bar.update(4, 0.5)
    drawn = tty.getvalue()
    assert "  epoch 1/1" in drawn and "4/4" in drawn and "loss 0.5000" in drawn  # tqdm's bar
    bar.finish("  epoch 1/1  done")
    assert tty.getvalue().endswith("  epoch 1/1  done\n")


@pytest.mark.parametrize("name", ["cnn", "lstm"])
def test_the_torch_twin_is_the_same_model_on_the_same_batches(name):
    """torch.nn layers from the same initialisation, the same batches, torch.optim's Adam: the same
    losses and accuracy as portable_nn's run (float32 rounding apart), so its times compare like for like."""
    pytest.importorskip("torch")
    from portable_nn.examples import torch_twin

    digits = data.load(np.float32).subset(128)
    cfg = train.TrainConfig(epochs=2, seed=3)
    _, ours = train.train(name, digits, cfg, "reference")
    theirs = torch_twin.train_torch(name, digits, cfg)
    assert theirs.backend == "torch.nn" and theirs.n_params == ours.n_params
    for a, b in zip(ours.epochs, theirs.epochs):
        assert abs(a.loss - b.loss) <= 1e-4 * abs(a.loss)
        assert abs(a.accuracy - b.accuracy) <= 1 / len(digits.y_test)


# --------------------------------------------------------------------------- first use


def test_the_models_declare_the_ops_they_call():
    """models.OPS (what the demo compiles first) is exactly the ops the models' code calls."""
    import inspect

    called = set(re.findall(r"pnn\.(\w+)[(,]", inspect.getsource(models))) - {"vjp"}
    assert called == set(models.OPS)


def test_the_demo_compiles_the_models_kernels_once(monkeypatch, tmp_path, capsys):
    """Without the marker: one compile of the models' ops in parallel processes, then the marker;
    with it: nothing."""
    from portable_nn import kernel_cache, warmup

    calls = []
    monkeypatch.setattr(warmup, "compile_kernels", lambda *a, **k: calls.append((a, k)) or {})
    monkeypatch.setattr(kernel_cache, "warm_marker", lambda py_file, name: str(tmp_path / f"{name}.warm"))
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    examples.compile_models_first("float32", 32, 512)
    examples.compile_models_first("float32", 32, 512)
    assert len(calls) == 1
    (ops, dtypes, backend), options = calls[0]
    assert ops == models.OPS and dtypes == ["float32"] and backend == "numba" and options["jobs"] == 4
    # The models' own calls compile, at the run's sizes (not the generic samples).
    runner = options["runner"]
    assert runner.func is train.exercise and runner.keywords == {"batch_size": 32, "train_images": 512}
    assert (tmp_path / "demo-float32-b32-n512.warm").exists()
    assert "compiling the models' kernels in 4 processes (first use only)" in capsys.readouterr().out
    examples.compile_models_first("float32", 32, None)  # other sizes may reach other paths
    assert len(calls) == 2


def test_exercise_runs_both_models_with_the_given_ops_on_the_backend(monkeypatch):
    """Every op of the family runs on the backend asked for, every other op on the reference."""
    from portable_nn import dispatch

    seen = []
    original = dispatch.Route._forward

    def spy(route, call):  # every forward runs a route, on the full path or the fast one
        seen.append((call.op, route.impl.backend))
        return original(route, call)

    monkeypatch.setattr(dispatch.Route, "_forward", spy)
    result = train.exercise(["dense", "cross_entropy"], ["float64"], "numba", batch_size=8, train_images=20)
    assert [op for op, _, ran in result if ran] == ["dense", "cross_entropy"] and result[0][1] > 0
    assert {backend for op, backend in seen if op in ("dense", "cross_entropy")} == {"numba"}
    assert {backend for op, backend in seen if op not in ("dense", "cross_entropy")} == {"reference"}
    assert {op for op, _ in seen} >= set(models.OPS)


def test_the_demo_compiles_nothing_first_on_one_cpu(monkeypatch, tmp_path):
    from portable_nn import kernel_cache, warmup

    monkeypatch.setattr(warmup, "compile_kernels", lambda *a, **k: pytest.fail("compiled on one CPU"))
    monkeypatch.setattr(kernel_cache, "warm_marker", lambda py_file, name: str(tmp_path / f"{name}.warm"))
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    examples.compile_models_first("float32", 32, None)
    assert not list(tmp_path.iterdir())
