"""The Numba-CUDA backend without a GPU: declarations, imports, every kernel compiled to PTX, and the
whole forward/backward suite in Numba's CUDA simulator against the reference."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import dispatch

from . import _sim_checks as sim
from .numba_cuda_testing import (  # noqa: F401  (fixture)
    HAS_NUMBA_CUDA,
    HERE,
    assert_compiles_to_ptx,
    assert_simulated,
    needs_numba_cuda,
    run_simulator,
    target_device,
)

NORMS = ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm")

#: Ops the backend declares (the others fall back under auto, raise when forced).
POOLS = ("max_pool", "avg_pool")

DECLARED = ("moments", *NORMS, "log_softmax", *POOLS, "cross_entropy", "dense", "conv", "conv_transpose")



@pytest.mark.parametrize("op", DECLARED)
def test_declared_support(op):
    impl = next(i for i in dispatch.implementations(op) if i.backend == "numba_cuda")
    s = impl.supports
    assert s.families == ("cupy", "torch") and s.devices == ("cuda",) and s.native == "cupy"
    assert impl.backward is not None and s.contiguous
    assert set(s.dtypes) == {"float16", "bfloat16", "float32", "float64"}
    if op in (*NORMS, "cross_entropy", "dense", "conv", "conv_transpose"):
        assert s.mixed_precision
    if op in (*POOLS, "conv", "conv_transpose"):
        assert set(s.layouts) == {"channels_first", "channels_last"}


def _run_outside_the_simulator(code: str, timeout: int) -> None:
    """Run ``code`` in a fresh interpreter at the repository root with the simulator off."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=HERE.parents[2], timeout=timeout)


def test_import_loads_neither_numba_cuda_nor_cupy():
    code = (
        "import sys, portable_nn as pnn, kernels_gpu.numba_cuda\n"
        "from portable_nn import dispatch\n"
        "assert any(i.backend == 'numba_cuda' for i in dispatch.implementations('layer_norm'))\n"
        "bad = [m for m in ('numba.cuda', 'cupy', 'numba_cuda') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    _run_outside_the_simulator(code, timeout=120)


def test_without_a_gpu_forcing_raises_and_auto_falls_back():
    if pnn.available_backends()["numba_cuda"]:
        pytest.skip("a GPU is available here")
    x = np.ones((2, 3), np.float32)
    with pnn.use_backend("numba_cuda"), pytest.raises(pnn.BackendUnavailableError, match="numba_cuda"):
        pnn.layer_norm(x)
    assert pnn.explain(pnn.layer_norm, x).backend != "numba_cuda"


def _kernel_specs():
    if not HAS_NUMBA_CUDA:
        return []
    from kernels_gpu.numba_cuda import _runtime, conv, dense, loss, norm, pool  # noqa: F401  (modules declare their kernels)

    return list(_runtime.KERNELS)


_SPECS = _kernel_specs()


def _ptx_params():
    params = []
    for spec in _SPECS:
        for sig in spec.signatures:
            variant = sig[sig.index("(") + 1:].split("[")[0]
            params.append(pytest.param(spec, sig, (8, 0), id=f"{spec.name.rsplit('.', 1)[1]}-{variant}-sm80"))
            mark = () if variant == "float32" else (pytest.mark.slow,)
            params.append(pytest.param(spec, sig, (9, 0), marks=mark,
                                       id=f"{spec.name.rsplit('.', 1)[1]}-{variant}-sm90-{len(params)}"))
    return params


@needs_numba_cuda
@pytest.mark.parametrize(("spec", "signature", "cc"), _ptx_params())
def test_kernel_compiles_to_ptx(spec, signature, cc, target_device):
    assert_compiles_to_ptx(spec, signature, cc, target_device)


def test_every_kernel_is_declared_with_signatures():
    if not HAS_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    names = [s.name for s in _SPECS]
    assert len(names) == len(set(names))
    for spec in _SPECS:
        assert spec.signatures, spec.name
    assert any(n.endswith("norm._row_forward") for n in names)
    assert any(n.endswith("loss._lsm_backward") for n in names)
    assert any(n.endswith("pool._max_backward") for n in names)
    assert any(n.endswith("loss._ce_backward") for n in names)
    assert any(n.endswith("dense._activation_grad") for n in names)
    assert any(n.endswith("conv._col2im") for n in names)
    for kernel in ("_mom_rows", "_mom_small", "_mom_cols", "_mom_finalize", "_mom_dx"):
        assert any(n.endswith(f"norm.{kernel}") for n in names), kernel


@pytest.fixture(scope="module")
def simulator_results():
    return run_simulator("_sim_checks.py")


@needs_numba_cuda
@pytest.mark.parametrize("case_id", sim.CASES)
def test_simulator_matches_reference(case_id, simulator_results):
    assert_simulated(simulator_results, case_id)


@needs_numba_cuda
def test_simulator_covers_every_norm_path(simulator_results):
    paths = {p for r in simulator_results.values() for p in r.get("paths", ())}
    assert {"row", "seg", "column"} <= paths
    assert {"moments-rows", "moments-small", "moments-cols", "moments-empty"} <= paths



@needs_numba_cuda
def test_kernels_compile_under_a_numpy_without_row_stack():
    """numba-cuda 0.30.4 registers ``np.row_stack``, which NumPy 2.5 removed: on the GPU machine
    (NumPy 2.5.2) every launch failed with AttributeError.  This NumPy is made to lack it too."""
    code = (
        "import numpy as np\n"
        "if hasattr(np, 'row_stack'):\n"
        "    del np.row_stack\n"
        "    np.__all__ = [n for n in np.__all__ if n != 'row_stack']\n"
        "import numba.cuda.dispatcher as dispatcher\n"
        "from numba import cuda\n"
        "import kernels_gpu.numba_cuda.norm\n"
        "from kernels_gpu.numba_cuda._runtime import KERNELS\n"
        "class Target:\n"
        "    compute_capability = (9, 0)\n"
        "dispatcher.get_current_device = lambda: Target\n"
        "spec = next(s for s in KERNELS if s.name.endswith('_row_forward'))\n"
        "ptx, _ = cuda.compile_ptx(spec.py_func, spec.signatures[0], cc=(9, 0))\n"
        "assert '.entry' in ptx\n"
        "assert not hasattr(np, 'row_stack'), 'the stand-in leaked into numpy'\n"
    )
    _run_outside_the_simulator(code, timeout=300)


@needs_numba_cuda
def test_the_cache_lets_kernels_that_link_code_run():
    """numba-cuda cannot pickle the bfloat16 kernels (they link the bf16 conversion code): on the
    GPU machine its cache raised from every such compile.  The kernels' caches skip exactly that."""
    import importlib

    from numba.cuda.dispatcher import CUDACache, CUDADispatcher

    from kernels_gpu.numba_cuda import _runtime as rt

    class Cache:
        def __init__(self, error):
            self.error = error

        def save_overload(self, sig, data):
            raise self.error

    class Dispatcher:
        pass

    linking = Dispatcher()
    linking._cache = Cache(RuntimeError("Cannot pickle CUDACodeLibrary with linking files"))
    rt.tolerant_cache(linking)._cache.save_overload("sig", object())  # swallowed
    other = Dispatcher()
    other._cache = Cache(RuntimeError("disk full"))
    with pytest.raises(RuntimeError, match="disk full"):
        rt.tolerant_cache(other)._cache.save_overload("sig", object())
    if rt.SIMULATOR:
        return
    wrapped = 0
    for name in ("_runtime", "norm", "loss", "pool", "conv", "dense", "rnn"):
        module = importlib.import_module(f"kernels_gpu.numba_cuda.{name}")
        for value in vars(module).values():
            if isinstance(value, CUDADispatcher) and isinstance(value._cache, CUDACache):  # kernels, not device fns
                assert "tolerant_cache" in value._cache.save_overload.__qualname__, value
                wrapped += 1
    assert wrapped >= len(rt.KERNELS)
