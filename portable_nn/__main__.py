"""Command line: ``python -m portable_nn info | demo | compile | bench | gpu-check | wheels``.

``info`` reports versions, which backends run on this machine (and why the
others do not), Numba's threading layer, the kernel cache directory and the
capability table.  ``demo`` is the main job: training on real data with
portable_nn ops and ``pnn.vjp`` only (:mod:`portable_nn.examples`).  ``compile``
fills the kernel cache ahead of time (:mod:`portable_nn.warmup`).  ``bench``
measures every backend against PyTorch on the CPU; ``gpu-check`` runs the GPU
tests and the GPU benchmark on a CUDA machine (:mod:`portable_nn.gpu_check`);
``wheels`` fetches the pure-Python dependencies for a machine without network.
"""

from __future__ import annotations

import argparse
import os
import sys

from .about import report

#: Pure-Python dependencies an offline GPU machine may lack (its image has numpy, numba, torch, cupy).
OFFLINE_WHEELS = ("array-api-compat>=1.9", "array-api-strict>=2.0")


def download_wheels(dest: str, python_version: str = "3.12") -> int:
    """``pip download`` :data:`OFFLINE_WHEELS` into ``dest`` for an offline machine.

    There: ``pip install --no-index --find-links DEST array-api-compat array-api-strict``,
    then ``pip install --no-deps --no-build-isolation -e .`` in the checkout.
    """
    import subprocess

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "-d", dest, *OFFLINE_WHEELS]
    code = subprocess.call(cmd)
    if code == 0:
        print(f"on the offline machine: pip install --no-index --find-links {dest} "
              + " ".join(w.split(">")[0] for w in OFFLINE_WHEELS))
    return code


def _compile(args: argparse.Namespace) -> int:
    """``compile``: every selected op's kernels, forward and backward, per dtype (see :mod:`portable_nn.warmup`)."""
    import time

    from .about import kernel_cache_dir
    from .warmup import compile_kernels

    ops = [op.strip() for op in args.ops.split(",") if op.strip()] if args.ops else None
    start = time.perf_counter()
    try:
        compile_kernels(ops, [d.strip() for d in args.dtypes.split(",") if d.strip()], args.backend,
                        jobs=args.jobs if args.jobs is not None else (os.cpu_count() or 1))
    except ValueError as exc:
        print(f"python -m portable_nn compile: {exc}", file=sys.stderr)
        return 2
    print(f"kernels ready in {time.perf_counter() - start:.1f} s; cache: {kernel_cache_dir()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.splitlines()[0].replace("``", "")  # without its reStructuredText markup
    parser = argparse.ArgumentParser(prog="python -m portable_nn", description=summary)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, available backends, threading layer, cache, capabilities")
    demo = sub.add_parser("demo", help="the main job: train a CNN and an LSTM on real data with portable_nn ops")
    from .examples import add_demo_arguments

    add_demo_arguments(demo)
    compile_ = sub.add_parser("compile", help="compile the kernels ahead of time into the on-disk cache (for Docker "
                              "images and CI); a process's first call of an op then loads instead of compiling")
    compile_.add_argument("--ops", help="comma-separated op names (default: every op)")
    compile_.add_argument("--dtypes", default="float32,float64",
                          help="comma-separated dtypes: float32, float64, float16, bfloat16 (default: "
                               "float32,float64)")
    compile_.add_argument("--backend", default="numba", help="the kernel backend to compile (default: numba)")
    compile_.add_argument("--jobs", type=int, default=None,
                          help="processes compiling at once, one op family each (default: the number of CPUs)")
    bench = sub.add_parser("bench", help="benchmark every backend against PyTorch (fwd, bwd, fwd+bwd)",
                           description="By default each contender runs each workload in its own fresh process "
                           "with the user's environment (tuning variables removed), alternated over rounds; "
                           "then PyTorch and portable_nn together in one process (the mixed section).")
    bench.add_argument("--ops", help="comma-separated op names or workload-name substrings (default: all)")
    mode = bench.add_mutually_exclusive_group()
    mode.add_argument("--tuned", action="store_true",
                      help="one process with tuning variables (OPENBLAS_THREAD_TIMEOUT, MALLOC_*), contenders "
                      "interleaved: what the kernels can do, not what users get")
    mode.add_argument("--quick", action="store_true",
                      help="a one-process smoke test: small shapes, few short repeats (CI)")
    bench.add_argument("--rounds", type=int, metavar="N", help="user mode: processes per contender, alternated "
                       "(default 3)")
    bench.add_argument("--repeats", type=int, metavar="N", help="timed bursts per phase (default: 7 per process "
                       "in the user mode, 15 tuned, 3 quick)")
    bench.add_argument("--isa", metavar="NAME[,NAME]",
                       help="native (default) or avx2: force the AVX2 code paths in Numba, OpenBLAS, ATen and "
                       "oneDNN; 'native,avx2' measures both (user mode)")
    bench.add_argument("--with-reference", action="store_true",
                       help="also time the reference backend (slow; not what users compare)")
    bench.add_argument("--mixed", action="store_true",
                       help="only the mixed section: PyTorch and portable_nn in one process (--ops filters cases)")
    bench.add_argument("--no-mixed", action="store_true", help="leave the mixed section out of a full user run")
    bench.add_argument("--no-cold", action="store_true",
                       help="skip the cold-compile measurement (tens of seconds per op, empty cache)")
    bench.add_argument("--models", nargs="?", const="all", metavar="NAMES",
                       help="instead: real models' training steps (torchvision, timm, transformers, an LSTM LM) "
                       "with our layers swapped in, against the unmodified models; NAMES: comma-separated "
                       "substrings of the models' names (default: all)")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="also draw the ratios to PyTorch (needs matplotlib)")
    check = sub.add_parser("gpu-check", help="on a CUDA machine: GPU tests, benchmark vs PyTorch CUDA, a report")
    from .gpu_check import add_arguments as add_gpu_check_arguments

    add_gpu_check_arguments(check)
    wheels = sub.add_parser("wheels", help="download the pure-Python dependencies as wheels (for an offline machine)")
    wheels.add_argument("dest", help="directory to download into")
    wheels.add_argument("--python-version", default="3.12", help="target Python version (default: 3.12)")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(report())
        return 0
    if args.command == "compile":
        return _compile(args)
    if args.command == "bench":
        if args.models is not None:
            from .bench.real_models import main as models_main

            return models_main(args)
        from .bench import main as bench_main

        return bench_main(args)
    if args.command == "gpu-check":
        from .gpu_check import main as gpu_check_main

        return gpu_check_main(args)
    if args.command == "wheels":
        return download_wheels(args.dest, args.python_version)
    from .examples import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
