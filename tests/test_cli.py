"""The command line and import-time guarantees (each in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


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


def test_help_has_no_markup():
    out = _run("-m", "portable_nn", "--help")
    assert out.returncode == 0 and "``" not in out.stdout and "compile" in out.stdout


def test_compile_fills_the_cache_ahead_of_time(tmp_path):
    """The first process compiles (and says so), the next one loads: no notice, nothing compiled."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path), "PORTABLE_NN_COMPILE_NOTICE": "1"}
    first = _run("-m", "portable_nn", "compile", "--ops", "log_softmax", "--dtypes", "float64", env_extra=env,
                 timeout=600)
    assert first.returncode == 0, first.stderr
    assert "log_softmax: compiled or loaded" in first.stdout and "kernels ready" in first.stdout
    assert "compiling the numba loss kernels for float64" in first.stderr
    second = _run("-m", "portable_nn", "compile", "--ops", "log_softmax", "--dtypes", "float64", env_extra=env,
                  timeout=600)
    assert second.returncode == 0, second.stderr
    assert "portable_nn: compiling" not in second.stderr


def test_compile_builds_families_in_parallel_processes(tmp_path):
    """--jobs 2 compiles two op families in two worker processes; a later process only loads.  Each
    family's kernels, parallel variants included (the samples run again under the backend's
    compile_variants), are in the cache."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path), "PORTABLE_NN_COMPILE_NOTICE": "1"}
    args = ("-m", "portable_nn", "compile", "--ops", "log_softmax,dense", "--dtypes", "float64")
    first = _run(*args, "--jobs", "2", env_extra=env, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "log_softmax: compiled or loaded" in first.stdout and "dense: compiled or loaded" in first.stdout
    code = ("import numpy as np, portable_nn as pnn; from kernels_cpu import _runtime\n"
            "x = np.ones((64, 1024)); w = np.ones((8, 1024))\n"
            "assert _runtime.parallel_threads() > 1\n"
            "with pnn.use_backend('numba'):\n"
            "    y, pb = pnn.vjp(pnn.log_softmax, x); pb(y)\n"
            "    y, pb = pnn.vjp(pnn.dense, x, w); pb(y)\n")
    second = _run("-c", code, env_extra=env, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "portable_nn: compiling" not in second.stderr


def test_compile_runs_a_program_s_own_runner_per_family():
    """A runner (the demo's: its models' own calls) replaces the samples, one call per op family."""
    from portable_nn import warmup

    seen = []

    def runner(ops, dtypes, backend):
        seen.append((list(ops), tuple(dtypes), backend))
        return [(op, 0.5, True) for op in ops]

    timings = warmup.compile_kernels(["layer_norm", "dense", "batch_norm"], ["float64"], "numba", quiet=True,
                                     runner=runner)
    assert seen == [(["layer_norm", "batch_norm"], ("float64",), "numba"), (["dense"], ("float64",), "numba")]
    assert timings == {"layer_norm": 0.5, "batch_norm": 0.5, "dense": 0.5}


def test_compile_builds_the_half_precision_kernels_it_is_asked_for(monkeypatch):
    """bfloat16 samples are ml_dtypes arrays, run on the kernels like any other dtype (they used to be
    skipped without a word); without ml_dtypes, the request is refused before any work."""
    from portable_nn import warmup

    for dtype in ("float16", "bfloat16"):
        args, _ = warmup.samples(dtype)["layer_norm"][0]
        assert all(a.dtype.name == dtype for a in args)
        _, ran = warmup._compile_op("layer_norm", [dtype], "numba")
        assert ran, dtype
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(ValueError, match="pip install ml-dtypes"):
        warmup.compile_kernels(["layer_norm"], ["float32", "bfloat16"], "numba", quiet=True)


def test_compile_refuses_a_bad_job_count():
    out = _run("-m", "portable_nn", "compile", "--ops", "log_softmax", "--jobs", "0")
    assert out.returncode == 2 and "jobs must be a positive int, got 0" in out.stderr


def test_compile_names_a_bad_op():
    out = _run("-m", "portable_nn", "compile", "--ops", "layer_nrom")
    assert out.returncode == 2 and "unknown op(s) layer_nrom" in out.stderr


_WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; "


def test_the_torch_adapter_without_torch_says_what_to_install():
    out = _run("-c", _WITHOUT_TORCH + "import portable_nn.torch")
    assert out.returncode != 0
    assert "ImportError: portable_nn.torch needs PyTorch: pip install 'portable_nn[torch]'" in out.stderr


def test_bench_without_torch_measures_portable_nn_alone():
    code = _WITHOUT_TORCH + ("from portable_nn.__main__ import main; "
                             "sys.exit(main(['bench', '--quick', '--ops', 'log_softmax']))")
    out = _run("-c", code, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "PyTorch is not installed: measuring portable_nn alone" in out.stderr
    assert "Traceback" not in out.stderr and "numba" in out.stdout
