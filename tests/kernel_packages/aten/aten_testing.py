"""Helpers shared by the aten kernel tests: tensors, both backends on one call, agreement, the problems."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import rel_err

torch = pytest.importorskip("torch")


GATES = {"rnn": 1, "lstm": 4, "gru": 3}


def _t(a: Any, dtype: Any = torch.float64, device: str = "cpu") -> Any:
    return None if a is None else torch.tensor(np.asarray(a), dtype=dtype, device=device)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _both(fn: Any, args: tuple, kwargs: dict, cotangent: Any, wrt: Any = None,
          backends: tuple[str, str] = ("aten", "reference")) -> list[tuple[Any, Any]]:
    """(outputs, gradients) of ``fn`` under each backend, forced."""
    results = []
    for backend in backends:
        with pnn.use_backend(backend):
            assert pnn.explain(fn, *args, **kwargs).backend == backend
            y, pullback = pnn.vjp(fn, *args, wrt=wrt, **kwargs)
            results.append((y, pullback(cotangent)))
    return results


def _assert_agree(results: list[tuple[Any, Any]], tol: float) -> None:
    (y, grads), (y_ref, grads_ref) = results
    for k, (a, e) in enumerate(zip(_leaves(y), _leaves(y_ref), strict=True)):
        assert tuple(a.shape) == tuple(e.shape) and a.dtype == e.dtype, f"output {k}"
        assert rel_err(a, e) <= tol, f"output {k}: {rel_err(a, e):.2e}"
    for name in grads._fields:
        got, ref = getattr(grads, name), getattr(grads_ref, name)
        if ref is None:
            assert got is None, f"d{name} should be None"
            continue
        for k, (a, e) in enumerate(zip(_leaves(got), _leaves(ref), strict=True)):
            if e is None:
                assert a is None, f"d{name}[{k}] should be None"
                continue
            assert tuple(a.shape) == tuple(e.shape) and a.dtype == e.dtype, f"d{name}[{k}]"
            assert rel_err(a, e) <= tol, f"d{name}[{k}]: {rel_err(a, e):.2e}"


CONV_GEOMS = {
    "2d-pad1": dict(x=(2, 4, 7, 6), w=(6, 4, 3, 3), stride=1, padding=1, dilation=1, groups=1),
    "2d-asym-s2-d2-g2": dict(x=(2, 4, 9, 8), w=(6, 2, 3, 2), stride=2, padding=((1, 2), (0, 1)), dilation=2,
                             groups=2),
    "2d-same-even": dict(x=(1, 3, 6, 5), w=(3, 3, 2, 4), stride=1, padding="same", dilation=1, groups=1),
    "2d-depthwise-valid": dict(x=(2, 3, 5, 6), w=(6, 1, 3, 3), stride=(2, 1), padding="valid", dilation=1,
                               groups=3),
    "1d-asym": dict(x=(2, 3, 9), w=(4, 3, 3), stride=2, padding=((2, 0),), dilation=2, groups=1),
    "3d-mixed": dict(x=(1, 2, 4, 5, 4), w=(4, 2, 2, 3, 2), stride=(1, 2, 1), padding=(1, 0, (0, 1)),
                     dilation=(2, 1, 1), groups=1),
}


def _conv_problem(geom: dict, layout: str, batched: bool, bias: bool, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(geom["x"])
    w = rng.standard_normal(geom["w"]) / np.sqrt(np.prod(geom["w"][1:]))
    b = rng.standard_normal(geom["w"][0]) if bias else None
    if layout == "last":
        x = np.moveaxis(x, 1, -1)
    if not batched:
        x = x[0]
    kwargs = {k: geom[k] for k in ("stride", "padding", "dilation", "groups")}
    kwargs["channel_axis"] = -1 if layout == "last" else 1
    return x, w, b, kwargs


def _seq_problem(kind: str, *, steps: int = 4, n: int = 3, features: int = 3, hs: int = 4, layers: int = 2,
                 bidirectional: bool = False, batch_first: bool = False, bias: str = "both", states: bool = True,
                 seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dirs = 2 if bidirectional else 1
    g = GATES[kind]
    params = []
    for k in range(layers * dirs):
        fin = features if k < dirs else dirs * hs
        w = [rng.uniform(-1, 1, (g * hs, fin)) * 0.5, rng.uniform(-1, 1, (g * hs, hs)) * 0.5]
        w += [rng.uniform(-0.5, 0.5, g * hs) if (bias == "both" or (bias == "mixed" and k % 2 == 0 and j == 0))
              else None for j in range(2)]
        params.append(tuple(_t(p) for p in w))
    shape = (n, steps, features) if batch_first else (steps, n, features)
    state = (layers * dirs, n, hs)
    out = (n, steps, dirs * hs) if batch_first else (steps, n, dirs * hs)
    return {
        "x": _t(rng.standard_normal(shape)),
        "params": params,
        "h0": _t(rng.standard_normal(state)) if states else None,
        "c0": _t(rng.standard_normal(state)) if states and kind == "lstm" else None,
        "cot": (_t(rng.standard_normal(out)), _t(rng.standard_normal(state)))
        + ((_t(rng.standard_normal(state)),) if kind == "lstm" else ()),
    }

