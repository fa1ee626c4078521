"""Helpers shared by the Numba-CUDA kernel tests (the target-device stand-in, the device checks)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import portable_nn as pnn

from . import _sim_checks as sim

HAS_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
needs_numba_cuda = pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")
HERE = Path(__file__).resolve().parent


def run_simulator(script: str) -> dict[str, dict]:
    """Run ``script`` (a simulator checks file beside this one) under ``NUMBA_ENABLE_CUDASIM=1`` in a
    subprocess; its results by case id (each a JSON line on stdout)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    proc = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True, env=env,
                          cwd=HERE.parents[2], timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["id"]] = r
    if proc.returncode != 0 or not results:
        pytest.fail(f"simulator run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


def assert_compiles_to_ptx(spec, signature: str, cc: tuple[int, int], target_device) -> None:
    """The kernel of ``spec`` compiles for ``signature`` to PTX for compute capability ``cc`` (the
    ``target_device`` fixture stands in for the device numba-cuda asks about while typing)."""
    from numba import cuda

    target_device.compute_capability = cc
    ptx, _ = cuda.compile_ptx(spec.py_func, signature, cc=cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx


def assert_simulated(results: dict[str, dict], case_id: str, compared: bool = False) -> None:
    """One simulator case reported, without error, every relative error within its tolerance (and,
    with ``compared``, at least one quantity compared)."""
    r = results.get(case_id)
    assert r is not None, f"{case_id} did not report"
    assert "error" not in r, r.get("traceback", r.get("error"))
    if compared:
        assert r["errors"], "nothing was compared"
    bad = {k: v for k, v in r["errors"].items() if not v <= r["tol"]}
    assert not bad, f"relative errors above {r['tol']:.0e}: {bad}"


def _gpu_vjp_check(fn, gargs, hargs, kw, tol, wrt=None):
    """Forward and gradients of ``fn`` forced onto numba_cuda (CuPy) against the float64 reference."""
    import cupy

    rng = np.random.default_rng(1)
    vjp_kw = {} if wrt is None else {"wrt": wrt}
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(fn, *gargs, **kw).backend == "numba_cuda"
        y, pullback = pnn.vjp(fn, *gargs, **kw, **vjp_kw)
        dy = rng.standard_normal(tuple(y.shape))
        grads = pullback(cupy.asarray(dy.astype(y.dtype)))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(fn, *hargs, **kw, **vjp_kw)
        g_ref = pull_ref(np.asarray(dy.astype(y.dtype), np.float64))
    assert sim.rel(cupy.asnumpy(y).astype(np.float64), y_ref) <= tol
    for name in g_ref._fields:
        e = getattr(g_ref, name)
        if e is not None:
            assert sim.rel(cupy.asnumpy(getattr(grads, name)).astype(np.float64), e) <= 10 * tol, name


@pytest.fixture
def target_device(monkeypatch):
    """numba-cuda compiles device functions for the *current* device while typing a kernel; without a
    driver there is none, so a stand-in with the target compute capability answers instead."""
    import numba.cuda.dispatcher as dispatcher

    class Target:
        compute_capability = (8, 0)

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: Target)
    return Target
