"""Shared test machinery: the (array library, backend, dtype) parametrisation,
pairwise argument grids, oracle comparisons and directional finite differences.

Every op's tests use :func:`cases` so that the set of backends tested is the set
that *declares* support for the op (``portable_nn.dispatch`` registrations):
adding a kernel automatically adds it to the tests, forced with ``use_backend``.
"""

from __future__ import annotations

import importlib.util
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import dispatch

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_STRICT = importlib.util.find_spec("array_api_strict") is not None



def cupy_has_device() -> bool:
    """Whether CuPy is installed and sees a CUDA device: the one GPU check of the tests (the
    ``gpu``-marked ones are skipped without it, see conftest.py)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _gpu_libs() -> tuple[str, ...]:
    """``cupy`` and ``torch_cuda`` (CUDA torch tensors) when CuPy sees a device."""
    if not cupy_has_device():
        return ()
    libs = ["cupy"]
    if HAS_TORCH:
        import torch

        if torch.cuda.is_available():
            libs.append("torch_cuda")
    return tuple(libs)


#: Array libraries on the CPU, always tested.
ARRAY_LIBS = tuple(
    name
    for name, present in (("numpy", True), ("torch", HAS_TORCH), ("array_api_strict", HAS_STRICT))
    if present
)
#: Array libraries on a CUDA device (their cases are marked ``gpu``; empty without a device).
GPU_LIBS = _gpu_libs()

#: Relative tolerance (norm-wise) per dtype, against a float64 oracle.
TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 5e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class Case:
    """One (array library, backend, dtype) combination."""

    lib: str
    backend: str
    dtype: str
    param_dtype: str | None = None  # float32 for mixed-precision cases

    @property
    def id(self) -> str:
        mixed = f"+{self.param_dtype}" if self.param_dtype and self.param_dtype != self.dtype else ""
        return f"{self.lib}-{self.backend}-{self.dtype}{mixed}"

    @property
    def tol(self) -> float:
        return TOL[self.dtype]

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        """``a`` (NumPy, float64) as this case's library and dtype."""
        if a is None:
            return None
        dtype = dtype or self.dtype
        a = np.asarray(a)
        if self.lib == "numpy":
            return a.astype(dtype)
        if self.lib in ("torch", "torch_cuda"):
            import torch

            device = "cuda" if self.lib == "torch_cuda" else "cpu"
            return torch.tensor(a, dtype=getattr(torch, dtype), device=device)
        if self.lib == "cupy":
            import cupy

            return cupy.asarray(a.astype(dtype))
        import array_api_strict as xps

        return xps.asarray(a, dtype=getattr(xps, dtype))

    def param(self, a: Any) -> Any:
        """A parameter array (float32 in mixed-precision cases)."""
        return self.asarray(a, self.param_dtype or self.dtype)

    def use(self) -> Any:
        """Force this case's backend."""
        return pnn.use_backend(self.backend)


def to_numpy(a: Any) -> Any:
    """Any array (or None / tuple) as float64 NumPy."""
    if a is None:
        return None
    if isinstance(a, (tuple, list)):
        return type(a)(to_numpy(v) for v in a)
    mod = type(a).__module__.split(".")[0]
    if mod == "torch":
        return a.detach().to(dtype=__import__("torch").float64).cpu().numpy()
    if mod == "array_api_strict":
        import array_api_strict as xps

        return np.asarray(xps.astype(a, xps.float64)._array)
    if mod == "cupy":
        return a.astype("float64").get()
    return np.asarray(a, dtype=np.float64)


def family_of(a: Any) -> str:
    """The :class:`Case` library name of an array (``torch_cuda`` for CUDA tensors)."""
    mod = type(a).__module__.split(".")[0]
    if mod == "torch" and a.device.type == "cuda":
        return "torch_cuda"
    return mod


def _lib_dtypes(lib: str, mixed: bool) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = [("float32", None), ("float64", None)]
    if mixed and lib in ("torch", "torch_cuda"):
        out += [("float16", "float32"), ("bfloat16", "float32")]
    if mixed and lib in ("numpy", "cupy"):
        out += [("float16", "float32")]
    return out


def cases(op: str, *, mixed: bool = True, libs: Sequence[str] | None = None) -> list[Any]:
    """pytest params over every (library, backend, dtype) an implementation of ``op`` declares."""
    params = []
    for impl in dispatch.implementations(op):
        if not dispatch.backend_status(impl.backend):
            continue
        s = impl.supports
        for lib in libs or ARRAY_LIBS + GPU_LIBS:
            on_gpu = lib in GPU_LIBS
            fam = "torch" if lib == "torch_cuda" else lib
            if s.families is not None and fam not in s.families:
                continue
            if s.devices is not None and ("cuda" if on_gpu else "cpu") not in s.devices:
                continue
            for dtype, pdt in _lib_dtypes(lib, mixed):
                if s.dtypes is not None and dtype not in s.dtypes:
                    continue
                if pdt and not s.mixed_precision:
                    continue
                case = Case(lib, impl.backend, dtype, pdt)
                marks = (pytest.mark.gpu,) if on_gpu else ()
                params.append(pytest.param(case, id=case.id, marks=marks))
    return params


# --------------------------------------------------------------------------- grids


def pairwise(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """A small set of combinations covering every pair of values of any two keys.

    Greedy all-pairs: repeatedly add the full combination that covers the most
    not-yet-covered pairs.  Deterministic.
    """
    keys = list(grid)
    values = [list(grid[k]) for k in keys]
    if len(keys) < 2:
        return [dict(zip(keys, combo)) for combo in itertools.product(*values)]
    uncovered = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(keys)), 2)
        for a in range(len(values[i]))
        for b in range(len(values[j]))
    }
    chosen = []
    all_combos = list(itertools.product(*(range(len(v)) for v in values)))
    while uncovered:
        best, best_gain = None, -1
        for combo in all_combos:
            gain = sum(
                (i, combo[i], j, combo[j]) in uncovered
                for i, j in itertools.combinations(range(len(keys)), 2)
            )
            if gain > best_gain:
                best, best_gain = combo, gain
        assert best is not None
        chosen.append(best)
        for i, j in itertools.combinations(range(len(keys)), 2):
            uncovered.discard((i, best[i], j, best[j]))
    return [{k: values[n][idx] for n, (k, idx) in enumerate(zip(keys, combo))} for combo in chosen]


def grid(grid_spec: Mapping[str, Sequence[Any]], *, id_fn: Callable[[dict], str] | None = None) -> list[Any]:
    """pytest params: a pairwise-covering set, plus the rest of the full grid marked ``slow``."""
    fast = pairwise(grid_spec)
    fast_keys = {repr(sorted(c.items())) for c in fast}
    keys = list(grid_spec)
    full = [dict(zip(keys, combo)) for combo in itertools.product(*(grid_spec[k] for k in keys))]
    name = id_fn or (lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
    params = [pytest.param(c, id=name(c)) for c in fast]
    params += [
        pytest.param(c, id=name(c), marks=pytest.mark.slow)
        for c in full
        if repr(sorted(c.items())) not in fast_keys
    ]
    return params


# --------------------------------------------------------------------------- comparisons


def rel_err(actual: Any, expected: Any) -> float:
    """max |actual − expected| / max |expected| (norm-wise relative error), in float64."""
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    if e.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(e))), 1e-30)
    return float(np.max(np.abs(a - e))) / scale


def assert_close(actual: Any, expected: Any, tol: float, what: str = "") -> None:
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def assert_matches(actual: Any, expected: Any, tol: float, what: str) -> None:
    """Relative error within ``tol``; NaN and ±inf must sit at the same places."""
    a, e = np.asarray(to_numpy(actual), np.float64), np.asarray(to_numpy(expected), np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    special = ~np.isfinite(e)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(a[special & ~np.isnan(e)], e[special & ~np.isnan(e)], err_msg=f"{what}: inf")
    if (~special).any():
        err = rel_err(a[~special], e[~special])
        assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.1e}"


def directional_check(
    f: Callable[..., Any],
    args: Mapping[str, np.ndarray],
    grads: Mapping[str, Any],
    cotangent: np.ndarray,
    *,
    directions: int = 2,
    h: float = 1e-6,
    tol: float = 1e-6,
    seed: int = 0,
) -> None:
    """Check gradients against central finite differences along random directions.

    ``f(**args)`` (float64 NumPy in, NumPy out) is differentiated in the scalar
    L = Σ cotangent · f; for a random direction v over the names in ``grads``,
    ⟨∇L, v⟩ must match (L(a + h v) − L(a − h v)) / 2h.
    """
    rng = np.random.default_rng(seed)
    names = [n for n, g in grads.items() if g is not None]
    for _ in range(directions):
        v = {n: rng.standard_normal(np.shape(args[n])) for n in names}
        analytic = sum(float(np.sum(to_numpy(grads[n]) * v[n])) for n in names)

        def loss(sign: float, v: dict = v) -> float:
            shifted = {k: (a + sign * h * v[k] if k in v else a) for k, a in args.items()}
            return float(np.sum(cotangent * to_numpy(f(**shifted))))

        numeric = (loss(1.0) - loss(-1.0)) / (2 * h)
        scale = max(abs(numeric), abs(analytic), 1.0)
        assert abs(analytic - numeric) <= tol * scale, (
            f"directional derivative {analytic!r} vs finite difference {numeric!r}"
        )


def check_pullback_plumbing(pullback: Callable[..., Any], dy: Any, inputs: Mapping[str, Any]) -> Any:
    """A pullback called twice gives the same gradients, and with ``out=`` (a buffer like each of
    ``inputs``, by gradient name) writes them into those buffers and returns them; the gradients."""
    grads = pullback(dy)
    again = pullback(dy)
    for name in grads._fields:
        np.testing.assert_array_equal(getattr(grads, name), getattr(again, name))
    buffers = {name: np.empty_like(value) for name, value in inputs.items()}
    got = pullback(dy, out=buffers)
    for name, buffer in buffers.items():
        assert getattr(got, name) is buffer, name
        np.testing.assert_array_equal(buffer, getattr(grads, name))
    return grads


def snapshot(arrays: Iterable[Any]) -> list[Any]:
    """Copies of arrays (to check later that nothing was mutated)."""
    return [None if a is None else to_numpy(a).copy() for a in arrays]


def unchanged(arrays: Iterable[Any], before: list[Any]) -> bool:
    return all(
        (a is None and b is None) or np.array_equal(to_numpy(a), b, equal_nan=True)
        for a, b in zip(arrays, before)
    )


def run_in_threads(body: Callable[[], None], threads: int = 4) -> None:
    """Run ``body`` in ``threads`` Python threads at once; re-raise the first failure in the caller."""
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            body()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- norm calls

#: The norms whose ``weight`` and ``bias`` are keyword-only (PyTorch's functional forms put the running
#: statistics first, so a positional port must fail).
KEYWORD_PARAM_NORMS = ("batch_norm", "instance_norm")


def norm_arguments(op: str, x: Any, weight: Any, bias: Any = None,
                   num_groups: int | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a norm call: group_norm takes ``num_groups`` second, rms_norm has no bias,
    batch and instance norm take ``weight`` and ``bias`` by keyword."""
    if op in KEYWORD_PARAM_NORMS:
        return (x,), {"weight": weight, "bias": bias}
    if op == "rms_norm":
        return (x, weight), {}
    if op == "group_norm":
        return (x, num_groups, weight, bias), {}
    return (x, weight, bias), {}
