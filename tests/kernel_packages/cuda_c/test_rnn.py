"""CUDA C sequence kernels (``rnn``/``lstm``/``gru`` on backend ``"cupy"``): checked without a GPU.

The compile test of ``test_runtime.py`` covers rnn.cu (cells and sequences) for
sm_80/sm_90.  Here, without a GPU:

* every argument combination's forward and backward runs through the launchers on NumPy with
  the exact CUDA source on the CPU emulator (every launch checked against the kernel signature
  and the PTX), compared with the float64 reference: outputs, final states, and the gradients of
  x, every layer's and direction's weights and biases, h0 and c0;
* the launch structure: one fused kernel per step and direction (two stages for the GRU with
  ``reset_after=False``), the same number in the backward;
* zero-size sequences, ``out=`` buffers, the no-``save`` (inference) path.

On a GPU (``-m gpu``): every spec forced onto ``cupy`` against the reference, and bitwise
reproducibility.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from kernels_gpu.cuda_c import rnn as crnn
from pnn_testing import TOL

from .cuda_c_testing import (
    GEMM_DTYPES,
    _call,
    _data_like,
    _host,
    _rng,
    assert_matches,
    emulated_case,
    emulating,
    gpu_compare,
    needs_emulator,
    recording,
    reference_of,
)

GATES = {"rnn": 1, "lstm": 4, "gru": 3}
DTYPES = ("float32", "float64")


def _params(r, op, layers, dirs, inp, hs, bias=(True, True), proj=0):
    g = GATES[op]
    out = proj or hs
    params = []
    for layer in range(layers):
        features = inp if layer == 0 else dirs * out
        for _ in range(dirs):
            entry = (r.standard_normal((g * hs, features)) * 0.6, r.standard_normal((g * hs, out)) * 0.6,
                     r.standard_normal(g * hs) * 0.5 if bias[0] else None,
                     r.standard_normal(g * hs) * 0.5 if bias[1] else None)
            params.append((*entry, r.standard_normal((proj, hs)) * 0.6) if proj else entry)
    return params


def sequence_specs():
    """(id, op, args, kwargs): every documented argument of rnn/lstm/gru, tiny shapes (T<=4, N<=3, H<=4)."""
    r = _rng(21)
    t, n, i, h = 4, 3, 3, 4

    def x(batch_first=False):
        return r.standard_normal((n, t, i) if batch_first else (t, n, i))

    def state(layers, dirs, size=h):
        return r.standard_normal((layers * dirs, n, size))

    return [
        ("rnn-tanh-h0", "rnn", (x(), _params(r, "rnn", 1, 1, i, h), state(1, 1)), {}),
        ("rnn-relu-2layer-bidir-lengths-nobias", "rnn", (x(), _params(r, "rnn", 2, 2, i, h, (False, False))),
         {"activation": "relu", "bidirectional": True, "lengths": [4, 1, 3]}),
        ("rnn-batch-first-bih-only", "rnn", (x(True), _params(r, "rnn", 1, 1, i, h, (True, False))),
         {"batch_first": True, "lengths": [2, 4, 3]}),
        ("lstm-h0-c0", "lstm", (x(), _params(r, "lstm", 1, 1, i, h), state(1, 1), state(1, 1)), {}),
        ("lstm-2layer-bidir-lengths", "lstm", (x(), _params(r, "lstm", 2, 2, i, h), state(2, 2), state(2, 2)),
         {"bidirectional": True, "lengths": [3, 4, 1]}),
        ("lstm-batch-first-nostate-bhh-only", "lstm", (x(True), _params(r, "lstm", 2, 1, i, h, (False, True))),
         {"batch_first": True}),
        ("lstm-proj-2layer-bidir-lengths", "lstm",
         (x(), _params(r, "lstm", 2, 2, i, h, proj=2), state(2, 2, 2), state(2, 2)),
         {"bidirectional": True, "lengths": [3, 4, 1]}),
        ("lstm-proj-batch-first-nostate-nobias", "lstm", (x(True), _params(r, "lstm", 1, 1, i, h, (False, False), 3)),
         {"batch_first": True, "lengths": [2, 4, 3]}),
        ("lstm-proj-h0-c0", "lstm", (x(), _params(r, "lstm", 1, 1, i, h, proj=1), state(1, 1, 1), state(1, 1)), {}),
        ("gru-bidir-lengths-batch-first", "gru", (x(True), _params(r, "gru", 1, 2, i, h), state(1, 2)),
         {"batch_first": True, "bidirectional": True, "lengths": [1, 4, 2]}),
        ("gru-2layer", "gru", (x(), _params(r, "gru", 2, 1, i, h)), {}),
        ("gru-reset-before-2layer-lengths", "gru", (x(), _params(r, "gru", 2, 1, i, h), state(2, 1)),
         {"reset_after": False, "lengths": [2, 3, 4]}),
        ("gru-reset-before-bidir-nobias", "gru", (x(), _params(r, "gru", 1, 2, i, h, (False, False)), state(1, 2)),
         {"reset_after": False, "bidirectional": True}),
    ]


SPECS = sequence_specs()


def _typed(spec, dtype):
    """The spec's params list in ``dtype`` (``_call`` converts arrays, not the list inside)."""
    _, op, args, kwargs = spec
    params = [tuple(None if a is None else a.astype(dtype) for a in entry) for entry in args[1]]
    return op, (args[0], params, *args[2:]), kwargs


def _needs_sets(call):
    names = {"x", "params"} | {s for s in ("h0", "c0") if call.arrays.get(s) is not None}
    return [names, {"params"}, {"x"}, names - {"x", "params"} or {"x"}]


def _compare(outputs, grads, ref_outputs, ref_grads, needs, dtype):
    tol = TOL[dtype]
    for k, (got, want) in enumerate(zip(outputs, ref_outputs)):
        assert_matches(_host(got), np.asarray(want), tol, f"output {k}")
    assert set(grads) == set(needs)
    for name in needs:
        if name != "params":
            assert_matches(_host(grads[name]), np.asarray(ref_grads[name]), 8 * tol, f"d{name}")
            continue
        assert len(grads["params"]) == len(ref_grads["params"])
        for k, (got, want) in enumerate(zip(grads["params"], ref_grads["params"])):
            for j, (g, e) in enumerate(zip(got, want)):
                assert (g is None) == (e is None), f"params[{k}][{j}]"
                if g is not None:
                    assert_matches(_host(g), np.asarray(e), 8 * tol, f"dparams[{k}][{j}]")


def emulated_sequence(spec, dtype, needs_sets=None):
    """Forward and backward of ``spec`` on the CPU emulator against the float64 reference."""
    op, args, kwargs = _typed(spec, dtype)
    call = _call(op, args, kwargs, dtype)
    with emulating():
        outputs, res = crnn.sequence_forward(call)
    cts = tuple(_data_like(tuple(o.shape), dtype, 31 + k) for k, o in enumerate(outputs))
    for needs in needs_sets or _needs_sets(call):
        with emulating():
            grads = crnn.sequence_backward(res, cts, frozenset(needs), {})
        ref_outputs, ref_grads = reference_of(call, cts, frozenset(needs))
        _compare(outputs, grads, ref_outputs, ref_grads, needs, dtype)
    return call


@needs_emulator
@pytest.mark.parametrize("spec", SPECS, ids=[s[0] for s in SPECS])
def test_emulated_sequences_match_reference(spec, monkeypatch):
    monkeypatch.setattr(crnn, "BLOCK", 32)
    monkeypatch.setattr(crnn, "MAX_BLOCKS", 1)  # N·H = 12 < 32: one block; the grid-stride loop is the cells'
    for dtype in DTYPES:
        emulated_sequence(spec, dtype)


@needs_emulator
def test_emulated_grid_stride_loop(monkeypatch):
    """More units than one block of threads: the kernels' grid-stride loops cover every (n, u)."""
    monkeypatch.setattr(crnn, "BLOCK", 32)
    monkeypatch.setattr(crnn, "MAX_BLOCKS", 1)
    r = _rng(5)
    t, n, i, h = 2, 3, 2, 12  # N·H = 36 > 32
    for op, kw in (("lstm", {"bidirectional": True}), ("gru", {"reset_after": False, "lengths": [1, 2, 2]})):
        spec = (op, op, (r.standard_normal((t, n, i)), _params(r, op, 1, 2 if kw.get("bidirectional") else 1, i, h)),
                kw)
        emulated_sequence(spec, "float64", [{"x", "params"}])


@needs_emulator
@pytest.mark.parametrize("op,kwargs", [("rnn", {}), ("lstm", {"bidirectional": True}),
                                       ("gru", {"reset_after": False, "lengths": [2, 1]})])
def test_emulated_inference_path_matches(op, kwargs, monkeypatch):
    """Without ``save`` (no gradient recorded) two state slots alternate: same outputs, no residuals."""
    monkeypatch.setattr(crnn, "BLOCK", 32)
    r = _rng(9)
    params = [tuple(a.astype(np.float64) if a is not None else None for a in e)
              for e in _params(r, op, 2, 2 if kwargs.get("bidirectional") else 1, 3, 2)]
    x = r.standard_normal((3, 2, 3))
    call = _call(op, (x, params), kwargs, "float64", save=False)
    with emulating():
        outputs, res = crnn.sequence_forward(call)
    assert res is None
    ref_outputs, _ = reference_of(call, tuple(np.zeros(o.shape) for o in outputs), frozenset())
    for got, want in zip(outputs, ref_outputs):
        assert_matches(got, want, TOL["float64"], "output")


def _count(launches, kernel):
    return sum(1 for _, name, _, _ in launches if name.startswith(kernel))


@pytest.mark.parametrize("spec", SPECS, ids=[s[0] for s in SPECS])
def test_one_fused_kernel_per_step(spec):
    """Launch structure (no Python launch per gate): per step and direction one kernel forward and one
    backward (two stages for the GRU with reset_after=False); every launch matches the kernel's signature."""
    op, args, kwargs = _typed(spec, "float32")
    call = _call(op, args, kwargs, "float32")
    steps = int(call.x.shape[1] if call.batch_first else call.x.shape[0])
    stages = 2 if op == "gru" and not call.reset_after else 1
    expected = steps * call.num_layers * call.num_directions * stages
    with recording() as launches:
        outputs, res = crnn.sequence_forward(call)
        assert _count(launches, "seq_fwd") == expected and len(launches) == expected
        launches.clear()
        cts = tuple(np.zeros(o.shape, np.float32) for o in outputs)
        grads = crnn.sequence_backward(res, cts, frozenset({"x", "params"}), {})
        assert _count(launches, "seq_bwd") == expected and len(launches) == expected
    assert grads["x"].shape == call.x.shape and grads["x"].dtype == np.float32
    for k, entry in enumerate(grads["params"]):
        for j, g in enumerate(entry):
            like = call.arrays[call.param_names[k][j]]
            assert (g is None) == (like is None)
            if g is not None:
                assert g.shape == like.shape and g.dtype == like.dtype


@needs_emulator
@pytest.mark.parametrize("op", ["rnn", "lstm", "gru"])
def test_zero_length_and_empty_batch(op):
    r = _rng(3)
    for shape in ((0, 2, 3), (3, 0, 3)):
        params = _params(r, op, 2, 2, 3, 2)
        h0 = r.standard_normal((4, shape[1], 2))
        args = (r.standard_normal(shape), params, h0) + ((h0 + 1,) if op == "lstm" else ())
        spec = (op, op, args, {"bidirectional": True})
        emulated_sequence(spec, "float64")


@needs_emulator
def test_backward_writes_into_given_buffers():
    r = _rng(4)
    params = [tuple(a.astype(np.float32) if a is not None else None for a in e)
              for e in _params(r, "lstm", 1, 2, 3, 2, (True, False))]
    call = _call("lstm", (r.standard_normal((3, 2, 3)), params, r.standard_normal((2, 2, 2))),
                 {"bidirectional": True}, "float32")
    with emulating():
        outputs, res = crnn.sequence_forward(call)
        cts = tuple(_data_like(tuple(o.shape), "float32", 40 + k) for k, o in enumerate(outputs))
        out = {"x": np.empty((3, 2, 3), np.float32), "h0": np.empty((2, 2, 2), np.float32),
               "params": [tuple(None if a is None else np.empty_like(a) for a in e) for e in params]}
        grads = crnn.sequence_backward(res, cts, frozenset({"x", "params", "h0"}), out)
    assert grads["x"] is out["x"] and grads["h0"] is out["h0"]
    for got, given in zip(grads["params"], out["params"]):
        assert got[0] is given[0] and got[1] is given[1] and got[2] is given[2] and got[3] is None
    _, ref = reference_of(call, cts, frozenset({"x", "params", "h0"}))
    assert_matches(grads["x"], ref["x"], 8 * TOL["float32"], "dx")
    assert_matches(grads["params"][1][1], ref["params"][1][1], 8 * TOL["float32"], "dw_hh reverse")


def test_sequences_are_registered_for_cupy():
    rows = {(row["op"], row["backend"]) for row in pnn.capabilities()}
    assert {("rnn", "cupy"), ("lstm", "cupy"), ("gru", "cupy")} <= rows


# --------------------------------------------------------------------------- GPU: against the reference


def _device(a, dtype):
    import cupy

    return None if a is None else cupy.asarray(np.asarray(a, dtype=dtype))


def gpu_sequence_compare(spec, dtype):
    """Forward and every gradient of ``spec`` forced onto ``cupy`` vs the float64 reference."""
    import cupy

    _, op, args, kwargs = spec
    x, params, *states = args
    dev_params = [tuple(_device(a, dtype) for a in e) for e in params]
    dev_args = (_device(x, dtype), dev_params, *(_device(s, dtype) for s in states))
    host = (_host(dev_args[0]), [tuple(_host(a) for a in e) for e in dev_params], *(_host(s) for s in dev_args[2:]))
    with pnn.use_backend("cupy"):
        fn = getattr(pnn, op)
        assert pnn.explain(op, *dev_args, **kwargs).backend == "cupy"
        y, pullback = pnn.vjp(fn, *dev_args, **kwargs)
        flat = (y[0], *y[1]) if op == "lstm" else y
        dys = [cupy.asarray(_rng(50 + k).standard_normal(tuple(v.shape)).astype(dtype)) for k, v in enumerate(flat)]
        ct = (dys[0], (dys[1], dys[2])) if op == "lstm" else tuple(dys)
        grads = pullback(ct)
    with pnn.use_backend("reference"):
        y_ref, pb_ref = pnn.vjp(getattr(pnn, op), *host, **kwargs)
        host_dys = [_host(d) for d in dys]
        grads_ref = pb_ref((host_dys[0], (host_dys[1], host_dys[2])) if op == "lstm" else tuple(host_dys))
    flat_ref = (y_ref[0], *y_ref[1]) if op == "lstm" else y_ref
    tol = 2 * TOL[dtype]
    for k, (got, want) in enumerate(zip(flat, flat_ref)):
        assert_matches(_host(got), want, tol, f"output {k}")
    for name in grads._fields:
        got, want = getattr(grads, name), getattr(grads_ref, name)
        assert (got is None) == (want is None), name
        if got is None:
            continue
        if name == "params":
            for k, (ge, we) in enumerate(zip(got, want)):
                for j, (g, e) in enumerate(zip(ge, we)):
                    assert (g is None) == (e is None)
                    if g is not None:
                        assert_matches(_host(g), e, 8 * tol, f"dparams[{k}][{j}]")
        else:
            assert_matches(_host(got), want, 8 * tol, f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS, ids=[s[0] for s in SPECS])
def test_gpu_sequences_match_reference(spec, dtype):
    gpu_sequence_compare(spec, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["lstm", "gru"])
def test_gpu_sequences_bitwise_deterministic(op):
    import cupy

    r = _rng(6)
    x = cupy.asarray(r.standard_normal((16, 8, 24)).astype(np.float32))
    params = [tuple(cupy.asarray(a.astype(np.float32)) for a in e) for e in _params(r, op, 2, 2, 24, 32)]
    dy = cupy.asarray(r.standard_normal((16, 8, 64)).astype(np.float32))
    results = []
    with pnn.use_backend("cupy"):
        for _ in range(2):
            y, pb = pnn.vjp(getattr(pnn, op), x, params, bidirectional=True, lengths=[16, 3, 9, 1, 16, 12, 5, 7])
            ct = (dy, (None, None)) if op == "lstm" else (dy, None)
            g = pb(ct)
            results.append([y[0], g.x, *(a for e in g.params for a in e)])
    for a, b in zip(*results):
        assert bool((a == b).all())


# --------------------------------------------------------------------------- cells
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



@needs_emulator
def test_emulated_padding_past_lengths_is_never_read(monkeypatch):
    """NaN past each sequence's end reaches no output and no gradient (the reference agrees: it zeroes it too)."""
    monkeypatch.setattr(crnn, "BLOCK", 32)
    _, op, args, kwargs = next(s for s in SPECS if s[0] == "lstm-2layer-bidir-lengths")
    x = np.array(args[0])
    for b, length in enumerate(kwargs["lengths"]):
        x[length:, b] = np.nan
    # The emulator matches the reference, NaN positions included; the reference has none:
    with pnn.use_backend("reference"):
        outputs = pnn.lstm(x, *args[1:], **kwargs)
    assert all(np.isfinite(o).all() for o in (outputs[0], *outputs[1]))
    call = emulated_sequence(("nan-padding", op, (x, *args[1:]), kwargs), "float64")
    assert call.lengths is not None
