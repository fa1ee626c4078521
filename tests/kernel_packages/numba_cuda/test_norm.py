"""The Numba-CUDA norm and moments kernels: the moments plan without a GPU, and (marked gpu) the device
against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import norm_arguments

from . import _sim_checks as sim
from .numba_cuda_testing import HAS_NUMBA_CUDA

NORMS = ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm")


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
    args, kw = norm_arguments(op, x, w, b)
    return args, {**kw, "channel_axis": axis, "running_mean": rng.standard_normal(c),
                  "running_var": rng.random(c) + 0.5, "return_stats": True}


def _compare_norm(op, layout, dtype, backend, to_device, to_host):
    """``op`` forced onto ``backend`` (arrays made by ``to_device``) against the float64 reference,
    outputs and every gradient."""
    rng = np.random.default_rng(0)
    args, kw = _gpu_norm_args(op, rng, dtype, layout)
    pdt = "float32" if dtype == "float16" else dtype

    def on_device(a, dt):
        return to_device(np.asarray(a).astype(dt)) if isinstance(a, np.ndarray) else a

    def on_host(a):
        return np.asarray(to_host(a), np.float64) if hasattr(a, "dtype") else a

    gargs = [on_device(args[0], dtype)] + [on_device(a, pdt) for a in args[1:]]
    gkw = {k: on_device(v, pdt) for k, v in kw.items()}
    hargs = [on_host(a) for a in gargs]
    hkw = {k: on_host(v) for k, v in gkw.items()}
    fn = getattr(pnn, op)
    with pnn.use_backend(backend):
        assert pnn.explain(fn, *gargs, **gkw).backend == backend
        y, pullback = pnn.vjp(fn, *gargs, **gkw)
        dy = rng.standard_normal(tuple(gargs[0].shape))
        grads = pullback(to_device(dy.astype(dtype)))
    with pnn.use_backend("reference"):
        y_ref, pull_ref = pnn.vjp(fn, *hargs, **hkw)
        g_ref = pull_ref(np.asarray(dy.astype(dtype), np.float64))
    tol = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3}[dtype]
    outs = y if isinstance(y, tuple) else (y,)
    refs = y_ref if isinstance(y_ref, tuple) else (y_ref,)
    for a, e in zip(outs, refs):
        assert sim.rel(on_host(a), e) <= tol
    for name in g_ref._fields:
        e = getattr(g_ref, name)
        if e is not None:
            assert sim.rel(on_host(getattr(grads, name)), e) <= 10 * tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("op", NORMS)
def test_gpu_norms_match_reference(op, layout, dtype):
    import cupy

    _compare_norm(op, layout, dtype, "numba_cuda", cupy.asarray, cupy.asnumpy)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("op", NORMS)
def test_gpu_norm_comparison_runs_on_numpy(op, layout):
    """The device comparison above, on NumPy through the reference: a slip in the test's own call
    shows without a GPU."""
    _compare_norm(op, layout, "float64", "reference", np.asarray, np.asarray)


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

