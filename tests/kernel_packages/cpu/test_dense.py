"""The numba dense kernels against the reference: every path, partial gradients, buffers, residuals."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import rel_err

pytest.importorskip("numba")

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")


from kernels_cpu import dense as kd  # noqa: E402

from .conv_dense_testing import _run, path  # noqa: E402, F401


def _dense_data(lead, n_in, n_out, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, n_in)).astype(dtype)
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(max(n_in, 1))).astype(dtype)
    b = (rng.standard_normal(n_out) * 0.5).astype(dtype)
    return x, w, b


def test_auto_picks_numba_for_dense():
    x, w, b = _dense_data((4,), 5, 3, np.float32)
    assert pnn.explain(pnn.dense, x, w, b).backend == "numba"


@pytest.mark.parametrize("act", ["identity", "relu", ("leaky_relu", 0.2), "gelu", "sigmoid"])
@pytest.mark.parametrize("lead", [(), (7,), (3, 5), (0,)])
def test_dense_float64_matches_reference(lead, act, path):
    x, w, b = _dense_data(lead, 6, 4, np.float64)
    got = _run(pnn.dense, (x, w, b), {"activation": act}, "numba")
    expected = _run(pnn.dense, (x, w, b), {"activation": act}, "reference")
    for name, a, e in zip(("y", "dx", "dweight", "dbias"), got, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert rel_err(a, e) <= 1e-12, f"{name}: {rel_err(a, e):.2e}"


def test_dense_mlp_layer_float32(path):
    """MLP-sized float32 layers (the serial path's workload) against the float64 reference."""
    x, w, b = _dense_data((16,), 784, 32, np.float32)
    got = _run(pnn.dense, (x, w, b), {"activation": "relu"}, "numba", wrt=("weight", "bias"))
    expected = _run(pnn.dense, [a.astype(np.float64) for a in (x, w, b)], {"activation": "relu"}, "reference")
    assert got[1] is None
    for name, a, e in zip(("y", "dweight", "dbias"), (got[0], got[2], got[3]), (expected[0], *expected[2:])):
        assert a.dtype == np.float32 and rel_err(a, e) <= 1e-5, name


@pytest.mark.parametrize("wrt", [("x",), ("weight",), ("bias",)])
def test_dense_partial_gradients(wrt, path):
    x, w, b = _dense_data((5,), 6, 3, np.float64)
    got = _run(pnn.dense, (x, w, b), {"activation": "silu"}, "numba", wrt=wrt)
    expected = _run(pnn.dense, (x, w, b), {"activation": "silu"}, "reference")
    for name, a, e in zip(("y", "x", "weight", "bias"), got, expected):
        if name != "y" and name not in wrt:
            assert a is None
        else:
            assert rel_err(a, e) <= 1e-12, name


def test_dense_bitwise_deterministic(path):
    x, w, b = _dense_data((33, 9), 17, 11, np.float32)
    first, second = (_run(pnn.dense, (x, w, b), {"activation": "gelu"}, "numba") for _ in range(2))
    for a, c in zip(first, second):
        assert np.array_equal(a, c)


def test_dense_out_buffers_written_in_place(path):
    x, w, b = _dense_data((3, 4), 6, 5, np.float32)
    expected = _run(pnn.dense, (x, w, b), {"activation": "relu"}, "numba")
    buffers = {"x": np.full_like(x, np.nan), "weight": np.full_like(w, np.nan), "bias": np.full_like(b, np.nan)}
    got = _run(pnn.dense, (x, w, b), {"activation": "relu"}, "numba", out=buffers)
    for name, value, want in zip(("x", "weight", "bias"), got[1:], expected[1:]):
        assert value is buffers[name]
        assert np.array_equal(value, want)


@pytest.mark.parametrize("act, kept", [("identity", None), ("relu", "y"), ("silu", "z")])
def test_dense_residuals(act, kept):
    from portable_nn.api._common import spec_of

    _prepare_dense = spec_of("dense").prepare

    x, w, b = _dense_data((4,), 5, 3, np.float32)
    call = _prepare_dense(x, w, b, activation=act).call.replace(save=True)
    (y,), (x2, _, kept_array, *_) = kd.dense_forward(call)
    assert np.shares_memory(x2, x)
    if kept is None:
        assert kept_array is None
    elif kept == "y":
        assert np.shares_memory(kept_array, y)
    else:
        np.testing.assert_allclose(kept_array, x @ w.T + b, rtol=1e-6, atol=1e-6)

