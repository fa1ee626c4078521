"""Dask arrays chunk by chunk: ``moments`` and ``batch_norm`` run each chunk through the kernels and
merge the partial statistics with Chan's merge.

Results equal NumPy's (float64, 1e-12) for every chunking — uneven chunks, chunks of one sample,
chunks along the reduced and the channel axes, chunks of unknown size — and float32 data with a
large mean keeps its variance where merging sums of squares does not.  Then: what ``explain``
reports, forced backends (the chunks run there or the call raises), the visible fallback to the
reference (dtypes no kernel takes, ``vjp``), ``batch_norm``'s running statistics
(returned lazily or assigned in place), a ``dask.distributed`` cluster of worker processes, and
the argument errors.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import numpy as np
import pytest
from scipy.special import erf

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

import portable_nn as pnn  # noqa: E402

TOL = 1e-12


def _rel(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def _data(shape, seed=0, loc=1.5, scale=2.0, dtype=np.float64):
    return np.random.default_rng(seed).normal(loc, scale, shape).astype(dtype)


def _ran_chunked(*arrays) -> bool:
    """Whether these results come from the chunked route's graph (its tasks are named ``pnn-…``)."""
    return all(a.name.startswith("pnn-") for a in arrays)


# --------------------------------------------------------------------------- moments: values

#: name -> (shape, chunks, axis)
_CHUNKINGS = {
    "uneven-rows": ((103, 5), ((40, 7, 31, 25), 5), 0),
    "one-sample-chunks": ((9, 4), (1, 4), 0),
    "channel-chunks": ((60, 7), (60, (3, 4)), 0),
    "both-axes": ((57, 9), (10, 4), 0),
    "reduce-last": ((6, 50), (4, 13), -1),
    "two-axes": ((12, 3, 10), (5, 2, 3), (0, 2)),
    "all-axes": ((20, 6), (7, 4), None),
    "one-chunk": ((30, 4), (30, 4), 0),
}


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("name", list(_CHUNKINGS))
def test_moments_equal_numpy_for_every_chunking(name, correction, keepdims):
    shape, chunks, axis = _CHUNKINGS[name]
    xn = _data(shape, seed=len(name))
    x = da.from_array(xn, chunks=chunks)
    assert pnn.explain(pnn.moments, x, axis).backend == "numba"
    mean, var = pnn.moments(x, axis, keepdims=keepdims, correction=correction)
    assert isinstance(mean, da.Array) and isinstance(var, da.Array) and _ran_chunked(mean, var)
    got_mean, got_var = dask.compute(mean, var, scheduler="threads")
    assert got_mean.dtype == got_var.dtype == np.float64
    assert _rel(got_mean, xn.mean(axis=axis, keepdims=keepdims)) <= TOL
    assert _rel(got_var, xn.var(axis=axis, keepdims=keepdims, ddof=correction)) <= TOL
    with pnn.use_backend("reference"):
        ref_mean, ref_var = pnn.moments(x, axis, keepdims=keepdims, correction=correction)
    assert not _ran_chunked(ref_mean)
    assert _rel(got_var, ref_var.compute()) <= TOL
    again = dask.compute(*pnn.moments(x, axis, keepdims=keepdims, correction=correction), scheduler="threads")
    np.testing.assert_array_equal(again[1], got_var)  # a fixed merge order: bitwise the same


def test_chunks_of_unknown_size_are_counted_when_they_run():
    """Boolean selection leaves chunk sizes unknown (NaN); each chunk counts its own rows."""
    xn = _data((200, 3), seed=1)
    x = da.from_array(xn, chunks=(60, 3))
    keep = x[x[:, 0] > 1.0]
    assert np.isnan(keep.shape[0])
    mean, var = pnn.moments(keep, axis=0, correction=1)
    picked = xn[xn[:, 0] > 1.0]
    assert _rel(mean.compute(), picked.mean(axis=0)) <= TOL
    assert _rel(var.compute(), picked.var(axis=0, ddof=1)) <= TOL


def test_empty_reductions_and_empty_chunks_give_nan_like_the_reference():
    x = da.zeros((0, 4), chunks=(5, 2))
    mean, var = dask.compute(*pnn.moments(x, axis=0))
    assert mean.shape == var.shape == (4,) and np.isnan(mean).all() and np.isnan(var).all()
    # Empty chunks among full ones contribute nothing.
    xn = _data((10, 3), seed=2)
    y = da.from_array(xn, chunks=((4, 0, 6), 3))
    mean, var = dask.compute(*pnn.moments(y, axis=0, correction=1))
    assert _rel(mean, xn.mean(axis=0)) <= TOL and _rel(var, xn.var(axis=0, ddof=1)) <= TOL
    # n <= correction: NaN variance, as the op documents.
    one = da.from_array(xn[:1], chunks=1)
    assert np.isnan(pnn.moments(one, axis=0, correction=1)[1].compute()).all()


# --------------------------------------------------------------------------- moments: float32 stability


def _offset_parts():
    """float32 data with mean 1e4 and standard deviation 1 in 8 chunks."""
    x32 = _data((8 * 4096, 4), seed=3, loc=1e4, scale=1.0, dtype=np.float32)
    return x32, da.from_array(x32, chunks=(4096, 4))


def test_float32_chunks_with_a_large_mean_keep_their_variance():
    x32, x = _offset_parts()
    assert x.npartitions == 8
    mean, var = pnn.moments(x, axis=0)
    got_mean, got_var = dask.compute(mean, var)
    assert got_var.dtype == np.float32
    x64 = x32.astype(np.float64)
    assert _rel(got_mean, x64.mean(axis=0)) <= 1e-6
    assert float(np.max(np.abs(got_var / x64.var(axis=0) - 1))) <= 1e-3


def test_merging_sums_of_squares_of_the_same_chunks_fails_by_orders_of_magnitude():
    """E[x²] − E[x]² from the chunks' float32 sums: the check above fails by more than 1000x."""
    x32, x = _offset_parts()
    s1 = x.map_blocks(lambda b: b.sum(axis=0, keepdims=True, dtype=np.float32), chunks=(1, 4)).sum(axis=0)
    s2 = x.map_blocks(lambda b: (b * b).sum(axis=0, keepdims=True, dtype=np.float32), chunks=(1, 4)).sum(axis=0)
    n = np.float32(x32.shape[0])
    s1, s2 = dask.compute(s1, s2)
    naive = s2 / n - (s1 / n) ** 2
    assert naive.dtype == np.float32
    assert float(np.max(np.abs(naive / x32.astype(np.float64).var(axis=0) - 1))) > 1.0


# --------------------------------------------------------------------------- explain, forced backends, fallbacks


def test_explain_names_the_chunked_route_and_the_chunks_kernel():
    x = da.from_array(_data((40, 3)), chunks=(16, 3))
    found = pnn.explain(pnn.moments, x, 0)
    text = str(found)
    assert found.backend == "numba" and found.implementation == "moments[numba]" and not found.fallback
    assert "runs: moments[numba]" in text
    assert "Dask chunked route runs instead" in text and "3 chunks, each a NumPy array on cpu, float64" in text
    assert "merge_moments" in text
    with pnn.use_backend("numba"):
        forced = pnn.explain(pnn.moments, x, 0)
    assert forced.backend == "numba" and forced.requested == "numba" and "not requested" in str(forced)
    with pnn.use_backend("reference"):
        whole = pnn.explain(pnn.moments, x, 0)
    assert whole.backend == "reference" and "chunked route" not in str(whole)
    bn = str(pnn.explain(pnn.batch_norm, da.from_array(_data((8, 3, 5)), chunks=4)))
    assert "runs: batch_norm[numba]" in bn and "moments[numba] on each chunk" in bn and "inference form" in bn


def test_a_forced_backend_runs_every_chunk_or_raises_saying_why():
    xn = _data((50, 4), seed=4)
    x = da.from_array(xn, chunks=(20, 4))
    with pnn.use_backend("numba"):
        mean, var = pnn.moments(x, 0)
        assert _ran_chunked(mean, var)
    assert _rel(var.compute(), xn.var(axis=0)) <= TOL
    half = x.astype(np.float16)
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError) as err:
        pnn.moments(half, 0)
    message = str(err.value)
    assert "backend 'numba'" in message and "chunk by chunk" in message and "float16" in message
    with pnn.use_backend(moments="numba"), pytest.raises(pnn.BackendUnavailableError, match="vjp"):
        pnn.vjp(pnn.moments, x, 0)


def test_the_configuration_reaches_the_chunks_in_worker_threads():
    """use_backend is context-local: the graph carries it to Dask's threads, so a forced reference
    for the per-chunk moments of a batch_norm applies there (a registered kernel records its calls)."""
    calls = []

    def forward(call):
        calls.append(call.family)
        return pnn.dispatch.implementations("moments")[-1].forward_fn()(call)

    pnn.register_kernel("moments", "spy", forward=forward, supports=pnn.Support(families=("numpy",)), priority=-0.5)
    try:
        x = da.from_array(_data((12, 3, 4)), chunks=(4, 3, 4))
        with pnn.use_backend(moments="spy"):
            y = pnn.batch_norm(x)
        assert calls == []  # nothing ran yet: the graph is lazy
        y.compute(scheduler="threads")
        assert calls == ["numpy"] * 3  # one per chunk, on Dask's threads, outside the use_backend block
    finally:
        pnn.unregister_kernel("moments", "spy")


def test_unsupported_calls_fall_back_to_the_reference_visibly():
    xn = _data((30, 4), seed=5)
    half = da.from_array(xn.astype(np.float16), chunks=(10, 4))
    found = pnn.explain(pnn.moments, half, 0)
    assert found.backend == "reference" and found.fallback
    assert any(b == "numba" and "each chunk" in r and "float16" in r for b, r in found.passed_over)
    mean, _ = pnn.moments(half, 0)
    assert not _ran_chunked(mean)
    assert _rel(mean.compute(), xn.astype(np.float16).astype(np.float32).mean(axis=0)) <= 1e-3
    pnn.set_fallback("error")
    with pytest.raises(pnn.BackendUnavailableError, match="falling back to the reference"):
        pnn.moments(half, 0)
    pnn.set_fallback("allow")
    masked = da.ma.masked_greater(da.from_array(xn, chunks=(10, 4)), 2.0)
    for run in (pnn.moments, functools.partial(pnn.explain, pnn.moments)):  # no route reads masks: refused
        with pytest.raises(TypeError, match="x is a masked array"):
            run(masked, 0)
    nothing = pnn.explain(pnn.moments, da.from_array(xn, chunks=10), ())
    assert nothing.backend == "reference" and nothing.fallback and "reduces no axis" in str(nothing)


@pytest.mark.gpu
def test_cupy_chunks_run_on_the_gpu_kernels_and_numba_refuses_them():
    cupy = pytest.importorskip("cupy")
    xn = _data((64, 5), seed=15)
    x = da.from_array(cupy.asarray(xn), chunks=(16, 5))
    assert pnn.explain(pnn.moments, x, 0).backend in pnn.dispatch.backends_taking("cupy")
    mean, var = pnn.moments(x, 0, correction=1)
    assert _ran_chunked(mean, var)
    mean, var = dask.compute(mean, var)
    assert isinstance(var, cupy.ndarray)
    assert _rel(mean.get(), xn.mean(axis=0)) <= 1e-10 and _rel(var.get(), xn.var(axis=0, ddof=1)) <= 1e-10
    with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="CuPy array"):
        pnn.moments(x, 0)


def test_vjp_runs_on_the_reference_over_the_whole_array():
    xn = _data((24, 3), seed=6)
    x = da.from_array(xn, chunks=(10, 3))
    pnn.set_fallback("warn")
    with pytest.warns(pnn.FallbackWarning, match="vjp needs a backward"):
        (mean, var), pullback = pnn.vjp(pnn.moments, x, 0, correction=1)
    assert not _ran_chunked(mean) and not _ran_chunked(var)
    dmean, dvar = np.arange(3.0), np.ones(3)
    dx = pullback((da.from_array(dmean), da.from_array(dvar))).x
    assert isinstance(dx, da.Array)
    want = dmean / 24 + dvar * 2 * (xn - xn.mean(axis=0)) / 23
    assert _rel(dx.compute(), want) <= TOL
    pnn.set_fallback("allow")
    y, pullback = pnn.vjp(pnn.batch_norm, da.from_array(_data((6, 2, 3)), chunks=3))
    assert not _ran_chunked(y) and isinstance(pullback(da.ones_like(y)).x, da.Array)


# --------------------------------------------------------------------------- batch_norm


def _act(name, z):
    return {"relu": lambda: np.maximum(z, 0), "gelu": lambda: 0.5 * z * (1 + erf(z / np.sqrt(2))),
            "tanh": lambda: np.tanh(z), "identity": lambda: z}[name]()


def _numpy_batch_norm(x, w, b, mean, var, channel_axis, activation, eps=1e-5):
    shape = [1] * x.ndim
    shape[channel_axis] = -1
    z = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)
    if w is not None:
        z = z * w.reshape(shape) + b.reshape(shape)
    return _act(activation, z)


#: (shape, chunks of x, channel_axis, activation, weight/bias given)
_BN = {
    "channels-first-gelu": ((10, 6, 4, 3), (3, 4, 2, 3), 1, "gelu", True),
    "channels-last-relu": ((9, 5, 7), (2, 5, 3), -1, "relu", True),
    "one-sample-chunks-tanh": ((5, 4, 6), (1, 4, 6), 1, "tanh", False),
}


@pytest.mark.parametrize("name", list(_BN))
def test_batch_norm_equals_numpy(name):
    shape, chunks, channel_axis, activation, affine = _BN[name]
    xn = _data(shape, seed=len(name))
    c = shape[channel_axis]
    wn, bn = _data(c, seed=7), _data(c, seed=8)
    x = da.from_array(xn, chunks=chunks)
    w = da.from_array(wn, chunks=2) if affine else None  # the parameters chunked unlike x's channels
    b = da.from_array(bn, chunks=3) if affine else None
    y = pnn.batch_norm(x, weight=w, bias=b, channel_axis=channel_axis, activation=activation)
    assert _ran_chunked(y) and y.chunks == x.chunks
    axes = tuple(i for i in range(xn.ndim) if i != channel_axis % xn.ndim)
    want = _numpy_batch_norm(xn, wn if affine else None, bn, xn.mean(axis=axes), xn.var(axis=axes), channel_axis,
                             activation)
    assert _rel(y.compute(), want) <= TOL
    # inference: the given running statistics normalise
    rm, rv = _data(c, seed=9), _data(c, seed=10, loc=2.0, scale=0.5) ** 2
    y = pnn.batch_norm(x, weight=w, bias=b, running_mean=da.from_array(rm), running_var=da.from_array(rv),
                       training=False, channel_axis=channel_axis, activation=activation)
    assert _ran_chunked(y)
    want = _numpy_batch_norm(xn, wn if affine else None, bn, rm, rv, channel_axis, activation)
    assert _rel(y.compute(), want) <= TOL


def test_running_statistics_are_returned_lazily_or_assigned_in_place():
    xn = _data((12, 3, 5), seed=11)
    x = da.from_array(xn, chunks=(5, 2, 5))
    rm0, rv0 = _data(3, seed=12), _data(3, seed=13, loc=1.0, scale=0.1) ** 2
    mean, var = xn.mean(axis=(0, 2)), xn.var(axis=(0, 2), ddof=1)
    want_mean, want_var = 0.7 * rm0 + 0.3 * mean, 0.7 * rv0 + 0.3 * var
    rm, rv = da.from_array(rm0), da.from_array(rv0)
    y, new_mean, new_var = pnn.batch_norm(x, running_mean=rm, running_var=rv, momentum=0.3, return_stats=True)
    assert all(isinstance(a, da.Array) for a in (y, new_mean, new_var)) and _ran_chunked(y)
    # One graph with other statistics of the same data: every result keeps its own keys.
    y, new_mean, new_var, _, unbiased = dask.compute(y, new_mean, new_var, *pnn.moments(x, (0, 2), correction=1))
    assert _rel(new_mean, want_mean) <= TOL and _rel(new_var, want_var) <= TOL
    assert _rel(unbiased, var) <= TOL
    np.testing.assert_array_equal(rm.compute(), rm0)  # return_stats mutates nothing
    # In place: Dask's item assignment; the call computes nothing, the arrays now hold the new values.
    pnn.batch_norm(x, running_mean=rm, running_var=rv, momentum=0.3)
    assert isinstance(rm, da.Array)
    assert _rel(rm.compute(), want_mean) <= TOL and _rel(rv.compute(), want_var) <= TOL
    # An empty batch leaves them as they are.
    empty = da.zeros((0, 3, 5), chunks=(4, 3, 5))
    _, same_mean, same_var = pnn.batch_norm(empty, running_mean=da.from_array(rm0), running_var=da.from_array(rv0),
                                            return_stats=True)
    np.testing.assert_array_equal(same_mean.compute(), rm0)
    np.testing.assert_array_equal(same_var.compute(), rv0)


# --------------------------------------------------------------------------- a cluster of worker processes


@pytest.fixture
def _environment_restored():
    """The cluster's nannies set OMP_NUM_THREADS=1 (and more) in this process's environment for
    good: put it back, or every later test of this process (and its subprocesses) runs serially."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.usefixtures("_environment_restored")
def test_a_local_cluster_of_worker_processes_runs_the_chunks():
    distributed = pytest.importorskip("distributed")
    xn = _data((400, 6, 3), seed=14, loc=50.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cluster's own start-up notes
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                           dashboard_address=None, silence_logs=40)
    with cluster, distributed.Client(cluster) as client:
        x = da.from_array(xn, chunks=(50, 3, 3))
        with pnn.use_backend("numba"):
            mean, var = pnn.moments(x, axis=(0, 2), correction=1)
            y, new_mean, _ = pnn.batch_norm(x, running_mean=da.zeros(6), running_var=da.ones(6), momentum=1.0,
                                            activation="relu", return_stats=True)
        mean, var, y, new_mean = client.compute([mean, var, y, new_mean], sync=True)
        ran_kernels = client.run(lambda: "kernels_cpu.norm" in sys.modules)
    assert len(ran_kernels) == 2 and any(ran_kernels.values())  # the numba kernels ran in the workers
    assert _rel(mean, xn.mean(axis=(0, 2))) <= TOL and _rel(var, xn.var(axis=(0, 2), ddof=1)) <= TOL
    assert _rel(new_mean, xn.mean(axis=(0, 2))) <= TOL
    want = _numpy_batch_norm(xn, None, None, xn.mean(axis=(0, 2)), xn.var(axis=(0, 2)), 1, "relu")
    assert _rel(y, want) <= TOL


# --------------------------------------------------------------------------- errors


def test_bad_arguments_raise_naming_the_argument():
    x = da.from_array(_data((10, 4)), chunks=5)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        pnn.moments(da.ones((4, 2), dtype=np.int32, chunks=2), 0)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        pnn.moments(x, 2)
    with pytest.raises(ValueError, match="correction must be a non-negative"):
        pnn.moments(x, 0, correction=-1)
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        pnn.batch_norm(x, weight=da.ones(3))
    with pytest.raises(TypeError, match="running_mean is a NumPy array"):
        pnn.batch_norm(x, running_mean=np.zeros(4), running_var=np.ones(4))
    with pytest.raises(ValueError, match="running_mean and running_var are required"):
        pnn.batch_norm(x, training=False)
