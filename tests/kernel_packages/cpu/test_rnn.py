"""Numba recurrent kernels (kernels_cpu/rnn.py): selection, float64 agreement with the reference,
determinism, BLAS threading regimes, ``out=`` buffers, packed sequences, the vectorised exp.

Agreement with PyTorch over the whole argument grid runs in tests/api/test_rnn.py, whose cases
include every backend that declares the recurrent ops (numba among them, forced).
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_TORCH, assert_matches, run_in_threads

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

GATES = {"rnn": 1, "lstm": 4, "gru": 3}
SEQ = {"rnn": pnn.rnn, "lstm": pnn.lstm, "gru": pnn.gru}
CELL = {"rnn": pnn.rnn_cell, "lstm": pnn.lstm_cell, "gru": pnn.gru_cell}
# (kind, keyword arguments): every cell the kernels implement
VARIANTS = [
    ("rnn", {"activation": "tanh"}),
    ("rnn", {"activation": "relu"}),
    ("lstm", {}),
    ("gru", {"reset_after": True}),
    ("gru", {"reset_after": False}),
]
VARIANT_IDS = ["rnn_tanh", "rnn_relu", "lstm", "gru", "gru_original"]


def _params(rng, kind, layers, dirs, features, hs, dtype, bias=True, proj=0):
    g = GATES[kind]
    scale = 0.9 / np.sqrt(hs)
    out = proj or hs
    params = []
    for k in range(layers * dirs):
        fin = features if k < dirs else dirs * out
        entry = [rng.uniform(-1, 1, (g * hs, fin)) * scale, rng.uniform(-1, 1, (g * hs, out)) * scale]
        entry += [rng.uniform(-0.5, 0.5, g * hs) if bias else None for _ in range(2)]
        if proj:
            entry.append(rng.uniform(-1, 1, (proj, hs)) * scale)
        params.append(tuple(None if p is None else p.astype(dtype) for p in entry))
    return params


def _problem(kind, *, steps=5, n=3, features=4, hs=3, layers=2, bidirectional=False, batch_first=False,
             lengths=None, bias=True, dtype=np.float64, seed=0, proj=0):
    rng = np.random.default_rng(seed)
    dirs = 2 if bidirectional else 1
    out = proj or hs
    shape = (n, steps, features) if batch_first else (steps, n, features)
    out_shape = (n, steps, dirs * out) if batch_first else (steps, n, dirs * out)
    state = (layers * dirs, n, out)
    cell = (layers * dirs, n, hs)
    return {
        "x": rng.standard_normal(shape).astype(dtype),
        "params": _params(rng, kind, layers, dirs, features, hs, dtype, bias, proj),
        "h0": (rng.standard_normal(state) * 0.5).astype(dtype),
        "c0": rng.standard_normal(cell).astype(dtype) if kind == "lstm" else None,
        "dy": rng.standard_normal(out_shape).astype(dtype),
        "dh": rng.standard_normal(state).astype(dtype),
        "dc": rng.standard_normal(cell).astype(dtype) if kind == "lstm" else None,
        "kw": {"bidirectional": bidirectional, "batch_first": batch_first, "lengths": lengths},
    }


def _sequence(kind, p, backend, out=None, **kw):
    """Outputs and gradients (flattened to a list of arrays) on ``backend``."""
    with pnn.use_backend(backend):
        if kind == "lstm":
            (y, (hn, cn)), pullback = pnn.vjp(pnn.lstm, p["x"], p["params"], p["h0"], p["c0"], **p["kw"], **kw)
            grads = pullback((p["dy"], (p["dh"], p["dc"])), out=out)
            outputs = [y, hn, cn]
        else:
            (y, hn), pullback = pnn.vjp(SEQ[kind], p["x"], p["params"], p["h0"], **p["kw"], **kw)
            grads = pullback((p["dy"], p["dh"]), out=out)
            outputs = [y, hn]
    flat = outputs + [grads.x, grads.h0] + [g for row in grads.params for g in row if g is not None]
    if kind == "lstm":
        flat.append(grads.c0)
    return flat, grads


def _assert_matches(actual, expected, tol):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, i
        if e.size:
            err = np.max(np.abs(np.asarray(a, np.float64) - e)) / max(np.max(np.abs(e)), 1e-300)
            assert err <= tol, f"array {i}: relative error {err:.2e} > {tol:.0e}"


# --------------------------------------------------------------------------- selection


def _explain_args(op):
    x = np.ones((2, 3), np.float32)
    h = np.zeros((2, 4), np.float32)
    if op in ("rnn_cell", "lstm_cell", "gru_cell"):
        g = GATES[op.split("_")[0]]
        w = (np.ones((g * 4, 3), np.float32), np.ones((g * 4, 4), np.float32))
        return (x, h, h, *w) if op == "lstm_cell" else (x, h, *w)
    g = GATES[op]
    return (np.ones((5, 2, 3), np.float32), [(np.ones((g * 4, 3), np.float32), np.ones((g * 4, 4), np.float32),
                                              None, None)])


@pytest.mark.parametrize("op", ["rnn_cell", "lstm_cell", "gru_cell", "rnn", "lstm", "gru"])
def test_auto_picks_numba_for_numpy_float32(op):
    report = pnn.explain(op, *_explain_args(op))
    assert report.backend == "numba", str(report)
    assert report.copies == []


def test_half_precision_runs_widened_to_float32():
    """float16 data with float32 weights runs the float32 kernels (widened on entry, rounded on exit):
    the outputs are float16 and agree with the float32 computation on the same values to float16's
    rounding (test_half.py checks every family against the float64 oracle)."""
    x = np.random.default_rng(0).standard_normal((5, 2, 3)).astype(np.float16)
    params = [(np.full((16, 3), 0.1, np.float32), np.full((16, 4), 0.2, np.float32), None, None)]
    assert pnn.explain(pnn.lstm, x, params).backend == "numba"
    with pnn.use_backend("numba"):
        out, (h, c) = pnn.lstm(x, params)
        out32, (h32, c32) = pnn.lstm(x.astype(np.float32), params)
    for half, single in ((out, out32), (h, h32), (c, c32)):
        assert half.dtype == np.float16
        np.testing.assert_allclose(half.astype(np.float32), single, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_cpu_tensors_run_the_kernel_and_get_tensors_back():
    import torch

    p = _problem("gru", dtype=np.float32)
    x = torch.from_numpy(p["x"])
    params = [tuple(torch.from_numpy(a) for a in e) for e in p["params"]]
    assert pnn.explain(pnn.gru, x, params).backend == "numba"
    with pnn.use_backend("numba"):
        y, hn = pnn.gru(x, params)
    assert isinstance(y, torch.Tensor) and isinstance(hn, torch.Tensor) and y.dtype == torch.float32
    with pnn.use_backend("reference"):
        ey, ehn = pnn.gru(p["x"], p["params"])
    np.testing.assert_allclose(y.numpy(), ey, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hn.numpy(), ehn, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- agreement with the reference


@pytest.fixture(params=["unblocked", "blocked"])
def blocking(request, monkeypatch):
    """The one-call time loop, or batch blocks of two rows (threaded when two threads may run)."""
    from kernels_cpu import rnn

    if request.param == "blocked":
        monkeypatch.setattr(rnn, "BLOCK_ROWS", 2)
        monkeypatch.setattr(rnn, "BLOCKED_MIN_MACS", 0)
    return request.param


SEQUENCE_OPTIONS = [
    {},
    {"bidirectional": True},
    {"batch_first": True, "lengths": [5, 2, 4]},
    {"bidirectional": True, "lengths": [1, 5, 3], "bias": False},
    {"layers": 1, "bidirectional": True, "batch_first": True, "lengths": [3, 3, 1]},
]


def _options_id(options):
    return "-".join(f"{k}={v}" for k, v in options.items()) or "plain"


@pytest.mark.parametrize("options", SEQUENCE_OPTIONS, ids=_options_id)
@pytest.mark.parametrize(("kind", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_sequence_float64_matches_the_reference(kind, kw, options, blocking):
    p = _problem(kind, **options)
    expected, _ = _sequence(kind, p, "reference", **kw)
    actual, _ = _sequence(kind, p, "numba", **kw)
    _assert_matches(actual, expected, 1e-12)


@pytest.mark.parametrize("options", SEQUENCE_OPTIONS, ids=_options_id)
def test_lstm_projections_match_the_reference(options, blocking):
    """5-tuple params (w_hr): h and the outputs have P < H columns; float64 agreement, both paths."""
    p = _problem("lstm", **{"hs": 5, "proj": 2, "n": 4, **options})
    if "lengths" in p["kw"] and p["kw"]["lengths"] is not None:
        p["kw"]["lengths"] = [*p["kw"]["lengths"], 2]
    expected, _ = _sequence("lstm", p, "reference")
    actual, grads = _sequence("lstm", p, "numba")
    _assert_matches(actual, expected, 1e-12)
    assert all(len(row) == 5 for row in grads.params)


def test_lstm_projection_gradients_skip_unwanted_weights_and_fill_out_buffers():
    p = _problem("lstm", hs=5, proj=2, bidirectional=True)
    p["kw"]["bidirectional"] = True
    with pnn.use_backend("numba"):
        _, pullback = pnn.vjp(pnn.lstm, p["x"], p["params"], p["h0"], p["c0"], bidirectional=True,
                              wrt=("x",))
        assert pullback((p["dy"], None)).params is None
        _, pullback = pnn.vjp(pnn.lstm, p["x"], p["params"], p["h0"], p["c0"], bidirectional=True)
        buffers = [tuple(None if w is None else np.empty_like(w) for w in row) for row in p["params"]]
        grads = pullback((p["dy"], (p["dh"], p["dc"])), out={"params": buffers})
    _, expected = _sequence("lstm", p, "reference")
    for row, buffer, want in zip(grads.params, buffers, expected.params):
        assert all(g is b for g, b in zip(row, buffer))  # written in place, w_hr's gradient included
        _assert_matches(list(row), list(want), 1e-12)


def _cell(kind, kw, backend, x, h, c, w, cts):
    """A cell's outputs and gradients (flattened to a list of arrays) on ``backend``."""
    with pnn.use_backend(backend):
        if kind == "lstm":
            out, pullback = pnn.vjp(pnn.lstm_cell, x, h, c, *w)
            grads = pullback(cts)
        else:
            out, pullback = pnn.vjp(CELL[kind], x, h, *w, **kw)
            out, grads = (out,), pullback(cts[0])
    return [*out, *(g for g in grads if g is not None)]


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize(("kind", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_cell_float64_matches_the_reference(kind, kw, unbatched):
    rng = np.random.default_rng(1)
    lead = () if unbatched else (4,)
    w = _params(rng, kind, 1, 1, 5, 3, np.float64)[0]
    x, h, c = rng.standard_normal((*lead, 5)), rng.standard_normal((*lead, 3)), rng.standard_normal((*lead, 3))
    cts = (rng.standard_normal((*lead, 3)), rng.standard_normal((*lead, 3)))
    results = {backend: _cell(kind, kw, backend, x, h, c, w, cts) for backend in ("reference", "numba")}
    _assert_matches(results["numba"], results["reference"], 1e-12)


@pytest.mark.parametrize(("kind", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_float32_close_to_the_float64_reference(kind, kw, blocking):
    """The float32 path (degree-6 exp polynomial, float32 GEMMs) stays well inside 1e-5."""
    p64 = _problem(kind, steps=8, n=5, hs=6, bidirectional=True, lengths=[8, 3, 6, 1, 8])
    p32 = {k: v for k, v in p64.items()}
    for name in ("x", "h0", "c0", "dy", "dh", "dc"):
        p32[name] = None if p64[name] is None else p64[name].astype(np.float32)
    p32["params"] = [tuple(None if a is None else a.astype(np.float32) for a in e) for e in p64["params"]]
    expected, _ = _sequence(kind, p64, "reference", **kw)
    actual, _ = _sequence(kind, p32, "numba", **kw)
    for a, e in zip(actual, expected):
        assert a.dtype == np.float32
        assert np.max(np.abs(a - e)) <= 1e-5 * max(np.max(np.abs(e)), 1.0)


def test_packed_sequences_equal_each_sequence_run_alone():
    """Steps past a sequence's end leave its state alone (forward and reverse directions)."""
    lengths = [5, 2, 4]
    p = _problem("lstm", bidirectional=True, lengths=lengths)
    with pnn.use_backend("numba"):
        y, (hn, cn) = pnn.lstm(p["x"], p["params"], p["h0"], p["c0"], bidirectional=True, lengths=lengths)
        for b, length in enumerate(lengths):
            yb, (hb, cb) = pnn.lstm(p["x"][:length, b : b + 1], p["params"], p["h0"][:, b : b + 1],
                                    p["c0"][:, b : b + 1], bidirectional=True)
            np.testing.assert_allclose(y[:length, b : b + 1], yb, rtol=1e-13, atol=1e-14)
            assert not np.any(y[length:, b])
            np.testing.assert_allclose(hn[:, b : b + 1], hb, rtol=1e-13, atol=1e-14)
            np.testing.assert_allclose(cn[:, b : b + 1], cb, rtol=1e-13, atol=1e-14)


# --------------------------------------------------------------------------- the vectorised exp, σ, tanh


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activations_accuracy_and_saturation(dtype):
    """rnn_cell with w_ih = 1, w_hh = 0 is the kernels' tanh; an LSTM cell's c' is σ(x)·tanh(x)."""
    z = np.concatenate([np.linspace(-12, 12, 2001), [-1e4, -100, -45, 45, 100, 1e4, 1e-6, -1e-6, 0.0]])
    x = z.astype(dtype)[:, None]
    zeros = np.zeros_like(x)
    with pnn.use_backend("numba"):
        t = pnn.rnn_cell(x, zeros, np.ones((1, 1), dtype), np.zeros((1, 1), dtype))
        _, c = pnn.lstm_cell(x, zeros, zeros, np.ones((4, 1), dtype), np.zeros((4, 1), dtype))
    xs = x.astype(np.float64)
    tol = 3e-7 if dtype == np.float32 else 1e-15
    assert np.max(np.abs(t - np.tanh(xs))) <= tol
    assert np.max(np.abs(c - np.tanh(xs) * 0.5 * (1 + np.tanh(xs / 2)))) <= tol  # σ = (1 + tanh(x/2))/2
    assert np.all(np.isfinite(t)) and np.all(np.isfinite(c))
    assert t[-9, 0] == -1 and t[-4, 0] == 1  # saturated exactly, no overflow
    nan = np.full((1, 1), np.nan, dtype)
    with pnn.use_backend("numba"):
        assert np.isnan(pnn.rnn_cell(nan, np.zeros_like(nan), np.ones((1, 1), dtype), np.zeros((1, 1), dtype)))


# --------------------------------------------------------------------------- determinism and threading


# (N, H): per-step GEMMs below OpenBLAS's threading threshold (M·N·K <= 2**18, one thread) and
# above it (several threads when the BLAS has them).
SIZES = [(3, 4), (96, 48)]


@pytest.mark.parametrize("size", SIZES, ids=["small-blas-serial", "large-blas-threaded"])
@pytest.mark.parametrize(("kind", "kw"), [VARIANTS[2], VARIANTS[4]], ids=["lstm", "gru_original"])
def test_bitwise_deterministic_and_matching_the_reference(kind, kw, size, blocking):
    n, hs = size
    p = _problem(kind, steps=4, n=n, hs=hs, features=8, bidirectional=True, lengths=[4, 1, 3] * (n // 3))
    first, _ = _sequence(kind, p, "numba", **kw)
    second, _ = _sequence(kind, p, "numba", **kw)
    for a, b in zip(first, second):
        assert np.array_equal(a, b)
    expected, _ = _sequence(kind, p, "reference", **kw)
    _assert_matches(first, expected, 1e-12)


@pytest.mark.parametrize(("n", "rows"), [(512, 128), (256, 128), (64, 32), (16, 8), (15, 0), (8, 0)])
def test_block_rows_fill_two_threads_down_to_small_batches(n, rows):
    """Blocks of about BLOCK_ROWS rows, but at least two (of at least MIN_BLOCK_ROWS rows) for batches
    too small for two such blocks; layers too small for a parallel launch stay unblocked."""
    from kernels_cpu import rnn

    assert rnn._block_rows(rnn.LSTM, 50, n, 64, 64) == rows
    assert rnn._block_rows(rnn.LSTM, 1, n, 4, 4) == 0


@pytest.mark.parametrize(("kind", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_blocked_results_do_not_depend_on_the_thread_count(kind, kw, monkeypatch):
    """Blocks are fixed by the shape: one thread runs the same blocks as two, bit for bit."""
    from kernels_cpu import rnn

    monkeypatch.setattr(rnn, "BLOCK_ROWS", 4)
    monkeypatch.setattr(rnn, "BLOCKED_MIN_MACS", 0)
    p = _problem(kind, dtype=np.float32, steps=6, n=12, hs=8, bidirectional=True, lengths=[6, 2, 5, 1] * 3)
    results = []
    for threads in (1, 2):
        with pnn.use_threads(threads):
            results.append(_sequence(kind, p, "numba", **kw)[0])
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_concurrent_calls_from_threads_agree():
    p = _problem("gru", dtype=np.float32, n=16, hs=8)
    expected, _ = _sequence("gru", p, "numba")

    def body():
        for _ in range(3):
            got, _ = _sequence("gru", p, "numba")
            assert all(np.array_equal(a, b) for a, b in zip(got, expected))

    run_in_threads(body)


def test_one_compiled_specialisation_per_dtype():
    """Read-only, strided and batch-first inputs are normalised before the kernels see them."""
    from kernels_cpu import rnn

    for dtype in (np.float32, np.float64):
        p = _problem("lstm", dtype=dtype, batch_first=True)
        p["x"] = np.asfortranarray(p["x"])
        for e in p["params"]:
            e[0].flags.writeable = False
        p["h0"].flags.writeable = False
        _sequence("lstm", p, "numba")
        with pnn.use_backend("numba"):
            pnn.gru_cell(p["x"][:, 0], p["h0"][0], *_params(np.random.default_rng(0), "gru", 1, 1, 4, 3, dtype)[0])
    for kernel in (rnn._forward_direction, rnn._backward_direction):
        dtypes = [sig[1].dtype.name for sig in kernel.signatures]
        assert sorted(dtypes) == sorted(set(dtypes)), kernel.signatures


# --------------------------------------------------------------------------- out= buffers and zero sizes


@pytest.mark.parametrize("batch_first", [False, True])
def test_sequence_out_buffers_are_written_in_place(batch_first, blocking):
    p = _problem("lstm", bidirectional=True, batch_first=batch_first, lengths=[5, 2, 4])
    _, ref = _sequence("lstm", p, "numba")
    bufs = {
        "x": np.full_like(p["x"], np.nan),
        "h0": np.full_like(p["h0"], np.nan),
        "c0": np.full_like(p["c0"], np.nan),
        "params": [tuple(np.full_like(a, np.nan) for a in e) for e in p["params"]],
    }
    bufs["params"][1] = (bufs["params"][1][0], None, bufs["params"][1][2], None)  # some entries left out
    bufs["params"][2] = (np.asfortranarray(bufs["params"][2][0]), *bufs["params"][2][1:])  # not C-contiguous
    _, got = _sequence("lstm", p, "numba", out=bufs)
    for name in ("x", "h0", "c0"):
        assert getattr(got, name) is bufs[name]
        assert np.array_equal(bufs[name], getattr(ref, name))
    for row, brow, rrow in zip(got.params, bufs["params"], ref.params):
        for g, b, r in zip(row, brow, rrow):
            if b is not None:
                assert g is b
            assert np.array_equal(g, r)


def test_cell_out_buffers_are_written_in_place():
    rng = np.random.default_rng(2)
    w = _params(rng, "lstm", 1, 1, 5, 3, np.float32)[0]
    x, h, c = (rng.standard_normal(s).astype(np.float32) for s in ((4, 5), (4, 3), (4, 3)))
    cts = (np.ones((4, 3), np.float32), np.ones((4, 3), np.float32))
    with pnn.use_backend("numba"):
        _, pullback = pnn.vjp(pnn.lstm_cell, x, h, c, *w)
        ref = pullback(cts)
        names = ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")
        bufs = {name: np.full_like(getattr(ref, name), np.nan) for name in names}
        got = pullback(cts, out=bufs)
    for name in names:
        assert getattr(got, name) is bufs[name]
        assert np.array_equal(bufs[name], getattr(ref, name))


def test_wrt_skips_unrequested_gradients():
    p = _problem("gru", bidirectional=True)
    with pnn.use_backend("numba"):
        _, pullback = pnn.vjp(pnn.gru, p["x"], p["params"], p["h0"], bidirectional=True, wrt=("h0",))
        g = pullback((p["dy"], p["dh"]))
    assert g.x is None and g.params is None
    _, full = _sequence("gru", p, "numba")
    assert np.array_equal(g.h0, full.h0)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_zero_sizes(kind):
    for steps, n in ((0, 3), (4, 0)):
        p = _problem(kind, steps=steps, n=n, bidirectional=True)
        expected, _ = _sequence(kind, p, "reference")
        actual, _ = _sequence(kind, p, "numba")
        _assert_matches(actual, expected, 1e-12)


def _same_values(actual, expected, tol):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_matches(a, e, tol, f"array {i}")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (the reference's NumPy: inf − inf)
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("value", [np.inf, -np.inf], ids=["+inf", "-inf"])
@pytest.mark.parametrize(("kind", "kw"), VARIANTS, ids=VARIANT_IDS)
def test_infinite_inputs_give_the_reference_s_nans(kind, kw, value, dtype):
    """An infinite input saturates the gates; 0 · inf in the weight gradients is NaN (IEEE), and the
    kernels' vector exp/sigmoid/tanh keep that: the outputs and every gradient have the reference's
    NaN at the same places and its other values (sequence with packed lengths, and a cell)."""
    tol = 1e-12 if dtype == np.float64 else 1e-4
    p = _problem(kind, dtype=dtype, bidirectional=True, lengths=[5, 2, 4])
    p["x"][1, 0, 2] = value
    expected, _ = _sequence(kind, p, "reference", **kw)
    actual, _ = _sequence(kind, p, "numba", **kw)
    _same_values(actual, expected, tol)
    assert any(np.isnan(a).any() for a in expected)  # the case is one where NaN appears
    rng = np.random.default_rng(3)
    w = _params(rng, kind, 1, 1, 5, 3, dtype)[0]
    x, h, c = (rng.standard_normal((4, n)).astype(dtype) for n in (5, 3, 3))
    x[2, 1] = value
    cts = tuple(rng.standard_normal((4, 3)).astype(dtype) for _ in range(2))
    results = {backend: _cell(kind, kw, backend, x, h, c, w, cts) for backend in ("reference", "numba")}
    _same_values(results["numba"], results["reference"], tol)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("value", [np.inf, -np.inf], ids=["+inf", "-inf"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_infinite_inputs_match_pytorch(kind, value):
    """PyTorch, the tie-breaker for IEEE corner cases, gives the kernels' NaN and values too."""
    import torch

    p = _problem(kind, layers=1, n=2)
    p["x"][2, 1, 0] = value
    actual, grads = _sequence(kind, p, "numba")
    module = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(4, 3).double()
    with torch.no_grad():
        for name, value_ in zip(("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"), p["params"][0]):
            getattr(module, name).copy_(torch.from_numpy(value_))
    x = torch.tensor(p["x"], requires_grad=True)
    h0 = torch.tensor(p["h0"])
    states = (h0, torch.tensor(p["c0"])) if kind == "lstm" else h0
    y, final = module(x, states)
    finals = final if kind == "lstm" else (final,)
    cotangents = (p["dy"], p["dh"], p["dc"]) if kind == "lstm" else (p["dy"], p["dh"])
    total = sum((t * torch.from_numpy(ct)).sum() for t, ct in zip((y, *finals), cotangents))
    total.backward()
    theirs = [y, *finals, x.grad, *(getattr(module, n).grad for n in ("weight_ih_l0", "weight_hh_l0",
                                                                      "bias_ih_l0", "bias_hh_l0"))]
    ours = [actual[0], *actual[1:1 + len(finals)], grads.x, *grads.params[0]]
    _same_values(ours, [t.detach().numpy() for t in theirs], 1e-10)
