"""Loading and launching the CUDA C kernels: RawModules cached per device, typed arguments.

Each op family has a source ``<family>.cu`` next to this file and a launcher module
``<family>.py`` that declares, with :func:`declare`, the kernel instantiations it launches
(C++ name expressions such as ``"norm_apply<float, float>"``).  :func:`source` pastes
``common.cuh`` in place of its ``#include`` so the text handed to NVRTC is self-contained (CuPy's
on-disk compile cache keys on the whole text, so a header change recompiles).  The same
source, options and name expressions are compiled for sm_80 and sm_90 by the CI tests
(:func:`compile_ptx`, NVRTC through ``cuda-bindings``, no GPU needed), which also check every
launch against the kernel's parameter list in the PTX.

Argument convention (matched by every kernel; checked against the PTX in the tests):
arrays and null pointers (:data:`NULL`) -> pointers, :func:`i64` -> ``long long``,
:func:`i32` -> ``int``, :func:`f64` -> ``double``.

Nothing here imports CuPy at import time; :func:`launch` does, on first use.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_INCLUDE = re.compile(r'^\s*#\s*include\s+"common\.cuh"\s*$', re.M)

#: Compiler options shared by the runtime and the CI compile test (CuPy adds the -arch option).
OPTIONS: tuple[str, ...] = ("-std=c++17",)

#: family -> name expressions of the kernel instantiations its launcher uses.
_declared: dict[str, tuple[str, ...]] = {}
_modules: dict[tuple[str, int], Any] = {}
_functions: dict[tuple[str, int, str], Any] = {}
_lock = threading.Lock()

#: A null pointer argument (an absent optional array).
NULL = np.uint64(0)


def i64(value: int) -> np.int64:
    """A ``long long`` kernel argument."""
    return np.int64(value)


def i32(value: int | bool) -> np.int32:
    """An ``int`` kernel argument (flags, activation codes)."""
    return np.int32(value)


def f64(value: float) -> np.float64:
    """A ``double`` kernel argument."""
    return np.float64(value)


def ptr(array: Any) -> Any:
    """An optional array as a pointer argument (:data:`NULL` when absent)."""
    return NULL if array is None else array


def declare(family: str, names: Sequence[str]) -> None:
    """Record the kernel instantiations the launcher of ``family`` uses (at its import)."""
    _declared[family] = tuple(dict.fromkeys(names))


def declared(family: str) -> tuple[str, ...]:
    """The name expressions declared for ``family``."""
    return _declared[family]


def source(family: str) -> str:
    """The self-contained CUDA C source of ``family`` (common.cuh pasted in)."""
    with open(os.path.join(_HERE, f"{family}.cu"), encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(_HERE, "common.cuh"), encoding="utf-8") as f:
        header = f.read().replace("#pragma once", "")
    return _INCLUDE.sub(lambda _: header, text, count=1)


def _module(family: str, device: int) -> Any:
    key = (family, device)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                import cupy

                mod = cupy.RawModule(code=source(family), options=OPTIONS, name_expressions=list(declared(family)))
                _modules[key] = mod
    return mod


def function(family: str, name: str) -> Any:
    """The compiled kernel ``name`` of ``family`` on the current device (compiled on first use)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (family, device, name)
    fn = _functions.get(key)
    if fn is None:
        if name not in declared(family):
            raise KeyError(f"kernel {name!r} is not declared for the CUDA C family {family!r}")
        fn = _functions[key] = _module(family, device).get_function(name)
    return fn


def _cupy_launch(family: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
                 shared: int) -> None:
    import cupy

    function(family, name)(grid, block, args, shared_mem=shared, stream=cupy.cuda.get_current_stream())


#: The launch backend; tests swap in a recorder to check launches without a GPU.
_launcher = _cupy_launch


def launch(family: str, name: str, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
           shared: int = 0) -> None:
    """Launch ``name`` on the current CuPy stream; a grid with a zero dimension launches nothing."""
    grid = tuple(int(g) for g in grid)
    block = tuple(int(b) for b in block)
    if min(grid) <= 0:
        return
    if grid[1:] and max(grid[1:]) > 65535:
        raise ValueError(f"{name}: grid {grid} exceeds 65535 blocks in y or z")
    _launcher(family, name, grid, block, tuple(args), int(shared))


def blocks(n: int, per: int) -> int:
    """Blocks of ``per`` threads covering ``n`` items."""
    return -(-int(n) // int(per))


def check_block(size: int, what: str) -> int:
    """``size`` if it is a power of two of at least 32 and at most 1024 (what the reductions need)."""
    size = int(size)
    if size < 32 or size > 1024 or size & (size - 1):
        raise ValueError(f"{what} must be a power of two between 32 and 1024, got {size}")
    return size


# --------------------------------------------------------------------------- dtypes


#: dtype name -> (C++ storage type, C++ accumulation type, accumulation NumPy dtype)
TYPES: dict[str, tuple[str, str, str]] = {
    "float32": ("float", "float", "float32"),
    "float64": ("double", "double", "float64"),
    "float16": ("pnn_half", "float", "float32"),
    "bfloat16": ("pnn_bf16", "float", "float32"),
}

#: (storage type, parameter type) pairs the launchers instantiate: same dtype, or float32
#: parameters for half data (mixed precision).
TYPE_PAIRS: tuple[tuple[str, str], ...] = (
    ("float", "float"),
    ("double", "double"),
    ("pnn_half", "pnn_half"),
    ("pnn_half", "float"),
    ("pnn_bf16", "pnn_bf16"),
    ("pnn_bf16", "float"),
)


def ctype(dtype: str) -> str:
    """The C++ storage type of a dtype name."""
    return TYPES[dtype][0]


#: Elements of each storage (C) type in a 16-byte vector (vec_width in common.cuh).
VECTOR_LANES = {"float": 4, "double": 2, "pnn_half": 8, "pnn_bf16": 8}


def vector_lanes(dtype: str) -> int:
    """Elements of ``dtype`` in one 16-byte vector load of the kernels."""
    return VECTOR_LANES[ctype(dtype)]


def whole_vectors(dtype: str, length: int, *arrays: Any) -> bool:
    """Whether runs of ``length`` elements of ``dtype`` are whole 16-byte vectors and every array
    (``None`` skipped) starts on a 16-byte boundary: what the kernels' vector paths need."""
    return length % vector_lanes(dtype) == 0 and aligned(*arrays)


def acc_dtype(dtype: str) -> str:
    """The NumPy/CuPy dtype name of the accumulation type of ``dtype``."""
    return TYPES[dtype][2]


# --------------------------------------------------------------------------- CI: compile without a GPU


def compile_ptx(family: str, arch: str, names: Sequence[str] | None = None) -> tuple[str, dict[str, str]]:
    """Compile ``family`` with NVRTC (cuda-bindings) for ``arch`` (``"sm_80"``): (PTX, {name: lowered}).

    Raises ``RuntimeError`` with the compile log on any error.
    """
    from cuda.bindings import nvrtc

    names = list(declared(family) if names is None else names)
    err, prog = nvrtc.nvrtcCreateProgram(source(family).encode(), f"{family}.cu".encode(), 0, [], [])
    _check_nvrtc(err, "create")
    try:
        for name in names:
            _check_nvrtc(nvrtc.nvrtcAddNameExpression(prog, name.encode())[0], f"name {name}")
        opts = [*(o.encode() for o in OPTIONS), f"--gpu-architecture={arch.replace('sm_', 'compute_')}".encode()]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed to compile {family}.cu for {arch}:\n{log.decode(errors='replace')}")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(prog, ptx)
        lowered = {}
        for name in names:
            err, low = nvrtc.nvrtcGetLoweredName(prog, name.encode())
            _check_nvrtc(err, f"lowered name of {name}")
            lowered[name] = low.decode()
        return ptx.decode(errors="replace").rstrip("\x00 "), lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _check_nvrtc(err: Any, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC error ({what}): {err}")


_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+(?:\.ptr\s+\S+\s+)?(?:\.align\s+\d+\s+)?[\w$]+")


def ptx_entries(ptx: str) -> dict[str, list[str]]:
    """Kernel entry name -> its parameters' PTX types (``u64``, ``u32``, ``f64`` …)."""
    return {m.group(1): _PARAM.findall(m.group(2)) for m in _ENTRY.finditer(ptx)}


# --------------------------------------------------------------------------- host helpers


def array_module(array: Any) -> Any:
    """CuPy for CuPy arrays, NumPy for NumPy arrays (the launch-recording tests run on NumPy)."""
    if type(array).__module__.split(".")[0] == "numpy":
        return np
    import cupy

    return cupy


def address(array: Any) -> int:
    """The device (CuPy) or host (NumPy, the emulator's) address of an array's first element."""
    data = getattr(array, "data", None)
    pointer = getattr(data, "ptr", None)
    return int(pointer) if pointer is not None else int(array.ctypes.data)


def aligned(*arrays: Any, to: int = 16) -> bool:
    """Whether every given array (None skipped) starts on a ``to``-byte boundary (vector loads)."""
    return all(a is None or address(a) % to == 0 for a in arrays)


_max_threads: dict[tuple[str, int, str], int] = {}


def max_threads(family: str, name: str) -> int:
    """The most threads a block of kernel ``name`` may have on the current device (its registers
    decide: the float64 rows backward cannot take 1024, seen on an H200); 1024 without a device.
    Asked of the driver once per kernel and device."""
    cupy = sys.modules.get("cupy")  # arrays on a device mean CuPy is imported; no import attempt per call
    if _launcher is not _cupy_launch or cupy is None:  # the emulator, the launch recorder, no CuPy
        return 1024
    try:
        key = (family, cupy.cuda.runtime.getDevice(), name)
        if key not in _max_threads:
            _max_threads[key] = int(function(family, name).max_threads_per_block)
        return _max_threads[key]
    except Exception:  # no CuPy or no device: the launch-planning tests
        return 1024


def multiprocessors() -> int:
    """Multiprocessors of the current CuPy device (132 when there is none: the emulator, the recorder)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:  # no CuPy imported: the launch-planning tests
        return 132
    try:
        return _multiprocessors(cupy.cuda.runtime.getDevice())
    except Exception:  # no device
        return 132


@functools.cache
def _multiprocessors(device: int) -> int:
    # once per device: Device.attributes asks the driver for every attribute it has
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


def bf16_bits_to_float(xp: Any, bits: Any) -> Any:
    """bfloat16 values stored as ``uint16`` bits, as float32."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def float_to_bf16_bits(xp: Any, values: Any) -> Any:
    """float32 values rounded to nearest even bfloat16, as ``uint16`` bits (NaN stays NaN)."""
    u = xp.ascontiguousarray(values, dtype=xp.float32).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, (u >> 16) | xp.uint32(0x40), rounded).astype(xp.uint16)


def into(out: Any, name: str, value: Any) -> Any:
    """``value`` as the gradient ``name``: copied into the caller's ``out`` buffer when one is given."""
    buffer = out.get(name)
    if buffer is None or buffer is value:
        return value
    buffer[...] = value
    return buffer


# --------------------------------------------------------------------------- CI: kernel signatures


_GLOBAL = re.compile(r"(template\s*<([^>]*)>\s*)?__global__\s+void\s+(\w+)\s*\(")


def _split_top(text: str) -> list[str]:
    """Split at commas outside <> and ()."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def kernel_signatures(family: str) -> dict[str, tuple[list[str], list[str]]]:
    """Kernel name -> (template parameter names, parameter type texts) parsed from ``<family>.cu``."""
    text = source(family)
    sigs = {}
    for m in _GLOBAL.finditer(text):
        tparams = [p.split()[-1] for p in _split_top(m.group(2) or "")]
        depth, k = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            k += 1
        params = [" ".join(p.split()[:-1]) if not p.endswith("*") else p for p in _split_top(text[m.end():k - 1])]
        sigs[m.group(3)] = (tparams, params)
    return sigs


def split_name(expression: str) -> tuple[str, list[str]]:
    """``"k<float, pnn_half>"`` -> ``("k", ["float", "pnn_half"])``."""
    name, _, rest = expression.partition("<")
    return name.strip(), _split_top(rest.rsplit(">", 1)[0]) if rest else []
