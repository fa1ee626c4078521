"""Shared machinery of the Numba-CUDA kernels: array module, launches, dtypes, settings.

The same host launchers run on a GPU (CuPy arrays, kernels compiled by numba-cuda) and in
Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``: NumPy arrays, kernels interpreted), so the
whole forward/backward path — launcher, kernels and matrix products — is testable without a GPU.
Everything array-library specific goes through :func:`array_module`, :func:`kernel_array` and
:func:`launch`.

Data types.  Kernels read and write the data's own dtype and compute in a *compute type*:
float32 for float16, bfloat16 and float32 data, float64 for float64 data; sums accumulate in
float64.  bfloat16 arrays reach the kernels as their ``uint16`` bit patterns (Numba has no
bfloat16 array type) and :func:`load`/:func:`store` convert; on the device this uses the
``cuda.bf16`` intrinsics, in the simulator the same conversion with NumPy.

Every kernel is declared with :func:`kernel`, which records its signatures per dtype variant so
the tests compile each one to PTX for sm_80 and sm_90 (``KERNELS``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numba import config as _numba_config
from numba import cuda

from portable_nn.kernel_cache import announce_compiles, drop_stale_cache

#: True under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).
SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)


def _load_numpy_support() -> None:
    """Import numba-cuda's NumPy overloads, also under NumPy >= 2.5.

    numba-cuda 0.30.4 (the newest release) registers an overload for ``np.row_stack``, which
    NumPy 2.5 removed, so its first compile fails with ``AttributeError`` (seen on the GPU machine:
    every numba_cuda launch failed under NumPy 2.5.2).  A stand-in function lets that module
    import; it is removed again at once, so user code never sees a ``row_stack`` NumPy lacks.
    """
    if SIMULATOR or hasattr(np, "row_stack"):
        return

    def row_stack(tup: Any) -> Any:  # only a registration key: no kernel can name it
        return np.vstack(tup)

    np.row_stack = row_stack
    try:
        import numba.cuda.np.arrayobj  # noqa: F401
    finally:
        del np.row_stack


_load_numpy_support()

#: dtype name -> (kernel element type name, compute type name) for the signatures.
VARIANTS = {
    "bfloat16": ("uint16", "float32"),
    "float16": ("float16", "float32"),
    "float32": ("float32", "float32"),
    "float64": ("float64", "float64"),
}


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Launch parameters; tests shrink them so multi-block and second-pass paths run on tiny inputs.

    Attributes:
        block: threads per block of 1-D kernels and row reductions (a power of two <= 1024).
        tile_x, tile_y: the 2-D block of column reductions (tile_x consecutive columns, tile_y
            row lanes); tile_x * tile_y <= 1024, tile_y a power of two.
        target_blocks: about how many blocks a reduction should have to fill the device; groups
            are split into chunks (with a second pass over the partial sums) until there are.
        row_max: a statistics group of at most this many elements is reduced by one block.
        min_chunk: the fewest elements (rows, in column reductions) one partial sum covers.
        column_below: groups whose contiguous runs are shorter than this are reduced by columns.
    """

    block: int = 256
    tile_x: int = 32
    tile_y: int = 8
    target_blocks: int = 264
    row_max: int = 16384
    min_chunk: int = 4096
    column_below: int = 32


_settings = Settings()
_settings_lock = threading.Lock()


def settings() -> Settings:
    """The launch parameters in force."""
    return _settings


@contextmanager
def use_settings(**changes: int) -> Iterator[Settings]:
    """Temporarily change launch parameters (tests force small blocks and many chunks)."""
    global _settings
    with _settings_lock:
        old = _settings
        _settings = replace(old, **changes)
    try:
        yield _settings
    finally:
        with _settings_lock:
            _settings = old


# --------------------------------------------------------------------------- kernel registry


@dataclass(frozen=True)
class KernelSpec:
    """A kernel's Python function and the signature of each dtype variant (for the PTX tests)."""

    name: str
    py_func: Callable[..., Any]
    signatures: tuple[str, ...]


#: Every kernel declared with :func:`kernel`, in declaration order.
KERNELS: list[KernelSpec] = []

_DEVICE_OPTIONS: dict[str, Any] = {} if SIMULATOR else {"forceinline": True}
_KERNEL_OPTIONS: dict[str, Any] = {} if SIMULATOR else {"cache": True}
if not SIMULATOR:  # kernels inline device functions from sibling modules: see kernels_cpu._runtime
    drop_stale_cache(__file__)
    announce_compiles()


def kernel(signature: str, dtypes: tuple[str, ...] = tuple(VARIANTS)) -> Callable[[Callable], Any]:
    """Declare a CUDA kernel.

    ``signature`` is a Numba signature with ``{x}`` for the data's element type and ``{c}`` for
    the compute type; one concrete signature per dtype in ``dtypes`` is recorded.  The kernel is
    compiled lazily for the argument types of each launch (with Numba's on-disk cache).
    """

    def wrap(fn: Callable) -> Any:
        sigs = tuple(signature.format(x=VARIANTS[d][0], c=VARIANTS[d][1]) for d in dtypes)
        KERNELS.append(KernelSpec(f"{fn.__module__}.{fn.__name__}", fn, tuple(dict.fromkeys(sigs))))
        return tolerant_cache(cuda.jit(**_KERNEL_OPTIONS)(fn))

    return wrap


def tolerant_cache(dispatcher: Any) -> Any:
    """Let ``dispatcher`` run the kernels its on-disk cache cannot hold.

    numba-cuda 0.30.4 cannot pickle a kernel that links external code — the bfloat16 variants,
    whose ``cuda.bf16`` conversions link NVIDIA's bf16 header code — and raises from the compile
    that would have saved it (``RuntimeError: Cannot pickle CUDACodeLibrary with linking files``),
    so every bfloat16 launch failed on the GPU machine.  Such a kernel is compiled once per process
    instead; any other error still propagates.
    """
    cache = getattr(dispatcher, "_cache", None)
    save = getattr(cache, "save_overload", None)
    if save is None:
        return dispatcher

    def save_overload(sig: Any, data: Any) -> None:
        try:
            save(sig, data)
        except RuntimeError as exc:
            if "linking files" not in str(exc):
                raise

    cache.save_overload = save_overload
    return dispatcher


def device(fn: Callable) -> Any:
    """Declare a device function (inlined into its callers on the GPU)."""
    return cuda.jit(device=True, **_DEVICE_OPTIONS)(fn)


# --------------------------------------------------------------------------- element access


def load(a, i):  # pragma: no cover - replaced below
    """``a[i]`` in the compute type (float32 for half precision, bfloat16 bits decoded)."""
    raise NotImplementedError


def store(a, i, v):  # pragma: no cover - replaced below
    """``a[i] = v`` rounded to ``a``'s dtype (bfloat16 bits encoded, round to nearest even)."""
    raise NotImplementedError


def compute_cast(a, v):  # pragma: no cover - replaced below
    """``v`` in the dtype of the compute-type array ``a`` (float32 or float64)."""
    raise NotImplementedError


def cast_as(like, v):  # pragma: no cover - replaced below
    """``v`` in the type of the scalar ``like`` (constants of float32 or float64 precision)."""
    raise NotImplementedError


if SIMULATOR:

    def _sim_bf16_to_f32(bits):
        return np.array([np.uint32(bits) << np.uint32(16)], np.uint32).view(np.float32)[0]

    def _sim_f32_to_bf16(v):
        u = int(np.array([v], np.float32).view(np.uint32)[0])
        if (u & 0x7F800000) == 0x7F800000 and (u & 0x7FFFFF):
            return np.uint16((u >> 16) | 0x40)  # quiet NaN
        rounding = 0x7FFF + ((u >> 16) & 1)
        return np.uint16(((u + rounding) >> 16) & 0xFFFF)

    def load(a, i):
        if a.dtype == np.uint16:
            return _sim_bf16_to_f32(a[i])
        if a.dtype == np.float16:
            return np.float32(a[i])
        return a[i]

    def store(a, i, v):
        if a.dtype == np.uint16:
            a[i] = _sim_f32_to_bf16(v)
        else:
            a[i] = v

    def compute_cast(a, v):
        return a.dtype.type(v)

    def cast_as(like, v):
        return type(like)(v)

else:
    from numba import float32 as _f32
    from numba.cuda import bf16 as _bf16
    from numba.cuda import types as _types
    from numba.cuda.extending import overload as _overload

    @_overload(load, target="cuda")
    def _load_impl(a, i):
        if a.dtype == _types.uint16:
            return lambda a, i: _bf16.bfloat16_to_float32(_bf16.ushort_as_bfloat16(a[i]))
        if a.dtype == _types.float16:
            return lambda a, i: _f32(a[i])
        return lambda a, i: a[i]

    @_overload(store, target="cuda")
    def _store_impl(a, i, v):
        if a.dtype == _types.uint16:

            def store_bf16(a, i, v):
                a[i] = _bf16.bfloat16_as_ushort(_bf16.float32_to_bfloat16(_f32(v)))

            return store_bf16
        if a.dtype in (_types.float16, _types.float32):

            def store_narrow(a, i, v):
                a[i] = _f32(v)

            return store_narrow

        def store_plain(a, i, v):
            a[i] = v

        return store_plain

    @_overload(compute_cast, target="cuda")
    def _compute_cast_impl(a, v):
        if a.dtype == _types.float32:
            return lambda a, v: _f32(v)
        return lambda a, v: _types.float64(v)

    @_overload(cast_as, target="cuda")
    def _cast_as_impl(like, v):
        if like == _types.float32:
            return lambda like, v: _f32(v)
        return lambda like, v: _types.float64(v)


# --------------------------------------------------------------------------- arrays and launches


def array_module(a: Any) -> Any:
    """CuPy for CuPy arrays, NumPy otherwise (the simulator's arrays)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def dtype_name(a: Any) -> str:
    """The array's dtype name (``"bfloat16"`` for ml_dtypes/CuPy bfloat16)."""
    return str(a.dtype)


def compute_dtype(name: str) -> Any:
    """NumPy dtype of the compute type for data of dtype ``name``."""
    return np.dtype(VARIANTS[name][1])


def kernel_array(a: Any) -> Any:
    """``a`` as a kernel argument: bfloat16 as its uint16 bits, a device view on the GPU.

    CuPy arrays become Numba device arrays without synchronising: numba would otherwise
    synchronise on the stream the ``__cuda_array_interface__`` names, stalling every launch.
    """
    if dtype_name(a) == "bfloat16":
        a = a.view(array_module(a).uint16)
    if SIMULATOR or isinstance(a, np.ndarray):
        return a
    return cuda.as_cuda_array(a, sync=False)


def _stream() -> Any:
    if SIMULATOR:
        return 0
    import cupy

    ptr = cupy.cuda.get_current_stream().ptr
    # CuPy's null stream (ptr 0) is the legacy default stream, which is Numba's default stream too.
    return cuda.external_stream(ptr) if ptr else cuda.default_stream()


def launch(kern: Any, grid: int | tuple[int, ...], block: int | tuple[int, ...], *args: Any) -> None:
    """Launch ``kern`` on CuPy's current stream (no launch for an empty grid).

    Array arguments go through :func:`kernel_array`; scalars are passed as they are (give
    float scalars the compute type with :func:`scalar` so activations stay in float32).
    """
    dims = grid if isinstance(grid, tuple) else (grid,)
    if any(int(d) <= 0 for d in dims):
        return
    converted = [kernel_array(v) if isinstance(v, np.ndarray) or hasattr(v, "__cuda_array_interface__") else v
                 for v in args]
    kern[grid, block, _stream()](*converted)


def scalar(value: float, dtype: Any) -> Any:
    """A float scalar typed as ``dtype`` (NumPy scalars keep their type through Numba's typing)."""
    return np.dtype(dtype).type(value)


def blocks_for(n: int, block: int) -> int:
    """Blocks of ``block`` threads covering ``n`` items (grid-stride loops cover the rest)."""
    return max(0, min(-(-n // block), 65535 * 4))


def chunks(units: int, n: int, min_chunk: int) -> int:
    """How many chunks to split each of ``units`` reductions of ``n`` elements into."""
    s = settings()
    if units <= 0 or n <= 0:
        return 1
    want = -(-s.target_blocks // units)
    return max(1, min(want, -(-n // max(1, min_chunk))))


def cast(a: Any, dtype: Any) -> Any:
    """``a`` converted to ``dtype`` (a dtype object; bfloat16 as the array library's own), on ``a``'s device.

    Conversions from or to bfloat16 run through a kernel of ours: array libraries differ in their
    bfloat16 arithmetic support, but all of them can allocate and view it.
    """
    xp = array_module(a)
    src, dst = dtype_name(a), _name_of(dtype)
    if src == dst:
        return a
    if "bfloat16" not in (src, dst):
        return a.astype(dtype)
    out = xp.empty(a.shape, dtype=dtype)
    if a.size:
        flat = xp.ascontiguousarray(a).reshape(-1)
        launch(_cast_kernel, blocks_for(a.size, settings().block), settings().block, flat, out.reshape(-1))
    return out


def _name_of(dtype: Any) -> str:
    return "bfloat16" if str(dtype) == "bfloat16" else str(np.dtype(dtype))


_CAST_SIG = "void({a}[::1], {b}[::1])"


def _cast_signatures() -> tuple[str, ...]:
    names = ["uint16", "float16", "float32", "float64"]
    return tuple(_CAST_SIG.format(a=a, b=b) for a in names for b in names if "uint16" in (a, b) and a != b)


def _cast_py(src, dst):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < src.shape[0]:
        store(dst, i, load(src, i))
        i += stride


KERNELS.append(KernelSpec(f"{__name__}._cast_kernel", _cast_py, _cast_signatures()))
_cast_kernel = tolerant_cache(cuda.jit(**_KERNEL_OPTIONS)(_cast_py))


def into(out: dict, name: str, value: Any) -> Any:
    """``value`` as gradient ``name``, copied into the caller's ``out`` buffer when one is given."""
    buffer = out.get(name) if out else None
    if buffer is None or buffer is value:
        return value
    buffer[...] = value
    return buffer


def prod(shape: tuple[int, ...]) -> int:
    return math.prod(int(s) for s in shape)
