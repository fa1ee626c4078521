"""Numba-CUDA kernels in Numba's CUDA simulator, against the reference implementation.

Run as a script in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (``tests/test_kernels_gpu_numba_cuda.py``
does); prints one JSON object per case: ``{"id", "errors": {output: relative error}, "tol",
"paths"}``.  Each case runs the whole host path — launchers, kernels and (for the GEMM-based ops)
the array-module matrix products — on NumPy arrays, with tiny block sizes and chunk limits so
multi-block reductions and second passes run, and compares every output and gradient with
``portable_nn.reference``.  ``CASES`` (ids) is importable without the simulator.

``python tests/_numba_cuda_sim_checks.py [substring ...]`` runs the cases whose id contains one of
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

_REGISTRY: dict[str, Callable[[], dict]] = {}


def case(name: str) -> Callable[[Callable[[], dict]], Callable[[], dict]]:
    def wrap(fn: Callable[[], dict]) -> Callable[[], dict]:
        _REGISTRY[name] = fn
        return fn

    return wrap


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


# --------------------------------------------------------------------------- entry point

#: Every case id (importable without running anything).
CASES = tuple(_REGISTRY)


def main(argv: list[str]) -> int:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        print("run with NUMBA_ENABLE_CUDASIM=1", file=sys.stderr)
        return 2
    selected = [c for c in CASES if not argv or any(a in c for a in argv)]
    for name in selected:
        start = time.perf_counter()
        try:
            result = _REGISTRY[name]()
        except Exception as exc:  # reported per case, so one failure does not hide the others
            import traceback

            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["id"] = name
        result["seconds"] = round(time.perf_counter() - start, 3)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
