"""``kernels_cpu._runtime``: the threading layer, concurrent calls, and what a first kernel call pays.

What a process's first kernel call pays: ``kernels_cpu._runtime``'s BLAS bindings and the lazy NumPy namespace.

A first call used to import scipy.linalg (through Numba's BLAS check) and array-api-compat's
NumPy wrapper (through validation), ~0.35 s of the 0.8 s first call; neither is needed by a
kernel route.  These tests pin that down structurally (which modules a first call imports),
and check that the rest of the process still sees a normal SciPy and a working reference path.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import run_in_threads
from portable_nn import _arrays

from .cpu_testing import _data

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_a_first_kernel_call_imports_neither_scipy_linalg_nor_the_numpy_wrapper():
    code = """
import sys
import numpy as np, portable_nn as pnn
x = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)
w = np.ones((3, 5), np.float32)
with pnn.use_backend("numba"):
    y, pullback = pnn.vjp(pnn.dense, x, w, activation="relu")
    g = pullback(np.ones_like(y))
    # a None cotangent, integer targets: paths that once reached for the wrapper namespace
    (out, _), lstm_pullback = pnn.vjp(pnn.lstm, x.reshape(8, 1, 5), wrt=("x",),
                                     params=[(np.ones((8, 5), np.float32), np.ones((8, 2), np.float32), None, None)])
    lstm_pullback((np.ones_like(out), None))
    loss, ce_pullback = pnn.vjp(pnn.cross_entropy, x, np.array([0, 1, 2, 3, 4, 0, 1, 2]))
    ce_pullback(np.ones_like(loss))
    backends = {pnn.explain(pnn.dense, x, w).backend, pnn.explain(pnn.cross_entropy, x, np.zeros(8, np.int64)).backend}
print(*backends)
print(float(abs(y - np.maximum(x @ w.T, 0)).max()), float(abs(g.weight - (x.T @ (y > 0)).T).max()))
print("scipy.linalg" in sys.modules, "array_api_compat.numpy" in sys.modules)
"""
    backend, errors, imported = _run(code)
    assert backend == "numba"
    assert max(float(e) for e in errors.split()) < 1e-5
    assert imported == "False False"


def test_scipy_linalg_imported_after_the_preload_is_complete():
    """The preloaded extension becomes the package's attribute, and SciPy's own BLAS/LAPACK work."""
    code = """
import numpy as np, portable_nn as pnn
with pnn.use_backend("numba"):
    pnn.dense(np.ones((4, 3)), np.ones((2, 3)))
import scipy.linalg
import scipy.linalg.cython_blas
import sys
print(scipy.linalg.cython_blas is sys.modules["scipy.linalg.cython_blas"])
print(scipy.linalg.solve(2 * np.eye(3), np.ones(3)).tolist())
print(scipy.linalg.blas.dgemm(1.0, np.eye(2), np.ones((2, 2))).tolist())
"""
    same, solved, product = _run(code)
    assert same == "True"
    assert solved == "[0.5, 0.5, 0.5]"
    assert product == "[[1.0, 1.0], [1.0, 1.0]]"


def test_the_preload_leaves_an_already_imported_scipy_linalg_alone():
    code = """
import scipy.linalg, sys
from kernels_cpu import _runtime
print(_runtime.preload_blas_bindings(), sys.modules["scipy.linalg.cython_blas"] is scipy.linalg.cython_blas)
"""
    assert _run(code) == ["False True"]


def test_the_lazy_numpy_namespace_is_array_api_compats():
    import array_api_compat.numpy as np_xp

    xp = _arrays.namespace(np.ones(3))
    assert xp is _arrays.NUMPY_NAMESPACE
    assert xp.asarray is np_xp.asarray and xp.__name__ == np_xp.__name__
    assert xp.float32 == np.float32
    with pytest.raises(AttributeError):
        xp.no_such_function  # noqa: B018  (the attribute access is the test)
    # the reference route runs through it
    with pnn.use_backend("reference"):
        y = pnn.layer_norm(np.arange(6.0).reshape(2, 3))
    np.testing.assert_allclose(y.sum(axis=1), 0.0, atol=1e-12)


# --------------------------------------------------------------------------- threads next to PyTorch

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch")

#: A parallel-size layer_norm whose result the parent and its children check.
_CHECKED_KERNEL = """
import numpy as np, portable_nn as pnn
def checked_kernel():
    x = np.arange(512 * 256, dtype=np.float64).reshape(512, 256) % 7
    y = pnn.layer_norm(x)
    assert np.abs(y.mean(axis=1)).max() < 1e-12 and np.abs(y.std(axis=1) - 1).max() < 1e-3
    return "ok"
"""


@needs_torch
def test_one_openmp_pool_with_pytorch():
    """Numba's pool is PyTorch's OpenMP pool: our parallel kernels start no thread of their own."""
    code = """
import os
import scipy.linalg.cython_blas  # its BLAS worker threads exist before the count
import torch, numpy as np
torch.set_num_threads(2)
torch.nn.functional.layer_norm(torch.rand(512, 256), (256,))  # torch's OpenMP pool started
before = len(os.listdir('/proc/self/task'))
import numba, portable_nn as pnn
with pnn.use_backend("numba"), pnn.use_threads(2):
    pnn.layer_norm(np.ones((512, 256)))
print(numba.threading_layer(), len(os.listdir('/proc/self/task')) - before)
"""
    layer, extra = _run(code)[-1].split()
    assert layer == "omp"
    assert extra == "0"


@needs_torch
def test_pytorch_imported_after_our_pool_binds_the_same_runtime():
    """Order does not matter: torch imported after our pool started reuses the loaded runtime."""
    code = """
import os, numpy as np, portable_nn as pnn
with pnn.use_backend("numba"), pnn.use_threads(2):
    pnn.layer_norm(np.ones((512, 256)))
import torch
torch.set_num_threads(2)
before = len(os.listdir('/proc/self/task'))
torch.nn.functional.layer_norm(torch.rand(512, 256), (256,))
torch.rand(300, 300) @ torch.rand(300, 300)
print(len(os.listdir('/proc/self/task')) - before)
"""
    assert _run(code)[-1] == "0"


@pytest.mark.parametrize("parent", ["ours", "torch_only", "nothing"])
def test_a_forked_child_runs_kernels(parent):
    """os.fork() after our pool (or PyTorch's) started: the child's kernels run and are right.

    GNU OpenMP's pool hangs in a forked child (PyTorch's own ops do, with more than one thread);
    the runtime runs the serial kernels there, or picks the fork-safe tbb layer when the child
    configures first.
    """
    if parent == "torch_only" and not HAS_TORCH:
        pytest.skip("needs torch")
    warm = {
        "ours": "checked_kernel()",
        "torch_only": "import torch; torch.set_num_threads(2); torch.rand(400, 400) @ torch.rand(400, 400)",
        "nothing": "",
    }[parent]
    code = _CHECKED_KERNEL + f"""
import os, signal
{warm}
pid = os.fork()
if pid == 0:
    signal.alarm(60)
    try:
        print("child", checked_kernel(), flush=True)
        os._exit(0)
    except BaseException as exc:
        print("child failed", exc, flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
print("status", status)
print("parent", checked_kernel())
"""
    lines = _run(code)
    assert "child ok" in lines and "status 0" in lines and "parent ok" in lines, lines


def test_a_multiprocessing_fork_pool_runs_kernels():
    """A DataLoader-style worker pool (fork start method) after the parent used our kernels."""
    code = _CHECKED_KERNEL + """
import multiprocessing as mp
checked_kernel()
def work(_):
    return checked_kernel()
with mp.get_context("fork").Pool(2) as pool:
    print(pool.map(work, range(4), chunksize=1))
"""
    assert _run(code)[-1] == "['ok', 'ok', 'ok', 'ok']"


# --------------------------------------------------------------------------- BLAS threads per call


def test_blas_is_single_threaded_during_a_numba_call_only():
    import threadpoolctl

    from kernels_cpu import _runtime

    _runtime.blas_limit.libraries()
    seen = []

    def spy():
        seen.append({i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info()
                     if i["user_api"] == "blas"})

    before = {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}
    assert before, "no BLAS library found"
    with _runtime.blas_limit:
        spy()
        with _runtime.blas_limit:  # re-entrant: the inner exit does not restore
            pass
        spy()
    spy()
    assert all(n == 1 for n in seen[0].values()) and seen[1] == seen[0]
    assert seen[2] == before


def test_dispatch_enters_the_numba_scope_around_forward_and_backward(monkeypatch):
    from kernels_cpu import CPU_SCOPE
    from portable_nn import dispatch

    impls = {op: i for op in dispatch.op_names() for i in dispatch.implementations(op) if i.backend == "numba"}
    # The BLAS limit is entered by the kernels that call BLAS, and only by them.
    blas = {"dense", "conv", "conv_transpose", "rnn_cell", "lstm_cell", "gru_cell", "rnn", "lstm", "gru"}
    assert blas <= impls.keys() and {"layer_norm", "cross_entropy", "max_pool", "moments"} <= impls.keys()
    assert all((i.scope == CPU_SCOPE) == (op in blas) for op, i in impls.items())

    entered = []

    class Spy:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    monkeypatch.setitem(impls["dense"].__dict__, "_scope_resolved", Spy)
    x, w = np.ones((4, 8)), np.ones((3, 8))
    with pnn.use_backend("numba"):
        y, pullback = pnn.vjp(pnn.dense, x, w)
        pullback(np.ones_like(y))
    assert entered == ["in", "out", "in", "out"]


# --------------------------------------------------------------------------- thread count


def _spy_kernels(monkeypatch):
    """Replace run_sized's kernels by recorders of which ran and with how many Numba threads."""
    import numba

    from kernels_cpu import _runtime

    ran = []

    def parallel(*args):
        ran.append(("parallel", numba.get_num_threads()))

    def serial(*args):
        ran.append(("serial", None))

    return ran, lambda want: _runtime.run_sized(parallel, serial, want)


def test_the_thread_count_bounds_parallel_kernels(monkeypatch):
    import numba

    ran, run = _spy_kernels(monkeypatch)
    before = numba.get_num_threads()
    with pnn.use_threads(1):
        run(True)
    run(False)
    if numba.config.NUMBA_NUM_THREADS >= 2:
        with pnn.use_threads(2):
            run(True)
        assert ran[2] == ("parallel", 2)
    assert ran[:2] == [("serial", None), ("serial", None)]
    assert numba.get_num_threads() == before  # the pool's setting is the caller's again


def test_omp_num_threads_is_the_default():
    code = """
import numpy as np, portable_nn as pnn
from kernels_cpu import _runtime
print(pnn.get_num_threads(), _runtime.parallel_threads())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


# --------------------------------------------------------------------------- pooled arrays


def test_pooled_arrays_are_reused_only_when_free():
    from kernels_cpu import _runtime

    shape = (512, 1024)
    a = _runtime.empty(shape, np.float32)
    assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % 64 == 0
    view = a[3:7].T  # a view keeps the block in use
    address = a.ctypes.data
    del a
    b = _runtime.empty(shape, np.float32)
    assert b.ctypes.data != address
    assert not np.shares_memory(b, view)
    del view
    c = _runtime.empty(shape, np.float32)  # the first block is free again
    assert c.ctypes.data == address
    small = _runtime.empty((4, 4), np.float64)
    assert small.base is None  # small arrays come from NumPy
    z = _runtime.zeros((300, 1000), np.float64)
    assert not z.any()


@needs_torch
def test_a_tensor_made_from_a_pooled_array_keeps_its_block():
    import torch

    from kernels_cpu import _runtime

    a = _runtime.empty((1024, 512), np.float32)
    a[...] = 3.0
    t = torch.from_numpy(a)
    address = a.ctypes.data
    del a
    b = _runtime.empty((1024, 512), np.float32)
    assert b.ctypes.data != address
    b[...] = 0.0
    assert float(t.min()) == 3.0


def test_the_pool_releases_free_blocks_beyond_its_bound(monkeypatch):
    from kernels_cpu import _runtime

    pool = _runtime.BlockPool()
    pool.max_free = 3 << 20
    held = [pool.take(1 << 20) for _ in range(6)]
    assert pool.stats()["blocks"] == 6 and pool.stats()["free_blocks"] == 0
    del held
    assert pool.stats()["free_bytes"] == 6 << 20
    pool.take(2 << 20)  # a new size: free blocks beyond the bound go, oldest first
    stats = pool.stats()
    assert stats["free_bytes"] <= 3 << 20
    pool.clear()
    assert pool.stats()["free_blocks"] == 0


def test_concurrent_takes_get_distinct_blocks():
    """Threads taking and dropping blocks at once never get a block another thread still uses."""
    import threading
    import time

    from kernels_cpu import _runtime

    def body():
        mark = float(threading.get_ident() % 1000003)
        for _ in range(20):
            arrays = [_runtime.empty((1 << 18,), np.float32) for _ in range(4)]
            for a in arrays:
                a[...] = mark
            time.sleep(0.001)
            assert all(float(a.min()) == mark == float(a.max()) for a in arrays)

    run_in_threads(body)


# --------------------------------------------------------------------------- threads and the threading layer
def test_concurrent_calls_from_threads_are_safe():
    x = _data((64, 32, 40))
    w, b = np.ones(32, np.float32), np.zeros(32, np.float32)
    expected = pnn.batch_norm(x, weight=w, bias=b)

    def body():
        for _ in range(5):
            assert np.array_equal(pnn.batch_norm(x, weight=w, bias=b), expected)

    run_in_threads(body)


def test_threading_layer_policy_in_a_fresh_process():
    """omp on PyTorch's own OpenMP runtime when torch is installed, else tbb (no OpenMP loaded)."""
    code = """
import numpy as np, portable_nn as pnn, numba
x = np.ones((256, 256), np.float32)
pnn.layer_norm(x)
print(numba.threading_layer())
maps = open('/proc/self/maps').read()
print(sorted({line.split('/')[-1] for line in maps.splitlines() if 'gomp' in line or 'libomp' in line}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    layer, openmp = out.stdout.strip().splitlines()
    from kernels_cpu import _runtime

    shared = _runtime.torch_openmp_runtime()
    expected = "omp" if shared else "tbb" if "tbb" in _runtime.describe() else "workqueue"
    assert layer == expected
    if layer == "omp":
        assert os.path.basename(shared) in openmp  # PyTorch's runtime, loaded without importing torch
    if layer == "tbb":
        assert openmp == "[]", f"an OpenMP runtime was loaded: {openmp}"


def test_user_threading_layer_is_respected():
    code = "import numpy as np, portable_nn as pnn, numba; pnn.layer_norm(np.ones((256, 256))); " \
           "print(numba.threading_layer())"
    env = {"NUMBA_THREADING_LAYER": "workqueue", "PATH": "/usr/bin:/bin"}
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "workqueue"

