"""The CUDA C norm and moments kernels: launches checked against the kernels' signatures, the CPU
emulator against the reference for every dtype and path, and (marked gpu) the device."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from kernels_gpu.cuda_c import _runtime as rt
from kernels_gpu.cuda_c import norm as cnorm
from pnn_testing import TOL, rel_err

from .cuda_c_testing import (
    ALL_DTYPES,
    _call,
    _data_like,
    _rng,
    as_float64,
    assert_matches,
    emulating,
    gpu_compare,
    needs_emulator,
    recording,
    reference_of,
)

SMALL_NORM = {"BLOCK": 32, "APPLY_BLOCK": 32, "TARGET_BLOCKS": 64, "SPLIT_MIN_ELEMENTS": 8,
              "COLUMN_BLOCK": (32, 2), "APPLY_TARGET_BLOCKS": 2}


NORM_SETTINGS = {
    "default": {},
    "small": SMALL_NORM,
    "row": {**SMALL_NORM, "COLUMN_MODE_BELOW": 0},
    "column": {**SMALL_NORM, "COLUMN_MODE_BELOW": 10**9},
    "scalar": {**SMALL_NORM, "VECTOR_APPLY": False, "ROWS_PATH": False},
}


def _use_settings(monkeypatch, settings: dict) -> None:
    """The launcher's module settings for this test (restored afterwards)."""
    for key, value in settings.items():
        monkeypatch.setattr(cnorm, key, value)


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
        ("rms-silu", "rms_norm", (x3, r.standard_normal(10)), {"activation": "silu"}),
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
        ("batch-nchw-vectors", "batch_norm", (r.standard_normal((4, 3, 2, 8)) + 50, r.standard_normal(3),
                                              r.standard_normal(3)),
         {"running_mean": r.standard_normal(3), "running_var": r.random(3) + 0.5, "activation": "relu"}),
        ("instance-nchw-vectors", "instance_norm", (r.standard_normal((2, 3, 4, 4)), r.standard_normal(3), None),
         {"activation": "gelu"}),
        ("group-nchw-vectors", "group_norm", (r.standard_normal((2, 4, 8)), 2, r.standard_normal(4),
                                              r.standard_normal(4)), {}),
        ("batch-nhwc-vectors", "batch_norm", (r.standard_normal((2, 3, 5, 8)) - 20, r.standard_normal(8),
                                              r.standard_normal(8)),
         {"channel_axis": -1, "running_mean": r.standard_normal(8), "running_var": r.random(8) + 0.5,
          "activation": "silu"}),
        ("instance-nhwc-vectors", "instance_norm", (r.standard_normal((2, 3, 5, 16)), None, r.standard_normal(16)),
         {"channel_axis": -1}),
        ("group-nhwc-vectors", "group_norm", (r.standard_normal((2, 3, 4, 16)), 2, r.standard_normal(16), None),
         {"channel_axis": -1, "activation": "tanh"}),
        # the activations added with MobileNetV3 and YOLO in mind, one each
        ("layer-hardswish", "layer_norm", (x3 * 3, r.standard_normal(10), r.standard_normal(10)),
         {"activation": "hardswish"}),
        ("layer-elu", "layer_norm", (x3, None, r.standard_normal(10)), {"activation": ("elu", 0.5)}),
        ("batch-nc-mish", "batch_norm", (r.standard_normal((40, 5)), r.standard_normal(5), None),
         {"activation": "mish"}),
        ("group-nhwc-relu6", "group_norm", (r.standard_normal((2, 4, 5, 6)) * 4, 2, c6 * 4, c6 + 3),
         {"channel_axis": -1, "activation": "relu6"}),
        ("instance-nchw-hardsigmoid", "instance_norm", (x4, r.standard_normal(4) * 3, None),
         {"activation": "hardsigmoid"}),
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
    _use_settings(monkeypatch, NORM_SETTINGS[settings])
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
    _use_settings(monkeypatch, NORM_SETTINGS["small"])
    for dtype, mixed in NORM_DTYPES:
        _emulated_norm_case(spec, dtype, mixed)


@needs_emulator
@pytest.mark.parametrize("settings", ["default", "row", "column", "scalar"])
@pytest.mark.parametrize("spec", NORM_SPECS, ids=[s[0] for s in NORM_SPECS])
def test_emulated_norm_every_path(spec, settings, monkeypatch):
    _use_settings(monkeypatch, NORM_SETTINGS[settings])
    _emulated_norm_case(spec, "float32", False)


def rows_specs():
    """layer_norm / rms_norm over trailing axes whose rows suit the contiguous-rows kernels: one and
    several vectors per thread, activations, no bias, a large offset."""
    r = _rng(3)
    return [
        ("layer-rows", "layer_norm", (r.standard_normal((6, 2, 40)), r.standard_normal(40), r.standard_normal(40)),
         {}),
        ("layer-rows-offset-gelu", "layer_norm", (r.standard_normal((5, 160)) * 0.5 + 1e4, r.standard_normal(160),
                                                  r.standard_normal(160)), {"activation": "gelu"}),
        ("layer-rows-2axes-leaky", "layer_norm", (r.standard_normal((3, 4, 100)), r.standard_normal((4, 100)), None),
         {"axis": (-2, -1), "activation": ("leaky_relu", 0.1)}),
        ("rms-rows", "rms_norm", (r.standard_normal((7, 48)), r.standard_normal(48)), {}),
        ("rms-rows-mish", "rms_norm", (r.standard_normal((7, 48)), r.standard_normal(48)), {"activation": "mish"}),
        ("rms-rows-noparams", "rms_norm", (r.standard_normal((9, 256)),), {"eps": 1e-3}),
    ]


ROWS_SPECS = rows_specs()


def _launched_names():
    """Wrap the installed launcher (inside emulating()) to collect the kernel names launched."""
    names = []
    inner = rt._launcher

    def run(family, name, grid, block, args, shared):
        names.append(name.split("<")[0])
        inner(family, name, grid, block, args, shared)

    rt._launcher = run
    return names


@needs_emulator
@pytest.mark.parametrize("bwd_blocks", [None, 2])
@pytest.mark.parametrize("spec", ROWS_SPECS, ids=[s[0] for s in ROWS_SPECS])
def test_emulated_contiguous_rows(spec, bwd_blocks, monkeypatch):
    """The vectorised rows kernels on the emulator against the reference, every dtype and gradient
    subset; with two backward blocks each block sums the parameter partials of several rows."""
    monkeypatch.setattr(cnorm, "ROWS_BWD_BLOCKS", bwd_blocks)
    _, op, args, kwargs = spec
    for dtype, mixed in NORM_DTYPES:
        call = _call(op, args, kwargs, dtype, mixed)
        every = frozenset(_needs_for(call))
        for needs in {every, frozenset({"x"}), every - {"x"}} - {frozenset()}:
            with emulating():
                names = _launched_names()
                (y, _, _), res = cnorm.norm_forward(call)
                dy = _data_like(y.shape, dtype, 7)
                grads = cnorm.norm_backward(res, (dy,), needs, {})
            assert "norm_rows_fwd" in names and "norm_rows_bwd" in names, names
            assert "norm_fwd_fused" not in names and "norm_col_partial" not in names, names
            (y_ref, _, _), grads_ref = reference_of(call, (dy,), needs)
            tol = TOL[dtype]
            assert rel_err(as_float64(y, dtype), y_ref) <= tol, (dtype, "y")
            for name in needs:
                err = rel_err(as_float64(grads[name], dtype if name == "x" or not mixed else "float32"),
                              grads_ref[name])
                assert err <= 4 * tol, f"{dtype}{'+f32' if mixed else ''} d{name}: relative error {err:.2e}"


#: Device-size rows: 1024-thread blocks, several vectors per thread, half data with float32 parameters.
LARGE_ROWS_SPECS = [
    ("layer-rows-4096", "layer_norm", (_rng(5).standard_normal((96, 4096)), _rng(6).standard_normal(4096),
                                       _rng(7).standard_normal(4096)), {}),
    ("rms-rows-16384", "rms_norm", (_rng(8).standard_normal((24, 16384)), _rng(9).standard_normal(16384)), {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("bwd_blocks", [None, 3])
@pytest.mark.parametrize("dtype,mixed", NORM_DTYPES, ids=[f"{d}{'+f32' if m else ''}" for d, m in NORM_DTYPES])
@pytest.mark.parametrize("spec", ROWS_SPECS + LARGE_ROWS_SPECS, ids=[s[0] for s in ROWS_SPECS + LARGE_ROWS_SPECS])
def test_gpu_contiguous_rows_match_reference(spec, dtype, mixed, bwd_blocks, monkeypatch):
    monkeypatch.setattr(cnorm, "ROWS_BWD_BLOCKS", bwd_blocks)
    gpu_compare(spec, dtype, mixed)


def test_contiguous_rows_need_aligned_vectors():
    """A row length that is no multiple of the vector width, or an array off a 16-byte boundary,
    goes to the generic row kernels."""
    r = _rng(4)
    call = _call("layer_norm", (r.standard_normal((4, 40)), r.standard_normal(40), None), {})
    plan = cnorm.plan_of(call)
    fwd = ("norm_rows_fwd", cnorm.ROWS_FWD_VECS)
    assert cnorm._rows_threads(call, plan, *fwd, call.x, call.weight) == (32, 1)
    shifted = np.empty(call.x.size + 1, np.float32)[1:].reshape(call.x.shape)
    assert cnorm._rows_threads(call, plan, *fwd, shifted, call.weight) is None
    odd = _call("layer_norm", (r.standard_normal((4, 42)),), {})
    assert cnorm._rows_threads(odd, cnorm.plan_of(odd), *fwd, odd.x) is None
    half = _call("layer_norm", (r.standard_normal((4, 40)),), {}, "float16")
    assert cnorm._rows_threads(half, cnorm.plan_of(half), *fwd, half.x) == (32, 1)
    batch = _call("batch_norm", (r.standard_normal((8, 4)),), {})
    assert cnorm._rows_threads(batch, cnorm.plan_of(batch), *fwd, batch.x) is None


def test_contiguous_rows_respect_the_kernels_thread_limit(monkeypatch):
    """float64 (96, 4096) asked the rows backward for 1024 threads, more than its registers allow on
    an H200 (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES): a row needing more threads than the compiled
    kernel takes goes to the generic kernels."""
    call = _call("layer_norm", (_rng(5).standard_normal((96, 4096)),), {}, "float64")
    plan = cnorm.plan_of(call)
    assert cnorm._rows_threads(call, plan, "norm_rows_bwd", cnorm.ROWS_BWD_VECS, call.x) == (1024, 2)
    asked = []

    def limit(family, name):
        asked.append(name)
        return 640

    monkeypatch.setattr(rt, "max_threads", limit)
    assert cnorm._rows_threads(call, plan, "norm_rows_bwd", cnorm.ROWS_BWD_VECS, call.x) is None
    assert asked == ["norm_rows_bwd<double, double>"]
    assert cnorm._rows_threads(call, plan, "norm_rows_fwd", cnorm.ROWS_FWD_VECS, call.x) == (512, 4)


@pytest.mark.parametrize("settings", ["default", "small"])
def test_norm_zero_size(settings, monkeypatch):
    _use_settings(monkeypatch, NORM_SETTINGS[settings])
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
    _use_settings(monkeypatch, NORM_SETTINGS[settings])
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


@pytest.mark.gpu
@pytest.mark.parametrize("settings", list(NORM_SETTINGS))
@pytest.mark.parametrize("dtype,mixed", NORM_DTYPES, ids=[f"{d}{'+f32' if m else ''}" for d, m in NORM_DTYPES])
@pytest.mark.parametrize("spec", NORM_SPECS, ids=[s[0] for s in NORM_SPECS])
def test_gpu_norm_matches_reference(spec, dtype, mixed, settings, monkeypatch):
    _use_settings(monkeypatch, NORM_SETTINGS[settings])
    gpu_compare(spec, dtype, mixed, tol_factor=4.0 if dtype in ("float16", "bfloat16") else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("settings", ["default", "small"])
def test_gpu_norm_bitwise_deterministic(settings, monkeypatch):
    import cupy

    _use_settings(monkeypatch, NORM_SETTINGS[settings])
    r = _rng(3)
    x = cupy.asarray(r.standard_normal((64, 32, 9)).astype(np.float32))
    dy = cupy.asarray(r.standard_normal((64, 32, 9)).astype(np.float32))
    w = cupy.asarray(r.standard_normal(32).astype(np.float32))
    results = []
    with pnn.use_backend("cupy"):
        for _ in range(2):
            y, pb = pnn.vjp(pnn.batch_norm, x, weight=w, bias=w, activation="gelu")
            results.append([y, *pb(dy)])
    for a, b in zip(*results):
        assert bool((a == b).all())


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
    _use_settings(monkeypatch, MOMENT_SETTINGS[settings])
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
    _use_settings(monkeypatch, MOMENT_SETTINGS[settings])
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
    _use_settings(monkeypatch, MOMENT_SETTINGS[settings])
    gpu_compare(spec, dtype, False, tol=MOMENT_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("settings", ["default", "small"])
def test_gpu_moments_bitwise_deterministic(settings, monkeypatch):
    import cupy

    _use_settings(monkeypatch, MOMENT_SETTINGS[settings])
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



def _special_value_specs():
    """Groups holding +inf, −inf or NaN (their statistics are NaN: every output of the group is NaN,
    as in PyTorch), next to finite groups."""
    r = _rng(21)
    rows = r.standard_normal((6, 40))
    rows[1, 3], rows[2, 5], rows[4, 0] = np.nan, np.inf, -np.inf
    planes = r.standard_normal((2, 8, 4, 4))
    planes[0, 1, 2, 2], planes[1, 3, 0, 0] = np.nan, -np.inf
    return [
        ("layer-special", "layer_norm", (rows, r.standard_normal(40), r.standard_normal(40)), {}),
        ("rms-special", "rms_norm", (rows, r.standard_normal(40)), {}),
        ("batch-special", "batch_norm", (planes, r.standard_normal(8), r.standard_normal(8)), {}),
        ("batch-nhwc-special", "batch_norm", (planes.transpose(0, 2, 3, 1).copy(), r.standard_normal(8), None),
         {"channel_axis": -1}),
        ("group-special", "group_norm", (planes, 2, r.standard_normal(8), r.standard_normal(8)), {}),
        ("instance-special", "instance_norm", (planes, None, r.standard_normal(8)), {}),
    ]


@needs_emulator
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's own inf − inf
@pytest.mark.parametrize("settings", ["default", "row", "column", "scalar"])
@pytest.mark.parametrize("spec", _special_value_specs(), ids=[s[0] for s in _special_value_specs()])
def test_emulated_norm_special_values(spec, settings, monkeypatch):
    """A variance made NaN by ±inf or NaN data stays NaN: the kernels clamped it to 0 (a rounding
    guard), giving ±inf outputs where PyTorch and the reference give NaN."""
    _use_settings(monkeypatch, NORM_SETTINGS[settings])
    _, op, args, kwargs = spec
    call = _call(op, args, kwargs, "float32", False)
    with emulating():
        (y, _, _), _ = cnorm.norm_forward(call)
    (y_ref, _, _), _ = reference_of(call, (np.ones(y.shape),), frozenset({"x"}))
    assert_matches(as_float64(y, "float32"), y_ref, TOL["float32"], "y")


HOST_SPECS = NORM_SPECS + ROWS_SPECS + MOMENT_SPECS


@pytest.mark.parametrize("spec", HOST_SPECS, ids=[s[0] for s in HOST_SPECS])
def test_gpu_comparison_runs_on_numpy(spec):
    """The device comparison's own steps (the public call, cotangents, the reference), run on NumPy
    through the reference: a slip in them shows without a GPU."""
    gpu_compare(spec, "float64", False, lib="numpy", backend="reference")
