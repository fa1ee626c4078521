"""What a process's first kernel call pays: ``kernels_cpu._runtime``'s BLAS bindings and the lazy NumPy namespace.

A first call used to import scipy.linalg (through Numba's BLAS check) and array-api-compat's
NumPy wrapper (through validation), ~0.35 s of the 0.8 s first call; neither is needed by a
kernel route.  These tests pin that down structurally (which modules a first call imports),
and check that the rest of the process still sees a normal SciPy and a working reference path.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import _arrays

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
