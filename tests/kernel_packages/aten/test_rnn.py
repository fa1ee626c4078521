"""The aten recurrent sequences: PyTorch's fused RNN/LSTM/GRU against the reference, what autograd records."""

from __future__ import annotations

from typing import Any

import pytest

import portable_nn as pnn
from pnn_testing import rel_err
from portable_nn.api._common import spec_of

torch = pytest.importorskip("torch")


pytestmark = pytest.mark.skipif(not pnn.available_backends()["aten"], reason="aten backend unavailable")


from .aten_testing import _assert_agree, _both, _leaves, _seq_problem  # noqa: E402


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

