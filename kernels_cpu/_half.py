"""Half-precision data (float16, bfloat16) in the CPU kernels: uint16 bits, float32 arithmetic.

Numba has no bfloat16 and refuses float16 arrays on the CPU, so half-precision arrays reach the
kernels as their ``uint16`` bits (a zero-copy view) together with a *kind*: ``None`` for native
float32/float64 data, :data:`FLOAT16` or :data:`BFLOAT16` for bits.  The kind is a compile-time
choice: each is a Numba type of its own, so a kernel compiles one element type per signature and
its native float32/float64 code is exactly what it was without half support.  Inside the kernels

* :func:`load` ``(a, i, kind)`` reads ``a[i]`` as a number of the compute type (float32 for half
  data),
* :func:`store` ``(a, i, v, kind)`` writes ``v`` to ``a[i]``, rounding to nearest even,
* :func:`to_compute` ``(v, a, kind)`` casts a scalar to the compute type of ``a``'s elements,

and arithmetic runs in float32 (statistics in float64 where the float32 kernels keep them).

The conversions are the CPU's own where it has them: float16 ↔ float32 is LLVM's
``fpext``/``fptrunc`` on ``half``, which becomes ``vcvtph2ps``/``vcvtps2ph`` (F16C, AVX-512)
and vectorises; without F16C (x86 CPUs before 2012) integer code does the same rounding.
bfloat16 → float32 is a 16-bit shift of the bits; float32 → bfloat16 rounds to nearest even
in integer arithmetic (``u + 0x7FFF + lsb``, NaN kept a quiet NaN) — bitwise what ml_dtypes
gives for every other value, PyTorch's rounding too — and it vectorises (AVX512-BF16's
``vcvtneps2bf16`` is not used: LLVM vectorised it only 4 wide, see :func:`f32_to_bf16`).

The module's NumPy-level helpers convert whole arrays at a kernel's entry and exit (:func:`widen`,
:func:`narrow`, parallel Numba loops) and give results the caller's dtype back (:func:`typed`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import (
    NativeValue,
    intrinsic,
    models,
    overload,
    register_jitable,
    register_model,
    typeof_impl,
    unbox,
)

from . import _runtime

_OPTS = {"cache": True, "error_model": "numpy", "nogil": True}


# --------------------------------------------------------------------------- kinds


class HalfKind:
    """The element type of ``uint16`` arrays a kernel reads: :data:`FLOAT16` or :data:`BFLOAT16`."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name} bits>"

    def __reduce__(self):
        return (kind, (self.name,))


class HalfKindType(types.Dummy):
    """Numba's type of a :class:`HalfKind`: one type per kind, so kernels specialise on it."""

    def __init__(self, name: str) -> None:
        self.kind_name = name
        super().__init__(name=f"HalfKind({name})")


FLOAT16 = HalfKind("float16")
BFLOAT16 = HalfKind("bfloat16")
float16_kind = HalfKindType("float16")
bfloat16_kind = HalfKindType("bfloat16")
_KINDS = {"float16": FLOAT16, "bfloat16": BFLOAT16}


register_model(HalfKindType)(models.OpaqueModel)  # no data: the type is the information


@typeof_impl.register(HalfKind)
def _typeof_kind(val, c):
    return float16_kind if val.name == "float16" else bfloat16_kind


@unbox(HalfKindType)
def _unbox_kind(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


def kind(dtype_name: str) -> HalfKind | None:
    """The kind for a call of dtype ``dtype_name``: ``None`` for float32/float64 (native arrays)."""
    return _KINDS.get(dtype_name)


# --------------------------------------------------------------------------- scalar conversions


def _has_f16c() -> bool:
    """Whether LLVM may lower float16 conversions to instructions (x86 F16C / AVX-512 FP16, AArch64)."""
    try:
        features = _llvm.get_host_cpu_features()
    except RuntimeError:
        return False
    return bool(features.get("f16c") or features.get("avx512fp16") or features.get("fp-armv8")
                or features.get("neon"))


#: Whether the float16 conversions use the CPU's instructions (else integer code).
NATIVE_FLOAT16 = _has_f16c()


@intrinsic
def _bits_as_float32(typingctx, u):
    """The float32 whose bits are the uint32 ``u``."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _float32_bits(typingctx, v):
    """The bits of the float32 ``v`` as a uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _f16_fpext(typingctx, u):
    """float16 bits -> float32 by LLVM (``vcvtph2ps`` with F16C)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _f16_fptrunc(typingctx, v):
    """float32 -> float16 bits by LLVM, rounding to nearest even (``vcvtps2ph`` with F16C)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@register_jitable
def f16_to_f32_soft(u):
    """float16 bits -> float32 in integer arithmetic (exact; subnormals, infinities and NaNs kept).

    Normal and subnormal values alike: the magnitude bits shifted into float32's place scale the
    value by 2^-112, undone by one exact float32 multiplication; infinities and NaNs get the
    float32 exponent directly.
    """
    w = np.uint32(u)
    sign = (w & np.uint32(0x8000)) << np.uint32(16)
    mag = w & np.uint32(0x7FFF)
    if mag >= np.uint32(0x7C00):  # infinity or NaN (made quiet, as vcvtph2ps does)
        quiet = np.uint32(0x400000) if mag > np.uint32(0x7C00) else np.uint32(0)
        return _bits_as_float32(sign | np.uint32(0x7F800000) | quiet | ((mag & np.uint32(0x3FF)) << np.uint32(13)))
    v = _bits_as_float32(mag << np.uint32(13)) * np.float32(5.192296858534828e33)  # 2^112
    return _bits_as_float32(_float32_bits(v) | sign)


@register_jitable
def f32_to_f16_soft(v):
    """float32 -> float16 bits in integer arithmetic, rounding to nearest even (as ``vcvtps2ph``).

    Subnormal results: adding 0.5 to |v| leaves the float16 subnormal's integer in the low
    mantissa bits, rounded to nearest even by the float32 addition itself.
    """
    w = _float32_bits(np.float32(v))
    sign = np.uint16((w >> np.uint32(16)) & np.uint32(0x8000))
    mag = w & np.uint32(0x7FFFFFFF)
    if mag >= np.uint32(0x7F800000):  # infinity or NaN (quiet, payload's high bits kept)
        nan = np.uint32(0x200) if mag > np.uint32(0x7F800000) else np.uint32(0)
        return sign | np.uint16(np.uint32(0x7C00) | nan | ((mag >> np.uint32(13)) & np.uint32(0x3FF)))
    if mag >= np.uint32(0x477FF000):  # rounds to >= 65520: overflow to infinity
        return sign | np.uint16(0x7C00)
    if mag < np.uint32(0x38800000):  # below 2^-14: float16 subnormal (or zero)
        r = _bits_as_float32(mag) + np.float32(0.5)
        return sign | np.uint16(_float32_bits(r) - np.uint32(0x3F000000))
    odd = (mag >> np.uint32(13)) & np.uint32(1)
    mag = mag + np.uint32(0xC8000FFF) + odd  # rebias the exponent (-112 << 23) and round
    return sign | np.uint16(mag >> np.uint32(13))


@register_jitable
def bf16_to_f32(u):
    """bfloat16 bits -> float32: the bits are float32's upper half (exact)."""
    return _bits_as_float32(np.uint32(u) << np.uint32(16))


@register_jitable
def f32_to_bf16(v):
    """float32 -> bfloat16 bits, rounding to nearest even; NaN stays a (quiet) NaN.

    One shift and one narrowing for both cases (a NaN is made quiet before the shift): with a
    separate NaN result the vectorised loop narrowed twice and blended, and a (256, 1024) write
    pass in L2 took 85 us against 59 us (one thread, Xeon with AVX-512; LLVM's own
    ``fptrunc`` to bfloat, ``vcvtneps2bf16``, vectorised only 4 wide here: 78 us).
    """
    w = _float32_bits(np.float32(v))
    rounded = w + np.uint32(0x7FFF) + ((w >> np.uint32(16)) & np.uint32(1))
    w = (w | np.uint32(0x400000)) if v != v else rounded
    return np.uint16(w >> np.uint32(16))


@register_jitable
def _f16_to_f32_native(u):
    return _f16_fpext(u)


@register_jitable
def _f32_to_f16_native(v):
    return _f16_fptrunc(np.float32(v))


#: float16 bits -> float32, and float32 -> float16 bits (nearest even): the CPU's instructions where
#: it has them, else the integer code, bitwise the same (test_half compares them on every input).
f16_to_f32, f32_to_f16 = ((_f16_to_f32_native, _f32_to_f16_native) if NATIVE_FLOAT16
                          else (f16_to_f32_soft, f32_to_f16_soft))


# --------------------------------------------------------------------------- element access in kernels


def load(a, i, h):
    """``a[i]`` as a number of the compute type (float32 for half bits)."""
    raise NotImplementedError  # pragma: no cover - compiled only


def store(a, i, v, h):
    """``a[i] = v`` (rounded to nearest even for half bits)."""
    raise NotImplementedError  # pragma: no cover - compiled only


def to_compute(v, a, h):
    """The scalar ``v`` in the compute type of ``a``'s elements (float32 for half bits)."""
    raise NotImplementedError  # pragma: no cover - compiled only


@overload(load)
def _load(a, i, h):
    if isinstance(h, types.NoneType):
        return lambda a, i, h: a[i]
    if h is float16_kind:
        return lambda a, i, h: f16_to_f32(a[i])
    if h is bfloat16_kind:
        return lambda a, i, h: bf16_to_f32(a[i])
    return None


@overload(store)
def _store(a, i, v, h):
    if isinstance(h, types.NoneType):
        def native(a, i, v, h):
            a[i] = v
        return native
    if h is float16_kind:
        def as_float16(a, i, v, h):
            a[i] = f32_to_f16(v)
        return as_float16
    if h is bfloat16_kind:
        def as_bfloat16(a, i, v, h):
            a[i] = f32_to_bf16(v)
        return as_bfloat16
    return None


@overload(to_compute)
def _to_compute(v, a, h):
    if isinstance(h, types.NoneType):
        return lambda v, a, h: a.dtype.type(v)
    if isinstance(h, HalfKindType):
        return lambda v, a, h: np.float32(v)
    return None


def at(a, q):
    """``a[q]`` for an array, ``a`` itself for a scalar (one loop serves per-element and shared values)."""
    raise NotImplementedError  # pragma: no cover - compiled only


@overload(at)
def _at(a, q):
    if isinstance(a, types.Array):
        return lambda a, q: a[q]
    return lambda a, q: a


# --------------------------------------------------------------------------- whole arrays

#: Elements per task of the conversion loops (below it, one thread).
_CONVERT_MIN = 1 << 16


@njit(**_OPTS)
def _widen_chunk(src, dst, lo, hi, h):
    # Slices indexed from 0: with src[i] for i in [lo, hi) LLVM kept the negative-index wraparound and
    # vectorised with scatters (1M float16 elements in cache, one thread, Xeon with AVX-512: 0.64 ms;
    # sliced, 0.19 ms: 33 GB/s; narrowing 0.25 ms float16, 0.31 ms bfloat16).
    s, d = src[lo:hi], dst[lo:hi]
    for i in range(s.shape[0]):
        d[i] = load(s, i, h)


@njit(**_OPTS)
def _narrow_chunk(src, dst, lo, hi, h):
    s, d = src[lo:hi], dst[lo:hi]
    for i in range(s.shape[0]):
        store(d, i, s[i], h)


@njit(parallel=True, **_OPTS)
def _widen_parallel(src, dst, tasks, h):
    n = src.shape[0]
    for t in prange(tasks):
        _widen_chunk(src, dst, t * n // tasks, (t + 1) * n // tasks, h)


@njit(**_OPTS)
def _widen_serial(src, dst, tasks, h):
    _widen_chunk(src, dst, 0, src.shape[0], h)


@njit(parallel=True, **_OPTS)
def _narrow_parallel(src, dst, tasks, h):
    n = src.shape[0]
    for t in prange(tasks):
        _narrow_chunk(src, dst, t * n // tasks, (t + 1) * n // tasks, h)


@njit(**_OPTS)
def _narrow_serial(src, dst, tasks, h):
    _narrow_chunk(src, dst, 0, src.shape[0], h)


def bits(a):
    """The ``uint16`` bits of a half-precision array (float16, ml_dtypes bfloat16, or bits already),
    C-contiguous (a view when it already is)."""
    a = np.asarray(a, order="C")  # (not ascontiguousarray: it makes 0-d arrays 1-d)
    return a if a.dtype == np.uint16 else a.view(np.uint16)


def _tasks(n: int) -> int:
    """Tasks of a conversion of ``n`` elements: one per thread, none under _CONVERT_MIN elements."""
    return max(1, min(_runtime.parallel_threads(), n // _CONVERT_MIN)) if n >= 2 * _CONVERT_MIN else 1


def widen(a, h):
    """A half-precision array (or its bits, read as ``h``) as a new C-contiguous float32 array."""
    b = bits(a)
    out = _runtime.empty(b.shape, np.float32)
    if b.size:
        tasks = _tasks(b.size)
        _runtime.run_sized(_widen_parallel, _widen_serial, tasks > 1, b.reshape(-1), out.reshape(-1), tasks, h)
    return out


def narrow(a, h, like=None):
    """float32/float64 ``a`` rounded to the half type ``h``: its bits, viewed with ``like``'s dtype
    when given (the caller's float16, ml_dtypes bfloat16 or ``uint16``)."""
    src = np.asarray(a, dtype=np.float32, order="C")
    out = _runtime.empty(src.shape, np.uint16)
    if src.size:
        tasks = _tasks(src.size)
        _runtime.run_sized(_narrow_parallel, _narrow_serial, tasks > 1, src.reshape(-1), out.reshape(-1), tasks, h)
    return out if like is None else out.view(like.dtype)


def typed(bits_array, like):
    """Half bits as an array of ``like``'s dtype (float16, ml_dtypes bfloat16, or uint16 as given)."""
    return bits_array.view(like.dtype)


def is_half(a) -> bool:
    """Whether ``a`` holds half-precision data: float16, ml_dtypes bfloat16, or bits (``uint16``)."""
    return a.dtype == np.uint16 or a.dtype == np.float16 or a.dtype.name == "bfloat16"


def bits_as(a, h):
    """``a`` as C-contiguous bits of the half type ``h``: a view of data of that type, a rounded
    copy of anything else (a cotangent given in float32, say)."""
    if a.dtype == np.uint16 or a.dtype.name == h.name:
        return bits(a)
    return narrow(np.asarray(a, dtype=np.float32), h)


def as_float(a, h, dtype):
    """``a`` — an array of the call's half type (or its bits), or a float32/float64 one — as a
    C-contiguous array of ``dtype``."""
    if is_half(a):
        return widen(a, h).astype(dtype, copy=False)
    return np.asarray(a, dtype=dtype, order="C")


def like_param(value, like, h):
    """A float gradient or statistic ``value`` in the dtype of the parameter ``like`` (float32, or
    the half type, rounded once)."""
    if is_half(like):
        return narrow(value, h, like)
    return np.asarray(value, dtype=like.dtype)

