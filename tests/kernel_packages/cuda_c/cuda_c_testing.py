"""Helpers shared by the CUDA C kernel tests: compiling, launch checks, the CPU emulator, reference comparisons."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
from typing import Any

import numpy as np
import pytest

import portable_nn as pnn
from kernels_gpu.cuda_c import _runtime as rt
from pnn_testing import KEYWORD_PARAM_NORMS, TOL, assert_matches

HAS_NVRTC = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


def _family(name: str) -> Any:
    return importlib.import_module(f"kernels_gpu.cuda_c.{name}")


_compiled: dict[tuple[str, str], tuple[dict[str, list[str]], dict[str, str]]] = {}


def compiled(family: str, arch: str = "sm_80") -> tuple[dict[str, list[str]], dict[str, str]]:
    """(PTX entries, lowered names) of a family, compiled once per test session."""
    key = (family, arch)
    if key not in _compiled:
        _family(family)
        ptx, lowered = rt.compile_ptx(family, arch)
        _compiled[key] = (rt.ptx_entries(ptx), lowered)
    return _compiled[key]


_C_DTYPES = {
    "float": {"float32"},
    "double": {"float64"},
    "pnn_half": {"float16"},
    "pnn_bf16": {"uint16", "bfloat16"},
    "long long": {"int64"},
    "int": {"int32"},
    "unsigned char": {"uint8", "bool"},
}


_SCALARS = {np.int64: "long long", np.int32: "int", np.float64: "double", np.float32: "float"}


_PTX_BITS = {"u64": 64, "s64": 64, "b64": 64, "f64": 64, "u32": 32, "s32": 32, "b32": 32, "f32": 32}


def _resolve(ptype: str, binding: dict[str, str]) -> tuple[str, bool]:
    """(C++ base type after template substitution, is pointer)."""
    is_ptr = ptype.endswith("*")
    base = ptype.rstrip("*").replace("const ", "").strip()
    m = re.fullmatch(r"typename acc_of<(\w+)>::type", base)
    if m:
        base = "double" if binding.get(m.group(1), m.group(1)) == "double" else "float"
    return binding.get(base, base), is_ptr


def _is_array(arg) -> bool:
    return not isinstance(arg, np.generic) and hasattr(arg, "dtype") and hasattr(arg, "flags")


def check_launch(family: str, name: str, grid, block, args, shared) -> None:
    """Everything about one launch that can be checked without running it."""
    assert name in rt.declared(family), f"{name} is not declared for {family}"
    base, targs = rt.split_name(name)
    tparams, ptypes = rt.kernel_signatures(family)[base]
    binding = dict(zip(tparams, targs))
    assert len(args) == len(ptypes), f"{name}: {len(args)} arguments for {len(ptypes)} parameters"
    for k, (arg, ptype) in enumerate(zip(args, ptypes)):
        ctype, is_ptr = _resolve(ptype, binding)
        where = f"{name} argument {k} ({ptype} = {ctype}{'*' if is_ptr else ''})"
        if is_ptr:
            if arg is rt.NULL:
                continue
            assert _is_array(arg), f"{where}: got {type(arg).__name__}"
            assert str(arg.dtype) in _C_DTYPES[ctype], f"{where}: array of {arg.dtype}"
            assert arg.flags.c_contiguous, f"{where}: array is not C-contiguous"
        else:
            assert _SCALARS.get(type(arg)) == ctype, f"{where}: got {type(arg).__name__}"
    threads = int(np.prod(block))
    assert 1 <= threads <= 1024 and len(grid) <= 3 and len(block) <= 3
    assert grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), f"{name}: grid {grid}"
    assert 0 <= shared <= 48 * 1024, f"{name}: {shared} bytes of shared memory"
    if HAS_NVRTC:
        entries, lowered = compiled(family)
        ptx_params = entries[lowered[name]]
        assert len(ptx_params) == len(args)
        for k, (arg, ptype) in enumerate(zip(args, ptx_params)):
            bits = 64 if (arg is rt.NULL or _is_array(arg)) else arg.nbytes * 8
            assert _PTX_BITS[ptype] == bits, f"{name} argument {k}: {bits}-bit value for .{ptype}"


@contextlib.contextmanager
def recording():
    """Replace the launch by a checker; yields the list of (family, name, grid, block) launched."""
    launches = []

    def record(family, name, grid, block, args, shared):
        check_launch(family, name, grid, block, args, shared)
        launches.append((family, name, grid, block))

    saved = rt._launcher
    rt._launcher = record
    try:
        with np.errstate(all="ignore"):  # outputs are never computed: the host math sees garbage
            yield launches
    finally:
        rt._launcher = saved


def stored(a, dtype: str):
    """Float64 data as a NumPy array of ``dtype`` (bfloat16 as uint16 bits, as dispatch hands it over)."""
    if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
        return a
    if dtype == "bfloat16":
        return rt.float_to_bf16_bits(np, a.astype(np.float32))
    return a.astype(dtype)


def as_float64(a, dtype: str):
    """A kernel result (bfloat16 bits decoded) as float64."""
    if a is None:
        return None
    if dtype == "bfloat16" and a.dtype == np.uint16:
        return rt.bf16_bits_to_float(np, a).astype(np.float64)
    return a.astype(np.float64)


def public_arguments(op, args, kwargs):
    """A spec's ``(args, kwargs)`` as the public op takes them: the specs list a norm's weight and bias
    positionally, but batch and instance norm take them by keyword."""
    if op in KEYWORD_PARAM_NORMS and len(args) > 1:
        return args[:1], {**dict(zip(("weight", "bias"), args[1:])), **kwargs}
    return args, kwargs


def _call(op, args, kwargs, dtype="float32", mixed=False, save=True):
    """A validated Call of ``op`` on NumPy arrays of ``dtype`` (the first array; parameters float32 when
    ``mixed``), as dispatch hands it to the kernels."""
    args, kwargs = public_arguments(op, args, kwargs)
    pdt = "float32" if mixed else dtype
    proxy = {"bfloat16": "float16"}  # NumPy has no bfloat16: validate with float16, then swap the bits in
    data = (0, 1) if op == "cross_entropy" else (0,)  # probability targets have the logits' dtype
    conv = [stored(a, proxy.get(dtype, dtype) if k in data else proxy.get(pdt, pdt)) for k, a in enumerate(args)]
    kw = {k: stored(v, proxy.get(pdt, pdt)) for k, v in kwargs.items()}
    call = pnn.explain(op, *conv, **kw).call.replace(save=save)
    if dtype != "bfloat16":
        return call
    arrays = {k: (stored(v.astype(np.float64), "bfloat16") if isinstance(v, np.ndarray) and v.dtype == np.float16
                  else v) for k, v in call.arrays.items()}
    return call.replace(arrays=arrays, dtype="bfloat16")


def _decoded(value, dtype):
    if isinstance(value, (list, tuple)):
        return type(value)(_decoded(v, dtype) for v in value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "fu" and not (value.dtype == np.uint16
                                                                           and dtype != "bfloat16"):
        return as_float64(value, dtype)
    return value


def reference_of(call, cotangents, needs):
    """The reference implementation's outputs and gradients for the same call, in float64."""
    from portable_nn import dispatch

    ref = next(i for i in dispatch.implementations(call.op) if i.backend == "reference")
    call64 = call.replace(arrays={k: _decoded(v, call.dtype) for k, v in call.arrays.items()}, dtype="float64",
                          params={**call.params, "mixed_precision": False}, save=True)
    outputs, res = ref.forward_fn()(call64)
    cts = tuple(_decoded(c, call.dtype) for c in cotangents)
    return outputs, ref.backward_fn()(res, cts, needs, {})


@contextlib.contextmanager
def emulating():
    """Run launches on the CPU emulator (after checking them like recording() does)."""
    from kernels_gpu.cuda_c import _emulator

    def run(family, name, grid, block, args, shared):
        check_launch(family, name, grid, block, args, shared)
        _emulator.emulated_launch(family, name, grid, block, args, shared)

    saved = rt._launcher
    rt._launcher = run
    try:
        yield
    finally:
        rt._launcher = saved


def _has_emulator():
    from kernels_gpu.cuda_c import _emulator

    return _emulator.compiler() is not None


needs_emulator = pytest.mark.skipif(not _has_emulator(), reason="no C++ compiler for the CUDA C emulator")


def _rng(seed=0):
    return np.random.default_rng(seed)


def _data_like(shape, dtype, seed):
    return stored(_rng(seed).standard_normal(shape), dtype)


def _to_device(a, dtype, lib):
    """A NumPy argument on the device (float data in ``dtype``; integer labels as int64)."""
    if not isinstance(a, np.ndarray):
        return a
    if lib == "numpy":
        return a.astype(dtype) if a.dtype.kind == "f" else a.astype(np.int64)
    if lib == "torch":
        import torch

        dt = getattr(torch, dtype) if a.dtype.kind == "f" else torch.int64
        return torch.tensor(a, dtype=dt, device="cuda")
    import cupy

    return cupy.asarray(a.astype(dtype) if a.dtype.kind == "f" else a.astype(np.int64))


def _gpu_lib(dtype):
    if dtype != "bfloat16":
        return "cupy"
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("bfloat16 on the GPU is tested through CUDA torch tensors")
    return "torch"


def _host(a):
    """A device array (or a NumPy/int argument) as float64 NumPy; integer labels stay integers."""
    if a is None or isinstance(a, (int, float, str, tuple)):
        return a
    if type(a).__module__.startswith("torch"):
        t = a.detach().cpu()
        return t.numpy() if not t.is_floating_point() else t.double().numpy()
    if type(a).__module__.startswith("cupy"):
        return a.get().astype(np.float64) if a.dtype.kind == "f" else a.get()
    if isinstance(a, np.ndarray) and a.dtype.kind == "f":
        return a.astype(np.float64)
    return a


def _dtype_name(a) -> str:
    """A CuPy or torch array's dtype name (``"float32"``, ``"bfloat16"`` …)."""
    return str(a.dtype).removeprefix("torch.")


def gpu_compare(spec, dtype, mixed, tol_factor=1.0, tol=None, lib=None, backend="cupy"):
    """Forward and every gradient of ``spec`` forced onto ``backend`` vs the float64 reference.

    Cotangents take each output's own dtype (float32 statistics of half data, for ``moments``);
    integer outputs (pooling indices) take none.  ``tol``, when given, bounds outputs and gradients
    alike (else ``TOL[dtype] * tol_factor`` the outputs and four times that the gradients).  ``lib``
    (default: CuPy, or CUDA torch tensors for bfloat16) and ``backend`` let the CPU tests run this
    same comparison on NumPy, so a mistake in it shows without a GPU.
    """
    _, op, args, kwargs = spec
    args, kwargs = public_arguments(op, args, kwargs)
    lib = lib or _gpu_lib(dtype)
    pdt = "float32" if mixed else dtype
    data = (0, 1) if op == "cross_entropy" else (0,)
    dev_args = [_to_device(a, dtype if k in data else pdt, lib) for k, a in enumerate(args)]
    dev_kwargs = {k: _to_device(v, pdt, lib) for k, v in kwargs.items()}
    ref_args = [_host(a) for a in dev_args]  # the rounded values the device sees, in float64
    ref_kwargs = {k: _host(v) for k, v in dev_kwargs.items()}
    with pnn.use_backend(backend):
        assert pnn.explain(op, *dev_args, **dev_kwargs).backend == backend
        y, pullback = pnn.vjp(op, *dev_args, **dev_kwargs)
        ys = y if isinstance(y, tuple) else (y,)
        dys = tuple(_to_device(np.asarray(_rng(5 + k).standard_normal(tuple(v.shape))), _dtype_name(v), lib)
                    if _dtype_name(v).startswith(("float", "bfloat")) else None for k, v in enumerate(ys))
        grads = pullback(dys if isinstance(y, tuple) else dys[0])
    with pnn.use_backend("reference"):
        y_ref, pb_ref = pnn.vjp(op, *ref_args, **ref_kwargs)
        host_dys = tuple(_host(d) for d in dys)
        grads_ref = pb_ref(host_dys if isinstance(y, tuple) else host_dys[0])
    grad_tol = 4 * TOL[dtype] * tol_factor if tol is None else tol
    tol = TOL[dtype] * tol_factor if tol is None else tol
    for k, (got, want) in enumerate(zip(ys, y_ref if isinstance(y_ref, tuple) else (y_ref,))):
        assert_matches(_host(got), _host(want), tol, f"output {k}")
    for name in grads._fields:
        got, want = getattr(grads, name), getattr(grads_ref, name)
        assert (got is None) == (want is None), name
        if got is not None:
            assert_matches(_host(got), _host(want), grad_tol, f"d{name}")
    for name in ("running_mean", "running_var"):
        if name in kwargs and kwargs.get("training", True) and kwargs.get("use_input_stats", True):
            assert_matches(_host(dev_kwargs[name]), _host(ref_kwargs[name]), TOL[pdt], name)


def emulated_case(module, forward, backward, spec, dtype, mixed, needs, grad_dtypes=None, tol_factor=1.0):
    """Run one op through the emulated kernels and the reference; compare outputs and gradients."""
    _, op, args, kwargs = spec
    call = _call(op, args, kwargs, dtype, mixed)
    with emulating():
        outputs, res = getattr(module, forward)(call)
        cts = tuple(_data_like(tuple(o.shape), dtype, 11 + k) for k, o in enumerate(outputs))
        grads = getattr(module, backward)(res, cts, frozenset(needs), {})
    ref_outputs, ref_grads = reference_of(call, cts, frozenset(needs))
    tol = TOL[dtype] * tol_factor
    for k, (got, want) in enumerate(zip(outputs, ref_outputs)):
        assert_matches(as_float64(got, dtype), want, tol, f"output {k}")
    assert set(grads) == set(needs)
    for name in needs:
        gdt = (grad_dtypes or {}).get(name, dtype)
        assert_matches(as_float64(grads[name], gdt), ref_grads[name], 4 * tol, f"d{name}")
    return call


ALL_DTYPES = [("float32", False), ("float64", False), ("float16", False), ("bfloat16", False)]


def loss_specs():
    r = _rng(4)
    with_inf = r.standard_normal((4, 6))
    with_inf[1, 2] = -np.inf
    labels = np.array([0, 4, 2, -100, 1, 3])
    probs = r.random((6, 5))
    probs /= probs.sum(axis=1, keepdims=True)
    return [
        ("lsm-rows", "log_softmax", (r.standard_normal((5, 70)),), {}),
        ("lsm-rows-neg-inf", "log_softmax", (with_inf,), {}),
        ("lsm-cols", "log_softmax", (r.standard_normal((3, 4, 5)),), {"axis": 1}),
        ("lsm-axis0", "log_softmax", (r.standard_normal((4, 3, 2)),), {"axis": 0}),
        ("ce-index-weight-smooth-mean", "cross_entropy", (r.standard_normal((6, 5)), labels),
         {"weight": r.random(5) + 0.5, "label_smoothing": 0.1}),
        ("ce-index-spatial-none", "cross_entropy",
         (r.standard_normal((4, 5, 3)), r.integers(0, 5, (4, 3))), {"reduction": "none"}),
        ("ce-index-sum-smooth", "cross_entropy", (r.standard_normal((6, 5)), np.array([0, 4, 2, 4, 1, 3])),
         {"weight": r.random(5) + 0.5, "label_smoothing": 0.2, "reduction": "sum", "ignore_index": 4}),
        ("ce-prob-weight-smooth", "cross_entropy", (r.standard_normal((6, 5)), probs),
         {"weight": r.random(5) + 0.5, "label_smoothing": 0.1}),
        ("ce-prob-spatial-none", "cross_entropy", (r.standard_normal((3, 4, 2)), r.random((3, 4, 2))),
         {"reduction": "none"}),
        ("ce-all-ignored", "cross_entropy", (r.standard_normal((3, 4)), np.array([-100, -100, -100])), {}),
        ("ce-unbatched", "cross_entropy", (r.standard_normal(5), np.array(2)), {}),
        *_vector_loss_specs(),
    ]


def _vector_loss_specs():
    """Rows of whole 16-byte vectors in every dtype (classes a multiple of 8): the rows kernels'
    vector path, with class weights, smoothing and probability targets."""
    r = _rng(14)
    probs = r.random((6, 16))
    probs /= probs.sum(axis=1, keepdims=True)
    return [
        ("lsm-rows-vec", "log_softmax", (r.standard_normal((5, 48)),), {}),
        ("ce-index-weight-smooth-vec", "cross_entropy", (r.standard_normal((6, 16)), r.integers(0, 16, 6)),
         {"weight": r.random(16) + 0.5, "label_smoothing": 0.1}),
        ("ce-prob-weight-smooth-vec", "cross_entropy", (r.standard_normal((6, 16)), probs),
         {"weight": r.random(16) + 0.5, "label_smoothing": 0.1}),
    ]


LOSS_SPECS = loss_specs()


GEMM_DTYPES = [("float32", False), ("float64", False)]

