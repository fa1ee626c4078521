"""The command line and import-time guarantees (each in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_import_is_light_and_fast():
    code = (
        "import sys, time; t = time.perf_counter(); import portable_nn; dt = time.perf_counter() - t; "
        "heavy = [m for m in ('numba', 'torch', 'cupy', 'jax') if m in sys.modules]; "
        "print(repr((heavy, dt)))"
    )
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    heavy, seconds = eval(out.stdout.strip())
    assert heavy == []
    assert seconds < 1.0


def test_info_reports_versions_backends_threading_cache_and_capabilities():
    out = _run("-m", "portable_nn", "info")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("portable_nn 0.1.0", "numpy", "backends:", "reference    available",
                   "numba threading layer", "kernel cache", "capabilities", "layer_norm"):
        assert needle in text, needle
    # every unavailable backend says why
    for line in text.split("backends:")[1].split("\n\n")[0].strip().splitlines():
        _name, state, *reason = line.split()
        assert reason, line
        assert state in ("available", "unavailable")


def test_unknown_command_is_an_error():
    out = _run("-m", "portable_nn", "frobnicate")
    assert out.returncode != 0
    assert "invalid choice" in out.stderr


@pytest.mark.parametrize("value", ["reference", "layer_norm=reference"])
def test_environment_variable_in_a_fresh_process(value):
    code = (
        "import numpy as np, portable_nn as pnn; "
        "print(pnn.explain(pnn.layer_norm, np.ones((2, 3))).source)"
    )
    import os

    env = {**os.environ, "PORTABLE_NN_BACKEND": value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PORTABLE_NN_BACKEND" in out.stdout


def test_readme_quick_start_is_two_commands_and_ci_runs_the_second():
    """The quick start's promise: one command for the demo, one for the tests, which CI runs verbatim."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0].strip() for b in quick.split("```bash\n")[1:]]
    assert len(blocks) == 2 and all("\n" not in b for b in blocks), blocks
    assert blocks[0].endswith("python -m portable_nn demo") and '".[examples]"' in blocks[0]
    assert blocks[1] in (root / ".ci" / "run").read_text()
