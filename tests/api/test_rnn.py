"""Recurrent cells and sequences against PyTorch (float64 oracle), finite differences
for the GRU form PyTorch lacks (``reset_after=False``), validation and gradient plumbing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import (
    Case,
    assert_close,
    cases,
    directional_check,
    grid,
    snapshot,
    to_numpy,
    unchanged,
)
from portable_nn import dispatch
from portable_nn.api.rnn import gru, gru_cell, lstm, lstm_cell, rnn, rnn_cell

torch = pytest.importorskip("torch")

GATES = {"rnn": 1, "lstm": 4, "gru": 3}
CELL_OPS = {"rnn_tanh": "rnn_cell", "rnn_relu": "rnn_cell", "lstm": "lstm_cell", "gru": "gru_cell"}
SEQ_OPS = {"rnn_tanh": "rnn", "rnn_relu": "rnn", "lstm": "lstm", "gru": "gru"}


def _kind(label: str) -> str:
    return label.split("_")[0]


def _op_cases(ops: dict[str, str]) -> list[Any]:
    """(op label, case) pairs over every case each op's implementations declare."""
    return [
        pytest.param(label, p.values[0], id=f"{label}-{p.id}")
        for label, op in ops.items()
        for p in cases(op)
    ]


def _grid_cases(ops: dict[str, str], configs: list[Any], slow_dtypes: tuple[str, ...] | None = None) -> list[Any]:
    """(op label, case, config) params: every case with the pairwise configs; the rest of the
    full grid (marked slow) with every case, or only the cases of ``slow_dtypes``."""
    params = []
    for cfg in configs:
        slow = bool(cfg.marks)
        for label, op in ops.items():
            for p in cases(op):
                case = p.values[0]
                if slow and slow_dtypes is not None and case.dtype not in slow_dtypes:
                    continue
                params.append(pytest.param(label, case, cfg.values[0], id=f"{label}-{p.id}-{cfg.id}", marks=cfg.marks))
    return params


def _weights(rng: np.random.Generator, gates: int, features: int, hs: int, bias: str) -> tuple:
    """(w_ih, w_hh, b_ih, b_hh) float64, biases per ``bias``: both, none, ih (b_hh None)."""
    scale = 0.6 / np.sqrt(max(hs, 1))
    w_ih = rng.uniform(-1, 1, (gates * hs, features)) * scale * 1.5
    w_hh = rng.uniform(-1, 1, (gates * hs, hs)) * scale * 1.5
    b_ih = rng.uniform(-0.5, 0.5, gates * hs) if bias in ("both", "ih") else None
    b_hh = rng.uniform(-0.5, 0.5, gates * hs) if bias == "both" else None
    return w_ih, w_hh, b_ih, b_hh


def _tensor(a: Any, grad: bool = True) -> Any:
    if a is None:
        return None
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _close(actual: Any, expected: Any, tol: float, what: str) -> None:
    """Norm-wise relative error at most ``tol``, against max(max|expected|, 1).

    States, gates and their gradients are O(1) here, so an entry that cancels
    to near zero (h' = (1 − z) n + z h) carries the rounding of its O(1)
    operands: the floor of 1 keeps float32 cases from failing on that alone.
    """
    if expected is None:
        assert actual is None, f"{what}: expected no gradient"
        return
    assert actual is not None, f"{what}: gradient missing"
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if e.size:
        err = float(np.max(np.abs(a - e))) / max(float(np.max(np.abs(e))), 1.0)
        assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# --------------------------------------------------------------------------- torch oracles


def torch_cell(label: str, x, h, c, w, dh, dc):
    """(outputs, grads) of a cell with PyTorch's functional cells, float64 NumPy in and out."""
    unbatched = np.ndim(x) == 1
    if unbatched:
        x, h, dh = x[None], h[None], dh[None]
        c = None if c is None else c[None]
        dc = None if dc is None else dc[None]
    xt, ht, ct = _tensor(x), _tensor(h), _tensor(c)
    wt = [_tensor(a) for a in w]
    if label == "lstm":
        h1, c1 = torch.lstm_cell(xt, (ht, ct), *wt)
        outs, cts = [h1, c1], [dh, dc]
    else:
        fn = {"rnn_tanh": torch.rnn_tanh_cell, "rnn_relu": torch.rnn_relu_cell, "gru": torch.gru_cell}[label]
        outs, cts = [fn(xt, ht, *wt)], [dh]
    inputs = [t for t in (xt, ht, ct, *wt) if t is not None]
    grads = torch.autograd.grad(outs, inputs, [torch.tensor(g) for g in cts])
    grads = iter(g.numpy() for g in grads)
    names = ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")
    result = {n: (next(grads) if v is not None else None) for n, v in zip(names, (xt, ht, ct, *wt))}
    outs = [o.detach().numpy() for o in outs]
    if unbatched:
        outs = [o[0] for o in outs]
        result = {n: (g[0] if g is not None and n in ("x", "h", "c") else g) for n, g in result.items()}
    return outs, result


def torch_sequence(label, x, params, h0, c0, *, bidirectional, batch_first, lengths, dy, dh, dc):
    """outputs, h_n, c_n and the gradients from nn.RNN/LSTM/GRU with the weights copied in."""
    kind = _kind(label)
    dirs = 2 if bidirectional else 1
    layers = len(params) // dirs
    proj = params[0][4].shape[0] if len(params[0]) == 5 else 0
    features, hs = x.shape[-1], params[0][1].shape[0] // GATES[kind]
    has_bias = any(b is not None for p in params for b in p[2:4])
    cls = {"rnn": torch.nn.RNN, "lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind]
    extra = {"nonlinearity": label.split("_")[1]} if kind == "rnn" else {"proj_size": proj} if proj else {}
    module = cls(features, hs, num_layers=layers, bias=has_bias, batch_first=batch_first,
                 bidirectional=bidirectional, **extra).double()
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")
    tensors = []
    with torch.no_grad():
        for k, entry in enumerate(params):
            layer, d = divmod(k, dirs)
            row = []
            for name, value in zip(names, entry):
                if not has_bias and name.startswith("bias"):
                    row.append(None)
                    continue
                p = getattr(module, f"{name}_l{layer}{'_reverse' if d else ''}")
                p.copy_(torch.zeros_like(p) if value is None else torch.from_numpy(np.asarray(value)))
                row.append(p if value is not None else None)
            tensors.append(row)
    xt, h0t, c0t = _tensor(x), _tensor(h0), _tensor(c0)
    steps = x.shape[1] if batch_first else x.shape[0]
    inp = xt
    if lengths is not None and x.shape[1 - int(batch_first)] > 0:
        inp = torch.nn.utils.rnn.pack_padded_sequence(xt, list(lengths), batch_first=batch_first,
                                                      enforce_sorted=False)
    if kind == "lstm":
        hx = None
        if h0t is not None or c0t is not None:
            def zeros(size):
                return torch.zeros(layers * dirs, x.shape[0 if batch_first else 1], size, dtype=torch.float64)
            hx = (zeros(proj or hs) if h0t is None else h0t, zeros(hs) if c0t is None else c0t)
        out, (hn, cn) = module(inp, hx)
    else:
        out, hn = module(inp, h0t)
        cn = None
    if inp is not xt:
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first, total_length=steps)
    loss = (out * torch.tensor(dy)).sum() + (hn * torch.tensor(dh)).sum()
    if cn is not None:
        loss = loss + (cn * torch.tensor(dc)).sum()
    flat = [t for row in tensors for t in row if t is not None]
    wanted = [t for t in (xt, h0t, c0t) if t is not None] + flat
    grads = iter(torch.autograd.grad(loss, wanted))
    gx = next(grads).numpy()
    gh0 = next(grads).numpy() if h0t is not None else None
    gc0 = next(grads).numpy() if c0t is not None else None
    gparams = [tuple(None if t is None else next(grads).numpy() for t in row) for row in tensors]
    outs = (out.detach().numpy(), hn.detach().numpy(), None if cn is None else cn.detach().numpy())
    return outs, {"x": gx, "h0": gh0, "c0": gc0, "params": gparams}


# --------------------------------------------------------------------------- cells vs torch


CELL_GRID = grid({"batch": [1, 3, "unbatched"], "hidden": [1, 4], "bias": ["both", "none", "ih"], "features": [1, 5]})


def _cell_call(label: str, case: Case, cfg: dict, seed: int = 0):
    """Arrays for one cell call: float64 NumPy originals and the case's arrays."""
    rng = np.random.default_rng(seed)
    kind = _kind(label)
    hs, features = cfg["hidden"], cfg["features"]
    lead = () if cfg["batch"] == "unbatched" else (cfg["batch"],)
    x = rng.standard_normal((*lead, features))
    h = rng.standard_normal((*lead, hs)) * 0.8
    c = rng.standard_normal((*lead, hs)) if kind == "lstm" else None
    w = _weights(rng, GATES[kind], features, hs, cfg["bias"])
    dh = rng.standard_normal((*lead, hs))
    dc = rng.standard_normal((*lead, hs)) if kind == "lstm" else None
    arrays = {
        "x": case.asarray(x), "h": case.asarray(h), "c": case.asarray(c),
        **{n: case.param(a) for n, a in zip(("w_ih", "w_hh", "b_ih", "b_hh"), w)},
        "dh": case.asarray(dh), "dc": case.asarray(dc),
    }
    return arrays


def _run_cell(label: str, a: dict, **kw):
    kind = _kind(label)
    w = (a["w_ih"], a["w_hh"], a["b_ih"], a["b_hh"])
    if kind == "lstm":
        result, pullback = pnn.vjp(lstm_cell, a["x"], a["h"], a["c"], *w, **kw)
        grads = pullback((a["dh"], a["dc"]))
        return list(result), grads
    if kind == "rnn":
        kw.setdefault("activation", label.split("_")[1])
        result, pullback = pnn.vjp(rnn_cell, a["x"], a["h"], *w, **kw)
    else:
        result, pullback = pnn.vjp(gru_cell, a["x"], a["h"], *w, **kw)
    return [result], pullback(a["dh"])


@pytest.mark.parametrize(("label", "case", "cfg"), _grid_cases(CELL_OPS, CELL_GRID))
def test_cell_matches_torch(label: str, case: Case, cfg: dict) -> None:
    a = _cell_call(label, case, cfg)
    before = snapshot(a.values())
    with case.use():
        outs, grads = _run_cell(label, a)
    assert unchanged(a.values(), before)
    np_a = {k: to_numpy(v) for k, v in a.items()}
    w = [np_a[n] for n in ("w_ih", "w_hh", "b_ih", "b_hh")]
    expected, egrads = torch_cell(label, np_a["x"], np_a["h"], np_a["c"], w, np_a["dh"], np_a["dc"])
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert tuple(o.shape) == e.shape
        assert o.dtype == a["x"].dtype
        _close(o, e, case.tol, f"output {i}")
    for name in grads._fields:
        g = getattr(grads, name)
        _close(g, egrads[name], case.tol, f"d{name}")
        if g is not None:
            assert g.dtype == a[name].dtype and tuple(g.shape) == tuple(a[name].shape), name


# --------------------------------------------------------------------------- sequences vs torch


SEQ_GRID = grid(
    {
        "layers": [1, 2, 3],
        "bidirectional": [False, True],
        "batch_first": [False, True],
        "packed": [False, True],
        "steps": [1, 4],
        "batch": [1, 3],
        "hidden": [1, 3],
        "bias": ["both", "none", "ih"],
        "states": [True, False],
    }
)


def _lengths(steps: int, batch: int) -> list[int]:
    base = [steps, 1, max(1, steps - 1), 2]
    out = [min(base[i % len(base)], steps) for i in range(batch)]
    if batch == 1:
        out = [max(1, steps - 1)]
    return out


def _seq_call(label: str, case: Case, cfg: dict, seed: int = 1):
    rng = np.random.default_rng(seed)
    kind = _kind(label)
    dirs = 2 if cfg["bidirectional"] else 1
    steps, n, hs, features = cfg["steps"], cfg["batch"], cfg["hidden"], cfg.get("features", 2)
    layers, proj = cfg["layers"], cfg.get("proj", 0)
    out = proj or hs  # h's size
    shape = (n, steps, features) if cfg["batch_first"] else (steps, n, features)
    x = rng.standard_normal(shape)
    params = []
    for k in range(layers * dirs):
        w_ih, w_hh, b_ih, b_hh = _weights(rng, GATES[kind], features if k < dirs else dirs * out, hs, cfg["bias"])
        if proj:  # w_hh takes the projected state; w_hr projects
            w_hh = rng.uniform(-1, 1, (GATES[kind] * hs, proj)) * 0.9 / np.sqrt(hs)
            params.append((w_ih, w_hh, b_ih, b_hh, rng.uniform(-1, 1, (proj, hs)) / np.sqrt(hs)))
        else:
            params.append((w_ih, w_hh, b_ih, b_hh))
    h0 = rng.standard_normal((layers * dirs, n, out)) * 0.8 if cfg["states"] else None
    c0 = rng.standard_normal((layers * dirs, n, hs)) if cfg["states"] and kind == "lstm" else None
    out_shape = (n, steps, dirs * out) if cfg["batch_first"] else (steps, n, dirs * out)
    dy = rng.standard_normal(out_shape)
    dh = rng.standard_normal((layers * dirs, n, out))
    dc = rng.standard_normal((layers * dirs, n, hs)) if kind == "lstm" else None
    lengths = _lengths(steps, n) if cfg["packed"] else None
    if lengths is not None:  # the oracle's padded outputs are zero there, and so are ours
        for b, length in enumerate(lengths):
            if cfg["batch_first"]:
                dy[b, length:] = 0.0
            else:
                dy[length:, b] = 0.0
    return {
        "x": case.asarray(x),
        "params": [tuple(None if p is None else case.param(p) for p in entry) for entry in params],
        "h0": case.asarray(h0),
        "c0": case.asarray(c0),
        "dy": case.asarray(dy),
        "dh": case.asarray(dh),
        "dc": case.asarray(dc),
        "lengths": lengths,
    }


def _run_seq(label: str, a: dict, cfg: dict, **kw):
    kind = _kind(label)
    kw.update(batch_first=cfg["batch_first"], bidirectional=cfg["bidirectional"], lengths=a["lengths"])
    if kind == "lstm":
        (y, (hn, cn)), pullback = pnn.vjp(lstm, a["x"], a["params"], a["h0"], a["c0"], **kw)
        return (y, hn, cn), pullback((a["dy"], (a["dh"], a["dc"]))), pullback
    if kind == "rnn":
        kw.setdefault("activation", label.split("_")[1])
        (y, hn), pullback = pnn.vjp(rnn, a["x"], a["params"], a["h0"], **kw)
    else:
        (y, hn), pullback = pnn.vjp(gru, a["x"], a["params"], a["h0"], **kw)
    return (y, hn, None), pullback((a["dy"], a["dh"])), pullback


def _check_seq_against_torch(label: str, a: dict, cfg: dict, outs, grads, tol: float) -> None:
    np_params = [tuple(to_numpy(p) for p in entry) for entry in a["params"]]
    expected, egrads = torch_sequence(
        label, to_numpy(a["x"]), np_params, to_numpy(a["h0"]), to_numpy(a["c0"]),
        bidirectional=cfg["bidirectional"], batch_first=cfg["batch_first"], lengths=a["lengths"],
        dy=to_numpy(a["dy"]), dh=to_numpy(a["dh"]), dc=to_numpy(a["dc"]),
    )
    for name, o, e in zip(("outputs", "h_n", "c_n"), outs, expected):
        if e is None:
            assert o is None
            continue
        assert tuple(o.shape) == e.shape, name
        assert o.dtype == a["x"].dtype, name
        _close(o, e, tol, name)
    for name in ("x", "h0", "c0"):
        if name in grads._fields:
            _close(getattr(grads, name), egrads[name], tol, f"d{name}")
    assert isinstance(grads.params, list) and len(grads.params) == len(a["params"])
    for k, (row, erow, prow) in enumerate(zip(grads.params, egrads["params"], a["params"])):
        assert isinstance(row, tuple) and len(row) == len(prow)
        for j, (g, e, p) in enumerate(zip(row, erow, prow)):
            _close(g, e, tol, f"dparams[{k}][{j}]")
            if g is not None:
                assert g.dtype == p.dtype and tuple(g.shape) == tuple(p.shape)


@pytest.mark.parametrize(("label", "case", "cfg"), _grid_cases(SEQ_OPS, SEQ_GRID, slow_dtypes=("float64",)))
def test_sequence_matches_torch(label: str, case: Case, cfg: dict) -> None:
    a = _seq_call(label, case, cfg)
    leaves = [a["x"], a["h0"], a["c0"], *(p for e in a["params"] for p in e)]
    before = snapshot(leaves)
    with case.use():
        outs, grads, _ = _run_seq(label, a, cfg)
    assert unchanged(leaves, before)
    _check_seq_against_torch(label, a, cfg, outs, grads, case.tol)


# --------------------------------------------------------------------------- LSTM projections


PROJ_GRID = grid(
    {
        "layers": [1, 2],
        "bidirectional": [False, True],
        "batch_first": [False, True],
        "packed": [False, True],
        "bias": ["both", "none", "ih"],
        "states": [True, False],
    }
)


@pytest.mark.parametrize("case", [p.values[0] for p in cases("lstm")], ids=lambda c: c.id)
@pytest.mark.parametrize("cfg", PROJ_GRID)
def test_lstm_projections_match_torch(case: Case, cfg: dict) -> None:
    """5-tuple params (torch.nn.LSTM's proj_size) on every backend, against PyTorch."""
    cfg = {**cfg, "steps": 4, "batch": 3, "hidden": 5, "proj": 2, "features": 3}
    a = _seq_call("lstm", case, cfg)
    leaves = [a["x"], a["h0"], a["c0"], *(p for e in a["params"] for p in e)]
    before = snapshot(leaves)
    with case.use():
        outs, grads, _ = _run_seq("lstm", a, cfg)
    assert unchanged(leaves, before)
    _check_seq_against_torch("lstm", a, cfg, outs, grads, case.tol)


def test_lstm_projection_shapes_are_checked() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 3))
    entry = (rng.standard_normal((20, 3)), rng.standard_normal((20, 2)), None, None, rng.standard_normal((2, 5)))
    (y, (h, c)) = lstm(x, [entry])
    assert y.shape == (4, 2, 2) and h.shape == (1, 2, 2) and c.shape == (1, 2, 5)
    with pytest.raises(ValueError, match=r"params\[0\]\[4\] \(w_hr_l0\) must have shape \(2, 5\)"):
        lstm(x, [(*entry[:4], rng.standard_normal((2, 4)))])
    with pytest.raises(ValueError, match="proj_size must be smaller than hidden_size"):
        lstm(x, [(rng.standard_normal((8, 3)), rng.standard_normal((8, 2)), None, None, rng.standard_normal((2, 2)))])
    with pytest.raises(ValueError, match=r"h0 must have shape \(1, 2, 2\)"):
        lstm(x, [entry], np.zeros((1, 2, 5)))
    with pytest.raises(ValueError, match=r"c0 must have shape \(1, 2, 5\)"):
        lstm(x, [entry], None, np.zeros((1, 2, 2)))
    with pytest.raises(TypeError, match="every entry must have the form of params\\[0\\]"):
        lstm(x, [entry, entry[:4]], bidirectional=True)
    with pytest.raises(TypeError, match="only lstm takes a fifth entry"):
        gru(x, [(rng.standard_normal((15, 3)), rng.standard_normal((15, 5)), None, None, entry[4])])


# --------------------------------------------------------------------------- zero-size inputs


ZERO_CASES = [p for p in _op_cases(SEQ_OPS) if p.values[1].dtype == "float64"]


@pytest.mark.parametrize(("label", "case"), ZERO_CASES)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_sequence_empty_batch(label: str, case: Case, bidirectional: bool) -> None:
    cfg = {"layers": 2, "bidirectional": bidirectional, "batch_first": False, "packed": False,
           "steps": 3, "batch": 0, "hidden": 2, "bias": "both", "states": True}
    a = _seq_call(label, case, cfg)
    a["lengths"] = []
    with case.use():
        outs, grads, _ = _run_seq(label, a, cfg)
    _check_seq_against_torch(label, {**a, "lengths": None}, cfg, outs, grads, case.tol)
    for row in grads.params:
        assert all(float(np.max(np.abs(to_numpy(g)))) == 0.0 for g in row)


@pytest.mark.parametrize(("label", "case"), ZERO_CASES)
@pytest.mark.parametrize("batch_first", [False, True])
def test_sequence_empty_time(label: str, case: Case, batch_first: bool) -> None:
    """T = 0: empty outputs, final states equal to the initial ones, zero weight gradients."""
    cfg = {"layers": 2, "bidirectional": True, "batch_first": batch_first, "packed": False,
           "steps": 0, "batch": 2, "hidden": 2, "bias": "both", "states": True}
    a = _seq_call(label, case, cfg)
    with case.use():
        (y, hn, cn), grads, _ = _run_seq(label, a, cfg)
    assert tuple(y.shape) == ((2, 0, 4) if batch_first else (0, 2, 4))
    assert_close(hn, a["h0"], 0.0, "h_n")
    assert_close(grads.h0, a["dh"], 0.0, "dh0")
    if cn is not None:
        assert_close(cn, a["c0"], 0.0, "c_n")
        assert_close(grads.c0, a["dc"], 0.0, "dc0")
    assert tuple(grads.x.shape) == tuple(a["x"].shape)
    for row, prow in zip(grads.params, a["params"]):
        for g, p in zip(row, prow):
            assert tuple(g.shape) == tuple(p.shape) and float(np.max(np.abs(to_numpy(g)))) == 0.0


@pytest.mark.parametrize(("label", "case"), [p for p in _op_cases(CELL_OPS) if p.values[1].dtype == "float64"])
def test_cell_empty_batch(label: str, case: Case) -> None:
    a = _cell_call(label, case, {"batch": 0, "hidden": 3, "bias": "both", "features": 2})
    with case.use():
        outs, grads = _run_cell(label, a)
    for o in outs:
        assert tuple(o.shape) == (0, 3)
    for name in grads._fields:
        g = getattr(grads, name)
        assert tuple(g.shape) == tuple(a[name].shape) and g.dtype == a[name].dtype
        assert not np.any(to_numpy(g))


# --------------------------------------------------------------------------- GRU reset_after=False


def _sig(z):
    return 1.0 / (1.0 + np.exp(-z))


def np_gru_cell_original(x, h, w_ih, w_hh, b_ih=None, b_hh=None):
    """DESIGN.md's original GRU, written out: n = tanh(W_in x + b_in + W_hn (r ⊙ h) + b_hn)."""
    hs = h.shape[-1]
    b_ih = np.zeros(3 * hs) if b_ih is None else b_ih
    b_hh = np.zeros(3 * hs) if b_hh is None else b_hh
    w_ir, w_iz, w_in = w_ih[:hs], w_ih[hs : 2 * hs], w_ih[2 * hs :]
    w_hr, w_hz, w_hn = w_hh[:hs], w_hh[hs : 2 * hs], w_hh[2 * hs :]
    r = _sig(x @ w_ir.T + b_ih[:hs] + h @ w_hr.T + b_hh[:hs])
    z = _sig(x @ w_iz.T + b_ih[hs : 2 * hs] + h @ w_hz.T + b_hh[hs : 2 * hs])
    n = np.tanh(x @ w_in.T + b_ih[2 * hs :] + (r * h) @ w_hn.T + b_hh[2 * hs :])
    return (1.0 - z) * n + z * h


def np_gru_cell_pytorch(x, h, w_ih, w_hh, b_ih=None, b_hh=None):
    hs = h.shape[-1]
    b_ih = np.zeros(3 * hs) if b_ih is None else b_ih
    b_hh = np.zeros(3 * hs) if b_hh is None else b_hh
    gi, gh = x @ w_ih.T + b_ih, h @ w_hh.T + b_hh
    r = _sig(gi[..., :hs] + gh[..., :hs])
    z = _sig(gi[..., hs : 2 * hs] + gh[..., hs : 2 * hs])
    n = np.tanh(gi[..., 2 * hs :] + r * gh[..., 2 * hs :])
    return (1.0 - z) * n + z * h


def np_sequence(cell, x, params, h0, *, bidirectional, lengths):
    """Stacked sequences one sample at a time over its own length (time-major x)."""
    steps, n = x.shape[:2]
    dirs = 2 if bidirectional else 1
    layers = len(params) // dirs
    hs = params[0][1].shape[1]
    h0 = np.zeros((layers * dirs, n, hs)) if h0 is None else h0
    out = np.zeros((steps, n, dirs * hs))
    hn = np.zeros((layers * dirs, n, hs))
    for b in range(n):
        length = steps if lengths is None else lengths[b]
        inp = x[:length, b]
        for layer in range(layers):
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                h = h0[k, b]
                o = np.zeros((length, hs))
                for t in reversed(range(length)) if d else range(length):
                    h = cell(inp[t][None], h[None], *params[k])[0]
                    o[t] = h
                hn[k, b] = h
                outs.append(o)
            inp = np.concatenate(outs, axis=-1)
        out[:length, b] = inp
    return out, hn


@pytest.mark.parametrize("case", [p.values[0] for p in cases("gru_cell")], ids=lambda c: c.id)
@pytest.mark.parametrize("cfg", grid({"batch": [1, 3, "unbatched"], "hidden": [1, 4], "bias": ["both", "none", "ih"]}))
def test_gru_cell_original_forward(case: Case, cfg: dict) -> None:
    a = _cell_call("gru", case, {**cfg, "features": 3})
    with case.use():
        y = gru_cell(a["x"], a["h"], a["w_ih"], a["w_hh"], a["b_ih"], a["b_hh"], reset_after=False)
    np_a = {k: to_numpy(v) for k, v in a.items()}
    expected = np_gru_cell_original(np_a["x"], np_a["h"], np_a["w_ih"], np_a["w_hh"], np_a["b_ih"], np_a["b_hh"])
    assert tuple(y.shape) == expected.shape and y.dtype == a["x"].dtype
    _close(y, expected, case.tol, "h'")
    # the two forms differ (they coincide when H = 1 and there is no b_hn)
    if cfg["hidden"] == 1 and cfg["bias"] != "both":
        return
    other = np_gru_cell_pytorch(np_a["x"], np_a["h"], np_a["w_ih"], np_a["w_hh"], np_a["b_ih"], np_a["b_hh"])
    assert float(np.max(np.abs(other - expected))) > 1e-6


@pytest.mark.parametrize("bias", ["both", "none"])
@pytest.mark.parametrize("reset_after", [False, True])
def test_gru_cell_finite_differences(bias: str, reset_after: bool) -> None:
    rng = np.random.default_rng(3)
    w = _weights(rng, 3, 3, 4, bias)
    args = {"x": rng.standard_normal((2, 3)), "h": rng.standard_normal((2, 4)),
            **{n: a for n, a in zip(("w_ih", "w_hh", "b_ih", "b_hh"), w) if a is not None}}
    dy = rng.standard_normal((2, 4))

    def f(**kw):
        return gru_cell(kw["x"], kw["h"], kw["w_ih"], kw["w_hh"], kw.get("b_ih"), kw.get("b_hh"),
                        reset_after=reset_after)

    _, pullback = pnn.vjp(gru_cell, args["x"], args["h"], w[0], w[1], w[2], w[3], reset_after=reset_after)
    grads = pullback(dy)._asdict()
    directional_check(f, args, {k: grads[k] for k in args}, dy, directions=3)
    for name in args:  # each gradient on its own, too
        directional_check(f, args, {name: grads[name]}, dy, directions=1, seed=7)


SEQ_ORIGINAL_GRID = grid({"layers": [1, 2], "bidirectional": [False, True], "packed": [False, True],
                          "batch_first": [False, True], "bias": ["both", "none"]})


@pytest.mark.parametrize("case", [p.values[0] for p in cases("gru")], ids=lambda c: c.id)
@pytest.mark.parametrize("cfg", SEQ_ORIGINAL_GRID)
def test_gru_sequence_original_forward(case: Case, cfg: dict) -> None:
    cfg = {**cfg, "steps": 4, "batch": 3, "hidden": 3, "states": True}
    a = _seq_call("gru", case, cfg)
    kwargs = dict(reset_after=False, batch_first=cfg["batch_first"], bidirectional=cfg["bidirectional"],
                  lengths=a["lengths"])
    with case.use():
        declined = pnn.explain(gru, a["x"], a["params"], a["h0"], **kwargs).error
    if declined is not None:  # a backend without this form (aten: PyTorch's GRU) must say so, not compute
        assert "reset_after=False" in declined
        with case.use(), pytest.raises(pnn.BackendUnavailableError, match="reset_after=False"):
            gru(a["x"], a["params"], a["h0"], **kwargs)
        return
    with case.use():
        y, hn = gru(a["x"], a["params"], a["h0"], **kwargs)
    x = to_numpy(a["x"])
    if cfg["batch_first"]:
        x = np.swapaxes(x, 0, 1)
    params = [tuple(to_numpy(p) for p in e) for e in a["params"]]
    ey, ehn = np_sequence(np_gru_cell_original, x, params, to_numpy(a["h0"]),
                          bidirectional=cfg["bidirectional"], lengths=a["lengths"])
    if cfg["batch_first"]:
        ey = np.swapaxes(ey, 0, 1)
    _close(y, ey, case.tol, "outputs")
    _close(hn, ehn, case.tol, "h_n")


def test_numpy_sequence_runner_matches_torch() -> None:
    """The independent NumPy runner used for reset_after=False agrees with nn.GRU."""
    case = Case("numpy", "reference", "float64")
    cfg = {"layers": 2, "bidirectional": True, "batch_first": False, "packed": True, "steps": 4,
           "batch": 3, "hidden": 3, "bias": "both", "states": True}
    a = _seq_call("gru", case, cfg)
    (ey, ehn, _), _ = torch_sequence("gru", a["x"], a["params"], a["h0"], None, bidirectional=True,
                                     batch_first=False, lengths=a["lengths"], dy=a["dy"], dh=a["dh"], dc=None)
    y, hn = np_sequence(np_gru_cell_pytorch, a["x"], a["params"], a["h0"], bidirectional=True, lengths=a["lengths"])
    assert_close(y, ey, 1e-12, "outputs")
    assert_close(hn, ehn, 1e-12, "h_n")


def _flat_params(params) -> dict[str, np.ndarray]:
    return {f"p{k}_{j}": p for k, e in enumerate(params) for j, p in enumerate(e) if p is not None}


def _unflat_params(kw: dict, like) -> list:
    return [tuple(kw.get(f"p{k}_{j}") for j in range(4)) for k in range(len(like))]


@pytest.mark.parametrize(
    ("label", "reset_after", "packed"),
    [("gru", False, True), ("gru", False, False), ("gru", True, True), ("lstm", True, True), ("rnn_tanh", True, True)],
)
def test_sequence_finite_differences(label: str, reset_after: bool, packed: bool) -> None:
    kind = _kind(label)
    case = Case("numpy", "reference", "float64")
    cfg = {"layers": 2, "bidirectional": True, "batch_first": True, "packed": packed, "steps": 3,
           "batch": 2, "hidden": 2, "bias": "both", "states": True}
    a = _seq_call(label, case, cfg)
    args = {"x": a["x"], "h0": a["h0"], **_flat_params(a["params"])}
    if kind == "lstm":
        args["c0"] = a["c0"]
    kw: dict[str, Any] = {"batch_first": True, "bidirectional": True, "lengths": a["lengths"]}
    if kind == "gru":
        kw["reset_after"] = reset_after

    def call(f_args):
        params = _unflat_params(f_args, a["params"])
        if kind == "lstm":
            return pnn.vjp(lstm, f_args["x"], params, f_args["h0"], f_args["c0"], **kw)
        return pnn.vjp({"rnn": rnn, "gru": gru}[kind], f_args["x"], params, f_args["h0"], **kw)

    def f(**f_args):
        result, _ = call(f_args)
        if kind == "lstm":
            y, (hn, cn) = result
            return np.concatenate([y.ravel(), hn.ravel(), cn.ravel()])
        y, hn = result
        return np.concatenate([y.ravel(), hn.ravel()])

    _, pullback = call(args)
    if kind == "lstm":
        grads = pullback((a["dy"], (a["dh"], a["dc"])))
        cot = np.concatenate([a["dy"].ravel(), a["dh"].ravel(), a["dc"].ravel()])
    else:
        grads = pullback((a["dy"], a["dh"]))
        cot = np.concatenate([a["dy"].ravel(), a["dh"].ravel()])
    named = {"x": grads.x, "h0": grads.h0, **_flat_params(grads.params)}
    if kind == "lstm":
        named["c0"] = grads.c0
    directional_check(f, args, named, cot, directions=3)


# --------------------------------------------------------------------------- gradient plumbing


def _np_case() -> Case:
    return Case("numpy", "reference", "float64")


def _lstm_setup(**overrides):
    cfg = {"layers": 2, "bidirectional": True, "batch_first": False, "packed": True, "steps": 4,
           "batch": 3, "hidden": 3, "bias": "ih", "states": True, **overrides}
    return _seq_call("lstm", _np_case(), cfg), cfg


def test_wrt_is_honoured() -> None:
    a, cfg = _lstm_setup()
    _, full, _ = _run_seq("lstm", a, cfg)
    kw = {"bidirectional": True, "lengths": a["lengths"]}
    _, pullback = pnn.vjp(lstm, a["x"], a["params"], a["h0"], a["c0"], wrt=("params",), **kw)
    g = pullback((a["dy"], (a["dh"], a["dc"])))
    assert g.x is None and g.h0 is None and g.c0 is None
    for row, frow in zip(g.params, full.params):
        for p, q in zip(row, frow):
            assert (p is None and q is None) or np.array_equal(p, q)
    _, pullback = pnn.vjp(lstm, a["x"], a["params"], a["h0"], a["c0"], wrt=("x", "c0"), **kw)
    g = pullback((a["dy"], (a["dh"], a["dc"])))
    assert g.params is None and g.h0 is None
    assert np.array_equal(g.x, full.x) and np.array_equal(g.c0, full.c0)
    # h0=None has no gradient even when asked for
    _, pullback = pnn.vjp(lstm, a["x"], a["params"], None, a["c0"], wrt=("h0", "c0"), **kw)
    assert pullback((a["dy"], None)).h0 is None
    with pytest.raises(ValueError, match="weight"):
        pnn.vjp(lstm, a["x"], a["params"], wrt="weight", bidirectional=True)
    # cells
    c = _cell_call("lstm", _np_case(), {"batch": 2, "hidden": 3, "bias": "both", "features": 2})
    _, pullback = pnn.vjp(lstm_cell, c["x"], c["h"], c["c"], c["w_ih"], c["w_hh"], c["b_ih"], c["b_hh"],
                          wrt=("w_hh", "b_ih"))
    g = pullback((c["dh"], c["dc"]))
    assert [n for n in g._fields if getattr(g, n) is not None] == ["w_hh", "b_ih"]
    _, full_cell = _run_cell("lstm", c)
    assert np.array_equal(g.w_hh, full_cell.w_hh)


def test_grad_fields() -> None:
    a, cfg = _lstm_setup()
    _, g, _ = _run_seq("lstm", a, cfg)
    assert g._fields == ("x", "params", "h0", "c0")
    b = _seq_call("gru", _np_case(), cfg)
    _, g, _ = _run_seq("gru", b, cfg)
    assert g._fields == ("x", "params", "h0")
    c = _cell_call("lstm", _np_case(), {"batch": 2, "hidden": 3, "bias": "both", "features": 2})
    _, g = _run_cell("lstm", c)
    assert g._fields == ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")
    c = _cell_call("gru", _np_case(), {"batch": 2, "hidden": 3, "bias": "both", "features": 2})
    _, g = _run_cell("gru", c)
    assert g._fields == ("x", "h", "w_ih", "w_hh", "b_ih", "b_hh")


def test_lstm_cotangent_structure() -> None:
    a, cfg = _lstm_setup()
    kw = {"bidirectional": True, "lengths": a["lengths"]}
    _, pullback = pnn.vjp(lstm, a["x"], a["params"], a["h0"], a["c0"], **kw)
    zh, zc = np.zeros_like(a["dh"]), np.zeros_like(a["dc"])
    ref = pullback((a["dy"], (zh, zc)))
    for ct in ((a["dy"], None), (a["dy"], (None, None)), [a["dy"], [zh, None]]):
        g = pullback(ct)
        assert np.array_equal(g.x, ref.x) and np.array_equal(g.c0, ref.c0)
    g_state = pullback((None, (None, a["dc"])))
    g_sum = pullback((a["dy"], (None, a["dc"])))
    assert_close(g_sum.x, ref.x + g_state.x, 1e-12, "linearity")
    for bad in ((a["dy"], a["dh"], a["dc"]), (a["dy"], (a["dh"],)), a["dy"]):
        with pytest.raises(ValueError, match=r"\(d_outputs, \(d_h_n, d_c_n\)\)"):
            pullback(bad)
    with pytest.raises(ValueError, match="shape"):
        pullback((a["dy"], (a["dh"][:1], None)))
    # rnn/gru: (d_outputs, d_h_n), and a pullback may be called again
    b = _seq_call("gru", _np_case(), cfg)
    _, pullback = pnn.vjp(gru, b["x"], b["params"], b["h0"], **kw)
    g1 = pullback((b["dy"], None))
    g2 = pullback((b["dy"], np.zeros_like(b["dh"])))
    assert np.array_equal(g1.x, g2.x)
    with pytest.raises(ValueError, match="tuple of 2"):
        pullback(b["dy"])
    # lstm_cell: (dh', dc'), either None
    c = _cell_call("lstm", _np_case(), {"batch": 2, "hidden": 3, "bias": "both", "features": 2})
    _, pullback = pnn.vjp(lstm_cell, c["x"], c["h"], c["c"], c["w_ih"], c["w_hh"])
    g = pullback((None, c["dc"]))
    g0 = pullback((np.zeros_like(c["dh"]), c["dc"]))
    assert np.array_equal(g.x, g0.x)


def test_out_buffers() -> None:
    a, _ = _lstm_setup(bias="ih")
    kw = {"bidirectional": True, "lengths": a["lengths"]}
    ct = (a["dy"], (a["dh"], a["dc"]))
    _, pullback = pnn.vjp(lstm, a["x"], a["params"], a["h0"], a["c0"], **kw)
    ref = pullback(ct)
    bufs = [tuple(None if p is None else np.full_like(p, np.nan) for p in e) for e in a["params"]]
    bufs[1] = (bufs[1][0], None, bufs[1][2], None)  # some entries without a buffer
    dx = np.full_like(a["x"], np.nan)
    g = pullback(ct, out={"x": dx, "params": bufs})
    assert g.x is dx and np.array_equal(dx, ref.x)
    for row, brow, rrow in zip(g.params, bufs, ref.params):
        for p, b, r in zip(row, brow, rrow):
            if b is not None:
                assert p is b
            assert (p is None and r is None) or np.array_equal(p, r)
    assert g.params[1][1] is not None
    with pytest.raises(TypeError, match="params"):
        pullback(ct, out={"params": bufs[:-1]})
    bad = [list(e) for e in bufs]
    bad[0][3] = np.zeros(12)  # b_hh is None there
    with pytest.raises(ValueError, match="None"):
        pullback(ct, out={"params": bad})
    bad = [list(e) for e in bufs]
    bad[0][0] = np.zeros((3, 3))
    with pytest.raises(ValueError, match="shape"):
        pullback(ct, out={"params": bad})
    # cells take plain buffers
    c = _cell_call("gru", _np_case(), {"batch": 2, "hidden": 3, "bias": "both", "features": 2})
    _, pullback = pnn.vjp(gru_cell, c["x"], c["h"], c["w_ih"], c["w_hh"], c["b_ih"], c["b_hh"])
    ref = pullback(c["dh"])
    dw = np.empty_like(c["w_hh"])
    g = pullback(c["dh"], out={"w_hh": dw})
    assert g.w_hh is dw and np.array_equal(dw, ref.w_hh)


def test_torch_out_buffers() -> None:
    case = Case("torch", "reference", "float64")
    cfg = {"layers": 1, "bidirectional": False, "batch_first": True, "packed": False, "steps": 3,
           "batch": 2, "hidden": 2, "bias": "both", "states": True}
    a = _seq_call("rnn_tanh", case, cfg)
    (y, _), pullback = pnn.vjp(rnn, a["x"], a["params"], a["h0"], batch_first=True)
    assert isinstance(y, torch.Tensor) and not y.requires_grad
    ref = pullback((a["dy"], a["dh"]))
    bufs = [tuple(torch.empty_like(p) for p in a["params"][0])]
    g = pullback((a["dy"], a["dh"]), out={"params": bufs})
    for p, b, r in zip(g.params[0], bufs[0], ref.params[0]):
        assert p is b and torch.equal(p, r)


def test_torch_module_weights_directly() -> None:
    """An nn.LSTM's own parameters (requiring grad) work as params; no autograd history."""
    torch.manual_seed(0)
    module = torch.nn.LSTM(3, 2, num_layers=2, bidirectional=True, batch_first=True)
    x = torch.randn(4, 5, 3)
    params = [tuple(w) for w in module.all_weights]
    assert all(p.requires_grad for e in params for p in e)
    (y, (hn, cn)), pullback = pnn.vjp(lstm, x, params, batch_first=True, bidirectional=True)
    assert not (y.requires_grad or hn.requires_grad or cn.requires_grad)
    ey, (ehn, ecn) = module(x)
    _close(y, ey, 2e-5, "outputs")
    _close(hn, ehn, 2e-5, "h_n")
    _close(cn, ecn, 2e-5, "c_n")
    g = pullback((torch.ones_like(y), None))
    assert not any(t.requires_grad for e in g.params for t in e)
    ey.sum().backward()
    _close(g.params[3][1], module.weight_hh_l1_reverse.grad, 2e-5, "dw_hh_l1_reverse")
    _close(g.params[0][2], module.bias_ih_l0.grad, 2e-5, "db_ih_l0")


def test_immutable_library_path(monkeypatch) -> None:
    """Libraries without in-place writes (JAX) stack the steps; same numbers."""
    from portable_nn.reference import rnn as ref_rnn

    a, cfg = _lstm_setup()
    b = _seq_call("gru", _np_case(), cfg)
    c = _cell_call("gru", _np_case(), {"batch": 2, "hidden": 3, "bias": "both", "features": 2})
    results = []
    for writable in (True, False):
        if not writable:
            monkeypatch.setattr(ref_rnn, "_writable", lambda arr: False)
        outs, g, _ = _run_seq("lstm", a, cfg)
        gouts, gg, _ = _run_seq("gru", b, cfg)
        couts, cg = _run_cell("gru", c)
        results.append((outs, g, gouts, gg, couts, cg))

    def flat(obj):
        if isinstance(obj, (list, tuple)):
            return [v for item in obj for v in flat(item)]
        return [] if obj is None else [obj]

    first, second = (flat(r) for r in results)
    assert len(first) == len(second)
    for u, v in zip(first, second):
        assert np.array_equal(u, v)


@pytest.mark.parametrize("lib", ["numpy", "torch", "array_api_strict"])
def test_lengths_as_arrays(lib: str) -> None:
    case = Case(lib, "reference", "float64")
    cfg = {"layers": 1, "bidirectional": True, "batch_first": False, "packed": True, "steps": 4,
           "batch": 3, "hidden": 2, "bias": "both", "states": False}
    a = _seq_call("gru", case, cfg)
    y_list, h_list = gru(a["x"], a["params"], bidirectional=True, lengths=a["lengths"])
    for lengths in (np.asarray(a["lengths"], dtype=np.int32), torch.tensor(a["lengths"]),
                    tuple(np.int64(v) for v in a["lengths"])):
        y, hn = gru(a["x"], a["params"], bidirectional=True, lengths=lengths)
        assert np.array_equal(to_numpy(y), to_numpy(y_list)) and np.array_equal(to_numpy(hn), to_numpy(h_list))
    if lib == "array_api_strict":
        import array_api_strict as xps

        y, _ = gru(a["x"], a["params"], bidirectional=True, lengths=xps.asarray(a["lengths"]))
        assert np.array_equal(to_numpy(y), to_numpy(y_list))
    # full lengths are the same as no lengths
    y_full, _ = gru(a["x"], a["params"], bidirectional=True, lengths=[4, 4, 4])
    y_none, _ = gru(a["x"], a["params"], bidirectional=True)
    assert np.array_equal(to_numpy(y_full), to_numpy(y_none))


def test_explain_names_the_implementation() -> None:
    a, _ = _lstm_setup()
    report = pnn.explain(lstm, a["x"], a["params"], bidirectional=True)
    assert f"lstm[{report.backend}]" in str(report)
    with pnn.use_backend("reference"):
        assert "lstm[reference]" in str(pnn.explain(lstm, a["x"], a["params"], bidirectional=True))


# --------------------------------------------------------------------------- validation


@pytest.fixture
def no_compute(monkeypatch):
    """Validation errors must come before any computation."""

    def fail(*args, **kwargs):
        raise AssertionError("a forward ran: validation should have failed first")

    monkeypatch.setattr(dispatch.Route, "_forward", fail)


def _cell_arrays(kind="lstm", n=2, features=3, hs=2):
    rng = np.random.default_rng(0)
    g = GATES[kind]
    return {
        "x": rng.standard_normal((n, features)), "h": rng.standard_normal((n, hs)),
        "c": rng.standard_normal((n, hs)), "w_ih": rng.standard_normal((g * hs, features)),
        "w_hh": rng.standard_normal((g * hs, hs)), "b_ih": rng.standard_normal(g * hs),
        "b_hh": rng.standard_normal(g * hs),
    }


def _cell(kind, a, **kw):
    w = (a["w_ih"], a["w_hh"], a["b_ih"], a["b_hh"])
    if kind == "lstm":
        return lstm_cell(a["x"], a["h"], a["c"], *w, **kw)
    return {"rnn": rnn_cell, "gru": gru_cell}[kind](a["x"], a["h"], *w, **kw)


CELL_ERRORS = [
    ("lstm", "w_ih", np.zeros((6, 3)), ValueError, r"w_ih must have shape \(8, 3\)"),
    ("lstm", "w_ih", np.zeros((8, 4)), ValueError, r"w_ih must have shape \(8, 3\)"),
    ("gru", "w_hh", np.zeros((6, 3)), ValueError, r"w_hh must have shape \(6, 2\)"),
    ("rnn", "w_hh", np.zeros((2, 2, 1)), ValueError, "w_hh"),
    ("gru", "b_ih", np.zeros(5), ValueError, r"b_ih must have shape \(6,\)"),
    ("lstm", "b_hh", np.zeros((8, 1)), ValueError, "b_hh"),
    ("lstm", "h", np.zeros((3, 2)), ValueError, "h must have shape"),
    ("lstm", "c", np.zeros((2, 3)), ValueError, "c must have shape"),
    ("gru", "h", np.zeros(2), ValueError, "h must have shape"),
    ("rnn", "x", np.zeros((2, 3, 1)), ValueError, "x must be"),
    ("lstm", "h", np.zeros((2, 2), dtype=np.float32), TypeError, "h has dtype float32"),
    ("gru", "w_hh", np.zeros((6, 2), dtype=np.float32), TypeError, "w_hh has dtype float32"),
    ("rnn", "x", np.zeros((2, 3), dtype=np.int64), TypeError, "x must have a floating dtype"),
    ("lstm", "w_ih", torch.zeros(8, 3, dtype=torch.float64), TypeError, "different libraries"),
    ("gru", "h", [[0.0, 0.0], [0.0, 0.0]], TypeError, "h must be an array"),
    ("lstm", "h", np.zeros((2, 0)), ValueError, "hidden_size >= 1"),
]


@pytest.mark.parametrize(("kind", "name", "value", "exc", "match"), CELL_ERRORS)
def test_cell_errors(no_compute, kind, name, value, exc, match) -> None:
    a = _cell_arrays(kind)
    a[name] = value
    with pytest.raises(exc, match=match):
        _cell(kind, a)


def test_cell_option_errors(no_compute) -> None:
    a = _cell_arrays("rnn")
    with pytest.raises(ValueError, match="activation must be 'tanh' or 'relu'"):
        _cell("rnn", a, activation="sigmoid")
    with pytest.raises(ValueError, match="activation"):
        _cell("rnn", a, activation="swish")
    a = _cell_arrays("gru")
    with pytest.raises(TypeError, match="reset_after"):
        _cell("gru", a, reset_after="no")


def _seq_arrays(kind="lstm", layers=2, dirs=2, steps=4, n=3, features=3, hs=2):
    rng = np.random.default_rng(0)
    g = GATES[kind]
    params = [
        (rng.standard_normal((g * hs, features if k < dirs else dirs * hs)), rng.standard_normal((g * hs, hs)),
         rng.standard_normal(g * hs), None)
        for k in range(layers * dirs)
    ]
    return {"x": rng.standard_normal((steps, n, features)), "params": params,
            "h0": rng.standard_normal((layers * dirs, n, hs)), "c0": rng.standard_normal((layers * dirs, n, hs))}


def _seq(kind, a, **kw):
    kw.setdefault("bidirectional", True)
    if kind == "lstm":
        return lstm(a["x"], a["params"], a["h0"], a["c0"], **kw)
    return {"rnn": rnn, "gru": gru}[kind](a["x"], a["params"], a["h0"], **kw)


def _replace(params, k, j, value):
    params = [list(e) for e in params]
    params[k][j] = value
    return [tuple(e) for e in params]


def test_sequence_errors(no_compute) -> None:
    a = _seq_arrays()
    P = a["params"]
    cases_ = [
        ({"params": np.zeros(3)}, TypeError, "params must be a non-empty list"),
        ({"params": []}, TypeError, "params must be a non-empty list"),
        ({"params": P[:3]}, ValueError, "needs two per layer"),
        ({"params": [P[0][:3], *P[1:]]}, TypeError, r"params\[0\] must be a tuple"),
        ({"params": _replace(P, 2, 0, np.zeros((8, 3)))}, ValueError,
         r"params\[2\]\[0\] \(w_ih_l1\) must have shape \(8, 4\)"),
        ({"params": _replace(P, 1, 0, np.zeros((8, 4)))}, ValueError,
         r"params\[1\]\[0\] \(w_ih_l0_reverse\) must have shape \(8, 3\)"),
        ({"params": _replace(P, 0, 1, np.zeros((6, 2)))}, ValueError, r"params\[0\]\[1\] \(w_hh_l0\)"),
        ({"params": _replace(P, 3, 1, np.zeros((8, 3)))}, ValueError, r"params\[3\]\[1\] \(w_hh_l1_reverse\)"),
        ({"params": _replace(P, 1, 2, np.zeros(7))}, ValueError, r"b_ih_l0_reverse\) must have shape \(8,\)"),
        ({"params": _replace(P, 0, 3, np.zeros(8, dtype=np.float32))}, TypeError, "b_hh_l0.*float32"),
        ({"params": _replace(P, 0, 0, "w")}, TypeError, r"params\[0\]\[0\] \(w_ih_l0\) must be an array"),
        ({"h0": np.zeros((2, 3, 2))}, ValueError, r"h0 must have shape \(4, 3, 2\)"),
        ({"c0": np.zeros((4, 2, 2))}, ValueError, r"c0 must have shape \(4, 3, 2\)"),
        ({"c0": np.zeros((4, 3, 2), dtype=np.float32)}, TypeError, "c0 has dtype float32"),
        ({"x": np.zeros((4, 3))}, ValueError, r"x must be 3-D \(T, N, input_size\)"),
        ({"h0": torch.zeros(4, 3, 2, dtype=torch.float64)}, TypeError, "different libraries"),
    ]
    for change, exc, match in cases_:
        with pytest.raises(exc, match=match):
            _seq("lstm", {**a, **change})
    with pytest.raises(ValueError, match=r"x must be 3-D \(N, T, input_size\)"):
        _seq("lstm", {**a, "x": np.zeros((4, 3))}, batch_first=True)
    with pytest.raises(ValueError, match="activation must be 'tanh' or 'relu' for rnn"):
        _seq("rnn", _seq_arrays("rnn"), activation="gelu")
    with pytest.raises(TypeError, match="bidirectional"):
        _seq("gru", _seq_arrays("gru"), bidirectional="yes")
    with pytest.raises(TypeError, match="batch_first"):
        _seq("gru", _seq_arrays("gru"), batch_first=None)
    b = _seq_arrays("gru", layers=1, dirs=1)
    with pytest.raises(ValueError, match=r"params\[1\]\[0\] \(w_ih_l1\) must have shape \(6, 2\)"):
        gru(b["x"], [*b["params"], b["params"][0]], None)  # layer 1 takes H features, not I


LENGTH_ERRORS = [
    ([4, 0, 2], ValueError, r"lengths\[1\] = 0 is out of range.*between 1 and T=4"),
    ([4, 5, 2], ValueError, r"lengths\[1\] = 5 is out of range"),
    ([-1, 2, 2], ValueError, r"lengths\[0\] = -1"),
    ([4, 2], ValueError, r"one entry per sequence \(N=3\), got 2"),
    ([4.0, 2, 2], TypeError, r"lengths\[0\] must be an int"),
    ([True, 2, 2], TypeError, r"lengths\[0\] must be an int"),
    (np.array([4.0, 2.0, 1.0]), TypeError, "lengths must be an integer array"),
    (np.array([[4, 2, 1]]), ValueError, "lengths must be 1-D"),
    (np.array([4, 2, 9]), ValueError, r"lengths\[2\] = 9"),
    (torch.tensor([0, 1, 2]), ValueError, r"lengths\[0\] = 0"),
    ("abc", TypeError, "lengths must be an integer array or a sequence of ints"),
    (3, TypeError, "lengths must be"),
]


@pytest.mark.parametrize(("lengths", "exc", "match"), LENGTH_ERRORS)
def test_lengths_errors(no_compute, lengths, exc, match) -> None:
    a = _seq_arrays("gru")
    with pytest.raises(exc, match=match):
        _seq("gru", a, lengths=lengths)
    b = _seq_arrays("gru")
    b["x"] = np.swapaxes(b["x"], 0, 1)  # batch_first: T and N from the right axes
    with pytest.raises(exc, match=match):
        _seq("gru", b, lengths=lengths, batch_first=True)


def test_lstm_cell_with_a_torch_style_state_tuple_says_h_and_c_are_separate():
    x, h = np.ones((2, 3)), np.ones((2, 4))
    with pytest.raises(TypeError, match="separate arguments"):
        pnn.lstm_cell(x, (h, h), np.ones((16, 3)), np.ones((16, 4)))
    with pytest.raises(TypeError, match="h and c as separate arguments"):
        pnn.lstm_cell(x, (h, h), np.ones((16, 3)), np.ones((16, 4)), np.ones(16), np.ones(16))


@pytest.mark.parametrize("case", cases("lstm"))
def test_padding_past_lengths_is_never_read(case):
    """NaN in x past each sequence's end reaches no output and no gradient (PyTorch's packed sequences)."""
    rng = np.random.default_rng(4)
    steps, n, features, hidden = 5, 3, 4, 3
    x = rng.standard_normal((steps, n, features))
    lengths = (5, 2, 3)
    for b, length in enumerate(lengths):
        x[length:, b] = np.nan
    params = [tuple(case.param(rng.standard_normal(s) * 0.5) for s in
                    ((4 * hidden, features), (4 * hidden, hidden), (4 * hidden,), (4 * hidden,)))]
    with case.use():
        (y, (h, c)), pullback = pnn.vjp(pnn.lstm, case.asarray(x), params, lengths=lengths)
        grads = pullback((case.asarray(np.ones(tuple(y.shape))), (case.asarray(np.ones(tuple(h.shape))),
                                                                  case.asarray(np.ones(tuple(c.shape))))))
    values = [y, h, c, grads.x, *grads.params[0]]
    assert not any(np.isnan(to_numpy(v).astype(np.float64)).any() for v in values if v is not None)
    for b, length in enumerate(lengths):
        assert np.all(to_numpy(grads.x)[length:, b] == 0)
