"""Command line: ``python -m portable_nn info | bench | demo``.

``info`` reports versions, which backends run on this machine (and why the
others do not), Numba's threading layer, the kernel cache directory and the
capability table.  ``demo`` is the main job (training on real data with
portable_nn ops only); until it lands it prints what it will do.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from . import __version__, dispatch

_PACKAGES = ("numpy", "scipy", "array-api-compat", "numba", "llvmlite", "torch", "cupy", "jax", "array-api-strict")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _threading_layer() -> str:
    """Numba's configured threading layer, without starting its thread pool."""
    if _version("numba") == "not installed":
        return "n/a (numba not installed)"
    from numba.core import config as numba_config

    from kernels_cpu import _runtime

    return f"{_runtime.describe()}, {numba_config.NUMBA_NUM_THREADS} threads"


def _cache_dir() -> str:
    """Where Numba caches compiled kernels (NUMBA_CACHE_DIR, else next to kernels_cpu)."""
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        return f"{env} (NUMBA_CACHE_DIR)"
    import kernels_cpu

    path = Path(kernels_cpu.__file__).parent / "__pycache__"
    writable = os.access(path if path.exists() else path.parent, os.W_OK)
    return f"{path} ({'writable' if writable else 'NOT writable: set NUMBA_CACHE_DIR'})"


def info() -> str:
    """The text of ``python -m portable_nn info``."""
    lines = [f"portable_nn {__version__}", f"python {platform.python_version()} on {platform.platform()}", ""]
    lines.append("packages:")
    lines += [f"  {name:18s} {_version(name)}" for name in _PACKAGES]
    lines += ["", "backends:"]
    for name, status in dispatch.available_backends().items():
        mark = "available" if status else "unavailable"
        lines.append(f"  {name:12s} {mark:12s} {status.reason}")
    lines += ["", f"numba threading layer: {_threading_layer()}", f"kernel cache: {_cache_dir()}", ""]
    lines.append("capabilities (op x backend, from the kernels' declarations):")
    lines += ["  " + line for line in dispatch.format_capabilities().splitlines()]
    return "\n".join(lines)


def demo() -> int:
    """The main job; prints its plan until the demo lands (issue 6)."""
    print(
        "portable_nn demo: not built yet.\n"
        "When it lands it will train a small network (convolution, normalisation and an LSTM\n"
        "classifier) on a real dataset using portable_nn ops and pnn.vjp only, print the loss\n"
        "curve and test accuracy per epoch, and report which backend ran each op.\n"
        "Meanwhile `python -m portable_nn info` shows the backends and capabilities on this machine."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_nn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, available backends, threading layer, cache, capabilities")
    sub.add_parser("demo", help="the main job: train on real data with portable_nn ops")
    bench = sub.add_parser("bench", help="benchmark every backend against PyTorch (fwd, bwd, fwd+bwd)")
    bench.add_argument("--ops", help="comma-separated ops or workload names (default: all)")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repeats (a smoke test)")
    bench.add_argument("--no-cold", action="store_true",
                       help="skip the cold-compile measurement (tens of seconds per op, empty cache)")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="also draw the ratios to PyTorch (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
        return 0
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(args)
    return demo()


if __name__ == "__main__":
    sys.exit(main())
