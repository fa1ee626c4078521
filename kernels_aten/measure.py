"""The measurement behind the ``aten`` priorities: ``python -m kernels_aten.measure``.

For each workload, forward + backward (``pnn.vjp`` and its pullback, every gradient) on CPU
torch tensors, float32, 2 threads, with the ``aten`` and the ``numba`` backend forced in turn,
interleaved round-robin in one process (``portable_nn.bench.time_interleaved``: medians of
bursts of back-to-back calls), in the user's environment (``bench``'s default: no tuning variables).
Prints milliseconds per fwd+bwd and the ratio for each of ``--runs`` runs (3) and the best of
them; ``kernels_aten/__init__.py`` records the result next to each priority.  Not imported by
the package: it needs torch and numba, and it is slow.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

#: Set by the re-executed, configured process.
_MARK = "PORTABLE_NN_ATEN_MEASURE_CONFIGURED"


def _conv_case(x_shape: tuple[int, ...], w_shape: tuple[int, ...], padding: int,
               channels_last: bool = False) -> Callable[[], tuple]:
    def make() -> tuple:
        import torch

        import portable_nn as pnn

        g = torch.Generator().manual_seed(0)
        x = torch.randn(x_shape, generator=g)
        if channels_last:  # (N, H, W, C) contiguous
            x = x.permute(0, 2, 3, 1).contiguous()
        w = torch.randn(w_shape, generator=g) * 0.1
        b = torch.randn(w_shape[0], generator=g) * 0.1
        kwargs = {"padding": padding, "activation": "relu", "channel_axis": -1 if channels_last else 1}
        y = pnn.conv(x, w, b, **kwargs)
        return pnn.conv, (x, w, b), kwargs, torch.randn(y.shape, generator=g)

    return make


def _sequence_case(op: str, steps: int, batch: int, hidden: int, layers: int) -> Callable[[], tuple]:
    def make() -> tuple:
        import torch

        import portable_nn as pnn

        g = torch.Generator().manual_seed(0)
        gates = {"lstm": 4, "gru": 3, "rnn": 1}[op]
        k = hidden**-0.5
        shapes = ((gates * hidden, hidden), (gates * hidden, hidden), (gates * hidden,), (gates * hidden,))
        params = [tuple(torch.rand(shape, generator=g) * 2 * k - k for shape in shapes) for _ in range(layers)]
        x = torch.randn(steps, batch, hidden, generator=g)
        dy = torch.randn(steps, batch, hidden, generator=g)
        return getattr(pnn, op), (x, params), {}, (dy, None)

    return make


def _dense_case(batch: int, fin: int, fout: int, activation: str = "relu") -> Callable[[], tuple]:
    def make() -> tuple:
        import torch

        import portable_nn as pnn

        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, fin, generator=g)
        w = torch.randn(fout, fin, generator=g) * fin**-0.5
        b = torch.randn(fout, generator=g) * 0.1
        return pnn.dense, (x, w, b), {"activation": activation}, torch.randn(batch, fout, generator=g)

    return make


#: (label, case builder): the shapes the priorities are decided on (aten vs numba, both forced).
WORKLOADS: list[tuple[str, Callable[[], tuple]]] = [
    ("conv 3x3 64->64 (32,64,28,28) pad 1 +bias+relu", _conv_case((32, 64, 28, 28), (64, 64, 3, 3), 1)),
    ("conv 3x3 64->64 (32,28,28,64) channels last", _conv_case((32, 64, 28, 28), (64, 64, 3, 3), 1, True)),
    ("conv 5x5 6->16 (128,6,12,12) +bias+relu", _conv_case((128, 6, 12, 12), (16, 6, 5, 5), 0)),
    ("lstm 2 layers I=H=64 N=256 T=50", _sequence_case("lstm", 50, 256, 64, 2)),
    ("gru 2 layers I=H=64 N=256 T=50", _sequence_case("gru", 50, 256, 64, 2)),
    ("rnn tanh 2 layers I=H=64 N=256 T=50", _sequence_case("rnn", 50, 256, 64, 2)),
    ("dense 784->512 N=256 +bias+relu", _dense_case(256, 784, 512)),
    ("dense 64->64 N=256 +bias+relu", _dense_case(256, 64, 64)),
    ("dense 784->32 N=128 +bias+relu", _dense_case(128, 784, 32)),
    ("dense 32->10 N=128", _dense_case(128, 32, 10, "identity")),
]

def _fwd_bwd(backend: str, fn: Any, args: tuple, kwargs: dict, cotangent: Any) -> Callable[[], Any]:
    import portable_nn as pnn

    def run() -> Any:
        with pnn.use_backend(backend):
            _, pullback = pnn.vjp(fn, *args, **kwargs)
            return pullback(cotangent)

    return run


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def measure(workloads: list[tuple[str, Callable[[], tuple]]], contenders: tuple[str, ...] = ("aten", "numba"),
            repeats: int = 15) -> list[tuple[str, dict[str, float]]]:
    """Median ms per fwd+bwd for each workload and backend (2 threads, interleaved)."""
    import torch

    import portable_nn as pnn
    from portable_nn.bench import time_interleaved

    torch.set_num_threads(2)
    pnn.set_num_threads(2)
    results = []
    for label, make in workloads:
        fn, args, kwargs, cotangent = make()
        fns = {c: _fwd_bwd(c, fn, args, kwargs, cotangent) for c in contenders}
        seconds = time_interleaved(fns, repeats)
        results.append((label, {c: s * 1e3 for c, s in seconds.items()}))
    return results


def best_of(runs: list[list[tuple[str, dict[str, float]]]]) -> list[tuple[str, dict[str, float]]]:
    """Per workload and backend, the lowest of the runs' medians: this machine's cores are shared,
    and a run another process disturbed is slower, never faster."""
    return [(label, {c: min(run[k][1][c] for run in runs) for c in ms}) for k, (label, ms) in enumerate(runs[0])]


def _table(results: list[tuple[str, dict[str, float]]], first: str, second: str) -> None:
    print(f"{'workload':48s} {first:>9s} {second:>9s} {second + '/' + first:>12s}")
    for label, ms in results:
        print(f"{label:48s} {ms[first]:9.3f} {ms[second]:9.3f} {ms[second] / ms[first]:12.2f}")


def main(argv: list[str] | None = None) -> int:
    """Re-execute once in the user's environment (the benchmark's default: no tuning variables), then
    measure and print."""
    from portable_nn.bench.environment import user_environment

    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(_MARK) != "1":
        env = {**user_environment(), _MARK: "1"}
        return subprocess.call([sys.executable, "-m", "kernels_aten.measure", *argv], env=env)
    import torch

    print(f"CPU: {_cpu_model()}; torch {torch.__version__}; numpy {np.__version__}; 2 threads; float32 "
          "CPU torch tensors; median ms per forward + backward")
    runs = int(argv[argv.index("--runs") + 1]) if "--runs" in argv else 3
    results = [measure(WORKLOADS) for _ in range(runs)]
    for k, run in enumerate(results):
        print(f"run {k + 1}:")
        _table(run, "aten", "numba")
    print(f"best of {runs} runs:")
    _table(best_of(results), "aten", "numba")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
