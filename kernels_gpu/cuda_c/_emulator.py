"""Run the CUDA C kernels on the CPU (tests without a GPU): ``emulator.h`` + g++ + ctypes.

:func:`build` compiles a family's exact source (``_runtime.source``) as C++ with ``PNN_EMULATE``
defined and one ``extern "C"`` entry per declared instantiation; :func:`launcher` returns a
drop-in for ``_runtime._launcher`` that runs launches on NumPy arrays.  With it installed, the
launchers' whole forward/backward paths (host planning, every kernel, the merging passes) run on
NumPy and can be compared with the reference.  Blocks run sequentially and threads as
cooperative fibers, so this checks the kernels' arithmetic, indexing and barrier structure, not
their speed or memory-model races.  Needs a C++17 compiler (``g++``); nothing imports this
module outside the tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import numpy as np

from . import _runtime as rt

_HERE = os.path.dirname(os.path.abspath(__file__))
_libs: dict[str, tuple[ctypes.CDLL, dict[str, str]]] = {}
_lock = threading.Lock()


def compiler() -> str | None:
    """The C++ compiler used, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _substitute(ptype: str, binding: dict[str, str]) -> str:
    for name, value in binding.items():
        ptype = re.sub(rf"\b{name}\b", value, ptype)
    return ptype


def _wrappers(family: str) -> tuple[str, dict[str, str]]:
    """C++ entry points, one per declared instantiation: ``pnn_launch_<k>(grid, block, shared, args)``."""
    sigs = rt.kernel_signatures(family)
    lines, symbols = [], {}
    for k, name in enumerate(rt.declared(family)):
        base, targs = rt.split_name(name)
        tparams, ptypes = sigs[base]
        binding = dict(zip(tparams, targs))
        unpack = ", ".join(
            f"*reinterpret_cast<{_substitute(p, binding)}*>(args[{i}])" for i, p in enumerate(ptypes)
        )
        symbol = f"pnn_launch_{k}"
        symbols[name] = symbol
        lines.append(
            f'extern "C" int {symbol}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
            f"unsigned bz, unsigned shared, void** args, char* err, int err_len) {{\n"
            f"  try {{ pnn_emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, shared, [&] {{ {name}({unpack}); }}); "
            f"return 0; }}\n"
            f"  catch (const std::exception& e) {{ std::snprintf(err, err_len, \"%s\", e.what()); return 1; }}\n}}"
        )
    return "\n".join(lines), symbols


def build(family: str) -> tuple[ctypes.CDLL, dict[str, str]]:
    """The compiled emulation library of ``family`` and its entry symbols (cached by source hash)."""
    with _lock:
        if family in _libs:
            return _libs[family]
        wrappers, symbols = _wrappers(family)
        text = "#define PNN_EMULATE 1\n#include \"emulator.h\"\n" + rt.source(family) + "\n" + wrappers + "\n"
        with open(os.path.join(_HERE, "emulator.h"), encoding="utf-8") as f:
            digest = hashlib.sha256((text + f.read()).encode()).hexdigest()[:16]
        cache = os.path.join(tempfile.gettempdir(), "pnn_cuda_c_emulator")
        os.makedirs(cache, exist_ok=True)
        lib_path = os.path.join(cache, f"{family}_{digest}.so")
        if not os.path.exists(lib_path):
            # Source and library under this process's own names until the final rename: test workers
            # building the same family at once rewrote one shared .cpp under each other's compiler.
            src = os.path.join(cache, f"{family}_{digest}.{os.getpid()}.cpp")
            with open(src, "w", encoding="utf-8") as f:
                f.write(text)
            tmp = f"{lib_path}.{os.getpid()}.tmp"
            cmd = [compiler() or "g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w", f"-I{_HERE}", src, "-o", tmp]
            res = subprocess.run(cmd, capture_output=True, text=True)
            os.remove(src)
            if res.returncode != 0:
                raise RuntimeError(f"emulator build of {family} failed:\n{res.stderr[-6000:]}")
            os.replace(tmp, lib_path)
        lib = ctypes.CDLL(lib_path)
        _libs[family] = (lib, symbols)
        return lib, symbols


_SCALAR_CTYPES = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.float64: ctypes.c_double,
                  np.float32: ctypes.c_float, np.uint64: ctypes.c_void_p}


def _pack(args: tuple) -> tuple[Any, list]:
    """A ``void*[]`` pointing at each argument's value (arrays: their data pointer)."""
    keep = []
    for a in args:
        if isinstance(a, np.generic):
            keep.append(_SCALAR_CTYPES[type(a)](a.item() if not isinstance(a, np.uint64) else int(a) or None))
        elif isinstance(a, np.ndarray):
            keep.append(ctypes.c_void_p(a.ctypes.data if a.size else None))
        else:
            raise TypeError(f"cannot pass {type(a).__name__} to an emulated kernel")
    array = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in keep])
    return array, keep


def emulated_launch(family: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
                    shared: int) -> None:
    """Run one launch on NumPy arrays (the signature of ``_runtime._launcher``)."""
    lib, symbols = build(family)
    fn = getattr(lib, symbols[name])
    fn.restype = ctypes.c_int
    g = (*grid, 1, 1)[:3]
    b = (*block, 1, 1)[:3]
    array, keep = _pack(args)
    err = ctypes.create_string_buffer(256)
    status = fn(*(ctypes.c_uint(v) for v in (*g, *b, shared)), array, err, ctypes.c_int(256))
    del keep
    if status:
        raise RuntimeError(f"{name}: {err.value.decode()}")
