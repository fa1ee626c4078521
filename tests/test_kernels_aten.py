"""The ``aten`` backend (kernels_aten/): PyTorch's own kernels for torch tensors.

Forward and every gradient against the reference in float64 (and against PyTorch's modules),
``wrt`` honoured (no dx computed), channels last without a copy, the declined cases explained
and raising when forced, NumPy arrays rejected, the probe not importing torch, half precision,
zero sizes, the autograd adapter and inference mode, CUDA tensors (marked ``gpu``).

Agreement with PyTorch over the shared argument grids runs in tests/test_conv.py,
test_dense.py and test_rnn.py, whose ``cases(op)`` include aten (forced) for torch tensors.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import rel_err, to_numpy
from portable_nn.api._common import spec_of

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = pytest.mark.skipif(not pnn.available_backends()["aten"], reason="aten backend unavailable")

GATES = {"rnn": 1, "lstm": 4, "gru": 3}
ACTS = ["identity", "relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "silu", "leaky_relu", ("leaky_relu", -0.3),
        ("leaky_relu", 0.0)]


def _t(a: Any, dtype: Any = torch.float64, device: str = "cpu") -> Any:
    return None if a is None else torch.tensor(np.asarray(a), dtype=dtype, device=device)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _both(fn: Any, args: tuple, kwargs: dict, cotangent: Any, wrt: Any = None,
          backends: tuple[str, str] = ("aten", "reference")) -> list[tuple[Any, Any]]:
    """(outputs, gradients) of ``fn`` under each backend, forced."""
    results = []
    for backend in backends:
        with pnn.use_backend(backend):
            assert pnn.explain(fn, *args, **kwargs).backend == backend
            y, pullback = pnn.vjp(fn, *args, wrt=wrt, **kwargs)
            results.append((y, pullback(cotangent)))
    return results


def _assert_agree(results: list[tuple[Any, Any]], tol: float) -> None:
    (y, grads), (y_ref, grads_ref) = results
    for k, (a, e) in enumerate(zip(_leaves(y), _leaves(y_ref), strict=True)):
        assert tuple(a.shape) == tuple(e.shape) and a.dtype == e.dtype, f"output {k}"
        assert rel_err(a, e) <= tol, f"output {k}: {rel_err(a, e):.2e}"
    for name in grads._fields:
        got, ref = getattr(grads, name), getattr(grads_ref, name)
        if ref is None:
            assert got is None, f"d{name} should be None"
            continue
        for k, (a, e) in enumerate(zip(_leaves(got), _leaves(ref), strict=True)):
            if e is None:
                assert a is None, f"d{name}[{k}] should be None"
                continue
            assert tuple(a.shape) == tuple(e.shape) and a.dtype == e.dtype, f"d{name}[{k}]"
            assert rel_err(a, e) <= tol, f"d{name}[{k}]: {rel_err(a, e):.2e}"


# --------------------------------------------------------------------------- registration and probing


def test_probing_does_not_import_torch():
    code = (
        "import sys, portable_nn as pnn\n"
        "status = pnn.available_backends()\n"
        "rows = [r for r in pnn.capabilities() if r['backend'] == 'aten']\n"
        "import numpy as np\n"
        "pnn.explain(pnn.conv, np.ones((1, 2, 5, 5)), np.ones((3, 2, 3, 3)))\n"
        "print(bool(status['aten']), len(rows) > 0, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "False"], out.stderr


def test_backend_is_listed_and_described():
    assert "aten" in pnn.dispatch.backend_names()
    status = pnn.available_backends()["aten"]
    assert status and "torch tensors only" in status.reason
    rows = {r["op"]: r for r in pnn.capabilities() if r["backend"] == "aten"}
    assert set(rows) == {"conv", "dense", "rnn", "lstm", "gru"}
    assert all(r["arrays"] == "torch on cpu/cuda" for r in rows.values())
    assert "oneDNN convolution" in rows["conv"]["notes"] and "torch activation" in rows["conv"]["notes"]
    assert "reset_after=True only" in rows["gru"]["notes"]


@pytest.mark.parametrize("op", ["conv", "dense"])
def test_auto_prefers_aten_where_it_measured_faster(op):
    x, args, kwargs = _float32_call(op)
    report = pnn.explain(op, x, *args, **kwargs)
    assert report.backend == "aten", str(report)
    assert any(b == "numba" and "lower priority than aten" in why for b, why in report.passed_over)


@pytest.mark.parametrize("op", ["gru", "lstm", "rnn"])
def test_auto_keeps_numba_first_for_the_sequences(op):
    x, args, kwargs = _float32_call(op)
    report = pnn.explain(op, x, *args, **kwargs)
    assert report.backend == "numba", str(report)
    assert ("aten", "lower priority than numba") in report.passed_over


def _float32_call(op: str) -> tuple[Any, tuple, dict]:
    if op == "conv":
        return torch.ones(2, 3, 6, 6), (torch.ones(4, 3, 3, 3),), {}
    if op == "dense":
        return torch.ones(4, 5), (torch.ones(3, 5),), {}
    g = GATES[op]
    return torch.ones(5, 2, 3), ([(torch.ones(g * 4, 3), torch.ones(g * 4, 4), None, None)],), {}


# --------------------------------------------------------------------------- declining


def test_numpy_arrays_are_declined():
    x, w = np.ones((2, 3, 6, 6)), np.ones((4, 3, 3, 3))
    report = pnn.explain(pnn.conv, x, w)
    assert ("aten", "takes torch arrays, not numpy") in report.passed_over
    with pnn.use_backend("aten"), pytest.raises(pnn.BackendUnavailableError, match="takes torch arrays, not numpy"):
        pnn.conv(x, w)
    with pnn.use_backend("aten"), pytest.raises(pnn.BackendUnavailableError, match="not numpy"):
        pnn.lstm(np.ones((5, 2, 3)), [(np.ones((16, 3)), np.ones((16, 4)), None, None)])


def test_gru_reset_after_false_is_declined_visibly():
    x = torch.ones(5, 2, 3, dtype=torch.float64)
    params = [(torch.ones(12, 3, dtype=torch.float64), torch.ones(12, 4, dtype=torch.float64), None, None)]
    report = pnn.explain(pnn.gru, x, params, reset_after=False)
    assert report.backend != "aten"
    reasons = dict(report.passed_over)
    assert "reset_after=False" in reasons["aten"]
    with pnn.use_backend("aten"), pytest.raises(pnn.BackendUnavailableError, match="reset_after=False"):
        pnn.gru(x, params, reset_after=False)
    with pnn.use_backend(gru="aten"):  # the other form runs
        pnn.gru(x, params)


def test_mixed_precision_is_declined():
    x = torch.ones(2, 3, 6, 6, dtype=torch.float16)
    w = torch.ones(4, 3, 3, 3)
    report = pnn.explain(pnn.conv, x, w)
    assert report.backend != "aten"
    assert "half-precision" in dict(report.passed_over)["aten"]
    with pnn.use_backend("aten"), pytest.raises(pnn.BackendUnavailableError, match="half-precision"):
        pnn.conv(x, w)


# --------------------------------------------------------------------------- conv against the reference

CONV_GEOMS = {
    "2d-pad1": dict(x=(2, 4, 7, 6), w=(6, 4, 3, 3), stride=1, padding=1, dilation=1, groups=1),
    "2d-asym-s2-d2-g2": dict(x=(2, 4, 9, 8), w=(6, 2, 3, 2), stride=2, padding=((1, 2), (0, 1)), dilation=2,
                             groups=2),
    "2d-same-even": dict(x=(1, 3, 6, 5), w=(3, 3, 2, 4), stride=1, padding="same", dilation=1, groups=1),
    "2d-depthwise-valid": dict(x=(2, 3, 5, 6), w=(6, 1, 3, 3), stride=(2, 1), padding="valid", dilation=1,
                               groups=3),
    "1d-asym": dict(x=(2, 3, 9), w=(4, 3, 3), stride=2, padding=((2, 0),), dilation=2, groups=1),
    "3d-mixed": dict(x=(1, 2, 4, 5, 4), w=(4, 2, 2, 3, 2), stride=(1, 2, 1), padding=(1, 0, (0, 1)),
                     dilation=(2, 1, 1), groups=1),
}


def _conv_problem(geom: dict, layout: str, batched: bool, bias: bool, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(geom["x"])
    w = rng.standard_normal(geom["w"]) / np.sqrt(np.prod(geom["w"][1:]))
    b = rng.standard_normal(geom["w"][0]) if bias else None
    if layout == "last":
        x = np.moveaxis(x, 1, -1)
    if not batched:
        x = x[0]
    kwargs = {k: geom[k] for k in ("stride", "padding", "dilation", "groups")}
    kwargs["channel_axis"] = -1 if layout == "last" else 1
    return x, w, b, kwargs


@pytest.mark.parametrize("geom", list(CONV_GEOMS))
@pytest.mark.parametrize("layout", ["first", "last"])
@pytest.mark.parametrize("batched", [True, False])
def test_conv_matches_reference(geom, layout, batched):
    x, w, b, kwargs = _conv_problem(CONV_GEOMS[geom], layout, batched, bias=True)
    with pnn.use_backend("reference"):
        y = pnn.conv(_t(x), _t(w), _t(b), activation="gelu", **kwargs)
    dy = np.random.default_rng(1).standard_normal(tuple(y.shape))
    results = _both(pnn.conv, (_t(x), _t(w), _t(b)), {**kwargs, "activation": "gelu"}, _t(dy))
    _assert_agree(results, 1e-12)
    y_aten = results[0][0]
    assert y_aten.is_contiguous()


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_conv_every_activation_matches_reference_and_torch(act):
    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-asym-s2-d2-g2"], "first", True, bias=True, seed=3)
    xt, wt, bt = _t(x), _t(w), _t(b)
    with pnn.use_backend("reference"):
        y = pnn.conv(xt, wt, bt, activation=act, **kwargs)
    dy = _t(np.random.default_rng(4).standard_normal(tuple(y.shape)))
    results = _both(pnn.conv, (xt, wt, bt), {**kwargs, "activation": act}, dy)
    _assert_agree(results, 1e-12)
    # PyTorch's own composition: F.pad, conv2d, the activation, autograd
    leaves = [t.clone().requires_grad_(True) for t in (xt, wt, bt)]
    z = F.conv2d(F.pad(leaves[0], (0, 1, 1, 2)), leaves[1], leaves[2], stride=2, dilation=2, groups=2)
    name, slope = (act, 0.01) if isinstance(act, str) else act
    torch_act = {"identity": lambda v: v, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
                 "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu,
                 "leaky_relu": lambda v: F.leaky_relu(v, slope)}[name]
    y_torch = torch_act(z)
    expected = torch.autograd.grad(y_torch, leaves, dy)
    y_aten, grads = results[0]
    assert torch.equal(y_aten, y_torch.detach())
    for got, exp in zip(grads, expected):
        assert rel_err(got, exp) <= 1e-13


def test_conv_zero_batch_and_no_bias():
    x = torch.zeros(0, 3, 5, 5, dtype=torch.float64)
    w = torch.ones(4, 3, 3, 3, dtype=torch.float64)
    with pnn.use_backend("aten"):
        y, pullback = pnn.vjp(pnn.conv, x, w, padding=((0, 1), 1), activation="silu")
        grads = pullback(torch.zeros_like(y))
    assert tuple(y.shape) == (0, 4, 4, 5)
    assert tuple(grads.x.shape) == (0, 3, 5, 5) and grads.bias is None
    assert not grads.weight.any()


# --------------------------------------------------------------------------- wrt, layout, residuals


@pytest.fixture
def conv_backward_spy(monkeypatch):
    """Records the output_mask of every aten::convolution_backward call."""
    masks = []
    original = torch.ops.aten.convolution_backward

    def spy(*args, **kwargs):
        masks.append(list(args[-1]))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "convolution_backward", spy)
    return masks


def test_conv_wrt_weight_and_bias_computes_no_dx(conv_backward_spy):
    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-pad1"], "first", True, bias=True)
    with pnn.use_backend("aten"):
        y, pullback = pnn.vjp(pnn.conv, _t(x), _t(w), _t(b), wrt=("weight", "bias"), activation="relu", **kwargs)
        grads = pullback(torch.ones_like(y))
        assert conv_backward_spy == [[False, True, True]]
        assert grads.x is None and grads.weight is not None and grads.bias is not None
        _, pullback = pnn.vjp(pnn.conv, _t(x), _t(w), _t(b), wrt="x", **kwargs)
        pullback(torch.ones_like(y))
    assert conv_backward_spy[-1] == [True, False, False]


def test_channels_last_reaches_torch_as_a_view(monkeypatch):
    """NHWC data goes to oneDNN as a channels_last-strided view of the caller's tensor: no copy."""
    seen = []
    original = torch.ops.aten.convolution

    def spy(x, *args):
        seen.append((x.data_ptr(), x.is_contiguous(memory_format=torch.channels_last)))
        return original(x, *args)

    monkeypatch.setattr(torch.ops.aten, "convolution", spy)
    x = torch.randn(2, 7, 6, 4)
    w = torch.randn(5, 4, 3, 3)
    with pnn.use_backend("aten"):
        y, pullback = pnn.vjp(pnn.conv, x, w, padding=1, channel_axis=-1)
        grads = pullback(torch.ones_like(y))
    assert seen == [(x.data_ptr(), True)]
    assert tuple(y.shape) == (2, 7, 6, 5) and y.is_contiguous()
    assert tuple(grads.x.shape) == tuple(x.shape) and grads.x.is_contiguous()
    with pnn.use_backend("reference"):
        expected = pnn.conv(x, w, padding=1, channel_axis=-1)
    assert rel_err(y, expected) <= 1e-5


def test_conv_keeps_output_or_preactivation():
    from kernels_aten.conv import conv_forward

    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-pad1"], "first", True, bias=True)
    for act, kept in (("relu", "y"), ("tanh", "y"), (("leaky_relu", 0.2), "y"), ("gelu", "z"),
                      (("leaky_relu", -0.2), "z"), ("identity", None)):
        prepared = spec_of(pnn.conv).prepare(_t(x), _t(w), _t(b), activation=act, **kwargs)
        (y,), residuals = conv_forward(prepared.call.replace(save=True))
        kept_tensor = residuals[2]
        if kept is None:
            assert kept_tensor is None
        elif kept == "y":
            assert torch.equal(kept_tensor, y)
        else:
            assert not torch.equal(kept_tensor, y)


# --------------------------------------------------------------------------- dense


@pytest.mark.parametrize("lead", [(), (5,), (2, 3), (0,)], ids=str)
@pytest.mark.parametrize("act", ["identity", "relu", "gelu", ("leaky_relu", 0.2)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_dense_matches_reference(lead, act, bias):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((*lead, 6)), rng.standard_normal((4, 6))
    b = rng.standard_normal(4) if bias else None
    dy = rng.standard_normal((*lead, 4))
    _assert_agree(_both(pnn.dense, (_t(x), _t(w), _t(b)), {"activation": act}, _t(dy)), 1e-12)


def test_dense_backward_computes_only_needs():
    from kernels_aten.dense import dense_backward, dense_forward

    prepared = spec_of(pnn.dense).prepare(torch.ones(3, 4), torch.ones(2, 4), torch.ones(2),
                                                          activation="relu")
    _, residuals = dense_forward(prepared.call.replace(save=True))
    assert set(dense_backward(residuals, (torch.ones(3, 2),), frozenset({"weight"}))) == {"weight"}
    assert set(dense_backward(residuals, (torch.ones(3, 2),), frozenset({"x", "bias"}))) == {"x", "bias"}


# --------------------------------------------------------------------------- sequences


def _seq_problem(kind: str, *, steps: int = 4, n: int = 3, features: int = 3, hs: int = 4, layers: int = 2,
                 bidirectional: bool = False, batch_first: bool = False, bias: str = "both", states: bool = True,
                 seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dirs = 2 if bidirectional else 1
    g = GATES[kind]
    params = []
    for k in range(layers * dirs):
        fin = features if k < dirs else dirs * hs
        w = [rng.uniform(-1, 1, (g * hs, fin)) * 0.5, rng.uniform(-1, 1, (g * hs, hs)) * 0.5]
        w += [rng.uniform(-0.5, 0.5, g * hs) if (bias == "both" or (bias == "mixed" and k % 2 == 0 and j == 0))
              else None for j in range(2)]
        params.append(tuple(_t(p) for p in w))
    shape = (n, steps, features) if batch_first else (steps, n, features)
    state = (layers * dirs, n, hs)
    out = (n, steps, dirs * hs) if batch_first else (steps, n, dirs * hs)
    return {
        "x": _t(rng.standard_normal(shape)),
        "params": params,
        "h0": _t(rng.standard_normal(state)) if states else None,
        "c0": _t(rng.standard_normal(state)) if states and kind == "lstm" else None,
        "cot": (_t(rng.standard_normal(out)), _t(rng.standard_normal(state)))
        + ((_t(rng.standard_normal(state)),) if kind == "lstm" else ()),
    }


def _seq_args(kind: str, p: dict) -> tuple[Any, tuple, Any]:
    fn = {"rnn": pnn.rnn, "lstm": pnn.lstm, "gru": pnn.gru}[kind]
    if kind == "lstm":
        dy, dh, dc = p["cot"]
        return fn, (p["x"], p["params"], p["h0"], p["c0"]), (dy, (dh, dc))
    return fn, (p["x"], p["params"], p["h0"]), p["cot"]


SEQ_LABELS = {"lstm": ("lstm", {}), "gru": ("gru", {}), "rnn_tanh": ("rnn", {"activation": "tanh"}),
              "rnn_relu": ("rnn", {"activation": "relu"})}
SEQ_CONFIGS = [
    dict(layers=1, bidirectional=False, batch_first=False, bias="both", states=True, lengths=None),
    dict(layers=2, bidirectional=True, batch_first=True, bias="none", states=False, lengths=None),
    dict(layers=3, bidirectional=False, batch_first=True, bias="mixed", states=True, lengths=(4, 1, 3)),
    dict(layers=2, bidirectional=True, batch_first=False, bias="both", states=True, lengths=(2, 4, 1)),
    dict(layers=1, bidirectional=True, batch_first=True, bias="mixed", states=False, lengths=(1, 1, 1)),
]


@pytest.mark.parametrize("label", list(SEQ_LABELS))
@pytest.mark.parametrize("cfg", SEQ_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sequence_matches_reference(label, cfg):
    kind, extra = SEQ_LABELS[label]
    cfg = dict(cfg)
    lengths = cfg.pop("lengths")
    p = _seq_problem(kind, **cfg)
    fn, args, cot = _seq_args(kind, p)
    kwargs = {**extra, "bidirectional": cfg["bidirectional"], "batch_first": cfg["batch_first"], "lengths": lengths}
    results = _both(fn, args, kwargs, cot)
    _assert_agree(results, 1e-12)
    if lengths is not None:  # outputs past a sequence's end are zero
        y = results[0][0][0]
        for b, length in enumerate(lengths):
            past = y[b, length:] if cfg["batch_first"] else y[length:, b]
            assert not past.any()


def test_lstm_matches_torch_module():
    p = _seq_problem("lstm", layers=2, bidirectional=True, batch_first=True, steps=5)
    module = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True).double()
    with torch.no_grad():
        for param, value in zip(module._flat_weights, [t for row in p["params"] for t in row]):
            param.copy_(value)
    x = p["x"].clone().requires_grad_(True)
    h0, c0 = p["h0"].clone().requires_grad_(True), p["c0"].clone().requires_grad_(True)
    y, (hn, cn) = module(x, (h0, c0))
    dy, dh, dc = p["cot"]
    expected = torch.autograd.grad((y, hn, cn), (x, h0, c0, *module._flat_weights), (dy, dh, dc))
    with pnn.use_backend("aten"):
        (ya, (hna, cna)), pullback = pnn.vjp(pnn.lstm, p["x"], p["params"], p["h0"], p["c0"], batch_first=True,
                                             bidirectional=True)
        grads = pullback((dy, (dh, dc)))
    for got, exp in zip((ya, hna, cna), (y, hn, cn)):
        assert rel_err(got, exp) <= 1e-13
    flat = [grads.x, grads.h0, grads.c0, *(g for row in grads.params for g in row)]
    for got, exp in zip(flat, expected, strict=True):
        assert rel_err(got, exp) <= 1e-13


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_sequence_empty_time_and_batch(kind):
    for steps, n in ((0, 3), (4, 0)):
        p = _seq_problem(kind, steps=steps, n=n, bidirectional=True)
        fn, args, cot = _seq_args(kind, p)
        _assert_agree(_both(fn, args, {"bidirectional": True}, cot), 0.0 if steps == 0 else 1e-12)


@pytest.fixture
def autograd_spy(monkeypatch):
    """Records how many inputs each torch.autograd.grad call asks for, and their shapes."""
    calls = []
    original = torch.autograd.grad

    def spy(outputs, inputs, *args, **kwargs):
        calls.append([tuple(t.shape) for t in inputs])
        return original(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    return calls


def test_sequence_wrt_records_and_asks_only_for_wanted_fields(autograd_spy):
    p = _seq_problem("lstm", layers=1, steps=3, n=2, features=5, hs=4)
    fn, args, cot = _seq_args("lstm", p)
    with pnn.use_backend("aten"):
        _, pullback = pnn.vjp(fn, *args, wrt=("params",))
        grads = pullback(cot)
    assert grads.x is None and grads.h0 is None and grads.c0 is None
    assert autograd_spy == [[(16, 5), (16, 4), (16,), (16,)]]
    ref = _both(fn, args, {}, cot, wrt=("params",))
    _assert_agree(ref, 1e-12)


def test_sequence_forward_records_only_call_needs():
    from kernels_aten.rnn import sequence_forward

    p = _seq_problem("gru", layers=1)
    prepared = spec_of(pnn.gru).prepare(p["x"], p["params"], p["h0"])
    _, (outputs, x, weights, states, record) = sequence_forward(
        prepared.call.replace(save=True, needs=frozenset({"h0"})))
    assert record == {"h0"}
    assert not x.requires_grad and states[0].requires_grad
    assert not any(w.requires_grad for row in weights for w in row if w is not None)
    assert all(o.requires_grad for o in outputs)


def test_pullback_runs_twice_and_inputs_are_untouched():
    p = _seq_problem("lstm", bidirectional=True)
    fn, args, cot = _seq_args("lstm", p)
    before = [t.clone() for t in _leaves(args) if t is not None]
    with pnn.use_backend("aten"):
        _, pullback = pnn.vjp(fn, *args, bidirectional=True)
        first, second = pullback(cot), pullback(cot)
    for a, b in zip(_leaves(tuple(first)), _leaves(tuple(second))):
        assert (a is None and b is None) or torch.equal(a, b)
    after = [t for t in _leaves(args) if t is not None]
    assert all(torch.equal(a, b) and not b.requires_grad for a, b in zip(before, after))


def test_vjp_under_inference_mode_and_no_grad():
    p = _seq_problem("rnn", layers=1)
    fn, args, cot = _seq_args("rnn", p)
    with pnn.use_backend("aten"):
        _, pullback = pnn.vjp(fn, *args)
        expected = pullback(cot)
        with torch.inference_mode():
            inference_args = (p["x"].clone(), [tuple(t.clone() for t in row) for row in p["params"]],
                              p["h0"].clone())
            _, pullback = pnn.vjp(fn, *inference_args)
            got = pullback(cot)
    for a, b in zip(_leaves(tuple(got)), _leaves(tuple(expected))):
        assert torch.equal(a, b)


def test_autograd_adapter_runs_aten_inside_its_custom_ops():
    """portable_nn.torch runs kernels below PyTorch's autograd keys; aten's recording must still work."""
    pnt = pytest.importorskip("portable_nn.torch")
    p = _seq_problem("lstm", layers=2, bidirectional=True)
    x = p["x"].clone().requires_grad_(True)
    params = [tuple(t.clone().requires_grad_(True) for t in row) for row in p["params"]]
    with pnn.use_backend("aten"):
        y, (hn, cn) = pnt.lstm(x, params, bidirectional=True)
        (y.sum() + hn.sum() + cn.sum()).backward()
    with pnn.use_backend("reference"):
        (yr, (hnr, cnr)), pullback = pnn.vjp(pnn.lstm, p["x"], p["params"], bidirectional=True)
        expected = pullback((torch.ones_like(yr), (torch.ones_like(hnr), torch.ones_like(cnr))))
    assert rel_err(y.detach(), yr) <= 1e-12
    assert rel_err(x.grad, expected.x) <= 1e-12
    for row, erow in zip(params, expected.params):
        for t, e in zip(row, erow):
            assert rel_err(t.grad, e) <= 1e-12
    xc = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    wc = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    with pnn.use_backend("aten"):
        pnt.conv(xc, wc, padding="same", activation="relu").sum().backward()
    leaves = [xc.detach().clone().requires_grad_(True), wc.detach().clone().requires_grad_(True)]
    F.relu(F.conv2d(*leaves, padding="same")).sum().backward()
    assert rel_err(xc.grad, leaves[0].grad) <= 1e-13 and rel_err(wc.grad, leaves[1].grad) <= 1e-13


def test_repeated_calls_are_bitwise_identical():
    """Float32 on 2 threads, where oneDNN runs: PyTorch's CPU kernels reduce in a fixed order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-pad1"], "last", True, bias=True)
        p = _seq_problem("lstm", layers=2, bidirectional=True, n=8, hs=16)
        cases = [
            (pnn.conv, tuple(_t(a, torch.float32) for a in (x, w, b)), {**kwargs, "activation": "relu"}),
            (pnn.lstm, (p["x"].float(), [tuple(t.float() for t in row) for row in p["params"]]),
             {"bidirectional": True}),
        ]
        for fn, args, kwargs in cases:
            runs = []
            for _ in range(3):
                with pnn.use_backend("aten"):
                    y, pullback = pnn.vjp(fn, *args, **kwargs)
                    ys = _leaves(y)
                    grads = pullback(ys[0].new_ones(ys[0].shape) if len(ys) == 1
                                     else (torch.ones_like(ys[0]), (torch.ones_like(ys[1]), None)))
                runs.append([t for t in _leaves((y, tuple(grads))) if t is not None])
            for run in runs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_against_the_float64_reference(dtype):
    tdt = getattr(torch, dtype)
    tol = 2e-2 if dtype == "float16" else 6e-2
    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-pad1"], "last", True, bias=True)
    p = _seq_problem("lstm", layers=2)
    cases = [
        (pnn.conv, (x, w, b), {**kwargs, "activation": "relu"}),
        (pnn.dense, (np.linspace(-1, 1, 24).reshape(4, 6), np.cos(np.arange(18.0)).reshape(3, 6), None),
         {"activation": "gelu"}),
        (pnn.lstm, (p["x"], p["params"]), {}),
    ]
    for fn, args, kwargs in cases:
        def cast(a: Any, to: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(cast(v, to) for v in a)
            return None if a is None else torch.as_tensor(np.asarray(to_numpy(a))).to(to)

        half = cast(args, tdt)
        with pnn.use_backend("aten"):
            y, pullback = pnn.vjp(fn, *half, **kwargs)
            ys = _leaves(y)
            cot = cast(tuple(torch.ones_like(t) for t in ys), tdt)
            grads = pullback(cot[0] if len(ys) == 1 else (cot[0], (cot[1], cot[2])))
        with pnn.use_backend("reference"):
            y64, pullback64 = pnn.vjp(fn, *cast(half, torch.float64), **kwargs)
            ys64 = _leaves(y64)
            cot64 = tuple(torch.ones_like(t) for t in ys64)
            grads64 = pullback64(cot64[0] if len(ys64) == 1 else (cot64[0], (cot64[1], cot64[2])))
        for a, e in zip(ys, ys64):
            assert a.dtype == tdt and rel_err(a, e) <= tol
        for a, e in zip(_leaves(tuple(grads)), _leaves(tuple(grads64))):
            assert (a is None) == (e is None)
            if a is not None:
                assert a.dtype == tdt and rel_err(a, e) <= tol


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_match_the_cpu_results():
    x, w, b, kwargs = _conv_problem(CONV_GEOMS["2d-asym-s2-d2-g2"], "last", True, bias=True)
    p = _seq_problem("gru", layers=2, bidirectional=True)
    cases = [
        (pnn.conv, (_t(x), _t(w), _t(b)), {**kwargs, "activation": "silu"}),
        (pnn.dense, (_t(np.ones((3, 5))), _t(np.eye(4, 5)), _t(np.ones(4))), {"activation": "tanh"}),
        (pnn.gru, (p["x"], p["params"], p["h0"]), {"bidirectional": True, "lengths": (4, 2, 1)}),
    ]
    for fn, args, kwargs in cases:
        def to(a: Any, device: str) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(to(v, device) for v in a)
            return None if a is None else a.to(device)

        outputs = []
        for device in ("cpu", "cuda"):
            with pnn.use_backend("aten"):
                assert pnn.explain(fn, *to(args, device), **kwargs).backend == "aten"
                y, pullback = pnn.vjp(fn, *to(args, device), **kwargs)
                ys = _leaves(y)
                cot = tuple(torch.ones_like(t) for t in ys)
                grads = pullback(cot[0] if len(ys) == 1 else cot)
            outputs.append([t for t in _leaves((y, tuple(grads))) if t is not None])
        for a, e in zip(*outputs, strict=True):
            assert a.device.type == "cpu" and e.device.type == "cuda"
            assert rel_err(e.cpu(), a) <= 1e-10
