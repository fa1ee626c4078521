"""The fast path (portable_nn.plans): a repeated call of one signature reuses the first call's plan.

What must hold: every op of every sample takes it; its results and gradients are bitwise the full
path's; any change to what validation or selection reads (shape, dtype, strides, read-only flag,
array library, options, backend forcing, fallback policy, thread count, the registry) misses the
plan; bad input after a warm cache raises the full path's error; plans keep no array alive and
the cache is bounded.
"""

from __future__ import annotations

import gc
import itertools
import re
import threading
import weakref

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_TORCH, run_in_threads
from portable_nn import dispatch, plans, warmup

SAMPLES = warmup.samples("float64")
CASES = [(op, k) for op, calls in SAMPLES.items() for k in range(len(calls))]


@pytest.fixture(autouse=True)
def _fresh_cache():
    plans.clear_cache()
    yield
    plans.set_cache_size(plans.DEFAULT_CACHE_SIZE)


def _map_arrays(fn, tree):
    """``tree`` (arguments: lists, tuples, dicts) with each NumPy array replaced by ``fn(array)``."""
    if isinstance(tree, np.ndarray):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_arrays(fn, t) for t in tree)
    if isinstance(tree, dict):
        return {k: _map_arrays(fn, v) for k, v in tree.items()}
    return tree


def _copy(tree):
    return _map_arrays(np.copy, tree)


def _to_torch(tree):
    import torch

    return _map_arrays(lambda a: torch.from_numpy(a.copy()), tree)


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _leaves(t)]
    return [tree]


def _bits(a):
    if not hasattr(a, "shape"):
        return a  # a scalar argument
    a = np.asarray(a.numpy() if hasattr(a, "numpy") else a)
    return a.dtype, a.shape, a.tobytes()


def _same(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert (x is None) == (y is None)
        if x is not None:
            assert _bits(x) == _bits(y)


def _run(op, args, kwargs, lib):
    """A plain call and a vjp with ones cotangents, on fresh copies: (result, gradients, inputs after)."""
    fn = getattr(pnn, op)
    make = _to_torch if lib == "torch" else _copy
    plain_args, plain_kwargs = make(args), make(kwargs)
    result = fn(*plain_args, **plain_kwargs)
    vjp_args, vjp_kwargs = make(args), make(kwargs)
    out, pullback = pnn.vjp(fn, *vjp_args, **vjp_kwargs)
    ones = warmup._ones_like(_copy(_numpy_tree(out)))
    grads = pullback(_to_torch(ones) if lib == "torch" else ones)
    return result, out, grads, (plain_args, plain_kwargs)


def _numpy_tree(tree):
    if isinstance(tree, tuple):
        return tuple(_numpy_tree(t) for t in tree)
    return None if tree is None else np.asarray(tree.numpy() if hasattr(tree, "numpy") else tree)


LIBS = ("numpy", "torch") if HAS_TORCH else ("numpy",)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize(("op", "k"), CASES, ids=[f"{op}-{k}" for op, k in CASES])
def test_every_op_takes_the_fast_path_bitwise_as_the_full_path(op, k, backend, lib):
    args, kwargs = SAMPLES[op][k]
    with pnn.use_backend(backend):
        plans.set_cache_size(0)  # the full path on every call
        full = _run(op, args, kwargs, lib)
        plans.set_cache_size(plans.DEFAULT_CACHE_SIZE)
        _run(op, args, kwargs, lib)  # the first calls make the plans
        made = plans.cache_info()
        fast = _run(op, args, kwargs, lib)  # the next ones take them
        taken = plans.cache_info()
        convert = _to_torch if lib == "torch" else _copy
        explained = pnn.explain(getattr(pnn, op), *convert(args), **convert(kwargs))
    assert taken.hits - made.hits >= 2 and taken.misses == made.misses, f"{op} missed its plan"
    for f, g in zip(full, fast):
        _same(f, g)  # results, vjp results, gradients and the arguments after (running statistics)
    assert explained.path.startswith("fast path"), explained.path


def _x(shape=(3, 4), dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _path(*args, **kwargs):
    return pnn.explain(pnn.layer_norm, *args, **kwargs).path


def test_a_call_s_first_signature_plans_and_the_next_reuse_it():
    x = _x()
    assert _path(x).startswith("full path now")
    pnn.layer_norm(x)
    assert _path(x).startswith("fast path")
    assert "path: fast path" in str(pnn.explain(pnn.layer_norm, x))


def _variants():
    """Calls that differ from ``layer_norm(x, w, b)`` in one thing validation or selection reads."""
    x, w, b = _x(), _x((4,)), _x((4,))
    frozen = x.copy()
    frozen.flags.writeable = False
    wide = _x((3, 8))
    yield "shape", (_x((5, 4)), w, b), {}
    yield "dtype", (x.astype(np.float64), w.astype(np.float64), b.astype(np.float64)), {}
    yield "strides", (wide[:, ::2], w, b), {}
    yield "read-only", (frozen, w, b), {}
    yield "absent weight", (x, None, b), {}
    yield "keyword", (x, w), {"bias": b}
    yield "option", (x, w, b), {"eps": 1e-3}
    yield "option type", (x, w, b), {"eps": 1}
    yield "activation", (x, w, b), {"activation": "gelu"}
    if HAS_TORCH:
        import torch

        yield "library", tuple(torch.from_numpy(a) for a in (x, w, b)), {}


def test_every_change_to_a_call_misses_the_plan():
    x, w, b = _x(), _x((4,)), _x((4,))
    pnn.layer_norm(x, w, b)
    assert _path(x, w, b).startswith("fast path")
    for what, args, kwargs in _variants():
        assert not _path(*args, **kwargs).startswith("fast path"), what
        pnn.layer_norm(*args, **kwargs)
        assert _path(*args, **kwargs).startswith("fast path"), what


def test_configuration_changes_miss_the_plan_and_take_effect():
    x = _x()
    pnn.layer_norm(x)
    seen = []
    original = dispatch.Route._forward

    def spy(route, call):
        seen.append(route.impl.backend)
        return original(route, call)

    changes = [
        lambda: pnn.use_backend("reference"),
        lambda: pnn.use_backend(layer_norm="reference"),
        lambda: pnn.use_threads(1),
    ]
    for change in changes:
        with change():
            assert not _path(x).startswith("fast path")
            pnn.layer_norm(x)
            assert _path(x).startswith("fast path")
        assert _path(x).startswith("fast path")  # the enclosing configuration's plan is still there
    setters = [
        (lambda: pnn.set_backend("reference"), lambda: pnn.set_backend(None)),
        (lambda: pnn.set_fallback("warn"), lambda: pnn.set_fallback("allow")),
        (lambda: pnn.set_num_threads(1), lambda: pnn.set_num_threads(None)),
    ]
    for setting, undo in setters:
        setting()
        try:
            assert not _path(x).startswith("fast path")
        finally:
            undo()
        assert not _path(x).startswith("fast path")  # undoing is a change too
        pnn.layer_norm(x)
    dispatch.Route._forward = spy
    try:
        with pnn.use_backend("reference"):
            pnn.layer_norm(x)
            pnn.layer_norm(x)
        assert seen == ["reference", "reference"]
    finally:
        dispatch.Route._forward = original


def test_the_environment_variable_misses_the_plan(monkeypatch):
    x = _x()
    pnn.layer_norm(x)
    monkeypatch.setenv("PORTABLE_NN_BACKEND", "reference")
    assert not _path(x).startswith("fast path")
    assert pnn.explain(pnn.layer_norm, x).backend == "reference"


def test_registering_a_kernel_misses_every_plan():
    x = _x()
    pnn.layer_norm(x)
    pnn.register_kernel("layer_norm", "planned", forward=lambda call: ((call.x * 0,), None), priority=100)
    try:
        assert not _path(x).startswith("fast path")
        assert np.all(pnn.layer_norm(x) == 0) and np.all(pnn.layer_norm(x) == 0)
    finally:
        pnn.unregister_kernel("layer_norm", "planned")
    assert not np.all(pnn.layer_norm(x) == 0)


def test_forcing_a_backend_that_cannot_run_the_call_raises_after_a_warm_cache():
    x = _x(dtype=np.float16)
    pnn.moments(x, 0)  # auto: the reference takes float16 moments
    if pnn.available_backends()["numba"]:
        with pnn.use_backend("numba"), pytest.raises(pnn.BackendUnavailableError, match="float16"):
            pnn.moments(x, 0)


def test_fallbacks_warn_on_every_planned_call():
    if not pnn.available_backends()["numba"]:
        pytest.skip("numba is not installed")
    x = _x(dtype=np.float16)
    pnn.set_fallback("warn")
    for _ in range(3):
        with pytest.warns(pnn.FallbackWarning, match="float16"):
            pnn.moments(x, 0)
    pnn.set_fallback("error")
    with pytest.raises(pnn.BackendUnavailableError, match="float16"):
        pnn.moments(x, 0)


def _error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc), str(exc)
    return None


def _bad_calls():
    """(op, good call, bad call): the bad call differs in values only where validation reads values."""
    x, w = _x(), _x((4,))
    labels = np.array([0, 1, 2])
    rm, rv = np.zeros(4), np.ones(4)
    frozen = rv.copy()
    frozen.flags.writeable = False
    x4 = _x((2, 4, 3)).astype(np.float64)
    idx = np.zeros((2, 3, 2, 2), np.int64)
    pooled = _x((2, 3, 2, 2)).astype(np.float64)
    return [
        (pnn.layer_norm, ((x, w), {}), ((x, _x((3,))), {})),
        (pnn.layer_norm, ((x, w), {}), ((x, w.astype(np.float64)), {})),
        (pnn.layer_norm, ((x, w), {}), ((x, w), {"eps": -1.0})),
        (pnn.cross_entropy, ((x, labels), {}), ((x, np.array([0, 1, 4])), {})),
        (pnn.cross_entropy, ((x, labels), {}), ((x, np.array([0, -3, 1])), {})),
        (pnn.max_unpool, ((pooled, idx, 2), {}), ((pooled, idx + 16, 2), {})),
        (pnn.batch_norm, ((x4,), {"running_mean": rm, "running_var": rv}),
         ((x4,), {"running_mean": rm, "running_var": frozen})),
        (pnn.batch_norm, ((x4,), {"running_mean": rm, "running_var": rv}),
         ((x4,), {"running_mean": rm, "running_var": rm})),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_after_a_warm_cache_raises_the_full_path_s_error(case):
    fn, (good_args, good_kwargs), (bad_args, bad_kwargs) = _bad_calls()[case]
    plans.set_cache_size(0)
    expected = _error(fn, *bad_args, **bad_kwargs)  # (the arguments themselves: a copy is writable, distinct)
    assert expected is not None
    plans.set_cache_size(plans.DEFAULT_CACHE_SIZE)
    for _ in range(2):  # the plan, then a call that would take it
        fn(*_copy(good_args), **_copy(good_kwargs))
    before = _copy((bad_args, bad_kwargs))
    assert _error(fn, *bad_args, **bad_kwargs) == expected
    _same(before, (bad_args, bad_kwargs))  # nothing mutated
    if fn is pnn.layer_norm:
        assert _error(pnn.vjp, fn, *bad_args, **bad_kwargs) is not None


def test_plans_keep_no_array_alive_and_the_cache_is_bounded():
    x, w = _x(), _x((4,))
    alive = [weakref.ref(x), weakref.ref(w)]
    y = pnn.layer_norm(x, w)
    out, pullback = pnn.vjp(pnn.layer_norm, x, w)
    pullback(np.ones_like(out))
    alive.append(weakref.ref(y))
    del x, w, y, out, pullback
    gc.collect()
    assert all(ref() is None for ref in alive)
    plans.set_cache_size(4)
    for n in range(1, 11):
        pnn.layer_norm(_x((n, 4)))
    assert plans.cache_info().currsize <= 4 and plans.cache_info().maxsize == 4


def test_a_signature_without_a_plan_says_why():
    x = _x((2, 3, 4))
    params = [(_x((2, 4)), _x((2, 2)), None, None)]
    lengths = np.array([2, 1, 2])  # an array read into a parameter: its values are not in the signature
    pnn.rnn(x, params, lengths=lengths)
    path = pnn.explain(pnn.rnn, x, params, lengths=lengths).path
    assert path.startswith("full path on every call") and "values" in path
    assert pnn.explain(pnn.layer_norm, x, axis=[-1]).path.startswith("full path now")
    plans.set_cache_size(0)
    assert "off" in _path(x)
    with pytest.raises(ValueError, match="non-negative"):
        plans.set_cache_size(-1)


def test_each_thread_keeps_its_own_configuration_on_the_fast_path():
    x = _x()
    errors = []
    barrier = threading.Barrier(4)
    turns = itertools.count()

    def body():
        backend = ("reference", "auto")[next(turns) % 2]
        try:
            barrier.wait()
            with pnn.use_backend(backend):
                for _ in range(20):
                    report = pnn.explain(pnn.layer_norm, x)
                    assert backend == "auto" or report.backend == "reference"
                    pnn.layer_norm(x)
        except Exception as exc:
            errors.append(exc)

    run_in_threads(body, threads=4)
    assert not errors, errors


def test_the_key_keeps_zero_signs_and_types_apart():
    x = _x()
    keys = {plans.signature("batch_norm", None, (x,), {"momentum": m})[0] for m in (0.0, -0.0, 0, False)}
    assert len(keys) == 4
    assert re.search("fast|full", _path(x))
