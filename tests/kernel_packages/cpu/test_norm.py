"""The numba norm and moments kernels: selection, zero-copy torch bridge, determinism, every path against the reference.

Numerical agreement with the reference and PyTorch runs in the per-op suites (tests/api/), through the
shared ``cases(op)`` parametrisation, which forces every backend that declares support."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_TORCH, norm_arguments, rel_err

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

NORMS = ("layer_norm", "batch_norm", "group_norm", "instance_norm")

from .cpu_testing import _data  # noqa: E402


@pytest.mark.parametrize("op", ["layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm"])
def test_auto_picks_numba_for_numpy_float32(op):
    x = _data((4, 6, 5))
    args = (x, 2) if op == "group_norm" else (x,)
    assert pnn.explain(op, *args).backend == "numba"


def test_numba_declines_what_it_does_not_declare():
    x16 = _data((4, 6), np.float16)  # the norms take half precision (test_half.py), moments does not
    report = pnn.explain(pnn.moments, x16, 0)
    assert report.backend == "reference" and report.fallback
    assert any(b == "numba" and "float16" in why for b, why in report.passed_over)
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="float16"):
        pnn.moments(x16, 0)
    x = _data((3, 4, 5, 6))
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="channels_other"):
        pnn.batch_norm(x, channel_axis=2)


def test_strided_input_is_copied_and_reported():
    x = _data((8, 6)).T
    report = pnn.explain(pnn.layer_norm, x)
    assert report.backend == "numba" and report.copies == ["x"]
    with pnn.use_backend("reference"):
        expected = pnn.layer_norm(x)
    np.testing.assert_allclose(pnn.layer_norm(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_cpu_tensors_run_the_numba_kernel_and_get_tensors_back():
    import torch

    x = torch.randn(4, 3, 8)
    rm, rv = torch.zeros(3), torch.ones(3)
    assert pnn.explain(pnn.batch_norm, x, running_mean=rm, running_var=rv).backend == "numba"
    with pnn.use_backend("numba"):
        y = pnn.batch_norm(x, running_mean=rm, running_var=rv)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    expected = torch.nn.functional.batch_norm(x, torch.zeros(3), torch.ones(3), training=True)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert rm.abs().sum() > 0  # the running statistics (tensors) were updated in place


@pytest.mark.parametrize("op", NORMS)
@pytest.mark.parametrize("size", [(6, 4, 10), (64, 32, 40)], ids=["serial", "parallel"])
def test_bitwise_deterministic(op, size):
    x, dy = _data(size), _data(size, seed=1)
    c = size[-1] if op == "layer_norm" else size[1]
    w, b = _data((c,), seed=2), _data((c,), seed=3)
    results = []
    for _ in range(2):
        args, params = norm_arguments(op, x, w, b, 2)
        y, pullback = pnn.vjp(op, *args, activation="gelu", **params)
        results.append((y, *pullback(dy)))
    for first, second in zip(*results):
        assert np.array_equal(first, second)


@pytest.mark.parametrize("op", NORMS)
@pytest.mark.parametrize("channel_axis", [1, -1], ids=["channels_first", "channels_last"])
def test_parallel_and_serial_paths_agree_bitwise_and_with_the_reference(op, channel_axis, monkeypatch):
    """Both wrappers run the same tasks in the same order, so the thread count cannot change a bit.

    Channels-last shapes take the column mode (short contiguous runs), channels-first the group mode.
    """
    from kernels_cpu import norm

    x = _data((6, 4, 5, 3), np.float64) * 3 + 100.0
    x = np.ascontiguousarray(np.moveaxis(x, 1, -1)) if channel_axis == -1 else x
    dy = _data(x.shape, np.float64, seed=1)
    c = x.shape[-1] if op == "layer_norm" else x.shape[channel_axis]
    w, b = _data((c,), np.float64, seed=2), _data((c,), np.float64, seed=3)
    args, kwargs = norm_arguments(op, x, w, b, 2)
    kwargs.update({} if op == "layer_norm" else {"channel_axis": channel_axis})
    results = {}
    for label, threshold in (("serial", 1 << 60), ("parallel", 0)):
        monkeypatch.setattr(norm, "PARALLEL_MIN_ELEMENTS", threshold)
        with pnn.use_backend("numba"):
            y, pullback = pnn.vjp(op, *args, activation="silu", **kwargs)
            results[label] = (y, *pullback(dy))
    with pnn.use_backend("reference"):
        y, pullback = pnn.vjp(op, *args, activation="silu", **kwargs)
        expected = (y, *pullback(dy))
    for serial, parallel, ref in zip(results["serial"], results["parallel"], expected):
        assert np.array_equal(serial, parallel)
        np.testing.assert_allclose(parallel, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())


@pytest.mark.parametrize(("op", "activation"), [
    *((op, act) for op in ("layer_norm", "group_norm", "instance_norm") for act in ("identity", "relu", "silu")),
    ("rms_norm", "identity"),  # rms_norm takes no activation
])
@pytest.mark.parametrize("length", [7, 600], ids=["short-rows", "rows-of-several-blocks"])
def test_pipelined_single_row_groups_match_the_two_pass_kernels(op, activation, length, monkeypatch):
    """Large single-row groups pipeline their passes (the next group's sums during this one's writes).

    Forward: the same sums in the same blocks, so bitwise equal to the two-pass kernel, serial or on
    threads; backward: equal to rounding, and equal to itself whatever the thread count.
    """
    from kernels_cpu import norm

    kwargs = {} if op == "rms_norm" else {"activation": activation}
    x = _data((5, 4, length), np.float64) * 3 + 100.0
    dy = _data(x.shape, np.float64, seed=1)
    c = length if op in ("layer_norm", "rms_norm") else 4
    w, b = _data((c,), np.float64, seed=2), _data((c,), np.float64, seed=3)
    args, params = norm_arguments(op, x, w, b, 2)
    kwargs = {**kwargs, **params}
    results = {}
    for label, pipelined, parallel in (("two-pass", 1 << 62, 0), ("serial", -1, 1 << 62), ("threads", -1, 0)):
        monkeypatch.setattr(norm, "PIPELINE_MIN_BYTES", pipelined)
        monkeypatch.setattr(norm, "PARALLEL_MIN_ELEMENTS", parallel)
        with pnn.use_backend("numba"):
            y, pullback = pnn.vjp(op, *args, **kwargs)
            results[label] = (y, *pullback(dy))
    assert np.array_equal(results["two-pass"][0], results["serial"][0])
    for serial, threads, plain in zip(results["serial"], results["threads"], results["two-pass"]):
        assert np.array_equal(serial, threads)
        np.testing.assert_allclose(serial, plain, rtol=1e-12, atol=1e-12 * np.abs(plain).max())


@pytest.mark.parametrize("op", ["layer_norm", "dense"])
def test_numba_relu_gives_positive_zero_and_propagates_nan(op):
    """relu(z <= 0) is +0.0 as in PyTorch and the reference (not -0.0); relu(NaN) is NaN."""
    with pnn.use_backend("numba"):
        if op == "layer_norm":
            y = pnn.layer_norm(np.array([[-3.0, -1.0, 2.0, 5.0]]), activation="relu")
        else:
            bias = np.array([0.0, 0.0, 0.0, np.nan])
            y = pnn.dense(np.array([[-3.0, -1.0, 2.0, 1.0]]), np.eye(4), bias, activation="relu")
    zeros = y[y == 0.0]
    assert zeros.size and not np.signbit(zeros).any()
    if op == "dense":
        assert np.isnan(y[0, 3])


#: (shape, axis): rows, columns, batch-norm statistics, middle axes, offset tables, all and no axes,
#: negative and unsorted axes, 0-d and empty arrays.
MOMENT_CASES = [
    ((), None), ((7,), 0), ((5, 40), -1), ((40, 5), 0), ((3, 4, 50), (0, 2)), ((8, 6, 5, 5), (0, 2, 3)),
    ((2, 3, 4, 5), (0, 2)), ((2, 3, 4, 5), (-1, 1)), ((3, 2, 2, 3, 2), (4, 0, 2)), ((2, 1, 3, 1), (1, 2)),
    ((6, 3), ()), ((4, 3, 2), None), ((0, 3), 0), ((3, 0), 0),
]


def _offsets_by_group(plan):
    """The flat offsets each group's elements are read from, in the kernels' order (groups × n)."""
    from portable_nn.kernel_plans import MomentsPlan

    assert isinstance(plan, MomentsPlan)
    kept = plan.kept_rows()
    reduced = plan.rtab if plan.rtab.size else np.arange(plan.rout, dtype=np.int64) * plan.rstride
    rows = kept[:, None] + reduced[None, :]  # (kout, rout)
    if plan.column:  # group kk·L + j: column j of the rows of kk
        return (rows[:, None, :] * plan.L + np.arange(plan.L)[None, :, None]).reshape(plan.groups, plan.n)
    return (rows[:, :, None] * plan.L + np.arange(plan.L)).reshape(plan.groups, plan.n)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (2, 1, 3, 4), (3, 2, 2, 3, 2), (2, 2, 1, 2, 2, 3)])
def test_moments_plan_reads_every_element_once_in_the_output_order(shape):
    """For every set of axes: each group reads exactly its elements, the first one (the shift) first,
    and groups come in the order of the output (kept axes row-major)."""
    import itertools

    from portable_nn.kernel_plans import moments_plan

    index = np.arange(int(np.prod(shape))).reshape(shape)
    for r in range(len(shape) + 1):
        for axes in itertools.combinations(range(len(shape)), r):
            plan = moments_plan(shape, axes)
            kept = [a for a in range(len(shape)) if a not in axes]
            expected = np.transpose(index, kept + list(axes)).reshape(plan.groups, plan.n)
            got = _offsets_by_group(plan)
            assert got.shape == expected.shape, axes
            np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(expected, axis=1), err_msg=str(axes))
            np.testing.assert_array_equal(got[:, 0], expected[:, 0], err_msg=f"shift of {axes}")
            assert plan.column == (bool(kept) and kept[-1] == len(shape) - 1 and shape[-1] > 1), axes


def _moments_vjp(x, axis, keepdims, correction, stat, seed=0):
    """(mean, var, dx for both cotangents, dx for dmean alone, dx for dvar alone) and the cotangents used."""
    (mean, var), pullback = pnn.vjp(pnn.moments, x, axis, keepdims=keepdims, correction=correction)
    rng = np.random.default_rng(seed)
    dm = rng.standard_normal(np.shape(mean)).astype(stat)
    dv = rng.standard_normal(np.shape(var)).astype(stat)
    grads = [pullback(c).x for c in ((dm, dv), (dm, None), (None, dv))]
    return [mean, var, *grads], (dm, dv)


def _assert_moments_match(got, expected, tol):
    for a, e, what in zip(got, expected, ("mean", "var", "dx", "dx(dmean)", "dx(dvar)")):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, what
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN positions")
        finite = ~np.isnan(e)
        if finite.any():
            err = rel_err(a[finite], e[finite])
            assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("keepdims, correction", [(False, 0), (True, 1), (False, 2.5)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape, axis", MOMENT_CASES, ids=[f"{s}-{a}" for s, a in MOMENT_CASES])
def test_forced_numba_moments_match_the_reference(shape, axis, dtype, keepdims, correction):
    """mean, var and dx (both cotangents, each alone) on the forced Numba kernel: float64 within 1e-12,
    float32 within 1e-5 of the float64 reference on the same values; dtypes and shapes as documented."""
    x = np.random.default_rng(1).normal(3.0, 2.0, shape).astype(dtype)
    with pnn.use_backend("numba"):
        assert pnn.explain(pnn.moments, x, axis, keepdims=keepdims, correction=correction).backend == "numba"
        got, _ = _moments_vjp(x, axis, keepdims, correction, dtype)
    for a in got:
        assert isinstance(a, np.ndarray) and a.dtype == np.dtype(dtype)
    assert got[2].shape == x.shape
    with pnn.use_backend("reference"):
        expected, _ = _moments_vjp(x.astype(np.float64), axis, keepdims, correction, "float64")
    _assert_moments_match(got, expected, 1e-12 if dtype == "float64" else 1e-5)


def test_moments_large_offset_is_as_accurate_as_centred_data():
    """float32 data at mean 1e4, std 1: the variance on every path is as accurate as for the same data centred."""
    rng = np.random.default_rng(2)
    for shape, axis in (((2048, 3), 0), ((3, 2048), -1), ((4096,), None), ((64, 3, 32), (0, 2))):
        noise = rng.standard_normal(shape)
        errors = []
        for offset in (0.0, 1e4):
            x = (noise + offset).astype(np.float32)
            with pnn.use_backend("numba"):
                mean, var = pnn.moments(x, axis)
            x64 = x.astype(np.float64)
            errors.append(rel_err(var, x64.var(axis=axis)))
            assert rel_err(mean, x64.mean(axis=axis)) <= 1e-7
        assert errors[1] <= max(4 * errors[0], 1e-6), (shape, axis, errors)


def test_moments_strided_input_is_copied_and_reported():
    x = np.asfortranarray(_data((6, 5, 4), np.float64))
    for axis in (0, (1, 2), -1):
        report = pnn.explain(pnn.moments, x, axis)
        assert report.backend == "numba" and report.copies == ["x"]
        with pnn.use_backend("numba"):
            got, _ = _moments_vjp(x, axis, False, 1, "float64")
        with pnn.use_backend("reference"):
            expected, _ = _moments_vjp(x, axis, False, 1, "float64")
        _assert_moments_match(got, expected, 1e-12)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_cpu_tensors_run_the_numba_moments_kernel():
    import torch

    x = torch.randn(4, 3, 5, dtype=torch.float64)
    assert pnn.explain(pnn.moments, x, (0, 2)).backend == "numba"
    with pnn.use_backend("numba"):
        (mean, var), pullback = pnn.vjp(pnn.moments, x, (0, 2), correction=1)
        dx = pullback((torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))).x
    var_t, mean_t = torch.var_mean(x, dim=(0, 2), correction=1)
    assert all(isinstance(t, torch.Tensor) for t in (mean, var, dx))
    torch.testing.assert_close(mean, mean_t, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, var_t, rtol=1e-12, atol=1e-12)
    xt = x.clone().requires_grad_()
    v, m = torch.var_mean(xt, dim=(0, 2), correction=1)
    (v.sum() + m.sum()).backward()
    torch.testing.assert_close(dx, xt.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape, axis", [((6, 4000), -1), ((4000, 6), 0), ((20000,), None), ((16, 3, 900), (0, 2)),
                                         ((5, 900, 6), 1)])
def test_moments_parallel_and_serial_split_paths_agree_bitwise(shape, axis, monkeypatch):
    """Groups split into tasks by shape alone: any thread count gives the same bits; still the reference's values."""
    from kernels_cpu import norm

    monkeypatch.setattr(norm, "MOMENTS_MIN_CHUNK", 64)  # many tasks per group, partial sums merged
    x = _data(shape, np.float64) * 3 + 100.0
    results = {}
    for label, threshold in (("serial", 1 << 60), ("parallel", 0)):
        monkeypatch.setattr(norm, "PARALLEL_MIN_ELEMENTS", threshold)
        with pnn.use_backend("numba"):
            results[label] = [_moments_vjp(x, axis, False, 1, "float64")[0] for _ in range(2)]
    runs = [*results["serial"], *results["parallel"]]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert np.array_equal(a, b)
    with pnn.use_backend("reference"):
        expected, _ = _moments_vjp(x, axis, False, 1, "float64")
    _assert_moments_match(runs[0], expected, 1e-12)


def test_moments_backward_writes_into_out_and_skips_what_is_not_needed():
    from kernels_cpu import norm

    x = _data((5, 7), np.float64)
    call = pnn.explain(pnn.moments, x, 0).call.replace(save=True)
    (mean, var), res = norm.moments_forward(call)
    out = {"x": np.full_like(x, 7.0)}
    grads = norm.moments_backward(res, (np.ones_like(mean), np.ones_like(var)), frozenset({"x"}), out)
    assert grads["x"] is out["x"] and not np.any(out["x"] == 7.0)
    assert norm.moments_backward(res, (np.ones_like(mean), None), frozenset(), {}) == {}
    zero = norm.moments_backward(res, (None, None), frozenset({"x"}), {"x": np.full_like(x, 7.0)})["x"]
    assert not np.any(zero)

