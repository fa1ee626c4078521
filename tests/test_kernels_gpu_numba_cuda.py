"""Numba-CUDA kernels (backend ``"numba_cuda"``), verified without a GPU and, where one is, on it.

* declarations: what the backend registers, that importing it loads neither numba.cuda nor
  cupy, and that a machine without a GPU reports it unavailable;
* PTX: every kernel compiles with ``numba.cuda.compile_ptx`` for every dtype variant's explicit
  signature at sm_80, and at sm_90 (float32 variants by default, all with ``-m slow``);
* simulator: ``tests/_numba_cuda_sim_checks.py`` runs every case in a subprocess with
  ``NUMBA_ENABLE_CUDASIM=1`` (whole launch path on NumPy arrays, tiny blocks so the multi-block
  and second-pass paths run) and each case's outputs and gradients must match the reference;
* ``-m gpu``: each op and gradient forced onto ``numba_cuda`` with CuPy arrays, compared with
  the float64 reference on the host, with ``explain`` confirming the backend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import dispatch

HERE = Path(__file__).resolve().parent
import _numba_cuda_sim_checks as sim  # noqa: E402  (tests/ is on pytest's pythonpath)

HAS_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
needs_numba_cuda = pytest.mark.skipif(not HAS_NUMBA_CUDA, reason="numba-cuda is not installed")

NORMS = ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm")
#: Ops the backend declares (the others fall back under auto, raise when forced).
POOLS = ("max_pool", "avg_pool")
DECLARED = ("moments", *NORMS, "log_softmax", *POOLS, "cross_entropy", "dense", "conv")


# --------------------------------------------------------------------------- declarations


@pytest.mark.parametrize("op", DECLARED)
def test_declared_support(op):
    impl = next(i for i in dispatch.implementations(op) if i.backend == "numba_cuda")
    s = impl.supports
    assert s.families == ("cupy", "torch") and s.devices == ("cuda",) and s.native == "cupy"
    assert impl.backward is not None and s.contiguous
    assert set(s.dtypes) == {"float16", "bfloat16", "float32", "float64"}
    if op in (*NORMS, "cross_entropy", "dense", "conv"):
        assert s.mixed_precision
    if op in (*POOLS, "conv"):
        assert set(s.layouts) == {"channels_first", "channels_last"}


def test_import_loads_neither_numba_cuda_nor_cupy():
    code = (
        "import sys, portable_nn as pnn, kernels_gpu.numba_cuda\n"
        "from portable_nn import dispatch\n"
        "assert any(i.backend == 'numba_cuda' for i in dispatch.implementations('layer_norm'))\n"
        "bad = [m for m in ('numba.cuda', 'cupy', 'numba_cuda') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=HERE.parent, timeout=120)


def test_without_a_gpu_forcing_raises_and_auto_falls_back():
    if pnn.available_backends()["numba_cuda"]:
        pytest.skip("a GPU is available here")
    x = np.ones((2, 3), np.float32)
    with pnn.use_backend("numba_cuda"), pytest.raises(pnn.BackendUnavailableError, match="numba_cuda"):
        pnn.layer_norm(x)
    assert pnn.explain(pnn.layer_norm, x).backend != "numba_cuda"


# --------------------------------------------------------------------------- PTX


def _kernel_specs():
    if not HAS_NUMBA_CUDA:
        return []
    from kernels_gpu.numba_cuda import _runtime, conv, dense, loss, norm, pool  # noqa: F401  (modules declare their kernels)

    return list(_runtime.KERNELS)


_SPECS = _kernel_specs()


def _ptx_params():
    params = []
    for spec in _SPECS:
        for sig in spec.signatures:
            variant = sig[sig.index("(") + 1:].split("[")[0]
            params.append(pytest.param(spec, sig, (8, 0), id=f"{spec.name.rsplit('.', 1)[1]}-{variant}-sm80"))
            mark = () if variant == "float32" else (pytest.mark.slow,)
            params.append(pytest.param(spec, sig, (9, 0), marks=mark,
                                       id=f"{spec.name.rsplit('.', 1)[1]}-{variant}-sm90-{len(params)}"))
    return params


@pytest.fixture
def target_device(monkeypatch):
    """numba-cuda compiles device functions for the *current* device while typing a kernel; without a
    driver there is none, so a stand-in with the target compute capability answers instead."""
    import numba.cuda.dispatcher as dispatcher

    class Target:
        compute_capability = (8, 0)

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: Target)
    return Target


@needs_numba_cuda
@pytest.mark.parametrize(("spec", "signature", "cc"), _ptx_params())
def test_kernel_compiles_to_ptx(spec, signature, cc, target_device):
    from numba import cuda

    target_device.compute_capability = cc
    ptx, _ = cuda.compile_ptx(spec.py_func, signature, cc=cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx


def test_every_kernel_is_declared_with_signatures():
    if not HAS_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    names = [s.name for s in _SPECS]
    assert len(names) == len(set(names))
    for spec in _SPECS:
        assert spec.signatures, spec.name
    assert any(n.endswith("norm._row_forward") for n in names)
    assert any(n.endswith("loss._lsm_backward") for n in names)
    assert any(n.endswith("pool._max_backward") for n in names)
    assert any(n.endswith("loss._ce_backward") for n in names)
    assert any(n.endswith("dense._activation_grad") for n in names)
    assert any(n.endswith("conv._col2im") for n in names)
    for kernel in ("_mom_rows", "_mom_small", "_mom_cols", "_mom_finalize", "_mom_dx"):
        assert any(n.endswith(f"norm.{kernel}") for n in names), kernel


# --------------------------------------------------------------------------- simulator


@pytest.fixture(scope="module")
def simulator_results():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "_numba_cuda_sim_checks.py")], capture_output=True, text=True,
                          env=env, cwd=HERE.parent, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["id"]] = r
    if proc.returncode != 0 or not results:
        pytest.fail(f"simulator run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


@needs_numba_cuda
@pytest.mark.parametrize("case_id", sim.CASES)
def test_simulator_matches_reference(case_id, simulator_results):
    r = simulator_results.get(case_id)
    assert r is not None, f"{case_id} did not report"
    assert "error" not in r, r.get("traceback", r.get("error"))
    bad = {k: v for k, v in r["errors"].items() if not v <= r["tol"]}
    assert not bad, f"relative errors above {r['tol']:.0e}: {bad}"


@needs_numba_cuda
def test_simulator_covers_every_norm_path(simulator_results):
    paths = {p for r in simulator_results.values() for p in r.get("paths", ())}
    assert {"row", "seg", "column"} <= paths
    assert {"moments-rows", "moments-small", "moments-cols", "moments-empty"} <= paths


def test_moments_plan_and_paths_without_a_gpu():
    """The host planning of every moments path (pure Python): the split groups cover every row once."""
    if not HAS_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    from kernels_gpu.numba_cuda import _runtime as rt
    from kernels_gpu.numba_cuda import norm as gn
    from portable_nn.kernel_plans import moments_plan

    for shape, axes, path in [((4, 1000), (1,), "rows"), ((8, 3), (1,), "small"), ((1000, 4), (0,), "cols"),
                              ((6, 50, 7), (1,), "cols"), ((6, 5, 7), (1,), "small"), ((4, 3, 64), (0, 2), "rows")]:
        plan = moments_plan(shape, axes)
        assert gn.moments_path(plan) == path, (shape, axes)
        for rows in (1, 7, 1000):
            for width in (1, 32):
                rper, splits = gn._unit_splits(3, rows, width)
                assert splits * rper >= rows > (splits - 1) * rper
    with rt.use_settings(column_below=2):
        assert gn.moments_path(moments_plan((8, 3), (1,))) == "rows"


# --------------------------------------------------------------------------- on a GPU


def _gpu_norm_args(op, rng, dtype, layout):
    x = rng.standard_normal((4, 6, 5)) + 2.0
    c = 6 if layout == "channels_first" else 5
    axis = 1 if layout == "channels_first" else -1
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    if op == "layer_norm":
        return (x, rng.standard_normal(5), rng.standard_normal(5)), {"activation": "gelu"}
    if op == "rms_norm":
        return (x, rng.standard_normal(5)), {}
    if op == "group_norm":
        return (x, 3 if layout == "channels_first" else 5, w, b), {"channel_axis": axis, "activation": "silu"}
    kw = {"channel_axis": axis, "running_mean": rng.standard_normal(c), "running_var": rng.random(c) + 0.5,
          "return_stats": True}
    return (x, w, b), kw


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("op", NORMS)
def test_gpu_norms_match_reference(op, layout, dtype):
    import cupy

    rng = np.random.default_rng(0)
    args, kw = _gpu_norm_args(op, rng, dtype, layout)
    pdt = "float32" if dtype == "float16" else dtype

    def on_gpu(a, dt):
        return cupy.asarray(np.asarray(a).astype(dt)) if isinstance(a, np.ndarray) else a

    gargs = [on_gpu(args[0], dtype)] + [on_gpu(a, pdt) for a in args[1:]]
    gkw = {k: on_gpu(v, pdt) for k, v in kw.items()}
    hargs = [np.asarray(cupy.asnumpy(a), np.float64) if isinstance(a, cupy.ndarray) else a for a in gargs]
    hkw = {k: (np.asarray(cupy.asnumpy(v), np.float64) if isinstance(v, cupy.ndarray) else v) for k, v in gkw.items()}
    fn = getattr(pnn, op)
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(fn, *gargs, **gkw).backend == "numba_cuda"
        y, pullback = pnn.vjp(fn, *gargs, **gkw)
        dy = rng.standard_normal(tuple(gargs[0].shape))
        grads = pullback(cupy.asarray(dy.astype(dtype)))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(fn, *hargs, **hkw)
        g_ref = pull_ref(np.asarray(dy.astype(dtype), np.float64))
    tol = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3}[dtype]
    outs = y if isinstance(y, tuple) else (y,)
    refs = y_ref if isinstance(y_ref, tuple) else (y_ref,)
    for a, e in zip(outs, refs):
        assert sim.rel(cupy.asnumpy(a).astype(np.float64), e) <= tol
    for name in g_ref._fields:
        e = getattr(g_ref, name)
        if e is not None:
            assert sim.rel(cupy.asnumpy(getattr(grads, name)).astype(np.float64), e) <= 10 * tol, name


@pytest.mark.gpu
def test_gpu_bfloat16_torch_layer_norm():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((8, 64)), dtype=torch.bfloat16, device="cuda")
    w = torch.tensor(rng.standard_normal(64), dtype=torch.float32, device="cuda")
    b = torch.tensor(rng.standard_normal(64), dtype=torch.float32, device="cuda")
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(pnn.layer_norm, x, w, b).backend == "numba_cuda"
        y = pnn.layer_norm(x, w, b)
    expected = torch.nn.functional.layer_norm(x.double(), (64,), w.double(), b.double())
    assert y.dtype == torch.bfloat16
    assert sim.rel(y.double().cpu().numpy(), expected.cpu().numpy()) <= 1.6e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("shape", "axis"), [((5, 37), -1), ((3, 300, 4), 1), ((2050,), 0)])
def test_gpu_log_softmax_matches_reference(shape, axis, dtype):
    import cupy

    rng = np.random.default_rng(0)
    x = (3.0 * rng.standard_normal(shape)).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gx = cupy.asarray(x)
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(pnn.log_softmax, gx, axis=axis).backend == "numba_cuda"
        y, pullback = pnn.vjp(pnn.log_softmax, gx, axis=axis)
        (dx,) = pullback(cupy.asarray(dy))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(pnn.log_softmax, x.astype(np.float64), axis=axis)
        (dx_ref,) = pull_ref(dy.astype(np.float64))
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}[dtype]
    assert sim.rel(cupy.asnumpy(y).astype(np.float64), y_ref) <= tol
    assert sim.rel(cupy.asnumpy(dx).astype(np.float64), dx_ref) <= tol


def _gpu_vjp_check(fn, gargs, hargs, kw, tol, wrt=None):
    """Forward and gradients of ``fn`` forced onto numba_cuda (CuPy) against the float64 reference."""
    import cupy

    rng = np.random.default_rng(1)
    vjp_kw = {} if wrt is None else {"wrt": wrt}
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(fn, *gargs, **kw).backend == "numba_cuda"
        y, pullback = pnn.vjp(fn, *gargs, **kw, **vjp_kw)
        dy = rng.standard_normal(tuple(y.shape))
        grads = pullback(cupy.asarray(dy.astype(y.dtype)))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(fn, *hargs, **kw, **vjp_kw)
        g_ref = pull_ref(np.asarray(dy.astype(y.dtype), np.float64))
    assert sim.rel(cupy.asnumpy(y).astype(np.float64), y_ref) <= tol
    for name in g_ref._fields:
        e = getattr(g_ref, name)
        if e is not None:
            assert sim.rel(cupy.asnumpy(getattr(grads, name)).astype(np.float64), e) <= 10 * tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("op", "shape", "kw"), [
    ("max_pool", (2, 3, 11, 9), {"window": 3, "stride": 2, "padding": 1, "dilation": (2, 1), "ceil_mode": True}),
    ("max_pool", (2, 6, 7, 4), {"window": (2, 2), "channel_axis": -1}),
    ("max_pool", (3, 17), {"window": (4,), "stride": 3, "padding": 2}),
    ("avg_pool", (2, 3, 5, 6, 7), {"window": 3, "stride": 2, "padding": 1, "count_include_pad": False,
                                   "ceil_mode": True}),
    ("avg_pool", (2, 9, 8, 5), {"window": 3, "padding": 1, "channel_axis": -1}),
])
def test_gpu_pools_match_reference(op, shape, kw, dtype):
    import cupy

    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}[dtype]
    _gpu_vjp_check(getattr(pnn, op), (cupy.asarray(x),), (x.astype(np.float64),), kw, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("shape", "axis", "kw", "probabilities"), [
    ((37, 1000), 1, {"label_smoothing": 0.1, "ignore_index": 3}, False),
    ((4, 7, 5, 3), 1, {"reduction": "sum", "weighted": True}, False),
    ((3, 5, 11), -1, {"reduction": "none", "weighted": True, "label_smoothing": 0.2}, False),
    ((3000, 3), 1, {"weighted": True}, False),
    ((6, 9, 4), 1, {"label_smoothing": 0.3, "weighted": True}, True),
    ((5, 2, 300), -1, {"reduction": "none"}, True),
])
def test_gpu_cross_entropy_matches_reference(shape, axis, kw, probabilities, dtype):
    import cupy

    rng = np.random.default_rng(0)
    kw = dict(kw)
    classes = shape[axis]
    logits = (2.0 * rng.standard_normal(shape)).astype(dtype)
    if probabilities:
        e = np.exp(rng.standard_normal(shape))
        target = (e / e.sum(axis=axis, keepdims=True)).astype(dtype)
        gt, ht = cupy.asarray(target), target.astype(np.float64)
    else:
        pos_shape = tuple(s for i, s in enumerate(shape) if i != axis % len(shape))
        target = rng.integers(0, classes, pos_shape)
        target.reshape(-1)[::7] = kw.get("ignore_index", -100)
        gt, ht = cupy.asarray(target), target
    if kw.pop("weighted", False):
        w = rng.random(classes) + 0.5
        kw["weight"] = w.astype("float32" if dtype == "float16" else dtype)
    hkw = {**kw, "axis": axis, **({"weight": kw["weight"].astype(np.float64)} if "weight" in kw else {})}
    gkw = {**kw, "axis": axis, **({"weight": cupy.asarray(kw["weight"])} if "weight" in kw else {})}
    tol = {"float64": 1e-10, "float32": 1e-5, "float16": 3e-3}[dtype]
    wrt = ("logits", "target") if probabilities else ("logits",)
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(pnn.cross_entropy, cupy.asarray(logits), gt, **gkw).backend == "numba_cuda"
        y, pullback = pnn.vjp(pnn.cross_entropy, cupy.asarray(logits), gt, wrt=wrt, **gkw)
        dy = rng.standard_normal(tuple(y.shape))
        grads = pullback(cupy.asarray(dy.astype(dtype)))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(pnn.cross_entropy, logits.astype(np.float64), ht, wrt=wrt, **hkw)
        g_ref = pull_ref(dy.astype(dtype).astype(np.float64))
    assert sim.rel(cupy.asnumpy(y).astype(np.float64), y_ref) <= tol
    for name in wrt:
        assert sim.rel(cupy.asnumpy(getattr(grads, name)).astype(np.float64), getattr(g_ref, name)) <= 10 * tol, name


def _gpu_params_check(fn, x, params, kw, dtype):
    """``fn(x, *params, **kw)`` on CuPy (params float32 for float16 data) against the reference."""
    import cupy

    pdt = "float32" if dtype == "float16" else dtype
    x = x.astype(dtype)
    params = [p.astype(pdt) for p in params]
    tol = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3}[dtype]
    _gpu_vjp_check(fn, (cupy.asarray(x), *map(cupy.asarray, params)),
                   (x.astype(np.float64), *(p.astype(np.float64) for p in params)), kw, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("x_shape", "n_out", "bias", "activation"), [
    ((33, 70), 45, True, "gelu"),
    ((2, 5, 16), 300, True, "relu"),
    ((64,), 8, False, "identity"),
    ((1000, 3), 7, True, "silu"),
    ((9, 12), 5, True, ("leaky_relu", 0.2)),
])
def test_gpu_dense_matches_reference(x_shape, n_out, bias, activation, dtype):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((n_out, x_shape[-1])) / np.sqrt(x_shape[-1])]
    if bias:
        params.append(rng.standard_normal(n_out))
    _gpu_params_check(pnn.dense, rng.standard_normal(x_shape), params, {"activation": activation}, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize(("x_shape", "w_shape", "bias", "kw"), [
    ((2, 6, 17), (8, 3, 5), True, {"groups": 2, "stride": 2, "padding": 2, "activation": "relu"}),
    ((2, 4, 13, 11), (6, 4, 3, 3), True, {"padding": "same", "dilation": 2, "activation": "gelu"}),
    ((2, 9, 8, 8), (8, 2, 3, 3), False, {"groups": 4, "channel_axis": -1, "stride": (2, 1), "padding": 1}),
    ((3, 6, 5, 4), (3, 1, 3, 2, 2), True, {"groups": 3, "padding": ((1, 0), 1, 0), "activation": "tanh"}),
    ((16, 12, 12), (16, 1, 3, 3), True, {"groups": 16, "padding": 1, "activation": "silu"}),
])
def test_gpu_conv_matches_reference(x_shape, w_shape, bias, kw, dtype):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))]
    if bias:
        params.append(rng.standard_normal(w_shape[0]))
    _gpu_params_check(pnn.conv, rng.standard_normal(x_shape), params, kw, dtype)


#: (shape, axis, keepdims, correction) covering rows, columns, middle axes, tables, all axes and no axes.
MOMENT_SHAPES = [
    ((64, 300), -1, False, 0),
    ((300, 64), 0, True, 1),
    ((8, 16, 9, 9), (0, 2, 3), False, 1),
    ((5000,), None, False, 0),
    ((3, 40, 5), 1, False, 0.5),
    ((4, 3, 5, 6, 7), (0, 2, 4), True, 0),
    ((2, 3, 4), (), False, 0),
    ((3, 2), 0, False, 2),
]


def gpu_moments_compare(backend, shape, axis, keepdims, correction, dtype, tol):
    """moments forced onto ``backend`` (CuPy arrays; bfloat16 as CUDA torch tensors) against the float64
    reference on the same rounded values: mean, var and dx for both cotangents, each alone and None."""
    import cupy

    rng = np.random.default_rng(0)
    x64 = rng.normal(1e3 if dtype in ("float32", "float64") else 1.0, 2.0, shape)
    kw = {"keepdims": keepdims, "correction": correction}
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("bfloat16 on the GPU is tested through CUDA torch tensors")
        x = torch.tensor(x64, dtype=torch.bfloat16, device="cuda")
        host = x.double().cpu().numpy()
        to_dev, to_host = (lambda a: torch.tensor(a, device="cuda")), (lambda a: a.double().cpu().numpy())
    else:
        x = cupy.asarray(x64.astype(dtype))
        host = cupy.asnumpy(x).astype(np.float64)
        to_dev, to_host = cupy.asarray, (lambda a: cupy.asnumpy(a).astype(np.float64))
    stat = "float64" if dtype == "float64" else "float32"
    with pnn.use_backend(backend):
        assert pnn.explain(pnn.moments, x, axis, **kw).backend == backend
        (mean, var), pullback = pnn.vjp(pnn.moments, x, axis, **kw)
        dm = rng.standard_normal(tuple(mean.shape)).astype(stat)
        dv = rng.standard_normal(tuple(var.shape)).astype(stat)
        grads = [pullback(cts).x for cts in ((to_dev(dm), to_dev(dv)), (to_dev(dm), None), (None, to_dev(dv)))]
    with pnn.use_backend("reference"):
        (mr, vr), pb_ref = pnn.vjp(pnn.moments, host, axis, **kw)
        refs = [pb_ref(cts).x for cts in ((dm.astype(np.float64), dv.astype(np.float64)),
                                         (dm.astype(np.float64), None), (None, dv.astype(np.float64)))]
    assert str(mean.dtype).endswith(stat) and str(var.dtype).endswith(stat)
    for got, want, what in ((mean, mr, "mean"), (var, vr, "var")):
        got = to_host(got)
        assert got.shape == want.shape and np.array_equal(np.isnan(got), np.isnan(want)), what
        assert sim.rel(got, want) <= tol, what
    for got, want in zip(grads, refs):
        assert got.dtype == x.dtype and tuple(got.shape) == tuple(x.shape)
        assert sim.rel(to_host(got), want) <= tol, "dx"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize(("shape", "axis", "keepdims", "correction"), MOMENT_SHAPES)
def test_gpu_moments_match_reference(shape, axis, keepdims, correction, dtype):
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    gpu_moments_compare("numba_cuda", shape, axis, keepdims, correction, dtype, tol)


@pytest.mark.gpu
def test_gpu_moments_bitwise_deterministic():
    import cupy

    x = cupy.asarray(np.random.default_rng(1).standard_normal((64, 32, 9)).astype(np.float32))
    results = []
    with pnn.use_backend("numba_cuda"):
        for _ in range(2):
            (mean, var), pullback = pnn.vjp(pnn.moments, x, (0, 2))
            results.append((mean, var, pullback((mean, var)).x))
    for a, b in zip(*results):
        assert bool((a == b).all())
