"""The benchmark's environments and the machine description printed at the top of its report.

Three environments, each derived from the process's own:

* :func:`user_environment` — what a user's process gets: the process environment less the
  tuning variables a benchmark might carry over (:data:`TUNING_VARIABLES`, every ``MALLOC_*``);
  nothing is added.  Thread counts are picked by the workers' own calls
  (``torch.set_num_threads``, ``portable_nn.set_num_threads``), not by variables.
* :func:`tuned_environment` — the process environment plus :data:`TUNED_SETTINGS`
  (the ``--tuned`` mode: ``OPENBLAS_THREAD_TIMEOUT`` against spinning BLAS workers, glibc
  ``MALLOC_*`` against page faults on every large output).
* either one with :data:`ISA_SETTINGS` for ``--isa avx2``: the AVX2 code paths forced in
  Numba, OpenBLAS, ATen and oneDNN alike.

:func:`describe_machine` collects the header: CPU model and vector ISA, CPU count,
OpenBLAS's core type (NumPy's), library versions and every variable that changes how the
contenders run, as the process that calls it sees them.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import Any

from .. import __version__
from ..about import package_version as _version

__all__ = [
    "ISA_SETTINGS",
    "REPORTED_PREFIXES",
    "TUNED_SETTINGS",
    "TUNING_VARIABLES",
    "describe_machine",
    "reported_variables",
    "tuned_environment",
    "user_environment",
]

#: Removed from the user environment (with every ``MALLOC_*`` variable): each one changes how a
#: library behaves, and a user's shell normally has none of them.
TUNING_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_THREAD_TIMEOUT", "OMP_WAIT_POLICY")

#: What ``--tuned`` adds: no spinning OpenBLAS workers, no page faults on large outputs.
TUNED_SETTINGS = {
    "OPENBLAS_THREAD_TIMEOUT": "4",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
}

#: ``--isa NAME``: the only variables it adds, forcing one ISA's code paths on every side.
ISA_SETTINGS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {
        "NUMBA_CPU_NAME": "haswell",  # Numba compiles (and caches) its kernels for this CPU name
        "OPENBLAS_CORETYPE": "Haswell",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}

#: Variables the report lists (by prefix, or exact name).
REPORTED_PREFIXES = ("OPENBLAS_", "MALLOC_", "OMP_", "NUMBA_", "MKL_", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _is_tuning(name: str) -> bool:
    return name in TUNING_VARIABLES or name.startswith("MALLOC_")


def user_environment(base: Mapping[str, str] | None = None, isa: str = "native") -> dict[str, str]:
    """``base`` (default ``os.environ``) less the tuning variables, plus the ``isa`` settings."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not _is_tuning(k)}
    return {**env, **ISA_SETTINGS[isa]}


def tuned_environment(base: Mapping[str, str] | None = None, isa: str = "native") -> dict[str, str]:
    """``base`` (default ``os.environ``) with :data:`TUNED_SETTINGS` and the ``isa`` settings."""
    return {**(os.environ if base is None else base), **TUNED_SETTINGS, **ISA_SETTINGS[isa]}


def reported_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``env`` (default ``os.environ``) that change how the contenders run, sorted."""
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env) if k.startswith(REPORTED_PREFIXES)}


# --------------------------------------------------------------------------- the machine


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def vector_isa(flags: set[str]) -> tuple[str, list[str]]:
    """The widest x86 vector ISA in ``flags`` and the matrix/bf16 extensions present.

    ``("AVX-512", ["avx512_bf16", "amx_tile"])``, ``("AVX2", [])`` … or, with no x86 flags
    (another architecture), the machine name and nothing.
    """
    extras = sorted(f for f in flags if f == "avx512_bf16" or f.startswith("amx"))
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2")):
        if flag in flags:
            return name, extras
    return platform.machine() or "unknown", extras


def openblas_coretype() -> str:
    """The core type NumPy's OpenBLAS runs its kernels for (``SkylakeX``, ``Haswell`` …), per threadpoolctl."""
    try:
        import numpy  # noqa: F401  (loads the BLAS threadpoolctl looks for)
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl not installed)"
    entries = [e for e in threadpool_info() if e.get("internal_api") == "openblas"]
    numpy_own = [e for e in entries if "numpy" in e.get("filepath", "")] or entries
    if not numpy_own:
        return "none (NumPy is not linked to OpenBLAS)"
    return str(numpy_own[0].get("architecture") or "unknown")




def describe_machine() -> dict[str, Any]:
    """The report's header, as this process sees it: CPU, ISA, OpenBLAS core type, versions, variables."""
    model, flags = _cpuinfo()
    isa, extras = vector_isa(flags)
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "isa": isa,
        "isa_extensions": extras,
        "cpus": os.cpu_count(),
        "openblas_coretype": openblas_coretype(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "torch": _version("torch"),
        "portable_nn": __version__,
        "env": reported_variables(),
    }
