"""Numba-CUDA kernels in Numba's CUDA simulator, against the reference implementation.

Run as a script in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (``tests/kernel_packages/numba_cuda/test_runtime.py``
does); prints one JSON object per case: ``{"id", "errors": {output: relative error}, "tol",
"paths"}``.  Each case runs the whole host path — launchers, kernels and (for the GEMM-based ops)
the array-module matrix products — on NumPy arrays, with tiny block sizes and chunk limits so
multi-block reductions and second passes run, and compares every output and gradient with
``portable_nn.reference``.  ``CASES`` (ids) is importable without the simulator.

``python tests/kernel_packages/numba_cuda/_sim_checks.py [substring ...]`` runs the cases whose id contains one of
the substrings (all without arguments).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np

#: Launch settings of the "small" runs: 8-thread blocks, 4×4 column tiles, every group split.
SMALL = {"block": 8, "tile_x": 4, "tile_y": 4, "target_blocks": 64, "row_max": 4, "min_chunk": 3}
#: The default settings' paths on tiny inputs (one block per group), with a small block still.
ROWS = {"block": 8, "tile_x": 4, "tile_y": 4}

def case_registry() -> tuple[dict[str, Callable[[], dict]], Callable[[str], Callable]]:
    """A registry of simulator cases and its ``case(name)`` decorator (each checks file keeps its own)."""
    registry: dict[str, Callable[[], dict]] = {}

    def case(name: str) -> Callable[[Callable[[], dict]], Callable[[], dict]]:
        def wrap(fn: Callable[[], dict]) -> Callable[[], dict]:
            registry[name] = fn
            return fn

        return wrap

    return registry, case


_REGISTRY, case = case_registry()


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def rel(actual, expected) -> float:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    if e.size == 0:
        return 0.0
    both_nan = np.isnan(a) & np.isnan(e)
    a, e = np.where(both_nan, 0.0, a), np.where(both_nan, 0.0, e)
    return float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 1e-30))


def as_f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


# --------------------------------------------------------------------------- norms

_TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def _norm_check(op, args, kwargs, settings, dtype="float64", param_dtype=None, bf16=False):
    """Forward (y and updated running statistics) and every gradient of one norm call."""
    import portable_nn as pnn
    from kernels_gpu.numba_cuda import _runtime as rt
    from kernels_gpu.numba_cuda import norm as gn
    from portable_nn.reference import norm as ref

    rng = _rng(1)
    fn = getattr(pnn, op)
    x = args[0]
    data_dtype = "float32" if bf16 else dtype
    pd = param_dtype or data_dtype
    x = np.asarray(x).astype(data_dtype)
    rest = [np.asarray(a).astype(pd) if isinstance(a, np.ndarray) else a for a in args[1:]]
    kw = {k: (np.asarray(v).astype(pd) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    if op in ("batch_norm", "instance_norm"):  # weight and bias are keyword-only there
        kw.update(zip(("weight", "bias"), rest))
        rest = []
    if "running_mean" in kw:
        kw["return_stats"] = True
    kcall = pnn.explain(fn, x, *rest, **kw).call.replace(save=True)
    if bf16:
        import ml_dtypes

        x = x.astype(ml_dtypes.bfloat16)
        kcall = kcall.replace(arrays={**kcall.arrays, "x": x}, dtype="bfloat16", save=True)
    # The oracle: the reference in float64 on the same (rounded) values.
    call = kcall.replace(arrays={k: as_f64(v) for k, v in kcall.arrays.items()}, dtype="float64",
                         params={**kcall.params, "mixed_precision": False}, save=True)
    with rt.use_settings(**settings):
        shape = gn._Shape(kcall)
        path = shape.group_path()
        (y, rm, rv), res = gn.norm_forward(kcall)
        dyk = rng.standard_normal(x.shape).astype(x.dtype)
        dy = as_f64(dyk)
        needs = frozenset(k for k in ("x", "weight", "bias") if call.arrays.get(k) is not None)
        grads = gn.norm_backward(res, (dyk,), needs, {})
    (yr, rmr, rvr), resr = ref.norm_forward(call)
    gr = ref.norm_backward(resr, (dy,), needs, {})
    tol = _TOL["bfloat16" if bf16 else dtype]
    errors = {"y": rel(as_f64(y), as_f64(yr))}
    if rm is not None or rmr is not None:
        errors["running_mean"] = rel(as_f64(rm), as_f64(rmr))
        errors["running_var"] = rel(as_f64(rv), as_f64(rvr))
    for k in needs:
        errors["d" + k] = rel(as_f64(grads[k]), as_f64(gr[k]))
        assert grads[k].dtype == kcall.arrays[k].dtype, (k, grads[k].dtype, kcall.arrays[k].dtype)
    assert y.dtype == kcall.x.dtype
    if rm is not None:
        assert rm.dtype == kcall.running_mean.dtype
    return {"errors": errors, "tol": tol, "paths": [path]}


def _norm_cases():
    r = _rng(0)
    cases = {
        "layer_norm-2d-gelu": ("layer_norm", (r.standard_normal((3, 7)) + 3, r.standard_normal(7),
                                              r.standard_normal(7)), {"activation": "gelu"}),
        "layer_norm-axes2-noparams": ("layer_norm", (r.standard_normal((2, 3, 4)),), {"axis": (-2, -1)}),
        "layer_norm-leaky": ("layer_norm", (r.standard_normal((2, 9)), r.standard_normal(9), None),
                             {"activation": ("leaky_relu", 0.3)}),
        "rms_norm-weight": ("rms_norm", (r.standard_normal((3, 6)) + 1, r.standard_normal(6)), {}),
        "rms_norm-gelu": ("rms_norm", (r.standard_normal((3, 6)) + 1, r.standard_normal(6)), {"activation": "gelu"}),
        "batch_norm-ncl-running-silu": ("batch_norm", (r.standard_normal((4, 3, 5)), r.standard_normal(3),
                                                      r.standard_normal(3)),
                                        {"running_mean": r.standard_normal(3), "running_var": r.random(3) + 0.5,
                                         "activation": "silu"}),
        "batch_norm-nlc": ("batch_norm", (r.standard_normal((3, 4, 5)), r.standard_normal(5), r.standard_normal(5)),
                           {"channel_axis": -1, "activation": "tanh"}),
        "batch_norm-nc": ("batch_norm", (r.standard_normal((6, 3)) + 5, r.standard_normal(3), r.standard_normal(3)),
                          {"activation": "relu"}),
        "batch_norm-inference": ("batch_norm", (r.standard_normal((3, 2, 4)), r.standard_normal(2),
                                                r.standard_normal(2)),
                                 {"running_mean": r.standard_normal(2), "running_var": r.random(2) + 0.5,
                                  "training": False, "activation": "sigmoid"}),
        "group_norm-nchw": ("group_norm", (r.standard_normal((2, 4, 2, 3)), 2, r.standard_normal(4),
                                           r.standard_normal(4)), {"activation": "gelu_tanh"}),
        "group_norm-nhwc": ("group_norm", (r.standard_normal((2, 3, 6)), 3, r.standard_normal(6),
                                           r.standard_normal(6)), {"channel_axis": -1}),
        "layer_norm-hardswish": ("layer_norm", (r.standard_normal((2, 9)), r.standard_normal(9) * 3, None),
                                 {"activation": "hardswish"}),
        "layer_norm-hardsigmoid": ("layer_norm", (r.standard_normal((2, 9)), r.standard_normal(9) * 3, None),
                                   {"activation": "hardsigmoid"}),
        "layer_norm-relu6": ("layer_norm", (r.standard_normal((2, 9)), r.standard_normal(9) * 4,
                                            r.standard_normal(9) + 3), {"activation": "relu6"}),
        "layer_norm-mish": ("layer_norm", (r.standard_normal((2, 9)), r.standard_normal(9), None),
                            {"activation": "mish"}),
        "layer_norm-elu": ("layer_norm", (r.standard_normal((2, 9)), r.standard_normal(9), None),
                           {"activation": ("elu", 0.5)}),
        "instance_norm-ncl-running": ("instance_norm", (r.standard_normal((2, 3, 5)), r.standard_normal(3),
                                                        r.standard_normal(3)),
                                      {"running_mean": r.standard_normal(3), "running_var": r.random(3) + 0.5}),
        "instance_norm-nlc": ("instance_norm", (r.standard_normal((2, 5, 3)),), {"channel_axis": -1}),
        "instance_norm-fixed-stats": ("instance_norm", (r.standard_normal((2, 3, 4)), r.standard_normal(3), None),
                                      {"running_mean": r.standard_normal(3), "running_var": r.random(3) + 0.5,
                                       "use_input_stats": False}),
    }
    return cases


for _name, (_op, _args, _kw) in _norm_cases().items():
    for _sname, _settings in (("rows", ROWS), ("small", SMALL)):
        case(f"norm/{_name}/{_sname}")(
            lambda op=_op, args=_args, kw=_kw, st=_settings: _norm_check(op, args, kw, st)
        )

_MIXED = {
    "float32-offset": ("layer_norm", (_rng(3).standard_normal((3, 16)) + 1e4, _rng(4).standard_normal(16),
                                      _rng(5).standard_normal(16)), {}, "float32", None, False),
    "float16+float32-params": ("batch_norm", (_rng(3).standard_normal((4, 3, 3)), _rng(4).standard_normal(3),
                                              _rng(5).standard_normal(3)),
                               {"running_mean": np.zeros(3), "running_var": np.ones(3)}, "float16", "float32", False),
    "bfloat16+float32-params": ("layer_norm", (_rng(3).standard_normal((3, 8)), _rng(4).standard_normal(8),
                                               _rng(5).standard_normal(8)), {"activation": "gelu"},
                                "float32", "float32", True),
    "bfloat16-groupnorm-nhwc": ("group_norm", (_rng(3).standard_normal((2, 3, 4)), 2, _rng(4).standard_normal(4),
                                               _rng(5).standard_normal(4)), {"channel_axis": -1},
                                "float32", "float32", True),
}
for _name, (_op, _args, _kw, _dt, _pdt, _bf) in _MIXED.items():
    case(f"norm/{_name}/small")(
        lambda op=_op, args=_args, kw=_kw, dt=_dt, pdt=_pdt, bf=_bf: _norm_check(op, args, kw, SMALL, dt, pdt, bf)
    )


# --------------------------------------------------------------------------- moments


def _moments_check(shape, axis, keepdims, correction, settings, dtype="float64", bf16=False, offset=0.0):
    """mean, var and dx (for both cotangents, and each alone) against the float64 reference."""
    import portable_nn as pnn
    from kernels_gpu.numba_cuda import _runtime as rt
    from kernels_gpu.numba_cuda import norm as gn
    from portable_nn.kernel_plans import moments_plan
    from portable_nn.reference import norm as ref

    rng = _rng(3)
    x = np.asarray(rng.normal(offset + 1.0, 2.0, shape)).astype("float32" if bf16 else dtype)
    kw = {"keepdims": keepdims, "correction": correction}
    kcall = pnn.explain(pnn.moments, x, axis, **kw).call.replace(save=True)
    if bf16:
        import ml_dtypes

        x = x.astype(ml_dtypes.bfloat16)
        kcall = kcall.replace(arrays={"x": x}, dtype="bfloat16", save=True)
    call = kcall.replace(arrays={"x": as_f64(x)}, dtype="float64", save=True)
    stat = np.float64 if dtype == "float64" and not bf16 else np.float32
    with rt.use_settings(**settings):
        path = gn.moments_path(moments_plan(tuple(x.shape), kcall.axes)) if x.size else "empty"
        (mean, var), res = gn.moments_forward(kcall)
        dm = rng.standard_normal(mean.shape).astype(stat)
        dv = rng.standard_normal(var.shape).astype(stat)
        grads = [gn.moments_backward(res, cts, frozenset({"x"}), {})["x"] for cts in ((dm, dv), (dm, None), (None, dv))]
        assert gn.moments_backward(res, (dm, dv), frozenset(), {}) == {}
    (mr, vr), resr = ref.moments_forward(call)
    errors = {"mean": rel(as_f64(mean), mr), "var": rel(as_f64(var), vr)}
    for name, got, cts in zip(("dx", "dx-mean-only", "dx-var-only"), grads, ((dm, dv), (dm, None), (None, dv))):
        # The reference gets zeros where the kernel got None (what vjp hands over for a None cotangent).
        full = tuple(np.zeros(mr.shape) if c is None else as_f64(c) for c in cts)
        expected = ref.moments_backward(resr, full, frozenset({"x"}), {})["x"]
        assert got.dtype == x.dtype and got.shape == x.shape, (got.dtype, got.shape)
        errors[name] = rel(as_f64(got), expected)
    assert mean.dtype == stat and var.dtype == stat and mean.shape == mr.shape, (mean.dtype, mean.shape)
    for got, want in ((mean, mr), (var, vr)):
        assert np.array_equal(np.isnan(as_f64(got)), np.isnan(want)), "NaN positions"
    return {"errors": errors, "tol": _TOL["bfloat16" if bf16 else dtype], "paths": ["moments-" + path]}


#: Settings that send tiny groups to the block reductions (``rows``, ``cols``) instead of a thread each.
_MOM_BLOCKS = {**SMALL, "column_below": 2}
_MOMENTS = {
    # name: (shape, axis, keepdims, correction, settings, dtype, bf16, offset)
    "rows-last-axis": ((2, 9), -1, False, 0, _MOM_BLOCKS, "float64", False, 0.0),
    "rows-all-split-along-row": ((20,), None, False, 1, _MOM_BLOCKS, "float64", False, 0.0),
    "rows-nchw-batch-stats": ((2, 2, 2, 3), (0, 2, 3), True, 0, _MOM_BLOCKS, "float64", False, 0.0),
    "rows-tables": ((2, 2, 2, 2, 3), (-1, 0, 2), False, 2.5, _MOM_BLOCKS, "float64", False, 0.0),
    "small-groups-scalar": ((), None, False, 0, SMALL, "float64", False, 0.0),
    "small-groups": ((5, 3), 1, False, 1, SMALL, "float64", False, 0.0),
    "small-columns": ((4, 6), 0, False, 0, SMALL, "float64", False, 0.0),
    "cols-axis0": ((9, 3), 0, False, 1, _MOM_BLOCKS, "float64", False, 0.0),
    "cols-tables-keepdims": ((2, 2, 2, 2, 2), (1, 3), True, 0, _MOM_BLOCKS, "float64", False, 0.0),
    "cols-one-block": ((3, 5), 0, False, 0, {**ROWS, "column_below": 2}, "float64", False, 0.0),
    "keep-all": ((2, 3), (), False, 0, SMALL, "float64", False, 0.0),
    "correction-at-least-n": ((2, 3), 0, False, 2, SMALL, "float64", False, 0.0),
    "empty-reduction": ((0, 3), 0, False, 0, SMALL, "float64", False, 0.0),
    "empty-groups": ((3, 0), 0, True, 0, SMALL, "float64", False, 0.0),
    "float32-offset-rows": ((1, 24), -1, False, 0, _MOM_BLOCKS, "float32", False, 1e4),
    "float32-offset-cols": ((16, 2), 0, False, 1, _MOM_BLOCKS, "float32", False, 1e4),
    "float16": ((4, 3), 0, False, 0, _MOM_BLOCKS, "float16", False, 0.0),
    "bfloat16-middle": ((2, 3, 2), (0, 2), False, 1, _MOM_BLOCKS, "float32", True, 0.0),
}
for _name, (_shape, _axis, _kd, _corr, _st, _dt, _bf, _off) in _MOMENTS.items():
    case(f"moments/{_name}")(
        lambda shape=_shape, axis=_axis, kd=_kd, corr=_corr, st=_st, dt=_dt, bf=_bf, off=_off: _moments_check(
            shape, axis, kd, corr, st, dt, bf, off)
    )


# --------------------------------------------------------------------------- log_softmax


def _log_softmax_check(shape, axis, dtype, settings, bf16=False):
    import portable_nn as pnn
    from kernels_gpu.numba_cuda import _runtime as rt
    from kernels_gpu.numba_cuda import loss as gl
    from portable_nn.reference import loss as ref

    rng = _rng(2)
    x = np.asarray(3.0 * rng.standard_normal(shape)).astype(dtype)
    kcall = pnn.explain(pnn.log_softmax, x, axis=axis).call.replace(save=True)
    if bf16:
        import ml_dtypes

        x = x.astype(ml_dtypes.bfloat16)
        kcall = kcall.replace(arrays={"x": x}, dtype="bfloat16", save=True)
    call = kcall.replace(arrays={"x": as_f64(x)}, dtype="float64", save=True)
    dyk = np.asarray(rng.standard_normal(shape)).astype(x.dtype)
    with rt.use_settings(**settings):
        (y,), res = gl.log_softmax_forward(kcall)
        g = gl.log_softmax_backward(res, (dyk,), frozenset({"x"}), {})
    (yr,), resr = ref.log_softmax_forward(call)
    gr = ref.log_softmax_backward(resr, (as_f64(dyk),), frozenset({"x"}), {})
    assert y.dtype == x.dtype and g["x"].dtype == x.dtype
    return {"errors": {"y": rel(as_f64(y), yr), "dx": rel(as_f64(g["x"]), gr["x"])},
            "tol": _TOL["bfloat16" if bf16 else str(np.dtype(dtype))]}


_LSM = {
    "2d-last": ((3, 11), -1, "float64", False),
    "3d-axis1": ((2, 9, 3), 1, "float64", False),
    "1d": ((13,), 0, "float32", False),
    "scalar": ((), -1, "float64", False),
    "empty": ((0, 4), -1, "float64", False),
    "float16": ((3, 10), -1, "float16", False),
    "bfloat16-axis0": ((10, 3), 0, "float32", True),
}
for _name, (_shape, _axis, _dt, _bf) in _LSM.items():
    case(f"loss/log_softmax-{_name}/small")(
        lambda shape=_shape, axis=_axis, dt=_dt, bf=_bf: _log_softmax_check(shape, axis, dt, SMALL, bf)
    )


# --------------------------------------------------------------------------- generic op check


def _op_check(op, module, args, kwargs, settings, dtype="float64", bf16=False, param_dtype=None, tol=None,
              prepare=None):
    """Forward and every floating gradient of ``pnn.<op>(*args, **kwargs)`` through
    ``kernels_gpu.numba_cuda.<module>`` against ``portable_nn.reference.<module>``.

    Floating arrays take ``dtype`` (bfloat16 when ``bf16``: rounded through float32), parameters
    (every floating array after the first) ``param_dtype`` when given; integer arrays stay as they
    are.  The oracle is the reference in float64 on the same rounded values.  ``prepare(x)`` may
    edit the rounded first array (e.g. plant NaN) before the call.
    """
    import importlib

    import portable_nn as pnn
    from kernels_gpu.numba_cuda import _runtime as rt

    mine = importlib.import_module(f"kernels_gpu.numba_cuda.{module}")
    ref = importlib.import_module(f"portable_nn.reference.{module}")
    entry = {"max_unpool": "unpool", "max_pool": "pool", "avg_pool": "pool"}.get(op, op)
    fwd_name, bwd_name = f"{entry}_forward", f"{entry}_backward"
    rng = _rng(7)
    data_dtype = "float32" if bf16 else dtype
    pd = param_dtype or data_dtype

    def conv(i, a):
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            return a.astype(data_dtype if i == 0 or param_dtype is None else pd)
        return a

    args = [conv(i, a) for i, a in enumerate(args)]
    kwargs = {k: conv(1, v) for k, v in kwargs.items()}
    if prepare is not None:
        prepare(args[0])
    kcall = pnn.explain(getattr(pnn, op), *args, **kwargs).call.replace(save=True)
    if bf16:
        import ml_dtypes

        arrays = {k: (v.astype(ml_dtypes.bfloat16) if isinstance(v, np.ndarray) and v.dtype == np.float32
                      and (param_dtype is None or v is args[0]) else v) for k, v in kcall.arrays.items()}
        kcall = kcall.replace(arrays=arrays, dtype="bfloat16", save=True)
    floats = {k for k, v in kcall.arrays.items() if v is not None and np.asarray(v).dtype.kind in "fV"}
    call = kcall.replace(arrays={k: (as_f64(v) if k in floats else v) for k, v in kcall.arrays.items()},
                         dtype="float64", params={**kcall.params, "mixed_precision": False}, save=True)
    needs = frozenset(k for k in floats if not (op == "cross_entropy" and k == "weight"))
    with rt.use_settings(**settings):
        outs, res = getattr(mine, fwd_name)(kcall)
        dys = tuple(rng.standard_normal(np.shape(o)).astype(o.dtype) for o in outs)
        grads = getattr(mine, bwd_name)(res, dys, needs, {})
    outs_r, res_r = getattr(ref, f"{op}_forward")(call)
    grads_r = getattr(ref, f"{op}_backward")(res_r, tuple(as_f64(d) for d in dys), needs, {})
    errors = {}
    assert len(outs) == len(outs_r), (len(outs), len(outs_r))
    for i, (o, e) in enumerate(zip(outs, outs_r)):
        if np.asarray(e).dtype.kind == "i":  # max_pool's indices: int64, exactly the reference's
            assert o.dtype == np.int64, (o.dtype,)
            errors[f"y{i}"] = float(np.any(np.asarray(o) != np.asarray(e)))
            continue
        assert o.dtype == kcall.arrays[next(iter(kcall.arrays))].dtype, (o.dtype,)
        errors[f"y{i}"] = rel(as_f64(o), as_f64(e))
    for k in needs:
        assert grads[k].dtype == kcall.arrays[k].dtype, (k, grads[k].dtype)
        errors["d" + k] = rel(as_f64(grads[k]), as_f64(grads_r[k]))
    return {"errors": errors, "tol": tol or _TOL["bfloat16" if bf16 else dtype]}


# --------------------------------------------------------------------------- pooling


def _nan_at_start(x):
    x.reshape(-1)[1] = np.nan


_POOL = {
    # name: (op, x shape, kwargs, dtype, bf16, prepare)
    "max-1d": ("max_pool", (2, 3, 9), {"window": 3, "stride": 2, "padding": 1}, "float64", False, None),
    "max-2d-dilation-ceil": ("max_pool", (2, 2, 7, 6), {"window": (3, 2), "stride": (2, 1), "padding": (1, 1),
                                                         "dilation": (2, 1), "ceil_mode": True}, "float64", False,
                             None),
    "max-3d": ("max_pool", (1, 2, 4, 5, 4), {"window": 2, "stride": (1, 2, 2), "padding": (1, 0, 1)}, "float32",
               False, None),
    "max-2d-nhwc": ("max_pool", (2, 5, 4, 3), {"window": 2, "channel_axis": -1, "ceil_mode": True}, "float64",
                    False, None),
    "max-unbatched-nan": ("max_pool", (2, 6, 5), {"window": (2, 3), "padding": (1, 1)}, "float64", False,
                          _nan_at_start),
    "max-float16-ties": ("max_pool", (2, 2, 6, 6), {"window": 3, "stride": 1}, "float16", False,
                         lambda x: np.round(x, 0, out=x)),
    "avg-1d-nopad-count": ("avg_pool", (2, 3, 8), {"window": 3, "stride": 2, "padding": 1,
                                                    "count_include_pad": False}, "float64", False, None),
    "avg-2d-ceil": ("avg_pool", (2, 2, 7, 5), {"window": 3, "stride": 2, "padding": 1, "ceil_mode": True},
                    "float64", False, None),
    "avg-3d-nhwc": ("avg_pool", (2, 3, 4, 5, 2), {"window": (2, 3, 2), "padding": (1, 1, 0), "channel_axis": -1,
                                                   "count_include_pad": False, "ceil_mode": True}, "float32", False,
                    None),
    "avg-unbatched-nlc": ("avg_pool", (7, 3), {"window": (3,), "stride": 1, "channel_axis": -1}, "float64", False,
                          None),
    "avg-bfloat16": ("avg_pool", (2, 2, 6, 4), {"window": 2}, "float32", True, None),
    "avg-2d-divisor-override": ("avg_pool", (2, 2, 7, 5), {"window": 3, "stride": 2, "padding": 1, "ceil_mode": True,
                                                          "divisor_override": 4}, "float64", False, None),
    "max-empty-batch": ("max_pool", (0, 2, 5), {"window": 2}, "float64", False, None),
    "max-2d-nhwc-indices": ("max_pool", (2, 5, 4, 3), {"window": 3, "stride": 2, "padding": 1, "channel_axis": -1,
                                                       "ceil_mode": True, "return_indices": True}, "float32", False,
                            None),
    "max-3d-indices-ties": ("max_pool", (1, 2, 4, 5, 4), {"window": 2, "stride": 1, "return_indices": True},
                            "float16", False, lambda x: np.round(x, 0, out=x)),
}
for _name, (_op, _shape, _kw, _dt, _bf, _prep) in _POOL.items():
    case(f"pool/{_name}/small")(
        lambda op=_op, shape=_shape, kw=_kw, dt=_dt, bf=_bf, prep=_prep: _op_check(
            op, "pool", (2.0 * _rng(5).standard_normal(shape),), kw, SMALL, dt, bf, prepare=prep)
    )


_UNPOOL = {
    # name: (x shape, indices upper bound, kwargs, dtype, bf16); bounds below the x plane size force duplicates
    "2d-duplicates": ((2, 3, 3, 4), 5, {"window": 2}, "float64", False),
    "2d-nhwc-output-size": ((2, 3, 4, 5), 40, {"window": 2, "channel_axis": -1, "output_size": (7, 8)}, "float32",
                            False),
    "1d-unbatched-bf16": ((3, 6), 12, {"window": (2,)}, "float32", True),
    "3d-float16": ((1, 2, 2, 3, 2), 96, {"window": 2, "stride": (2, 2, 2)}, "float16", False),
}
for _name, (_shape, _bound, _kw, _dt, _bf) in _UNPOOL.items():
    case(f"pool/unpool-{_name}/small")(
        lambda shape=_shape, bound=_bound, kw=_kw, dt=_dt, bf=_bf: _op_check(
            "max_unpool", "pool", (_rng(6).standard_normal(shape), _rng(8).integers(0, bound, shape)), kw, SMALL,
            dt, bf)
    )


# --------------------------------------------------------------------------- cross_entropy


def _labels(shape, classes, ignore=None, every=3, dtype=np.int64):
    t = _rng(11).integers(0, classes, shape)
    if ignore is not None:
        t.reshape(-1)[::every] = ignore
    return t.astype(dtype)


def _probs(shape, axis):
    e = np.exp(_rng(12).standard_normal(shape))
    return e / e.sum(axis=axis, keepdims=True)


def _ce_case(shape, axis, target, kw, dtype="float64", bf16=False, param_dtype=None):
    logits = 2.0 * _rng(13).standard_normal(shape)
    # 4-thread blocks: each position runs four block reductions, slow in the simulator.
    return _op_check("cross_entropy", "loss", (logits, target), {"axis": axis, **kw}, {**SMALL, "block": 4}, dtype,
                     bf16, param_dtype)


_CE = {
    "int-2d-mean-weight-ignore-smooth": ((6, 5), 1, lambda: _labels((6,), 5, -100),
                                         {"weight": _rng(1).random(5) + 0.5, "label_smoothing": 0.1}, "float64"),
    "int-3d-sum": ((2, 4, 3), 1, lambda: _labels((2, 3), 4, dtype=np.int32), {"reduction": "sum"}, "float64"),
    "int-nlc-none-ignore-class": ((2, 3, 6), -1, lambda: _labels((2, 3), 6, 2, every=2),
                                  {"ignore_index": 2, "reduction": "none", "weight": _rng(2).random(6),
                                   "label_smoothing": 0.3}, "float64"),
    "int-many-positions-mean": ((4, 3, 3), 1, lambda: _labels((4, 3), 3, -1, every=5),
                                {"ignore_index": -1, "weight": _rng(3).random(3) + 0.1}, "float32"),
    "int-all-ignored-mean-nan": ((4, 3), 1, lambda: _labels((4,), 3, -100, every=1), {}, "float64"),
    "int-unbatched": ((7,), 0, lambda: np.array(4, np.int64), {"label_smoothing": 0.2}, "float64"),
    "int-empty-mean": ((0, 4), 1, lambda: np.zeros((0,), np.int64), {}, "float64"),
    "prob-2d-mean-weight-smooth": ((6, 4), 1, lambda: _probs((6, 4), 1),
                                   {"weight": _rng(4).random(4) + 0.5, "label_smoothing": 0.2}, "float64"),
    "prob-3d-axis2-none": ((2, 3, 5), 2, lambda: _probs((2, 3, 5), 2), {"reduction": "none"}, "float64"),
    "prob-sum-float32": ((3, 3, 2), 1, lambda: _probs((3, 3, 2), 1), {"reduction": "sum"}, "float32"),
}
for _name, (_shape, _axis, _target, _kw, _dt) in _CE.items():
    case(f"loss/cross_entropy-{_name}/small")(
        lambda shape=_shape, axis=_axis, target=_target, kw=_kw, dt=_dt: _ce_case(shape, axis, target(), kw, dt)
    )
case("loss/cross_entropy-float16-float32-weight/small")(
    lambda: _ce_case((6, 5), 1, _labels((6,), 5, -100), {"weight": _rng(5).random(5) + 0.5, "label_smoothing": 0.1},
                     "float16", param_dtype="float32"))
case("loss/cross_entropy-bfloat16-prob/small")(
    lambda: _ce_case((4, 6), 1, _probs((4, 6), 1), {"reduction": "sum"}, "float32", bf16=True))


# --------------------------------------------------------------------------- dense


def _dense_case(x_shape, n_out, bias, activation, dtype="float64", bf16=False, param_dtype=None, settings=None):
    r = _rng(21)
    n_in = x_shape[-1]
    args = [r.standard_normal(x_shape), r.standard_normal((n_out, n_in)) / np.sqrt(n_in)]
    if bias:
        args.append(r.standard_normal(n_out))
    return _op_check("dense", "dense", tuple(args), {"activation": activation}, settings or SMALL, dtype, bf16,
                     param_dtype)


_DENSE = {
    "2d-bias-gelu": ((7, 5), 4, True, "gelu", "float64"),
    "3d-relu": ((2, 3, 4), 6, True, "relu", "float64"),
    "1d-nobias-identity": ((5,), 3, False, "identity", "float64"),
    "tanh-float32": ((9, 3), 5, True, "tanh", "float32"),
    "leaky-negative-slope": ((6, 4), 3, True, ("leaky_relu", -0.5), "float64"),
    "sigmoid-silu-rows": ((11, 2), 3, True, "silu", "float64"),
    "empty-rows": ((0, 3), 2, True, "sigmoid", "float64"),
}
for _name, (_xs, _no, _b, _act, _dt) in _DENSE.items():
    case(f"dense/{_name}/small")(
        lambda xs=_xs, no=_no, b=_b, a=_act, dt=_dt: _dense_case(xs, no, b, a, dt)
    )
case("dense/float16-float32-params-gelu_tanh/small")(
    lambda: _dense_case((5, 8), 3, True, "gelu_tanh", "float16", param_dtype="float32"))
case("dense/bfloat16-relu/small")(lambda: _dense_case((4, 6), 3, True, "relu", "float32", bf16=True))
case("dense/sigmoid/rows")(lambda: _dense_case((6, 3), 4, True, "sigmoid", "float64", settings=ROWS))


# --------------------------------------------------------------------------- conv


def _conv_case(x_shape, w_shape, bias, kw, dtype="float64", bf16=False, param_dtype=None):
    r = _rng(31)
    fan_in = int(np.prod(w_shape[1:]))
    args = [r.standard_normal(x_shape), r.standard_normal(w_shape) / np.sqrt(fan_in)]
    if bias:
        args.append(r.standard_normal(w_shape[0]))
    return _op_check("conv", "conv", tuple(args), kw, SMALL, dtype, bf16, param_dtype)


_CONV = {
    "1d-stride-pad": ((2, 3, 9), (4, 3, 3), True, {"stride": 2, "padding": 1, "activation": "relu"}),
    "2d-groups-dilation": ((1, 4, 6, 5), (6, 2, 2, 3), True, {"groups": 2, "dilation": (2, 1), "padding": (1, 2),
                                                              "activation": "gelu"}),
    "2d-nhwc-groups": ((2, 5, 4, 4), (4, 2, 3, 2), True, {"groups": 2, "channel_axis": -1, "stride": (2, 1),
                                                          "padding": ((1, 0), (0, 1)), "activation": "tanh"}),
    "3d-same": ((1, 2, 3, 4, 3), (3, 2, 2, 3, 2), False, {"padding": "same"}),
    "depthwise-unbatched": ((3, 7), (3, 1, 3), True, {"groups": 3, "padding": 2, "dilation": 2,
                                                      "activation": "silu"}),
    "3d-nlc-unbatched-leaky": ((3, 4, 3, 2), (2, 2, 2, 2, 1), True, {"channel_axis": -1, "stride": (1, 2, 1),
                                                                     "activation": ("leaky_relu", 0.1)}),
}
for _name, (_xs, _ws, _b, _kw) in _CONV.items():
    case(f"conv/{_name}/small")(lambda xs=_xs, ws=_ws, b=_b, kw=_kw: _conv_case(xs, ws, b, kw))
case("conv/float32-1d-sigmoid/small")(
    lambda: _conv_case((2, 2, 8), (3, 2, 3), True, {"padding": "valid", "activation": "sigmoid"}, "float32"))
case("conv/float16-float32-params/small")(
    lambda: _conv_case((1, 2, 5, 5), (2, 2, 3, 3), True, {"padding": 1, "activation": "gelu_tanh"}, "float16",
                       param_dtype="float32"))
case("conv/bfloat16-nhwc/small")(
    lambda: _conv_case((1, 4, 4, 2), (2, 2, 2, 2), True, {"channel_axis": -1}, "float32", bf16=True))


def _conv_transpose_case(x_shape, w_shape, bias, kw, dtype="float64", bf16=False, param_dtype=None):
    """conv_transpose with weight (C_in, O/groups, *k) and, with ``bias``, one bias per output channel."""
    r = _rng(37)
    fan_in = int(np.prod(w_shape[1:]))
    args = [r.standard_normal(x_shape), r.standard_normal(w_shape) / np.sqrt(fan_in)]
    if bias:
        args.append(r.standard_normal(kw.get("groups", 1) * w_shape[1]))
    return _op_check("conv_transpose", "conv", tuple(args), kw, SMALL, dtype, bf16, param_dtype)


_CONV_TRANSPOSE = {
    "2d-stride2-pad1-outpad1-groups2": ((2, 4, 3, 3), (4, 2, 3, 3), True, {
        "stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "activation": "relu"}),
    "1d-dilation2-gelu": ((2, 3, 5), (3, 2, 3), True, {"dilation": 2, "padding": 1, "activation": "gelu"}),
    "3d": ((1, 2, 2, 2, 2), (2, 2, 2, 2, 2), False, {"stride": (2, 1, 1), "padding": (0, 1, 0)}),
    "2d-nhwc-groups-gelu": ((2, 3, 3, 4), (4, 1, 2, 3), True, {"groups": 2, "stride": (2, 1), "channel_axis": -1,
                                                                "activation": "gelu"}),
    "1d-unbatched-nlc-relu": ((4, 3), (3, 2, 2), True, {"stride": 3, "output_padding": 2, "channel_axis": -1,
                                                         "activation": "relu"}),
    "2d-unbatched": ((4, 3, 3), (4, 2, 2, 2), True, {}),
}
for _name, (_xs, _ws, _b, _kw) in _CONV_TRANSPOSE.items():
    case(f"conv_transpose/{_name}/small")(lambda xs=_xs, ws=_ws, b=_b, kw=_kw: _conv_transpose_case(xs, ws, b, kw))
case("conv_transpose/float32-1d-sigmoid/small")(
    lambda: _conv_transpose_case((2, 2, 4), (2, 3, 3), True, {"stride": 2, "activation": "sigmoid"}, "float32"))
case("conv_transpose/float16-float32-params/small")(
    lambda: _conv_transpose_case((1, 2, 3, 3), (2, 2, 3, 3), True, {"stride": 2, "padding": 1, "output_padding": 1,
                                                                     "activation": "gelu_tanh"}, "float16",
                                 param_dtype="float32"))
case("conv_transpose/bfloat16-nhwc-relu/small")(
    lambda: _conv_transpose_case((1, 3, 3, 2), (2, 2, 2, 2), True, {"channel_axis": -1, "stride": 2,
                                                                     "activation": "relu"}, "float32", bf16=True))


# --------------------------------------------------------------------------- entry point

#: Every case id (importable without running anything).
CASES = tuple(_REGISTRY)


def run_cases(registry: dict[str, Callable[[], dict]], argv: list[str],
              setup: Callable[[], None] | None = None) -> int:
    """Run the cases of ``registry`` whose ids contain one of ``argv`` (all without), one JSON line
    each; 2 outside the simulator.  ``setup`` runs first (the recurrent checks register kernels)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        print("run with NUMBA_ENABLE_CUDASIM=1", file=sys.stderr)
        return 2
    if setup is not None:
        setup()
    selected = [c for c in registry if not argv or any(a in c for a in argv)]
    for name in selected:
        start = time.perf_counter()
        try:
            result = registry[name]()
        except Exception as exc:  # reported per case, so one failure does not hide the others
            import traceback

            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["id"] = name
        result["seconds"] = round(time.perf_counter() - start, 3)
        print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str]) -> int:
    return run_cases(_REGISTRY, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
