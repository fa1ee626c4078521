"""What this installation is: versions, backends, threading, the kernel cache (``python -m portable_nn info``).

The command line, the demo's report, ``gpu-check`` and the benchmark headers all describe the
installation with these functions; nothing imports them from ``__main__``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

from . import __version__, dispatch
from .introspection import format_capabilities

#: The distributions ``info`` lists.
PACKAGES = ("numpy", "scipy", "array-api-compat", "numba", "llvmlite", "torch", "cupy", "jax", "array-api-strict")


def package_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def threading_layer() -> str:
    """Numba's configured threading layer, without starting its thread pool."""
    if package_version("numba") == "not installed":
        return "n/a (numba not installed)"
    from numba.core import config as numba_config

    from kernels_cpu import _runtime

    from .threads import get_num_threads

    return (f"{_runtime.describe()}; Numba's pool {numba_config.NUMBA_NUM_THREADS} threads, "
            f"portable_nn uses {get_num_threads()} (pnn.set_num_threads)")


def kernel_cache_dir() -> str:
    """Where Numba caches compiled kernels (NUMBA_CACHE_DIR, else next to kernels_cpu)."""
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        return f"{env} (NUMBA_CACHE_DIR)"
    import kernels_cpu

    path = Path(kernels_cpu.__file__).parent / "__pycache__"
    writable = os.access(path if path.exists() else path.parent, os.W_OK)
    return f"{path} ({'writable' if writable else 'NOT writable: set NUMBA_CACHE_DIR'})"


def report() -> str:
    """The text of ``python -m portable_nn info``: versions, backends (and why any is unavailable),
    Numba's threading layer, the kernel cache and the capability table."""
    lines = [f"portable_nn {__version__}", f"python {platform.python_version()} on {platform.platform()}", ""]
    lines.append("packages:")
    lines += [f"  {name:18s} {package_version(name)}" for name in PACKAGES]
    lines += ["", "backends:"]
    for name, status in dispatch.available_backends().items():
        mark = "available" if status else "unavailable"
        lines.append(f"  {name:12s} {mark:12s} {status.reason}")
    lines += ["", f"numba threading layer: {threading_layer()}", f"kernel cache: {kernel_cache_dir()}", ""]
    lines.append("capabilities (op x backend, from the kernels' declarations):")
    lines += ["  " + line for line in format_capabilities().splitlines()]
    return "\n".join(lines)
