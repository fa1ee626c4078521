"""CUDA C kernels (backend ``"cupy"``): compiled and checked without a GPU, compared on one.

Without a GPU (CI):

* every ``.cu`` source compiles for sm_80 and sm_90 with NVRTC (cuda-bindings), with every
  template instantiation its launcher declares; each instantiation is an ``.entry`` of the PTX
  whose parameter count matches the C++ signature;
* the launchers run on NumPy arrays with the launch itself replaced by a recorder, over the
  argument combinations of every op; each recorded launch is checked against the kernel: the
  instantiation is declared and compiled, the argument count matches, every scalar has the
  C++ parameter's type, every array the element type of the pointer parameter (after template
  substitution) and is C-contiguous, and the grid, block and shared memory are within limits;
* the pure-Python planning (row/column mode, splits, row chunks) covers every element.

On a GPU (``-m gpu``): every op and gradient, forced onto ``cupy``, against the reference,
with small block settings that force the multi-block and second-pass paths.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import portable_nn as pnn
from kernels_gpu.cuda_c import _runtime as rt
from pnn_testing import TOL, rel_err

FAMILIES = ("norm", "pool", "loss", "dense", "conv", "rnn")
ARCHS = ("sm_80", "sm_90")
HAS_NVRTC = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


def _family(name: str) -> Any:
    return importlib.import_module(f"kernels_gpu.cuda_c.{name}")


# --------------------------------------------------------------------------- compile (no GPU)

_compiled: dict[tuple[str, str], tuple[dict[str, list[str]], dict[str, str]]] = {}


def compiled(family: str, arch: str = "sm_80") -> tuple[dict[str, list[str]], dict[str, str]]:
    """(PTX entries, lowered names) of a family, compiled once per test session."""
    key = (family, arch)
    if key not in _compiled:
        _family(family)
        ptx, lowered = rt.compile_ptx(family, arch)
        _compiled[key] = (rt.ptx_entries(ptx), lowered)
    return _compiled[key]


def _needs_compiler():
    if not HAS_NVRTC:
        pytest.skip("cuda-bindings (NVRTC) not installed")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_instantiation_compiles(family, arch):
    _needs_compiler()
    entries, lowered = compiled(family, arch)
    sigs = rt.kernel_signatures(family)
    names = rt.declared(family)
    assert names, "the launcher declares no kernels"
    for name in names:
        base, _ = rt.split_name(name)
        assert base in sigs, f"{name}: no __global__ {base} in {family}.cu"
        low = lowered[name]
        assert low in entries, f"{name} ({low}) is not an entry of the PTX"
        assert len(entries[low]) == len(sigs[base][1]), f"{name}: PTX and source disagree on the parameters"
    # Every kernel of the source is used by the launcher (no dead kernels).
    assert set(sigs) == {rt.split_name(n)[0] for n in names}


def test_a_syntax_error_fails_the_compile(monkeypatch):
    _needs_compiler()
    _family("norm")
    good = rt.source
    broken = "\n__global__ void broken(int* p) { p[0] = q; }\n"
    monkeypatch.setattr(rt, "source", lambda family: good(family) + broken)
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        rt.compile_ptx("norm", "sm_80")


def test_source_is_self_contained():
    text = rt.source("norm")
    # No #include left: it compiles with a bare NVRTC (no CUDA headers needed).
    assert not re.search(r"^\s*#\s*include", text, re.M) and "block_sum2" in text


def test_importing_the_package_does_not_import_cupy():
    code = "import sys, kernels_gpu.cuda_c, kernels_gpu.cuda_c.norm; print('cupy' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_backend_is_declared_and_unavailable_without_a_device():
    ops = {row["op"] for row in pnn.capabilities() if row["backend"] == "cupy"}
    assert {"layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm"} <= ops
    status = pnn.available_backends()["cupy"]
    if not status:
        x = np.zeros((2, 3), np.float32)
        with pnn.use_backend("cupy"), pytest.raises(pnn.BackendUnavailableError, match="cupy"):
            pnn.layer_norm(x)


# --------------------------------------------------------------------------- launch recording (no GPU)

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


def rounded(a, dtype: str):
    """Float64 data rounded to the values ``dtype`` can hold (what kernel and reference both see)."""
    if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
        return a
    if dtype == "bfloat16":
        return rt.bf16_bits_to_float(np, rt.float_to_bf16_bits(np, a.astype(np.float32))).astype(np.float64)
    return a.astype(dtype).astype(np.float64)


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


def _call(op, args, kwargs, dtype="float32", mixed=False, save=True):
    """A validated Call of ``op`` on NumPy arrays of ``dtype`` (the first array; parameters float32 when
    ``mixed``), as dispatch hands it to the kernels."""
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


# --------------------------------------------------------------------------- norms: plans and launches

from kernels_gpu.cuda_c import norm as cnorm  # noqa: E402

SMALL_NORM = {"BLOCK": 32, "APPLY_BLOCK": 32, "TARGET_BLOCKS": 64, "SPLIT_MIN_ELEMENTS": 8,
              "COLUMN_BLOCK": (32, 2)}
NORM_SETTINGS = {
    "default": {},
    "small": SMALL_NORM,
    "row": {**SMALL_NORM, "COLUMN_MODE_BELOW": 0},
    "column": {**SMALL_NORM, "COLUMN_MODE_BELOW": 10**9},
}


def _rng(seed=0):
    return np.random.default_rng(seed)


def norm_specs():
    """(id, op, args, kwargs) covering every norm, layout, parameter and statistics option."""
    r = _rng()
    x3 = r.standard_normal((4, 6, 10))
    x4 = r.standard_normal((3, 4, 5, 6))
    c6 = r.standard_normal(6)
    specs = [
        ("layer-1axis-gelu", "layer_norm", (x3, r.standard_normal(10), r.standard_normal(10)),
         {"activation": "gelu"}),
        ("layer-2axes-noparams", "layer_norm", (x3,), {"axis": (-2, -1)}),
        ("layer-offset", "layer_norm", (x3 * 0.5 + 1e4, r.standard_normal(10), None),
         {"activation": ("leaky_relu", 0.2)}),
        ("rms", "rms_norm", (x3, r.standard_normal(10)), {}),
        ("rms-2axes", "rms_norm", (x3,), {"axis": (-2, -1), "eps": 1e-3}),
        ("batch-nchw-train", "batch_norm", (x4, r.standard_normal(4), r.standard_normal(4)),
         {"running_mean": r.standard_normal(4), "running_var": r.random(4) + 0.5, "activation": "silu"}),
        ("batch-nc", "batch_norm", (r.standard_normal((40, 5)), r.standard_normal(5), None), {"activation": "relu"}),
        ("batch-nhwc-train", "batch_norm", (x4, r.standard_normal(6), r.standard_normal(6)),
         {"channel_axis": -1, "running_mean": r.standard_normal(6), "running_var": r.random(6) + 0.5}),
        ("batch-infer", "batch_norm", (x4, r.standard_normal(4), r.standard_normal(4)),
         {"running_mean": r.standard_normal(4), "running_var": r.random(4) + 0.5, "training": False,
          "activation": "tanh"}),
        ("batch-nhwc-infer", "batch_norm", (x4, None, r.standard_normal(6)),
         {"channel_axis": -1, "running_mean": r.standard_normal(6), "running_var": r.random(6) + 0.5,
          "training": False}),
        ("group-nchw", "group_norm", (r.standard_normal((2, 6, 4, 5)), 3, c6, r.standard_normal(6)),
         {"activation": "gelu_tanh"}),
        ("group-nhwc", "group_norm", (r.standard_normal((2, 4, 5, 6)), 2, c6, r.standard_normal(6)),
         {"channel_axis": -1, "activation": "sigmoid"}),
        ("instance-nchw", "instance_norm", (x4, r.standard_normal(4), r.standard_normal(4)),
         {"running_mean": r.standard_normal(4), "running_var": r.random(4) + 0.5}),
        ("instance-nhwc", "instance_norm", (x4, c6, None), {"channel_axis": -1}),
        ("instance-infer", "instance_norm", (x4, None, None),
         {"running_mean": r.standard_normal(4), "running_var": r.random(4) + 0.5, "use_input_stats": False}),
    ]
    return specs


NORM_SPECS = norm_specs()
NORM_DTYPES = [("float32", False), ("float64", False), ("float16", False), ("float16", True), ("bfloat16", False),
               ("bfloat16", True)]


def _needs_for(call):
    needs = {"x"}
    if call.weight is not None:
        needs.add("weight")
    if call.bias is not None:
        needs.add("bias")
    return needs


@pytest.mark.parametrize("settings", list(NORM_SETTINGS))
@pytest.mark.parametrize("spec", NORM_SPECS, ids=[s[0] for s in NORM_SPECS])
def test_norm_launches_match_the_kernels(spec, settings, monkeypatch):
    for key, value in NORM_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    _, op, args, kwargs = spec
    for dtype, mixed in NORM_DTYPES:
        call = _call(op, args, kwargs, dtype, mixed)
        with recording() as launches:
            (y, rm, rv), res = cnorm.norm_forward(call)
            assert y.shape == call.x.shape and y.dtype == call.x.dtype
            if call.update_running:
                assert rm.shape == rv.shape == call.running_mean.shape
                assert rm.dtype == call.running_mean.dtype
            dy = np.zeros_like(call.x)
            needs = _needs_for(call)
            # Every subset of gradients (the dx-less one skips the dx kernels).
            for want in (needs, needs - {"x"}, {"x"}):
                grads = cnorm.norm_backward(res, (dy,), frozenset(want), {})
                assert set(grads) == set(want)
                for name, g in grads.items():
                    ref = call.arrays[name]
                    assert g.shape == ref.shape and g.dtype == ref.dtype, name
        assert launches, "no kernel was launched"


def _data_like(shape, dtype, seed):
    return stored(_rng(seed).standard_normal(shape), dtype)


def _emulated_norm_case(spec, dtype, mixed):
    _, op, args, kwargs = spec
    call = _call(op, args, kwargs, dtype, mixed)
    needs = frozenset(_needs_for(call))
    with emulating():
        (y, rm, rv), res = cnorm.norm_forward(call)
        dy = _data_like(y.shape, dtype, 7)
        grads = cnorm.norm_backward(res, (dy,), needs, {})
    (y_ref, rm_ref, rv_ref), grads_ref = reference_of(call, (dy,), needs)
    tol = TOL[dtype]
    assert rel_err(as_float64(y, dtype), y_ref) <= tol, "y"
    for name in needs:
        err = rel_err(as_float64(grads[name], dtype if name == "x" or not mixed else "float32"), grads_ref[name])
        assert err <= 4 * tol, f"d{name}: relative error {err:.2e}"
    if rm_ref is not None and call.update_running:
        pdt = "float32" if mixed else dtype
        assert rel_err(as_float64(rm, pdt), rm_ref) <= TOL[pdt], "running_mean"
        assert rel_err(as_float64(rv, pdt), rv_ref) <= TOL[pdt], "running_var"


@needs_emulator
@pytest.mark.parametrize("spec", NORM_SPECS, ids=[s[0] for s in NORM_SPECS])
def test_emulated_norm_every_dtype(spec, monkeypatch):
    """Every norm and dtype on the CPU emulator, small blocks: multi-block and merging passes run."""
    for key, value in NORM_SETTINGS["small"].items():
        monkeypatch.setattr(cnorm, key, value)
    for dtype, mixed in NORM_DTYPES:
        _emulated_norm_case(spec, dtype, mixed)


@needs_emulator
@pytest.mark.parametrize("settings", ["default", "row", "column"])
@pytest.mark.parametrize("spec", NORM_SPECS, ids=[s[0] for s in NORM_SPECS])
def test_emulated_norm_every_path(spec, settings, monkeypatch):
    for key, value in NORM_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    _emulated_norm_case(spec, "float32", False)


@pytest.mark.parametrize("settings", ["default", "small"])
def test_norm_zero_size(settings, monkeypatch):
    for key, value in NORM_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    call = _call("batch_norm", (np.zeros((0, 3, 4)), np.ones(3), np.zeros(3)), {})
    with recording() as launches:
        (y, _, _), res = cnorm.norm_forward(call)
        grads = cnorm.norm_backward(res, (np.zeros((0, 3, 4), np.float32),), frozenset({"x", "weight", "bias"}), {})
    assert y.shape == (0, 3, 4) and not launches
    assert np.all(grads["weight"] == 0) and np.all(grads["bias"] == 0)


def test_norm_backward_writes_into_given_buffers():
    r = _rng(1)
    call = _call("layer_norm", (r.standard_normal((4, 8)), r.standard_normal(8), r.standard_normal(8)), {})
    with recording():
        _, res = cnorm.norm_forward(call)
        out = {"x": np.empty((4, 8), np.float32), "weight": np.empty(8, np.float32)}
        grads = cnorm.norm_backward(res, (np.zeros((4, 8), np.float32),), frozenset({"x", "weight"}), out)
    assert grads["x"] is out["x"] and grads["weight"] is out["weight"]


@pytest.mark.parametrize("settings", list(NORM_SETTINGS))
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 7, 3, 1), (2, 1, 5, 100), (3, 50, 4, 2), (1, 1000, 2, 1),
                                   (100, 3, 2, 40), (0, 4, 3, 2), (2, 0, 3, 5)])
def test_norm_plan_covers_every_row(shape, settings, monkeypatch):
    for key, value in NORM_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    plan = cnorm.make_plan(shape, 1, 1)
    nn, pp, _, qq = shape
    assert plan.column == (qq < cnorm.COLUMN_MODE_BELOW and pp > 1)
    for chunks, rows, total in ((plan.chunks, plan.rows, pp), (plan.param_chunks, plan.param_rows, nn * pp)):
        assert chunks >= 1 and rows >= 1
        assert chunks * rows >= total and (chunks - 1) * rows < max(total, 1)
    assert 1 <= plan.splits <= 65535
    if plan.splits > 1:
        n = pp * qq
        chunk = -(-n // plan.splits)
        assert chunk * plan.splits >= n and chunk * (plan.splits - 1) < n
    if plan.column:
        assert nn * plan.chunks <= 65535


def test_block_sizes_are_checked(monkeypatch):
    monkeypatch.setattr(cnorm, "BLOCK", 48)
    call = _call("layer_norm", (_rng().standard_normal((4, 8)),), {})
    with recording(), pytest.raises(ValueError, match="BLOCK must be a power of two"):
        cnorm.norm_forward(call)
    call = _call("moments", (_rng().standard_normal((4, 80)),), {"axis": -1})
    with recording(), pytest.raises(ValueError, match="BLOCK must be a power of two"):
        cnorm.moments_forward(call)


def test_bfloat16_bit_helpers_round_to_nearest_even():
    values = np.array([1.0, -2.5, 1.00390625, 1.01171875, 3.0e38, np.inf, -np.inf, np.nan, 0.0], np.float32)
    bits = rt.float_to_bf16_bits(np, values)
    back = rt.bf16_bits_to_float(np, bits)
    torch = pytest.importorskip("torch")

    expected = torch.tensor(values).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(back, expected)


# --------------------------------------------------------------------------- GPU: against the reference


def _to_device(a, dtype, lib):
    """A NumPy argument on the device (float data in ``dtype``; integer labels as int64)."""
    if not isinstance(a, np.ndarray):
        return a
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
    return a


def _dtype_name(a) -> str:
    """A CuPy or torch array's dtype name (``"float32"``, ``"bfloat16"`` …)."""
    return str(a.dtype).removeprefix("torch.")


def gpu_compare(spec, dtype, mixed, tol_factor=1.0, tol=None):
    """Forward and every gradient of ``spec`` forced onto ``cupy`` vs the float64 reference.

    Cotangents take each output's own dtype (float32 statistics of half data, for ``moments``);
    ``tol``, when given, bounds outputs and gradients alike (else ``TOL[dtype] * tol_factor`` the
    outputs and four times that the gradients).
    """
    _, op, args, kwargs = spec
    lib = _gpu_lib(dtype)
    pdt = "float32" if mixed else dtype
    data = (0, 1) if op == "cross_entropy" else (0,)
    dev_args = [_to_device(a, dtype if k in data else pdt, lib) for k, a in enumerate(args)]
    dev_kwargs = {k: _to_device(v, pdt, lib) for k, v in kwargs.items()}
    ref_args = [_host(a) for a in dev_args]  # the rounded values the device sees, in float64
    ref_kwargs = {k: _host(v) for k, v in dev_kwargs.items()}
    with pnn.use_backend("cupy"):
        assert pnn.explain(op, *dev_args, **dev_kwargs).backend == "cupy"
        y, pullback = pnn.vjp(op, *dev_args, **dev_kwargs)
        ys = y if isinstance(y, tuple) else (y,)
        dys = tuple(_to_device(np.asarray(_rng(5 + k).standard_normal(tuple(v.shape))), _dtype_name(v), lib)
                    for k, v in enumerate(ys))
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


@pytest.mark.gpu
@pytest.mark.parametrize("settings", list(NORM_SETTINGS))
@pytest.mark.parametrize("dtype,mixed", NORM_DTYPES, ids=[f"{d}{'+f32' if m else ''}" for d, m in NORM_DTYPES])
@pytest.mark.parametrize("spec", NORM_SPECS, ids=[s[0] for s in NORM_SPECS])
def test_gpu_norm_matches_reference(spec, dtype, mixed, settings, monkeypatch):
    for key, value in NORM_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    gpu_compare(spec, dtype, mixed, tol_factor=4.0 if dtype in ("float16", "bfloat16") else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("settings", ["default", "small"])
def test_gpu_norm_bitwise_deterministic(settings, monkeypatch):
    import cupy

    for key, value in NORM_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    r = _rng(3)
    x = cupy.asarray(r.standard_normal((64, 32, 9)).astype(np.float32))
    dy = cupy.asarray(r.standard_normal((64, 32, 9)).astype(np.float32))
    w = cupy.asarray(r.standard_normal(32).astype(np.float32))
    results = []
    with pnn.use_backend("cupy"):
        for _ in range(2):
            y, pb = pnn.vjp(pnn.batch_norm, x, w, w, activation="gelu")
            results.append([y, *pb(dy)])
    for a, b in zip(*results):
        assert bool((a == b).all())


# --------------------------------------------------------------------------- generic: emulated against the reference


def assert_matches(actual, expected, tol, what):
    """Relative error within ``tol``; NaN and ±inf must sit at the same places."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    special = ~np.isfinite(e)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(a[special & ~np.isnan(e)], e[special & ~np.isnan(e)], err_msg=f"{what}: inf")
    if (~special).any():
        err = rel_err(a[~special], e[~special])
        assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.1e}"


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


from kernels_gpu.cuda_c import loss as closs  # noqa: E402
from kernels_gpu.cuda_c import pool as cpool  # noqa: E402

ALL_DTYPES = [("float32", False), ("float64", False), ("float16", False), ("bfloat16", False)]


def pool_specs():
    r = _rng(2)
    ties = np.round(r.standard_normal((2, 3, 7, 6)))  # many equal values: the first maximum wins
    nan = r.standard_normal((2, 2, 6, 6))
    nan[0, 0, 1, 1] = np.nan
    nan[1, 1, 4, 2:4] = np.nan
    return [
        ("max2d-pad-ceil", "max_pool", (ties, 3), {"stride": 2, "padding": 1, "ceil_mode": True}),
        ("max1d-nlc-dil", "max_pool", (r.standard_normal((3, 9, 4)), (3,)),
         {"stride": 2, "dilation": 2, "channel_axis": -1}),
        ("max3d", "max_pool", (r.standard_normal((1, 2, 5, 4, 6)), 2), {}),
        ("max2d-unbatched-overlap", "max_pool", (ties[0], (2, 3)), {"stride": 1}),
        ("max-nan", "max_pool", (nan, 2), {}),
        ("max-pad-only-windows", "max_pool", (r.standard_normal((1, 2, 3, 3)), 2),
         {"stride": 2, "padding": 1, "ceil_mode": True}),
        ("avg2d-exclude-pad-ceil", "avg_pool", (r.standard_normal((2, 3, 7, 6)), 3),
         {"stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False}),
        ("avg2d-nhwc", "avg_pool", (r.standard_normal((2, 5, 6, 3)), 2), {"padding": 1, "channel_axis": -1}),
        ("avg1d-overlap", "avg_pool", (r.standard_normal((2, 3, 9)), 4), {"stride": 3, "padding": 2}),
        ("avg3d-unbatched", "avg_pool", (r.standard_normal((2, 4, 5, 6)), (2, 2, 2)), {"stride": (1, 2, 2)}),
    ]


POOL_SPECS = pool_specs()


@needs_emulator
@pytest.mark.parametrize("spec", POOL_SPECS, ids=[s[0] for s in POOL_SPECS])
def test_emulated_pool(spec, monkeypatch):
    monkeypatch.setattr(cpool, "BLOCK", 32)
    monkeypatch.setattr(cpool, "MAX_BLOCKS", 3)  # the kernels' grid-stride loops run
    for dtype, mixed in ALL_DTYPES:
        emulated_case(cpool, "pool_forward", "pool_backward", spec, dtype, mixed, {"x"})


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
    ]


LOSS_SPECS = loss_specs()


@needs_emulator
@pytest.mark.parametrize("spec", LOSS_SPECS, ids=[s[0] for s in LOSS_SPECS])
def test_emulated_loss(spec, monkeypatch):
    monkeypatch.setattr(closs, "BLOCK", 32)
    monkeypatch.setattr(closs, "MAX_BLOCKS", 2)
    monkeypatch.setattr(closs, "REDUCE_BLOCK", 32)
    _, op, args, kwargs = spec
    probabilities = op == "cross_entropy" and args[1].dtype.kind == "f"
    dtypes = ALL_DTYPES + ([("float16", True), ("bfloat16", True)] if "weight" in kwargs else [])
    for dtype, mixed in dtypes:
        fwd, bwd = f"{op}_forward", f"{op}_backward"
        needs = {"x"} if op == "log_softmax" else ({"logits", "target"} if probabilities else {"logits"})
        emulated_case(closs, fwd, bwd, spec, dtype, mixed, needs, tol_factor=2.0)


from kernels_gpu.cuda_c import conv as cconv  # noqa: E402
from kernels_gpu.cuda_c import dense as cdense  # noqa: E402

GEMM_DTYPES = [("float32", False), ("float64", False)]


def dense_specs():
    r = _rng(6)
    return [
        ("dense-bias-gelu", "dense", (r.standard_normal((5, 7)), r.standard_normal((4, 7)), r.standard_normal(4)),
         {"activation": "gelu"}),
        ("dense-3d-relu", "dense", (r.standard_normal((2, 3, 7)), r.standard_normal((9, 7)), r.standard_normal(9)),
         {"activation": "relu"}),
        ("dense-1d-nobias-tanh", "dense", (r.standard_normal(7), r.standard_normal((4, 7))), {"activation": "tanh"}),
        ("dense-identity-bias", "dense", (r.standard_normal((40, 3)), r.standard_normal((5, 3)), r.standard_normal(5)),
         {}),
        ("dense-plain", "dense", (r.standard_normal((4, 3)), r.standard_normal((5, 3))), {}),
        ("dense-zero-rows", "dense", (np.zeros((0, 3)), r.standard_normal((5, 3)), r.standard_normal(5)),
         {"activation": "silu"}),
    ]


def conv_specs():
    r = _rng(7)
    return [
        ("conv2d-pad-stride-bias-relu", "conv", (r.standard_normal((2, 4, 7, 6)), r.standard_normal((6, 4, 3, 3)),
                                                 r.standard_normal(6)),
         {"stride": 2, "padding": 1, "activation": "relu"}),
        ("conv2d-groups-dilation", "conv", (r.standard_normal((2, 4, 7, 8)), r.standard_normal((6, 2, 2, 3)),
                                            r.standard_normal(6)),
         {"dilation": (2, 1), "groups": 2, "padding": ((1, 0), (2, 1))}),
        ("conv2d-nhwc-same-silu", "conv", (r.standard_normal((2, 5, 6, 4)), r.standard_normal((3, 4, 3, 3)),
                                           r.standard_normal(3)),
         {"padding": "same", "channel_axis": -1, "activation": "silu"}),
        ("conv1d-depthwise", "conv", (r.standard_normal((3, 4, 9)), r.standard_normal((4, 1, 3))),
         {"groups": 4, "stride": 2, "padding": 1}),
        ("conv1d-unbatched-nlc", "conv", (r.standard_normal((9, 3)), r.standard_normal((2, 3, 2)),
                                          r.standard_normal(2)), {"channel_axis": -1, "activation": "gelu_tanh"}),
        ("conv3d", "conv", (r.standard_normal((1, 2, 4, 5, 4)), r.standard_normal((3, 2, 2, 3, 2)),
                            r.standard_normal(3)), {"stride": (1, 2, 1), "padding": 1}),
        ("conv2d-1x1-direct", "conv", (r.standard_normal((2, 4, 3, 5)), r.standard_normal((6, 4, 1, 1)),
                                       r.standard_normal(6)), {"activation": "sigmoid"}),
        ("conv2d-1x1-direct-plain", "conv", (r.standard_normal((2, 4, 3, 5)), r.standard_normal((6, 4, 1, 1))), {}),
    ]


DENSE_SPECS = dense_specs()
CONV_SPECS = conv_specs()


def _gemm_needs(call):
    needs = {"x", "weight"}
    if call.bias is not None:
        needs.add("bias")
    return needs


@needs_emulator
@pytest.mark.parametrize("spec", DENSE_SPECS + CONV_SPECS, ids=[s[0] for s in DENSE_SPECS + CONV_SPECS])
def test_emulated_dense_conv(spec, monkeypatch):
    for module in (cdense, cconv):
        monkeypatch.setattr(module, "BLOCK", 32)
        monkeypatch.setattr(module, "MAX_BLOCKS", 3)
    monkeypatch.setattr(cdense, "GRAD_BLOCK", (32, 2))
    monkeypatch.setattr(cdense, "TARGET_BLOCKS", 8)
    monkeypatch.setattr(cdense, "FINALIZE_BLOCK", 32)
    module = cdense if spec[1] == "dense" else cconv
    for dtype, mixed in GEMM_DTYPES:
        call = _call(spec[1], spec[2], spec[3], dtype, mixed)
        for needs in (_gemm_needs(call), {"weight"}, {"x"}):
            emulated_case(module, f"{spec[1]}_forward", f"{spec[1]}_backward", spec, dtype, mixed, needs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,mixed", ALL_DTYPES, ids=[d for d, _ in ALL_DTYPES])
@pytest.mark.parametrize("spec", POOL_SPECS + LOSS_SPECS, ids=[s[0] for s in POOL_SPECS + LOSS_SPECS])
def test_gpu_pool_loss_match_reference(spec, dtype, mixed):
    gpu_compare(spec, dtype, mixed, tol_factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec", DENSE_SPECS + CONV_SPECS, ids=[s[0] for s in DENSE_SPECS + CONV_SPECS])
def test_gpu_dense_conv_match_reference(spec, dtype):
    gpu_compare(spec, dtype, False, tol_factor=2.0)


@pytest.mark.gpu
def test_gpu_torch_tensors_run_zero_copy_on_the_current_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pnn.use_backend("cupy"):
        assert pnn.explain(pnn.layer_norm, x, w).backend == "cupy"
        y = pnn.layer_norm(x, w, activation="gelu")
    stream.synchronize()
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    expected = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x.float(), (16,), w))
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


from kernels_gpu.cuda_c import rnn as crnn  # noqa: E402


def cell_specs():
    r = _rng(8)
    n, i, h = 3, 4, 5

    def weights(g, bias=True):
        return (r.standard_normal((g * h, i)) * 0.5, r.standard_normal((g * h, h)) * 0.5,
                r.standard_normal(g * h) if bias else None, r.standard_normal(g * h) if bias else None)

    x, h0, c0 = r.standard_normal((n, i)), r.standard_normal((n, h)), r.standard_normal((n, h))
    return [
        ("rnn-tanh", "rnn_cell", (x, h0, *weights(1)), {}),
        ("rnn-relu-nobias", "rnn_cell", (x, h0, *weights(1, False)), {"activation": "relu"}),
        ("rnn-unbatched", "rnn_cell", (x[0], h0[0], *weights(1)), {}),
        ("lstm", "lstm_cell", (x, h0, c0, *weights(4)), {}),
        ("lstm-unbatched-nobias", "lstm_cell", (x[1], h0[1], c0[1], *weights(4, False)), {}),
        ("gru-reset-after", "gru_cell", (x, h0, *weights(3)), {}),
        ("gru-reset-before", "gru_cell", (x, h0, *weights(3)), {"reset_after": False}),
        ("gru-reset-before-nobias-unbatched", "gru_cell", (x[2], h0[2], *weights(3, False)), {"reset_after": False}),
    ]


CELL_SPECS = cell_specs()


@needs_emulator
@pytest.mark.parametrize("spec", CELL_SPECS, ids=[s[0] for s in CELL_SPECS])
def test_emulated_cells(spec, monkeypatch):
    monkeypatch.setattr(crnn, "BLOCK", 32)
    monkeypatch.setattr(crnn, "MAX_BLOCKS", 1)
    for dtype, mixed in GEMM_DTYPES:
        call = _call(spec[1], spec[2], spec[3], dtype, mixed)
        names = [k for k in ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh") if call.arrays.get(k) is not None]
        for needs in (set(names), {"w_hh"}, {"h"}):
            emulated_case(crnn, "cell_forward", "cell_backward", spec, dtype, mixed, needs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec", CELL_SPECS, ids=[s[0] for s in CELL_SPECS])
def test_gpu_cells_match_reference(spec, dtype):
    gpu_compare(spec, dtype, False, tol_factor=2.0)


# --------------------------------------------------------------------------- moments


#: Settings of the moments paths: the defaults, small blocks (multi-block rows and columns, split
#: groups and the merging pass, even for tiny groups) and every group summed by one thread.
MOMENT_SETTINGS = {
    "default": {},
    "small": {**SMALL_NORM, "MOMENTS_THREAD_BELOW": 2},
    "threads": {**SMALL_NORM, "MOMENTS_THREAD_BELOW": 10**9},
}
#: Tolerances of forced-backend moments results against the float64 reference.
MOMENT_TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def moment_specs():
    """(id, op, args, kwargs): rows, columns, middle axes, offset tables, every edge case."""
    r = _rng(9)

    def x(shape, offset=1.0):
        return r.normal(offset, 2.0, shape)

    return [
        ("rows-last", "moments", (x((5, 40)),), {"axis": -1}),
        ("rows-all-one-long-row", "moments", (x((300,)),), {"correction": 1}),
        ("rows-nchw-batch-stats", "moments", (x((3, 4, 5, 6)),), {"axis": (0, 2, 3), "keepdims": True}),
        ("rows-tables", "moments", (x((2, 3, 2, 4, 6)),), {"axis": (-1, 0, 2), "correction": 2.5}),
        ("cols-axis0", "moments", (x((40, 5)),), {"axis": 0, "correction": 1}),
        ("cols-wide-tiles", "moments", (x((3, 70)),), {"axis": 0}),
        ("cols-middle", "moments", (x((3, 7, 4)),), {"axis": 1, "keepdims": True}),
        ("cols-tables", "moments", (x((2, 3, 2, 3, 2, 3)),), {"axis": (3, 1)}),
        ("small-groups", "moments", (x((6, 3)),), {"axis": 1}),
        ("scalar", "moments", (x(()),), {}),
        ("keep-all", "moments", (x((2, 3)),), {"axis": ()}),
        ("correction-at-least-n", "moments", (x((2, 3)),), {"axis": 0, "correction": 2}),
        ("empty-reduction", "moments", (np.zeros((0, 3)),), {"axis": 0}),
        ("empty-groups", "moments", (np.zeros((3, 0)),), {"axis": 0, "keepdims": True}),
        ("offset-rows", "moments", (x((4, 64), 1e4),), {"axis": -1}),
        ("offset-cols", "moments", (x((64, 3), 1e4),), {"axis": 0, "correction": 1}),
    ]


MOMENT_SPECS = moment_specs()
#: The cotangent pairs each moments backward runs with (None: what a direct kernel call may pass).
MOMENT_COTANGENTS = ("both", "mean", "var", "none")


def _moment_cotangents(outputs, which, seed=11):
    acc = str(outputs[0].dtype)
    pair = tuple(_rng(seed + k).standard_normal(tuple(o.shape)).astype(acc) for k, o in enumerate(outputs))
    return {"both": pair, "mean": (pair[0], None), "var": (None, pair[1]), "none": (None, None)}[which]


@pytest.mark.parametrize("settings", list(MOMENT_SETTINGS))
@pytest.mark.parametrize("spec", MOMENT_SPECS, ids=[s[0] for s in MOMENT_SPECS])
def test_moments_launches_match_the_kernels(spec, settings, monkeypatch):
    for key, value in MOMENT_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    _, op, args, kwargs = spec
    for dtype, _ in ALL_DTYPES:
        call = _call(op, args, kwargs, dtype)
        with recording() as launches:
            (mean, var), res = cnorm.moments_forward(call)
            shape = tuple(1 if i in call.axes else n for i, n in enumerate(call.x.shape)
                          if call.keepdims or i not in call.axes)
            assert mean.shape == var.shape == shape and str(mean.dtype) == rt.acc_dtype(dtype)
            for which in MOMENT_COTANGENTS:
                grads = cnorm.moments_backward(res, _moment_cotangents((mean, var), which), frozenset({"x"}), {})
                assert grads["x"].shape == call.x.shape and grads["x"].dtype == call.x.dtype
            assert cnorm.moments_backward(res, _moment_cotangents((mean, var), "both"), frozenset(), {}) == {}
        assert bool(launches) == (call.x.size > 0), "kernels run exactly when there is data"


@needs_emulator
@pytest.mark.parametrize("settings", list(MOMENT_SETTINGS))
@pytest.mark.parametrize("spec", MOMENT_SPECS, ids=[s[0] for s in MOMENT_SPECS])
def test_emulated_moments(spec, settings, monkeypatch):
    """Every path and dtype on the CPU emulator against the reference (None cotangents as zeros)."""
    for key, value in MOMENT_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    _, op, args, kwargs = spec
    dtypes = ALL_DTYPES if settings == "small" else [("float32", False), ("float64", False)]
    for dtype, _ in dtypes:
        call = _call(op, args, kwargs, dtype)
        with emulating():
            outputs, res = cnorm.moments_forward(call)
            grads = {which: cnorm.moments_backward(res, _moment_cotangents(outputs, which), frozenset({"x"}), {})["x"]
                     for which in MOMENT_COTANGENTS}
        tol = MOMENT_TOL[dtype]
        for which, got in grads.items():
            cts = tuple(np.zeros(o.shape) if c is None else c
                        for o, c in zip(outputs, _moment_cotangents(outputs, which)))
            ref_outputs, ref_grads = reference_of(call, cts, frozenset({"x"}))
            assert_matches(as_float64(got, dtype), ref_grads["x"], tol, f"dx ({which}, {dtype})")
        for got, want, what in zip(outputs, ref_outputs, ("mean", "var")):
            assert_matches(got, want, tol, f"{what} ({dtype})")


def test_moments_backward_writes_into_the_given_buffer():
    call = _call("moments", (_rng(2).standard_normal((4, 8)),), {"axis": 0})
    with recording():
        outputs, res = cnorm.moments_forward(call)
        out = {"x": np.empty((4, 8), np.float32)}
        grads = cnorm.moments_backward(res, _moment_cotangents(outputs, "both"), frozenset({"x"}), out)
    assert grads["x"] is out["x"]


@pytest.mark.parametrize("shape, axes, path", [((4, 1000), (1,), "rows"), ((8, 3), (1,), "small"),
                                               ((1000, 4), (0,), "cols"), ((6, 50, 7), (1,), "cols"),
                                               ((6, 5, 7), (1,), "small"), ((4, 3, 64), (0, 2), "rows")])
def test_moments_path_choice(shape, axes, path):
    from portable_nn.kernel_plans import moments_plan

    assert cnorm.moments_path(moments_plan(shape, axes)) == path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("settings", ["default", "small"])
@pytest.mark.parametrize("spec", MOMENT_SPECS, ids=[s[0] for s in MOMENT_SPECS])
def test_gpu_moments_match_reference(spec, settings, dtype, monkeypatch):
    for key, value in MOMENT_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    gpu_compare(spec, dtype, False, tol=MOMENT_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("settings", ["default", "small"])
def test_gpu_moments_bitwise_deterministic(settings, monkeypatch):
    import cupy

    for key, value in MOMENT_SETTINGS[settings].items():
        monkeypatch.setattr(cnorm, key, value)
    x = cupy.asarray(_rng(3).standard_normal((64, 32, 9)).astype(np.float32))
    results = []
    with pnn.use_backend("cupy"):
        for axis in ((0, 2), 0, -1, None):
            for _ in range(2):
                (mean, var), pullback = pnn.vjp(pnn.moments, x, axis)
                results.append((mean, var, pullback((mean, var)).x))
    for first, second in zip(results[::2], results[1::2]):
        for a, b in zip(first, second):
            assert bool((a == b).all())


def test_activation_codes_are_the_python_ones():
    """common.cuh spells the activation codes as PNN_ACT_* macros: the same numbers as
    portable_nn.kernel_codes (which the API and the Numba kernels use), one macro per name."""
    from pathlib import Path

    from portable_nn.kernel_codes import ACTIVATION_CODES

    header = (Path(rt.__file__).parent / "common.cuh").read_text()
    macros = {name.lower(): int(code) for name, code in re.findall(r"#define PNN_ACT_(\w+) (\d+)", header)}
    assert macros == ACTIVATION_CODES
    assert not re.search(r"case \d+:", header.split("act_fwd", 1)[1].split("block reductions", 1)[0])


def test_cell_family_codes_are_the_python_ones():
    """rnn.cu's KIND_* macros are portable_nn.kernel_codes.CELL_FAMILIES: one numbering of the recurrent cells."""
    from pathlib import Path

    from portable_nn.kernel_codes import CELL_FAMILIES

    source = (Path(rt.__file__).parent / "rnn.cu").read_text()
    macros = {name.lower(): int(code) for name, code in re.findall(r"#define KIND_(\w+) (\d+)", source)}
    assert macros == CELL_FAMILIES
