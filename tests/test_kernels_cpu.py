"""Numba CPU kernels: selection, zero-copy torch bridge, determinism, threads, threading layer.

Numerical agreement with the reference and PyTorch runs in the per-op test files, through the
shared ``cases(op)`` parametrisation, which forces every backend that declares support.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_TORCH, run_in_threads

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

NORMS = ("layer_norm", "batch_norm", "group_norm", "instance_norm")


def _data(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("op", ["layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm"])
def test_auto_picks_numba_for_numpy_float32(op):
    x = _data((4, 6, 5))
    args = (x, 2) if op == "group_norm" else (x,)
    assert pnn.explain(op, *args).backend == "numba"


def test_numba_declines_what_it_does_not_declare():
    x16 = _data((4, 6), np.float16)
    report = pnn.explain(pnn.layer_norm, x16)
    assert report.backend == "reference" and report.fallback
    assert any(b == "numba" and "float16" in why for b, why in report.passed_over)
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="float16"):
        pnn.layer_norm(x16)
    x = _data((3, 4, 5, 6))
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="channels_other"):
        pnn.batch_norm(x, channel_axis=2)


def test_strided_input_is_copied_and_reported():
    x = _data((8, 6)).T
    report = pnn.explain(pnn.layer_norm, x)
    assert report.backend == "numba" and report.copies == ["x"]
    with pnn.use_backend("reference"):
        expected = pnn.layer_norm(x)
    np.testing.assert_allclose(pnn.layer_norm(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_cpu_tensors_run_the_numba_kernel_and_get_tensors_back():
    import torch

    x = torch.randn(4, 3, 8)
    rm, rv = torch.zeros(3), torch.ones(3)
    assert pnn.explain(pnn.batch_norm, x, running_mean=rm, running_var=rv).backend == "numba"
    with pnn.use_backend("numba"):
        y = pnn.batch_norm(x, running_mean=rm, running_var=rv)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    expected = torch.nn.functional.batch_norm(x, torch.zeros(3), torch.ones(3), training=True)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert rm.abs().sum() > 0  # the running statistics (tensors) were updated in place


@pytest.mark.parametrize("op", NORMS)
@pytest.mark.parametrize("size", [(6, 4, 10), (64, 32, 40)], ids=["serial", "parallel"])
def test_bitwise_deterministic(op, size):
    x, dy = _data(size), _data(size, seed=1)
    c = size[-1] if op == "layer_norm" else size[1]
    w, b = _data((c,), seed=2), _data((c,), seed=3)
    results = []
    for _ in range(2):
        args = (x, 2, w, b) if op == "group_norm" else (x, w, b)
        y, pullback = pnn.vjp(op, *args, activation="gelu")
        results.append((y, *pullback(dy)))
    for first, second in zip(*results):
        assert np.array_equal(first, second)


@pytest.mark.parametrize("op", NORMS)
@pytest.mark.parametrize("channel_axis", [1, -1], ids=["channels_first", "channels_last"])
def test_parallel_and_serial_paths_agree_bitwise_and_with_the_reference(op, channel_axis, monkeypatch):
    """Both wrappers run the same tasks in the same order, so the thread count cannot change a bit.

    Channels-last shapes take the column mode (short contiguous runs), channels-first the group mode.
    """
    from kernels_cpu import norm

    x = _data((6, 4, 5, 3), np.float64) * 3 + 100.0
    x = np.ascontiguousarray(np.moveaxis(x, 1, -1)) if channel_axis == -1 else x
    dy = _data(x.shape, np.float64, seed=1)
    c = x.shape[-1] if op == "layer_norm" else x.shape[channel_axis]
    w, b = _data((c,), np.float64, seed=2), _data((c,), np.float64, seed=3)
    args = (x, 2, w, b) if op == "group_norm" else (x, w, b)
    kwargs = {} if op == "layer_norm" else {"channel_axis": channel_axis}
    results = {}
    for label, threshold in (("serial", 1 << 60), ("parallel", 0)):
        monkeypatch.setattr(norm, "PARALLEL_MIN_ELEMENTS", threshold)
        with pnn.use_backend("numba"):
            y, pullback = pnn.vjp(op, *args, activation="silu", **kwargs)
            results[label] = (y, *pullback(dy))
    with pnn.use_backend("reference"):
        y, pullback = pnn.vjp(op, *args, activation="silu", **kwargs)
        expected = (y, *pullback(dy))
    for serial, parallel, ref in zip(results["serial"], results["parallel"], expected):
        assert np.array_equal(serial, parallel)
        np.testing.assert_allclose(parallel, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())


def test_concurrent_calls_from_threads_are_safe():
    x = _data((64, 32, 40))
    w, b = np.ones(32, np.float32), np.zeros(32, np.float32)
    expected = pnn.batch_norm(x, w, b)

    def body():
        for _ in range(5):
            assert np.array_equal(pnn.batch_norm(x, w, b), expected)

    run_in_threads(body)


def test_threading_layer_policy_in_a_fresh_process():
    """The tbb layer is chosen (when installed) and no second OpenMP runtime is loaded for torch."""
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

    expected = "tbb" if "tbb" in _runtime.describe() else "workqueue"
    assert layer == expected
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


@pytest.mark.parametrize("op", ["layer_norm", "dense"])
def test_numba_relu_gives_positive_zero_and_propagates_nan(op):
    """relu(z <= 0) is +0.0 as in PyTorch and the reference (not -0.0); relu(NaN) is NaN."""
    with pnn.use_backend("numba"):
        if op == "layer_norm":
            y = pnn.layer_norm(np.array([[-3.0, -1.0, 2.0, 5.0]]), activation="relu")
        else:
            bias = np.array([0.0, 0.0, 0.0, np.nan])
            y = pnn.dense(np.array([[-3.0, -1.0, 2.0, 1.0]]), np.eye(4), bias, activation="relu")
    zeros = y[y == 0.0]
    assert zeros.size and not np.signbit(zeros).any()
    if op == "dense":
        assert np.isnan(y[0, 3])


def test_cached_kernels_are_dropped_when_any_sibling_source_changes(tmp_path):
    """Numba checks a cached kernel against its own file only; kernels inline sibling modules."""
    from kernels_cpu import _runtime

    (tmp_path / "kernels.py").write_text("x = 1\n")
    (tmp_path / "helpers.py").write_text("y = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    (cache / "kernels.f-1.py311.nbi").write_text("stale")
    assert _runtime.drop_stale_cache(str(tmp_path / "kernels.py"))  # no fingerprint yet: dropped
    assert not list(cache.glob("*.nbi"))
    (cache / "kernels.f-1.py311.nbi").write_text("fresh")
    assert not _runtime.drop_stale_cache(str(tmp_path / "kernels.py"))  # unchanged sources: kept
    assert list(cache.glob("*.nbi"))
    (tmp_path / "helpers.py").write_text("y = 22\n")  # a sibling, not the kernel's own file
    assert _runtime.drop_stale_cache(str(tmp_path / "kernels.py"))
    assert not list(cache.glob("*.nbi"))
