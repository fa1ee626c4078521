"""Benchmark workloads: standard shapes from the issue tracker, float32, fwd / bwd / fwd+bwd.

Each :class:`Workload` builds its data once and returns closures; ``bytes_moved``
is the minimum memory traffic of a phase (each input read once, each output
written once), the numerator of the GB/s column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import portable_nn as pnn


@dataclass
class Cases:
    portable: Callable[[str], dict[str, Callable[[], Any]]]
    torch: Callable[[], dict[str, Callable[[], Any]]] | None
    bytes_moved: dict[str, int]


@dataclass
class Workload:
    name: str
    op: str
    build: Callable[[bool], Cases]


def _phases(forward: Callable[[], Any], vjp: Callable[[], Any], dy: Any) -> dict[str, Callable[[], Any]]:
    """fwd, bwd (pullback only) and fwd+bwd closures for one contender."""
    _, pullback = vjp()

    def fwd_bwd() -> Any:
        _, pb = vjp()
        return pb(dy)

    return {"fwd": forward, "bwd": lambda: pullback(dy), "fwd+bwd": fwd_bwd}


def _torch_phases(forward: Callable[[], Any], inputs: tuple, dy: Any) -> dict[str, Callable[[], Any]]:
    import torch

    y = forward()

    def bwd() -> Any:
        return torch.autograd.grad(y, inputs, dy, retain_graph=True)

    def fwd_bwd() -> Any:
        return torch.autograd.grad(forward(), inputs, dy)

    def fwd() -> Any:
        with torch.no_grad():
            return forward()

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def _norm_workload(name: str, op: str, shape: tuple[int, ...], quick_shape: tuple[int, ...],
                   channels_of: Callable[[tuple[int, ...]], int], extra: tuple = ()) -> Workload:
    def build(quick: bool) -> Cases:
        s = quick_shape if quick else shape
        rng = np.random.default_rng(0)
        x = rng.standard_normal(s, dtype=np.float32)
        dy = rng.standard_normal(s, dtype=np.float32)
        c = channels_of(s)
        w = np.ones(c, np.float32)
        b = np.zeros(c, np.float32)
        fn = getattr(pnn, op)
        args = (x, *extra, w, b)

        def portable(backend: str) -> dict[str, Callable[[], Any]]:
            def forward() -> Any:
                with pnn.use_backend(backend):
                    return fn(*args)

            def vjp() -> Any:
                with pnn.use_backend(backend):
                    y, pb = pnn.vjp(fn, *args)

                def pullback(d: Any) -> Any:
                    with pnn.use_backend(backend):
                        return pb(d)

                return y, pullback

            return _phases(forward, vjp, dy)

        def torch_cases() -> dict[str, Callable[[], Any]]:
            import torch
            import torch.nn.functional as F

            xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
            dyt = torch.tensor(dy)
            forward = {
                "layer_norm": lambda: F.layer_norm(xt, (c,), wt, bt),
                "batch_norm": lambda: F.batch_norm(xt, None, None, wt, bt, training=True),
                "group_norm": lambda: F.group_norm(xt, extra[0] if extra else 1, wt, bt),
            }[op]
            return _torch_phases(forward, (xt, wt, bt), dyt)

        nbytes = x.nbytes
        return Cases(portable, torch_cases, {"fwd": 2 * nbytes, "bwd": 3 * nbytes, "fwd+bwd": 5 * nbytes})

    return Workload(name, op, build)


WORKLOADS = [
    _norm_workload("layer_norm (4096,1024)", "layer_norm", (4096, 1024), (256, 1024), lambda s: s[-1]),
    _norm_workload("batch_norm train (128,64,32,32)", "batch_norm", (128, 64, 32, 32), (8, 64, 16, 16),
                   lambda s: s[1]),
    _norm_workload("group_norm 32 groups (128,64,32,32)", "group_norm", (128, 64, 32, 32), (8, 64, 16, 16),
                   lambda s: s[1], extra=(32,)),
]
