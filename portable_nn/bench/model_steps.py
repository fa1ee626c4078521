"""Small-model training steps, portable_nn against PyTorch, each contender in its own fresh process.

The ``small-model steps`` section of ``python -m portable_nn.bench.overhead``.  Each
:class:`ModelStep` builds one step for either contender — ``ours`` (portable_nn) or ``theirs``
(PyTorch doing the same) — from the same seed, so both start from the same weights and data:

* **MLP 784-32-10** and **LeNet-5** gradients (cross-entropy, batch 32 and 128): ours chains
  ``pnn.vjp`` pullbacks of ``pnn.dense`` / ``pnn.conv`` / ``pnn.max_pool`` layers on NumPy arrays
  (the layers of :mod:`portable_nn.bench.workloads`), theirs is ``torch.nn.functional`` with autograd.
* the **demo's CNN and LSTM** training steps (:mod:`portable_nn.examples`, its default batch of
  32 digits, Adam): ours is the demo's own step on its chosen backend with BLAS limited to one thread,
  as the demo trains; theirs is the demo's ``torch.nn`` twin (:mod:`portable_nn.examples.torch_twin`).
* a **transformer MLP block** (LayerNorm, Linear 128→512, GELU, Linear 512→128, residual) on
  (8,128,128), and a **resnet18** step on (8,3,64,64) (forward, cross-entropy, backward): theirs the
  ``torch.nn`` model, ours the same model with :func:`~portable_nn.bench.torch_models.swap_modules`.

:func:`measure_isolated` runs every contender in a new ``python`` process with a given environment
(the user's: :func:`~portable_nn.bench.isa_environment`), alternating ``ours, theirs, ours, theirs…``
for ``rounds`` rounds; a process warms its step up (compilation, first calls) and times
steady-state bursts (:func:`~portable_nn.bench.worker.timed_steady_state`).  The figure of a
contender is the median over its processes.  :func:`measure_in_process` times both contenders
interleaved in the calling process, a second figure.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import portable_nn as pnn

from .isolated import WORKER_TIMEOUT_S, WorkerError, package_root
from .worker import RESULT_MARK, set_threads, timed_steady_state
from .workloads import FLATTEN, Layer, Placement, _chain, _lenet, _mlp, _place_layers

__all__ = ["CONTENDERS", "MODEL_STEPS", "ModelStep", "StepFn", "as_numpy", "find_step", "measure_in_process",
           "measure_isolated", "relative_error", "select_steps", "worker_main"]

#: ``ours`` is portable_nn, ``theirs`` PyTorch; a process runs one of them.
CONTENDERS = ("ours", "theirs")

#: One step: forward and backward; returns ``(value, gradients)`` — the loss (or the output whose
#: cotangent seeds the backward) and the gradients, in the same order for both contenders.
StepFn = Callable[[], tuple[Any, Sequence[Any]]]

#: The worker's ``-c`` program: one contender's steps, one result line (:data:`RESULT_MARK`).
_BOOTSTRAP = "import sys\nfrom portable_nn.bench.model_steps import worker_main\nsys.exit(worker_main(sys.argv[1]))\n"


@dataclass(frozen=True)
class ModelStep:
    """A training step of one small model for either contender.

    ``build(contender, stack, dtype)`` returns the step function; contexts the step runs in (a
    backend choice, a BLAS thread limit) are entered on ``stack`` and last as long as it does.
    ``slow`` steps are left out of ``--quick`` runs.
    """

    name: str
    build: Callable[[str, contextlib.ExitStack, str], StepFn]
    slow: bool = False


# --------------------------------------------------------------------------- shared pieces


def _labels(batch: int, classes: int = 10) -> np.ndarray:
    """Class labels ``(batch,)`` int64, the same in every process."""
    return np.random.default_rng(1).integers(0, classes, batch)


def _autograd_step(objective: Callable[[], Any], inputs: Sequence[Any], seed: Any = None) -> StepFn:
    """A step differentiating ``objective()`` w.r.t. ``inputs`` by autograd (seeded by ``seed`` if not a scalar)."""
    import torch

    def step() -> tuple[Any, Sequence[Any]]:
        value = objective()
        return value, torch.autograd.grad(value, inputs, seed)

    return step


def _segments(layers: Sequence[Layer | str]) -> list[list[Layer]]:
    """The layers split at each ``FLATTEN``."""
    parts: list[list[Layer]] = [[]]
    for layer in layers:
        if layer == FLATTEN:
            parts.append([])
        else:
            parts[-1].append(layer)  # type: ignore[arg-type]
    return parts


def _parameter_grads(results: Sequence[Any]) -> list[Any]:
    """The weight and bias gradients of a chain's pullback results (last layer first), in layer order."""
    return [v for r in reversed(results) for name, v in r._asdict().items() if name in ("weight", "bias")]


def cross_entropy_gradient(layers: Sequence[Layer | str], x: Any, labels: Any) -> tuple[Any, list[Any]]:
    """Mean cross-entropy of the layers' logits and its gradient w.r.t. every weight and bias (layer order).

    The forward runs each segment between flattens under :func:`~portable_nn.bench.workloads._chain`
    (a chain of ``pnn.vjp`` calls), the backward their pullbacks in reverse.
    """
    h, tape = x, []
    for k, segment in enumerate(_segments(layers)):
        shape = h.shape if k else None
        if shape is not None:
            h = h.reshape(shape[0], -1)
        h, pullback = _chain(segment, h)
        tape.append((pullback, shape))
    loss, xent = pnn.vjp(pnn.cross_entropy, h, labels, wrt=("logits",))
    g, grads = xent(np.ones((), h.dtype)).logits, []
    for pullback, shape in reversed(tape):
        results = pullback(g)
        grads = _parameter_grads(results) + grads
        if shape is not None:
            g = results[-1][0].reshape(shape)
    return loss, grads


def _layer_arrays(layers: Sequence[Layer | str]) -> list[np.ndarray]:
    """Every weight and bias of the layers, in layer order (a pool size is not one)."""
    return [p for layer in layers if layer != FLATTEN for p in layer[1] if isinstance(p, np.ndarray)]


# --------------------------------------------------------------------------- MLP and LeNet-5


def _functional_model(make: Callable[[bool], tuple[Any, list, Callable]], batch: int) -> Callable[..., StepFn]:
    """A builder of a workloads model's cross-entropy gradient: ``pnn.vjp`` chain vs ``torch.nn.functional``.

    ``make`` is one of the workloads' model makers (input, layers, PyTorch forward); its input is
    cut to ``batch`` rows.
    """

    def build(contender: str, stack: contextlib.ExitStack, dtype: str = "float32") -> StepFn:
        x, layers, torch_forward = make(False)
        place = Placement(dtype=dtype)
        x, layers, labels = place.array(x[:batch]), _place_layers(layers, place), _labels(batch)
        if contender == "ours":
            return lambda: cross_entropy_gradient(layers, x, labels)
        import torch
        import torch.nn.functional as F

        params = [torch.from_numpy(a).requires_grad_(True) for a in _layer_arrays(layers)]
        xt, yt = torch.from_numpy(x), torch.from_numpy(labels)
        return _autograd_step(lambda: F.cross_entropy(torch_forward(xt, params), yt), params)

    return build


# --------------------------------------------------------------------------- the demo's models


def _digits_batch(batch: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The demo's first training batch (its training images in their fixed order), or random images
    of its shape where scikit-learn, which ships the data, is not installed."""
    from ..examples import data as data_module

    try:
        digits = data_module.load(np.dtype(dtype))
        return digits.x_train[:batch], digits.y_train[:batch]
    except ImportError:
        return np.random.default_rng(2).standard_normal((batch, 1, 8, 8)).astype(dtype), _labels(batch)


def _demo_model(name: str) -> Callable[..., StepFn]:
    """A builder of the demo's training step of model ``name`` (``cnn`` or ``lstm``), at its default batch.

    Ours: the demo's model and optimiser, stepped by the demo's own step function under the
    backend ``--backend auto`` picks, with BLAS limited to one thread (as the demo trains).
    Theirs: the demo's ``torch.nn`` twin and ``torch.optim`` twin, stepped by the twin's step.
    Both from the demo's initialisation for seed 0.
    """

    def build(contender: str, stack: contextlib.ExitStack, dtype: str = "float32") -> StepFn:
        from ..examples import AUTO_ORDER, torch_twin
        from ..examples import train as training
        from ..examples.models import MODELS
        from ..examples.optim import make_optimizer

        cfg = training.TrainConfig()
        x, y = _digits_batch(cfg.batch_size, dtype)
        model = MODELS[name].init(training.model_rng(cfg.seed, name), np.dtype(dtype))
        if contender == "ours":
            status = pnn.available_backends()
            stack.enter_context(pnn.use_backend(next(b for b in AUTO_ORDER if status[b])))
            stack.enter_context(training.single_threaded_blas())
            optimizer = make_optimizer(cfg.optimizer, list(model.params.values()), cfg.lr)
            grads = list(model.grads.values())
            return lambda: (training._step(model, optimizer, x, y, optimizer.lr), grads)
        import torch

        module = torch_twin._modules(name, model.params).to(getattr(torch, dtype))
        optimizer = torch_twin._optimizer(cfg, module)
        lr, xt, yt = optimizer.param_groups[0]["lr"], torch.from_numpy(x), torch.from_numpy(y).long()
        params = list(module.parameters())
        return lambda: (torch_twin._step(module, optimizer, xt, yt, lr), [p.grad for p in params])

    return build


# --------------------------------------------------------------------------- torch.nn models, ours swapped in


def _swapped(model: Any, contender: str, dtype: str) -> Any:
    """``model`` in ``dtype``: as it is for ``theirs``, with our modules swapped in for ``ours``."""
    import torch

    from .torch_models import swap_modules

    model = model.to(getattr(torch, dtype))
    return swap_modules(model) if contender == "ours" else model


def _tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, grad: bool = False) -> Any:
    """A standard-normal torch tensor of ``shape`` and ``dtype`` drawn from ``rng``."""
    import torch

    return torch.from_numpy(rng.standard_normal(shape).astype(dtype)).requires_grad_(grad)


def _transformer_block(contender: str, stack: contextlib.ExitStack, dtype: str = "float32") -> StepFn:
    """A transformer's MLP block on (8,128,128): ``x + Linear(512,128)(gelu(Linear(128,512)(LayerNorm(x))))``.

    Gradients w.r.t. the input and every parameter, seeded by a fixed random cotangent.
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    block = _swapped(nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)),
                     contender, dtype)
    rng = np.random.default_rng(0)
    x, dy = _tensor(rng, (8, 128, 128), dtype, grad=True), _tensor(rng, (8, 128, 128), dtype)
    return _autograd_step(lambda: x + block(x), [x, *block.parameters()], dy)


def _resnet18(contender: str, stack: contextlib.ExitStack, dtype: str = "float32") -> StepFn:
    """resnet18 (:class:`~portable_nn.bench.torch_models.ResNet18`) on (8,3,64,64): forward, cross-entropy, backward."""
    import torch
    import torch.nn.functional as F

    from .torch_models import ResNet18

    torch.manual_seed(0)
    model = _swapped(ResNet18(), contender, dtype)
    rng = np.random.default_rng(0)
    images, targets = _tensor(rng, (8, 3, 64, 64), dtype), torch.from_numpy(_labels(8, 1000))
    return _autograd_step(lambda: F.cross_entropy(model(images), targets), list(model.parameters()))


MODEL_STEPS = [
    ModelStep("MLP 784-32-10 gradient, batch 32", _functional_model(_mlp, 32)),
    ModelStep("MLP 784-32-10 gradient, batch 128", _functional_model(_mlp, 128)),
    ModelStep("LeNet-5 gradient, batch 32", _functional_model(_lenet, 32)),
    ModelStep("LeNet-5 gradient, batch 128", _functional_model(_lenet, 128)),
    ModelStep("demo CNN training step (Adam), batch 32", _demo_model("cnn")),
    ModelStep("demo LSTM training step (Adam), batch 32", _demo_model("lstm")),
    ModelStep("transformer MLP block (8,128,128) fwd+bwd", _transformer_block),
    ModelStep("resnet18 step (8,3,64,64) fwd+CE+bwd", _resnet18, slow=True),
]


def find_step(name: str) -> ModelStep:
    """The model step called ``name`` (a small model's, or a real model's: :mod:`.real_models`)."""
    found = next((s for s in MODEL_STEPS if s.name == name), None)
    if found is not None:
        return found
    from .real_models import REAL_MODEL_STEPS

    return REAL_MODEL_STEPS[name]


def select_steps(selectors: Sequence[str] | None) -> list[ModelStep]:
    """The steps whose names contain one of ``selectors`` (case-insensitive; all when ``None``)."""
    if selectors is None:
        return list(MODEL_STEPS)
    wanted = [s.lower() for s in selectors]
    return [s for s in MODEL_STEPS if any(w in s.name.lower() for w in wanted)]


def as_numpy(value: Any) -> np.ndarray:
    """A float64 NumPy copy of an array, a torch tensor or a number."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.array(value, np.float64)


def relative_error(ours: Any, theirs: Any) -> float:
    """``‖ours − theirs‖ / ‖theirs‖`` of two arrays, tensors or numbers."""
    a, b = as_numpy(ours), as_numpy(theirs)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# --------------------------------------------------------------------------- timing


def _timed(fns: Mapping[str, StepFn], repeats: int, burst_s: float, warm: bool) -> dict[str, float]:
    """Median seconds per call of ``fns`` timed interleaved, after a warm-up (``warm``) or one first call each."""
    from . import time_interleaved

    if warm:
        return timed_steady_state(dict(fns), repeats, burst_s)[1]
    return time_interleaved(dict(fns), repeats, settle_s=0.0, burst_s=burst_s)


def _time_step(step: ModelStep, contender: str, repeats: int, burst_s: float, warm: bool,
               threads: int | None = None) -> float:
    """Median seconds per step of one contender in this process.

    ``threads``: give portable_nn and (once the build has imported it) PyTorch this many threads.
    """
    with contextlib.ExitStack() as stack:
        fn = step.build(contender, stack, "float32")
        if threads is not None and "torch" in sys.modules:
            set_threads(threads, torch_too=True)
        return _timed({step.name: fn}, repeats, burst_s, warm)[step.name]


def worker_main(spec_json: str) -> int:
    """A worker process: time one contender's steps and print the result line; exit status 0."""
    from .environment import reported_variables

    spec = json.loads(spec_json)
    set_threads(spec["threads"], torch_too=False)
    seconds = {name: _time_step(find_step(name), spec["contender"], spec["repeats"], spec["burst_s"], spec["warm"],
                                spec["threads"]) for name in spec["steps"]}
    sys.stdout.write(RESULT_MARK + json.dumps({"steps": seconds, "env": reported_variables()}) + "\n")
    sys.stdout.flush()
    return 0


def _run_process(spec: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, float]:
    """One worker process with ``env``: seconds per step by name.

    Raises:
        WorkerError: a non-zero exit, a timeout or no result line.
    """
    command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(dict(spec))]
    try:
        done = subprocess.run(command, env=dict(env), cwd=package_root(), capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise WorkerError(f"timed out after {WORKER_TIMEOUT_S} s") from exc
    found = [line[len(RESULT_MARK):] for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode or not found:
        last = (done.stderr or done.stdout or "no output").strip().splitlines()[-1]
        raise WorkerError(f"exit status {done.returncode}: {last}")
    return json.loads(found[-1])["steps"]


def measure_isolated(steps: Sequence[ModelStep], env: Mapping[str, str], *, rounds: int, repeats: int,
                     burst_s: float, threads: int = 2, quick: bool = False,
                     notes: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Median seconds per step of each contender, each process running one contender.

    Processes alternate ``ours, theirs`` for ``rounds`` rounds, one step each and warmed up; a
    ``quick`` run puts every step of a contender in one process and warms each up by one call.
    A failed process is noted in ``notes`` and its step left out.  Returns ``{step name:
    {contender: median seconds}}``.
    """
    batches = [[s.name for s in steps]] if quick else [[s.name] for s in steps]
    times: dict[str, dict[str, list[float]]] = {s.name: {c: [] for c in CONTENDERS} for s in steps}
    for names in batches:
        for _ in range(rounds):
            for contender in CONTENDERS:
                spec = {"steps": names, "contender": contender, "repeats": repeats, "burst_s": burst_s,
                        "threads": threads, "warm": not quick}
                try:
                    for name, seconds in _run_process(spec, env).items():
                        times[name][contender].append(seconds)
                except WorkerError as exc:
                    if notes is not None:
                        notes.append(f"{', '.join(names)} [{contender}]: {exc}")
    return {name: {c: statistics.median(v) for c, v in per.items()} for name, per in times.items()
            if all(per.values())}


def measure_in_process(step: ModelStep, repeats: int, burst_s: float, warm: bool = True) -> dict[str, float]:
    """Median seconds per step of both contenders built in this process and timed interleaved."""
    with contextlib.ExitStack() as stack:
        return _timed({c: step.build(c, stack, "float32") for c in CONTENDERS}, repeats, burst_s, warm)
