"""The kernel packages' Numba cache follows their sources (portable_nn.kernel_cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

import portable_nn as pnn

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

NORMS = ("layer_norm", "batch_norm", "group_norm", "instance_norm")



@pytest.mark.parametrize("where", ["beside the source", "NUMBA_CACHE_DIR"])
def test_cached_kernels_are_dropped_when_any_sibling_source_changes(tmp_path, monkeypatch, where):
    """Numba checks a cached kernel against its own file only; kernels inline sibling modules.  Wherever
    Numba caches — beside the source, or under NUMBA_CACHE_DIR as a Docker image or a CI cache sets it."""
    from numba.core import config as numba_config

    from portable_nn import kernel_cache

    monkeypatch.setattr(numba_config, "CACHE_DIR", str(tmp_path / "numba_cache") if where == "NUMBA_CACHE_DIR" else "")
    sources = tmp_path / "package"
    sources.mkdir()
    (sources / "kernels.py").write_text("x = 1\n")
    (sources / "helpers.py").write_text("y = 1\n")
    cache = Path(kernel_cache.numba_cache_dir(str(sources / "kernels.py")))
    assert (cache.parent == sources) == (where == "beside the source")
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "kernels.f-1.py311.nbi").write_text("stale")
    assert kernel_cache.drop_stale_cache(str(sources / "kernels.py"))  # no fingerprint yet: dropped
    assert not list(cache.glob("*.nbi"))
    (cache / "kernels.f-1.py311.nbi").write_text("fresh")
    assert not kernel_cache.drop_stale_cache(str(sources / "kernels.py"))  # unchanged sources: kept
    assert list(cache.glob("*.nbi"))
    (sources / "helpers.py").write_text("y = 22\n")  # a sibling, not the kernel's own file
    assert kernel_cache.drop_stale_cache(str(sources / "kernels.py"))
    assert not list(cache.glob("*.nbi"))


# --------------------------------------------------------------------------- compile notices


@pytest.fixture
def fresh_notices(monkeypatch):
    """The notice state of a new process (what was announced, whether a line was printed)."""
    from portable_nn import kernel_cache

    monkeypatch.setattr(kernel_cache, "_announced", set())
    monkeypatch.setattr(kernel_cache, "_state", {**kernel_cache._state, "printed": False})
    monkeypatch.delenv(kernel_cache.NOTICE_VARIABLE, raising=False)
    return kernel_cache


class _Array:
    """A stand-in for a Numba array type (what the compile event's ``args`` hold)."""

    ndim = 2

    def __init__(self, dtype):
        self.dtype = dtype


def test_a_notice_names_the_kernels_the_dtype_and_the_cache_once(fresh_notices):
    import kernels_cpu.conv as conv

    args = (_Array("float32"), 3)
    message = fresh_notices.compile_notice("kernels_cpu.conv", conv.__file__, args)
    assert message.startswith("portable_nn: compiling the numba conv kernels for float32 (first use only; cached in ")
    assert fresh_notices.compile_notice("kernels_cpu.conv", conv.__file__, args) is None  # once per process
    assert "float64" in fresh_notices.compile_notice("kernels_cpu.conv", conv.__file__, (_Array("float64"),))
    assert fresh_notices.compile_notice("numba.np.arraymath", conv.__file__, args) is None  # not ours
    assert "numba_cuda norm kernels for bfloat16" in fresh_notices.compile_notice(
        "kernels_gpu.numba_cuda.norm", conv.__file__, (_Array("uint16"),))  # bf16 travels as its bits


class _Stream:
    def __init__(self, terminal):
        self.terminal, self.text = terminal, ""

    def isatty(self):
        return self.terminal

    def write(self, text):
        self.text += text

    def flush(self):
        pass


@pytest.mark.parametrize("terminal", [True, False])
def test_notices_go_to_the_logger_and_stderr(fresh_notices, monkeypatch, caplog, terminal):
    """Every notice on a terminal, the first one only otherwise; always to the logger."""
    stream = _Stream(terminal)
    monkeypatch.setattr(fresh_notices.sys, "stderr", stream)
    monkeypatch.setattr(fresh_notices.logging.getLogger("portable_nn"), "hasHandlers", lambda: False)
    with caplog.at_level("INFO", logger="portable_nn.compile"):
        fresh_notices._announce("first")
        fresh_notices._announce("second")
    assert [r.getMessage() for r in caplog.records] == ["first", "second"]
    assert stream.text == ("first\nsecond\n" if terminal else "first; more kernels may follow\n")


def test_notices_stay_off_stderr_when_opted_out_or_logging_is_configured(fresh_notices, monkeypatch):
    stream = _Stream(True)
    monkeypatch.setattr(fresh_notices.sys, "stderr", stream)
    monkeypatch.setattr(fresh_notices.logging.getLogger("portable_nn"), "hasHandlers", lambda: False)
    monkeypatch.setenv(fresh_notices.NOTICE_VARIABLE, "0")
    fresh_notices._announce("quiet")
    monkeypatch.delenv(fresh_notices.NOTICE_VARIABLE)
    monkeypatch.setattr(fresh_notices.logging.getLogger("portable_nn"), "hasHandlers", lambda: True)
    fresh_notices._announce("logged only")
    assert stream.text == ""


_ORDER_SCRIPT = """
import sys
import numpy as np
import portable_nn as pnn
import kernels_cpu.loss  # noqa: F401  (its runtime installs the notices, before this test's marker)
from numba.core import event

class Marker(event.Listener):
    def on_start(self, ev):
        func = getattr(ev.data.get("dispatcher"), "py_func", None)
        if func is not None and (func.__module__ or "").startswith("kernels_cpu."):  # (overloads: no module)
            sys.stderr.write("MARK compilation starts\\n")
            sys.stderr.flush()
    def on_end(self, ev):
        pass

event.register("numba:compile", Marker())
pnn.log_softmax(np.ones((2, 3)))
print("done")
"""


def test_the_notice_comes_before_the_first_compilation_with_an_empty_cache(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("PORTABLE_NN_COMPILE_NOTICE", None)
    run = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    notice = next(i for i, line in enumerate(lines) if "compiling the numba loss kernels for float64" in line)
    assert notice < next(i for i, line in enumerate(lines) if line.startswith("MARK"))
    assert sum("portable_nn: compiling" in line for line in lines) == 1  # not a terminal: one line
    assert str(tmp_path) in lines[notice]
