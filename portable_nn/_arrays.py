"""Array-family helpers: which library an array comes from, its device and dtype.

Everything here works from array-api-compat's type checks, which look at
``sys.modules`` and therefore never import torch, cupy or jax themselves.
"""

from __future__ import annotations

from typing import Any

import array_api_compat as aac
import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")

_FAMILY_CHECKS = (
    ("numpy", aac.is_numpy_array),
    ("torch", aac.is_torch_array),
    ("cupy", aac.is_cupy_array),
    ("jax", aac.is_jax_array),
    ("dask", aac.is_dask_array),
)

#: Array families whose arrays are collections of chunks of another library's arrays, and the route
#: (``"module:attr"``, imported by dispatch on the first call that holds such an array) that runs an
#: op chunk by chunk through the kernels of the chunks' library (see ``dispatch._chunked_route``).
CHUNKED_ROUTES = {"dask": "portable_nn.adapters.dask:ROUTE"}


# Whether a value is an array, and of which library, depends on its type only; both are asked
# several times per argument per call (~20 times for a batch_norm on torch tensors), so the answers
# are kept per type: a dict lookup instead of array-api-compat's chain of checks.
_ARRAY_TYPES: dict[type, bool] = {np.ndarray: True}
_FAMILY_OF_TYPE: dict[type, str] = {np.ndarray: "numpy"}


def is_array(value: Any) -> bool:
    """Whether ``value`` is an array of a library portable_nn can work with."""
    kind = type(value)
    known = _ARRAY_TYPES.get(kind)
    if known is None:
        if isinstance(value, (bool, int, float, complex, str, bytes, list, tuple, dict, np.generic)):
            known = False
        else:
            known = bool(aac.is_array_api_obj(value))
        _ARRAY_TYPES[kind] = known
    return known


def is_masked(value: Any) -> bool:
    """Whether ``value`` is a masked array — NumPy's ``MaskedArray``, or a Dask array of them —
    whose mask no kernel or reference formula reads (the masked entries would count)."""
    if isinstance(value, np.ma.MaskedArray):
        return True
    return family(value) == "dask" and isinstance(getattr(value, "_meta", None), np.ma.MaskedArray)


def family(x: Any) -> str:
    """The array library of ``x``: numpy, torch, cupy, jax, dask, array_api_strict or other."""
    kind = type(x)
    name = _FAMILY_OF_TYPE.get(kind)
    if name is None:
        name = _family_of(x)
        _FAMILY_OF_TYPE[kind] = name
    return name


def _family_of(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    for name, check in _FAMILY_CHECKS:
        if check(x):
            return name
    module = type(x).__module__.split(".")[0]
    return module if module else "other"


def describe_family(name: str) -> str:
    """A human name for an array family, used in error messages."""
    return {
        "numpy": "a NumPy array",
        "torch": "a PyTorch tensor",
        "cupy": "a CuPy array",
        "jax": "a JAX array",
        "dask": "a Dask array",
        "array_api_strict": "an array_api_strict array",
    }.get(name, f"a {name} array")


def device_of(x: Any) -> str:
    """A normalised device string: ``"cpu"``, ``"cuda:0"``, …"""
    fam = family(x)
    if fam == "numpy":
        return "cpu"
    if fam == "torch":
        return str(x.device)
    if fam == "cupy":
        return f"cuda:{x.device.id}"
    dev = aac.device(x)
    text = str(dev).lower()
    if "cpu" in text:
        return "cpu"
    return text


def device_kind(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` (or the device string's prefix for anything else)."""
    return device.split(":")[0].split("(")[0].strip() or device


_NUMPY_NAMES: dict[Any, str] = {}
#: Other libraries' dtype objects (torch's …) by identity: a dtype's name never changes, and finding
#: it walks the candidate names below (a few µs per array argument of every call).
_OTHER_NAMES: dict[int, tuple[Any, str]] = {}


def dtype_name(xp: Any, dtype: Any) -> str:
    """The array-API name of ``dtype`` (``"float32"``, ``"int64"``, …)."""
    if isinstance(dtype, np.dtype):  # NumPy's names are the standard's (dtype.name is slow Python code)
        name = _NUMPY_NAMES.get(dtype)
        if name is None:
            name = _NUMPY_NAMES[dtype] = dtype.name
        return name
    known = _OTHER_NAMES.get(id(dtype))
    if known is not None and known[0] is dtype:
        return known[1]
    name = _dtype_name_of(xp, dtype)
    if xp is not None and len(_OTHER_NAMES) < 256:  # the dtype is kept alive by the entry, so ids stay unique
        _OTHER_NAMES[id(dtype)] = (dtype, name)
    return name


def _dtype_name_of(xp: Any, dtype: Any) -> str:
    for name in (
        "float32", "float64", "float16", "bfloat16", "bool",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "complex64", "complex128",
    ):
        candidate = getattr(xp, name, None)
        if candidate is not None and dtype == candidate:
            return name
    text = str(dtype)
    for prefix in ("torch.", "array_api_strict.", "dtype("):
        text = text.replace(prefix, "")
    return text.strip("')\"")


class LazyNamespace:
    """A namespace module imported on its first attribute access.

    ``array_api_compat.numpy`` builds itself by cloning NumPy's whole namespace, which
    imports NumPy's lazy submodules (f2py, testing, …): ~0.17 s, paid by a process's first
    call although the kernel routes never touch the namespace.  Validation (which reads
    NumPy dtypes directly) and the kernels run without it; the reference implementation,
    and anything else that uses ``call.xp``, imports it on first use.  Each attribute is
    cached on the instance after its first lookup, so later accesses cost a plain lookup.
    """

    def __init__(self, module_name: str) -> None:
        self._module_name = module_name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_module_name", "_module"):  # not set yet (copying, unpickling): no recursion
            raise AttributeError(attr)
        if self._module is None:
            import importlib

            self._module = importlib.import_module(self._module_name)
        value = getattr(self._module, attr)
        self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<lazily imported namespace {self._module_name!r}>"


#: array-api-compat's NumPy namespace, imported when first used (see :class:`LazyNamespace`).
NUMPY_NAMESPACE = LazyNamespace("array_api_compat.numpy")


#: The namespace of CuPy and torch arrays by type: array-api-compat's lookup cost ~3 µs each time,
#: asked twice per call (the other libraries are asked each time: a JAX tracer's or a strict
#: array's namespace can depend on more than its type).
_NAMESPACE_OF_TYPE: dict[type, Any] = {}


def namespace(x: Any) -> Any:
    """The array-API namespace for ``x`` (array-api-compat's wrapper where needed)."""
    if isinstance(x, np.ndarray):
        return NUMPY_NAMESPACE
    kind = type(x)
    found = _NAMESPACE_OF_TYPE.get(kind)
    if found is None:
        found = aac.array_namespace(x)
        if family(x) in ("cupy", "torch"):
            _NAMESPACE_OF_TYPE[kind] = found
    return found


def has_values(x: Any) -> bool:
    """Whether ``x``'s values can be read: false for a stand-in that has only a shape and dtype
    (a torch fake or meta tensor, as ``torch.compile`` traces with), whose values validation
    must therefore leave to the kernel."""
    return getattr(x, "fake_mode", None) is None and str(getattr(x, "device", "")) != "meta"


def is_writeable(x: Any) -> bool:
    """Whether ``x`` can be updated in place (``x[...] = v``)."""
    return bool(aac.is_writeable_array(x))


def is_c_contiguous(x: Any) -> bool:
    """Whether a kernel can take ``x`` as it is: C-contiguous (true for libraries that hide strides)
    and, for NumPy, in the machine's byte order (Numba cannot type a ``'>f4'`` array)."""
    fam = family(x)
    if fam == "numpy":
        return bool(x.flags.c_contiguous) and x.dtype.isnative
    if fam == "cupy":
        return bool(x.flags.c_contiguous)
    if fam == "torch":
        return bool(x.is_contiguous())
    return True


def to_numpy_view(x: Any) -> Any:
    """A zero-copy NumPy view of a CPU torch tensor (or ``x`` itself if NumPy).

    NumPy has no bfloat16: a bfloat16 tensor's bits are shared as a ``uint16`` view, which is
    how the CPU kernels read bfloat16 in any case (``kernels_cpu._half``).
    """
    if family(x) == "torch":
        import torch

        t = x.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.uint16).numpy()
        return t.numpy()
    return x


def from_numpy_like(result: Any, like_family: str, like_dtype: str | None = None) -> Any:
    """Wrap a NumPy array produced by a kernel back into ``like_family`` without a copy.

    ``like_dtype="bfloat16"`` re-types a ``uint16`` result (bfloat16 bits, see
    :func:`to_numpy_view`) or an ml_dtypes bfloat16 one as a bfloat16 tensor.
    """
    if result is None or like_family != "torch":
        return result
    import torch

    # (NumPy's dtype.name is slow Python code: the cached name of dtype_name instead)
    if dtype_name(None, result.dtype) == "bfloat16" or (like_dtype == "bfloat16" and result.dtype == np.uint16):
        return torch.from_numpy(result.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(result)


def to_cupy_view(x: Any) -> Any:
    """A zero-copy CuPy view of a CUDA torch tensor (or ``x`` itself if CuPy).

    bfloat16 goes through DLPack when CuPy knows the type (CuPy >= 14 with
    ``ml_dtypes``); otherwise the tensor's bits are shared as a ``uint16`` view,
    which is how the GPU kernels read bfloat16 in any case.
    """
    if family(x) != "torch":
        return x
    import cupy
    import torch

    t = x.detach()
    if t.dtype == torch.bfloat16:
        try:
            return cupy.from_dlpack(t)
        except (TypeError, NotImplementedError, BufferError, ValueError):
            return cupy.from_dlpack(t.view(torch.uint16))
    return cupy.from_dlpack(t)


def from_cupy_like(result: Any, like_family: str, like_dtype: str | None = None) -> Any:
    """Wrap a CuPy array produced by a kernel back into ``like_family`` without a copy.

    ``like_dtype="bfloat16"`` re-types a ``uint16`` result (bfloat16 bits, see
    :func:`to_cupy_view`) as a bfloat16 tensor.
    """
    if result is None or like_family != "torch":
        return result
    import torch

    if str(result.dtype) == "uint16" and like_dtype == "bfloat16":
        return torch.from_dlpack(result).view(torch.bfloat16)
    if str(result.dtype) == "bfloat16":
        try:
            return torch.from_dlpack(result)
        except (TypeError, NotImplementedError, BufferError, ValueError):
            import cupy

            return torch.from_dlpack(result.view(cupy.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(result)


def cuda_index(device: str) -> int:
    """The ordinal of a ``"cuda:N"`` device string (0 for a bare ``"cuda"``)."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def ascontiguous(x: Any) -> Any:
    """A C-contiguous version of ``x`` in native byte order (a copy only when needed)."""
    fam = family(x)
    if fam == "numpy":
        return np.ascontiguousarray(x, dtype=x.dtype if x.dtype.isnative else x.dtype.newbyteorder("="))
    if fam == "torch":
        return x.contiguous()
    if fam == "cupy":
        import cupy

        return cupy.ascontiguousarray(x)
    return x
