"""Backend configuration: precedence, context isolation, environment variable, fallback modes."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_STRICT


def test_default_is_auto():
    assert pnn.get_backend("layer_norm") == ("auto", "default")


def test_set_backend_global_and_per_op():
    pnn.set_backend("reference")
    assert pnn.get_backend("conv")[0] == "reference"
    pnn.set_backend(conv="numba")
    assert pnn.get_backend("conv")[0] == "numba"
    assert pnn.get_backend("layer_norm")[0] == "reference"
    pnn.set_backend(conv=None)
    assert pnn.get_backend("conv")[0] == "reference"
    pnn.set_backend(None)
    assert pnn.get_backend("conv") == ("auto", "default")


def test_use_backend_nests_and_restores():
    with pnn.use_backend("reference"):
        assert pnn.get_backend("lstm_cell")[0] == "reference"
        with pnn.use_backend(lstm_cell="numba"):
            assert pnn.get_backend("lstm_cell")[0] == "numba"
            assert pnn.get_backend("conv")[0] == "reference"
        assert pnn.get_backend("lstm_cell")[0] == "reference"
    assert pnn.get_backend("lstm_cell")[0] == "auto"


def test_context_beats_global_beats_env(monkeypatch):
    monkeypatch.setenv("PORTABLE_NN_BACKEND", "numba")
    assert pnn.get_backend("dense")[0] == "numba"
    pnn.set_backend("cupy")
    assert pnn.get_backend("dense")[0] == "cupy"
    with pnn.use_backend("reference"):
        assert pnn.get_backend("dense")[0] == "reference"


def test_environment_variable_with_per_op_entries(monkeypatch):
    monkeypatch.setenv("PORTABLE_NN_BACKEND", "reference,conv=numba, lstm_cell = numba_cuda")
    assert pnn.get_backend("conv")[0] == "numba"
    assert pnn.get_backend("lstm_cell")[0] == "numba_cuda"
    assert pnn.get_backend("layer_norm")[0] == "reference"
    assert "PORTABLE_NN_BACKEND" in pnn.get_backend("conv")[1]


def test_environment_variable_is_honoured_by_calls(monkeypatch):
    x = np.ones((2, 3))
    monkeypatch.setenv("PORTABLE_NN_BACKEND", "layer_norm=numba_cuda")
    with pytest.raises(pnn.BackendUnavailableError, match="numba_cuda.*PORTABLE_NN_BACKEND"):
        pnn.layer_norm(x)
    monkeypatch.setenv("PORTABLE_NN_BACKEND", "reference")
    assert "layer_norm[reference]" in str(pnn.explain(pnn.layer_norm, x))


@pytest.mark.parametrize(
    "text, match",
    [("nonsense", "unknown backend 'nonsense'"), ("conv=numba,bogus_op=reference", "unknown op 'bogus_op'")],
)
def test_bad_environment_variable_is_a_clear_error(monkeypatch, text, match):
    monkeypatch.setenv("PORTABLE_NN_BACKEND", text)
    with pytest.raises(ValueError, match=match):
        pnn.get_backend("conv")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: pnn.set_backend("fast"), ValueError, "unknown backend 'fast'"),
        (lambda: pnn.set_backend(3), TypeError, "backend name"),
        (lambda: pnn.set_backend(not_an_op="numba"), ValueError, "unknown op 'not_an_op'"),
        (lambda: pnn.use_backend("gpu").__enter__(), ValueError, "unknown backend 'gpu'"),
        (lambda: pnn.set_fallback("loud"), ValueError, "fallback mode"),
    ],
)
def test_bad_configuration_values(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
    assert pnn.get_backend("conv") == ("auto", "default")


def test_use_backend_is_thread_local():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def worker():
        with pnn.use_backend("reference"):
            inside.set()
            release.wait(5)
            seen["worker"] = pnn.get_backend("conv")[0]

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    seen["main"] = pnn.get_backend("conv")[0]
    release.set()
    t.join()
    assert seen == {"worker": "reference", "main": "auto"}


def test_use_backend_is_asyncio_task_local():
    async def task(name, backend, results, gate):
        with pnn.use_backend(backend):
            await gate.wait()  # both tasks are inside their contexts here
            results[name] = pnn.get_backend("conv")[0]

    async def main():
        results = {}
        gate = asyncio.Event()
        tasks = [
            asyncio.create_task(task("a", "reference", results, gate)),
            asyncio.create_task(task("b", "numba", results, gate)),
        ]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks)
        results["outside"] = pnn.get_backend("conv")[0]
        return results

    assert asyncio.run(main()) == {"a": "reference", "b": "numba", "outside": "auto"}


@pytest.mark.skipif(not HAS_STRICT, reason="array_api_strict not installed")
def test_forcing_numba_on_array_api_strict_raises():
    import array_api_strict as xps

    x = xps.ones((4, 8))
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="numba"):
        pnn.layer_norm(x)


def test_forcing_an_unavailable_backend_says_why():
    x = np.ones((2, 3))
    with pnn.use_backend("cupy"), pytest.raises(pnn.BackendUnavailableError, match="cupy.*not available"):
        pnn.layer_norm(x)
    with pnn.use_backend("numba_cuda"), pytest.raises(pnn.BackendUnavailableError, match="numba_cuda"):
        pnn.batch_norm(x)


def test_fallback_modes_with_a_declining_kernel():
    """A float64-only kernel declines float32: allow runs the next candidate, warn warns, error raises."""
    calls = []

    def forward(call):
        calls.append(call.dtype)
        return (call.xp.zeros_like(call.x), None, None), None

    pnn.register_kernel(
        "layer_norm", "float64_only", forward=forward, supports=pnn.Support(dtypes=("float64",)), priority=50
    )
    try:
        x32 = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
        expected = (x32 - x32.mean(-1, keepdims=True)) / np.sqrt(x32.var(-1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(pnn.layer_norm(x32), expected, atol=1e-5)
        assert calls == []
        report = str(pnn.explain(pnn.layer_norm, x32))
        assert "runs: layer_norm[float64_only]" not in report
        assert "passed over float64_only: supports dtypes float64" in report and "fallback" in report

        pnn.set_fallback("warn")
        with pytest.warns(pnn.FallbackWarning, match="float64_only"):
            pnn.layer_norm(x32)
        pnn.set_fallback("error")
        with pytest.raises(pnn.BackendUnavailableError, match="float64_only supports dtypes float64"):
            pnn.layer_norm(x32)
        # the kernel itself still runs where it applies, whatever the mode
        assert np.all(pnn.layer_norm(x32.astype(np.float64)) == 0)
        assert calls == ["float64"]
    finally:
        pnn.unregister_kernel("layer_norm", "float64_only")
    assert "float64_only" not in pnn.available_backends()
