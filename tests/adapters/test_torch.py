"""The PyTorch adapter: custom ops (gradcheck, torch.compile), needs_input_grad, and drop-in modules.

Oracles: ``torch.autograd.gradcheck`` (finite differences, float64) for every
custom op; the ``torch.nn`` modules themselves for the drop-in modules (state
dicts loaded both ways, outputs within 1e-12 in float64; 20 SGD steps of a
small model to the same parameters within a relative 1e-8).
"""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import portable_nn as pnn  # noqa: E402
import portable_nn.torch as pnt  # noqa: E402
from portable_nn import dispatch  # noqa: E402
from portable_nn.adapters.torch import _ops as adapter_ops  # noqa: E402

DT = torch.float64


def _t(*shape, grad=True, scale=1.0, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else sum(shape) * 7 + len(shape))
    return (scale * torch.randn(*shape, dtype=DT, generator=gen)).requires_grad_(grad)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, f"{tuple(a.shape)} != {tuple(b.shape)}"
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# =========================================================================== gradcheck on every custom op


def _seq_params(gates, inp, hidden, layers, dirs, bias=True):
    params = []
    for layer in range(layers):
        for _ in range(dirs):
            i = inp if layer == 0 else dirs * hidden
            params.append((_t(gates * hidden, i, scale=0.5, seed=len(params) * 4 + 1),
                           _t(gates * hidden, hidden, scale=0.5, seed=len(params) * 4 + 2),
                           _t(gates * hidden, scale=0.5, seed=len(params) * 4 + 3) if bias else None,
                           _t(gates * hidden, scale=0.5, seed=len(params) * 4 + 4) if bias else None))
    return params


def _flat(params):
    return [t for p in params for t in p if t is not None]


def _rebuild(params, flat):
    it = iter(flat)
    return [tuple(None if t is None else next(it) for t in p) for p in params]


def _gradcheck_cases():
    x34, w4, b4 = _t(3, 4), _t(4), _t(4)
    rm, rv = torch.zeros(3, dtype=DT), torch.ones(3, dtype=DT)
    ce_target = torch.tensor([1, 0, 3, 2, 1])
    probs = torch.softmax(_t(5, 4, grad=False), 1).requires_grad_()
    lstm_p = _seq_params(4, 3, 2, 2, 1)
    gru_p = _seq_params(3, 3, 2, 1, 2)
    rnn_p = _seq_params(1, 3, 2, 2, 2, bias=False)
    return {
        "layer_norm": (lambda x, w, b: pnt.layer_norm(x, w, b, activation="tanh"), (x34, w4, b4)),
        "layer_norm_2axes": (lambda x, w: pnt.layer_norm(x, w, axis=(-2, -1)), (_t(2, 3, 4), _t(3, 4))),
        "rms_norm": (lambda x, w: pnt.rms_norm(x, w, eps=1e-3), (x34, w4)),
        "group_norm": (lambda x, w, b: pnt.group_norm(x, 2, w, b, activation="silu"), (_t(2, 4, 3), w4, b4)),
        "group_norm_last": (lambda x, w, b: pnt.group_norm(x, 2, w, b, channel_axis=-1), (_t(2, 3, 4), w4, b4)),
        "batch_norm_train": (
            lambda x, w, b: pnt.batch_norm(x, weight=w, bias=b, running_mean=rm.clone(), running_var=rv.clone(),
                                           activation="gelu"),
            (_t(4, 3, 2), _t(3), _t(3))),
        "batch_norm_eval": (
            lambda x, w, b: pnt.batch_norm(x, weight=w, bias=b, running_mean=rm + 0.2, running_var=rv * 1.5,
                                           training=False),
            (_t(4, 3, 2), _t(3), _t(3))),
        "instance_norm": (lambda x, w, b: pnt.instance_norm(x, weight=w, bias=b, activation=("leaky_relu", 0.2)),
                          (_t(2, 3, 4), _t(3), _t(3))),
        "moments": (lambda x: pnt.moments(x, 1, correction=1), (x34,)),
        "dense": (lambda x, w, b: pnt.dense(x, w, b, activation="gelu"), (_t(2, 3, 4), _t(5, 4), _t(5))),
        "conv1d": (lambda x, w, b: pnt.conv(x, w, b, stride=2, padding=((1, 2),), activation="silu"),
                   (_t(2, 3, 7), _t(4, 3, 3), _t(4))),
        "conv2d_groups_same_last": (
            lambda x, w: pnt.conv(x, w, padding="same", dilation=(1, 2), groups=2, channel_axis=-1),
            (_t(1, 4, 5, 4), _t(2, 2, 2, 3))),
        "conv2d_reflect_last": (
            lambda x, w, b: pnt.conv(x, w, b, padding=((2, 1), 1), padding_mode="reflect", channel_axis=-1),
            (_t(2, 3, 4, 2), _t(3, 2, 2, 3), _t(3))),
        "conv1d_circular_unbatched": (
            lambda x, w: pnt.conv(x, w, stride=2, padding=3, padding_mode="circular"), (_t(2, 3), _t(2, 2, 2))),
        "max_pool": (lambda x: pnt.max_pool(x, 2, stride=1, padding=1), (_t(1, 2, 3, 4),)),
        "max_pool_unbatched_last": (
            lambda x: pnt.max_pool(x, (2, 2), dilation=(1, 2), ceil_mode=True, channel_axis=-1), (_t(3, 5, 2),)),
        "avg_pool": (lambda x: pnt.avg_pool(x, (3,), stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                     (_t(2, 2, 6),)),
        "log_softmax": (lambda x: pnt.log_softmax(x, axis=0), (x34,)),
        "cross_entropy_labels": (
            lambda z, w: pnt.cross_entropy(z, ce_target, weight=w, label_smoothing=0.1),
            (_t(5, 4), torch.rand(4, dtype=DT, generator=torch.Generator().manual_seed(1)) + 0.5)),
        "cross_entropy_probs": (lambda z, p: pnt.cross_entropy(z, p, reduction="none"), (_t(5, 4), probs)),
        "rnn_cell": (lambda x, h, wi, wh, b: pnt.rnn_cell(x, h, wi, wh, b, None, activation="tanh"),
                     (_t(2, 3), _t(2, 4), _t(4, 3), _t(4, 4), _t(4))),
        "lstm_cell": (lambda x, h, c, wi, wh, bi, bh: pnt.lstm_cell(x, h, c, wi, wh, bi, bh),
                      (_t(2, 3), _t(2, 2), _t(2, 2, seed=5), _t(8, 3), _t(8, 2), _t(8), _t(8, seed=9))),
        "gru_cell": (lambda x, h, wi, wh: pnt.gru_cell(x, h, wi, wh, reset_after=False),
                     (_t(2, 3), _t(2, 2), _t(6, 3), _t(6, 2))),
        "lstm_lengths": (
            lambda x, h0, c0, *flat: pnt.lstm(x, _rebuild(lstm_p, flat), h0, c0, batch_first=True,
                                              lengths=[3, 1]),
            (_t(2, 3, 3), _t(2, 2, 2), _t(2, 2, 2, seed=3), *_flat(lstm_p))),
        "gru_bidirectional": (
            lambda x, *flat: pnt.gru(x, _rebuild(gru_p, flat), bidirectional=True),
            (_t(3, 2, 3), *_flat(gru_p))),
        "rnn_relu_stacked": (
            lambda x, h0, *flat: pnt.rnn(x, _rebuild(rnn_p, flat), h0, activation="relu", bidirectional=True),
            (_t(3, 2, 3), _t(4, 2, 2), *_flat(rnn_p))),
    }


_CASES = _gradcheck_cases()


def _outputs(result):
    """The tensors of a nested result."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for r in result for t in _outputs(r)]


@pytest.mark.parametrize("case", sorted(_CASES))
def test_gradcheck(case):
    fn, inputs = _CASES[case]
    assert torch.autograd.gradcheck(lambda *a: tuple(_outputs(fn(*a))), inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_fake_implementations_match_real_outputs_and_gradients(case):
    """What torch.compile traces with (shapes, dtypes, strides) is what the kernels return, both ways."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn, inputs = _CASES[case]
    real = _outputs(fn(*inputs))
    real_grads = torch.autograd.grad(real, [t for t in inputs if t.requires_grad], [torch.ones_like(r) for r in real])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_inputs = [mode.from_tensor(t).requires_grad_(t.requires_grad) for t in inputs]
        fake = _outputs(fn(*fake_inputs))
        fake_grads = torch.autograd.grad(fake, [t for t in fake_inputs if t.requires_grad],
                                         [torch.ones_like(f) for f in fake])
    for r, f in zip([*real, *real_grads], [*fake, *fake_grads]):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    assert len(real) == len(fake)


def test_every_op_is_a_custom_op_with_a_backward_op():
    for name in dispatch.op_names():
        packet = getattr(torch.ops.portable_nn, name)
        assert packet.default._schema.returns[-1].type == torch._C.TensorType.get()  # the pullback handle
        getattr(torch.ops.portable_nn, f"{name}_backward")
    for name in ("batch_norm_", "instance_norm_"):
        schema = str(getattr(torch.ops.portable_nn, name).default._schema)
        assert "Tensor(a!)? running_mean" in schema and "Tensor(b!)? running_var" in schema


def test_opcheck_schema_fake_and_autograd_registration():
    x, w, b = _t(2, 3, 4), _t(5, 4), _t(5)
    torch.library.opcheck(
        torch.ops.portable_nn.dense.default, (x, w, b, "relu", 0.01, [True, True, True]),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    xs = _t(2, 3, 5, 4)
    torch.library.opcheck(
        torch.ops.portable_nn.conv.default,
        (xs, _t(4, 3, 2, 3), None, [2, 1], [0, 1, 1, 1], "explicit", "zeros", [1], 1, "identity", 0.01, 1, None),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(  # padded before dispatch (reflect): by index gathers on the fake tensors too
        torch.ops.portable_nn.conv.default,
        (xs, _t(4, 3, 2, 3), None, [1], [1, 2, 0, 1], "explicit", "reflect", [1], 1, "identity", 0.01, 1, None),
        test_utils=("test_schema", "test_faketensor"),
    )


# =========================================================================== pullbacks: kept, reduced, released


def _spy_dense(record):
    ref = next(i for i in dispatch.implementations("dense") if i.backend == "reference")

    def backward(residuals, cotangents, needs, out=None):
        record.append(frozenset(needs))
        return ref.backward_fn()(residuals, cotangents, needs, out)

    pnn.register_kernel("dense", "adapter_spy", forward=ref.forward_fn(), backward=backward,
                        supports=ref.supports, priority=100)


@pytest.mark.parametrize("lost", [None, False, True], ids=["eager", "kept", "recomputed"])
def test_needs_input_grad_skips_unwanted_gradients(lost, monkeypatch):
    """The backward kernel is asked only for the gradients autograd needs (the first layer never gets dx)."""
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", lost is None)
    record: list[frozenset[str]] = []
    _spy_dense(record)
    try:
        x, w, b = _t(3, 4, grad=False), _t(2, 4), _t(2)
        with pnn.use_backend(dense="adapter_spy"):
            y = pnt.dense(x, w, b, activation="tanh")
            if lost:
                adapter_ops._saved.clear()  # the backward must then recompute, still with the reduced wrt
            y.sum().backward()
            assert record == [frozenset({"weight", "bias"})]
            assert x.grad is None
            w_grad = w.grad.clone()
            x.requires_grad_()
            w.requires_grad_(False)
            pnt.dense(x, w, b).sum().backward()
        assert record[1] == frozenset({"x", "bias"})
        assert _rel(x.grad, torch.autograd.grad(F.linear(x, w, b).sum(), x)[0]) < 1e-14
        assert torch.equal(w.grad, w_grad)  # no gradient accumulated into w the second time
    finally:
        pnn.unregister_kernel("dense", "adapter_spy")


def test_eager_path_releases_its_pullback_with_the_saved_tensors():
    """In eager mode an op is a plain autograd.Function that keeps its executed forward on the node
    and drops it as autograd frees saved tensors: right after the node's backward (the graph may
    live on), kept under retain_graph=True, and with the graph when no backward runs; it never
    enters the custom ops' table."""
    gc.collect()
    base = pnt.saved_pullbacks()
    x, w, b = _t(3, 4), _t(4), _t(4)
    y = pnt.layer_norm(x, w, b)
    assert adapter_ops.is_eager_node(y.grad_fn)
    assert y.grad_fn.pnn_kept is not None and pnt.saved_pullbacks() == base
    kept = weakref.ref(y.grad_fn.pnn_kept)
    y.sum().backward()
    assert y.grad_fn.pnn_kept is None and kept() is None  # y and its graph are still alive
    first = x.grad.clone()
    x.grad = None
    y = pnt.layer_norm(x, w, b)
    y.sum().backward(retain_graph=True)
    assert y.grad_fn.pnn_kept is not None
    assert torch.equal(x.grad, first)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * first)
    assert y.grad_fn.pnn_kept is None
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()
    y = pnt.layer_norm(x, w, b)
    kept = weakref.ref(y.grad_fn.pnn_kept)
    del y
    gc.collect()
    assert kept() is None
    with torch.no_grad():
        assert pnt.layer_norm(x, w, b).grad_fn is None
    assert pnt.saved_pullbacks() == base


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "custom_op"])
@pytest.mark.parametrize("make", [lambda: pnt.LayerNorm(4), lambda: pnt.RMSNorm(4), lambda: pnt.BatchNorm1d(3),
                                  lambda: pnt.Linear(4, 2)], ids=["LayerNorm", "RMSNorm", "BatchNorm1d", "Linear"])
def test_an_input_modified_in_place_after_the_forward_is_refused(make, eager, monkeypatch):
    """As for torch's own ops: a backward through a tensor changed in place since the forward would
    read the new values (our residuals are views of it), so autograd's version check refuses it."""
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", eager)
    module = make().double()
    x = _t(5, 3, 4) if isinstance(module, torch.nn.BatchNorm1d) else _t(3, 4)
    h = x * 1.0
    y = module(h)
    h.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("cls", [pnt.LSTM, pnt.GRU], ids=["LSTM", "GRU"])
def test_sequence_ops_take_the_eager_path_with_their_weight_lists(cls, monkeypatch):
    """The sequence ops take their weights as lists, which autograd.Function cannot see inside a list:
    the eager path spreads them into its arguments.  Same values and gradients as the custom op
    (bitwise: the same kernels), only the gradients autograd asks for (a frozen layer, no biases), and
    autograd's version check on a weight changed in place."""
    torch.manual_seed(0)
    module = cls(4, 3, num_layers=2, bidirectional=True, bias=False).double()
    module.weight_ih_l0.requires_grad_(False)
    x = _t(5, 2, 4)
    results = []
    for eager in (True, False):
        monkeypatch.setattr(adapter_ops, "EAGER_PATH", eager)
        out, _ = module(x)
        assert adapter_ops.is_eager_node(out.grad_fn) == eager
        params = [p for p in module.parameters() if p.requires_grad]
        results.append([out, *torch.autograd.grad((out * out).sum(), [x, *params])])
    for a, e in zip(*results):
        assert torch.equal(a, e)
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", True)
    out, _ = module(x)
    with torch.no_grad():
        module.weight_hh_l1_reverse.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_eager_calls_on_pytorch_s_own_kernels_are_recorded_by_autograd():
    """conv, conv_transpose and dense calls that run on ``aten`` go straight to torch's autograd (its
    own backward nodes, no pullback kept), with torch's values and gradients; channels last and
    calls on our kernels keep the pullback path."""
    gc.collect()
    base = pnt.saved_pullbacks()
    x, w, b, wd = _t(2, 3, 6, 5), _t(4, 3, 3, 3), _t(4), _t(3, 90)
    cases = [
        (lambda x, w, b: pnt.conv(x, w, b, padding=1, activation="gelu"),
         lambda x, w, b: F.gelu(F.conv2d(x, w, b, padding=1))),
        (lambda x, w, b: pnt.conv_transpose(x, w.transpose(0, 1), b, stride=2, activation="relu"),
         lambda x, w, b: F.relu(F.conv_transpose2d(x, w.transpose(0, 1), b, stride=2))),
        (lambda x, w, b: pnt.dense(x.flatten(1), wd, activation="tanh"),
         lambda x, w, b: torch.tanh(F.linear(x.flatten(1), wd))),
    ]
    for ours, theirs in cases:
        y, expected = ours(x, w, b), theirs(x, w, b)
        assert not adapter_ops.is_eager_node(y.grad_fn) and pnt.saved_pullbacks() == base
        assert torch.allclose(y, expected, rtol=1e-12, atol=1e-12)
        inputs = (x, w, b, wd)
        got, want = (torch.autograd.grad((v * v).sum(), inputs, allow_unused=True) for v in (y, expected))
        for g, e in zip(got, want):
            assert (g is None) == (e is None) and (g is None or torch.allclose(g, e, rtol=1e-12, atol=1e-12))
    last = pnt.conv(x.permute(0, 2, 3, 1).contiguous(), w, b, channel_axis=-1)
    assert adapter_ops.is_eager_node(last.grad_fn) and last.is_contiguous()
    with pnn.use_backend("numba"):
        assert adapter_ops.is_eager_node(pnt.conv(x, w, b).grad_fn)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # (torch's make_dual)
def test_forward_mode_ad_through_the_layers_autograd_records():
    """Recorded as torch's own ops, the eager convolutions and dense layers carry forward-mode tangents."""
    import torch.autograd.forward_ad as fwad

    x, w, b, t = _t(2, 3, 5, 5, grad=False), _t(4, 3, 3, 3, grad=False), _t(4, grad=False), _t(2, 3, 5, 5, seed=7)
    with fwad.dual_level():
        y = pnt.conv(fwad.make_dual(x, t), w, b, padding=1, activation="gelu")
        tangent = fwad.unpack_dual(y).tangent
        expected = fwad.unpack_dual(F.gelu(F.conv2d(fwad.make_dual(x, t), w, b, padding=1))).tangent
    assert tangent is not None
    assert torch.allclose(tangent, expected, rtol=1e-12, atol=1e-12)


def test_eager_and_custom_op_paths_agree(monkeypatch):
    x, w, b = _t(2, 3, 6, 5), _t(4, 3, 3, 3), _t(4)
    results = []
    for eager in (True, False):
        monkeypatch.setattr(adapter_ops, "EAGER_PATH", eager)
        xx, ww, bb = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = pnt.conv(xx, ww, bb, padding=1, activation="relu")
        grads = torch.autograd.grad((y * y).sum(), (xx, ww, bb))
        results.append([y, *grads])
    for a, e in zip(*results):
        assert torch.equal(a, e)


def test_pullbacks_are_released(monkeypatch):
    monkeypatch.setattr(adapter_ops, "EAGER_PATH", False)  # the custom ops' table of kept pullbacks
    gc.collect()
    base = pnt.saved_pullbacks()
    x, w, b = _t(3, 4), _t(4), _t(4)
    y = pnt.layer_norm(x, w, b)
    assert pnt.saved_pullbacks() == base + 1
    y.sum().backward()
    assert pnt.saved_pullbacks() == base  # released with autograd's saved tensors
    y = pnt.layer_norm(x, w, b)
    torch.autograd.grad(y.sum(), x, retain_graph=True)
    del y
    assert pnt.saved_pullbacks() == base  # retained graph freed: no reference cycle through the table
    pnt.layer_norm(x, w, b)
    with torch.no_grad():
        pnt.layer_norm(x, w, b)
    pnt.layer_norm(x.detach(), w.detach(), b.detach())
    assert pnt.saved_pullbacks() == base


def test_direct_op_call_without_wrt_recomputes_in_backward():
    x, w, b = _t(3, 4), _t(5, 4), _t(5)
    y, handle = torch.ops.portable_nn.dense(x, w, b, "gelu", 0.01)
    assert int(handle) == -1
    grads = torch.autograd.grad(y.sum(), (x, w, b))
    expected = torch.autograd.grad(F.gelu(F.linear(x, w, b)).sum(), (x, w, b))
    for g, e in zip(grads, expected):
        assert _rel(g, e) < 1e-13


def test_pullback_survives_multiple_backward_calls():
    x, h, c = _t(2, 3), _t(2, 2), _t(2, 2, seed=5)
    wi, wh = _t(8, 3), _t(8, 2)
    h1, c1 = pnt.lstm_cell(x, h, c, wi, wh)
    first = torch.autograd.grad(h1.sum(), (x, wi), retain_graph=True)
    second = torch.autograd.grad(c1.sum(), (x, wi), retain_graph=True)  # only c' used: dh' is zero
    both = torch.autograd.grad((h1.sum(), c1.sum()), (x, wi))
    ref_h, ref_c = torch.lstm_cell(x, (h, c), wi, wh)
    expected = torch.autograd.grad((ref_h.sum(), ref_c.sum()), (x, wi))
    for f, s, g, e in zip(first, second, both, expected):
        assert _rel(f + s, e) < 1e-13 and _rel(g, e) < 1e-13


def test_batch_norm_functional_forms():
    x, w, b = _t(6, 3, 2), _t(3), _t(3)
    rm, rv = torch.zeros(3, dtype=DT), torch.ones(3, dtype=DT)
    y, new_mean, new_var = pnt.batch_norm(x, weight=w, bias=b, running_mean=rm, running_var=rv, momentum=0.3,
                                          return_stats=True)
    assert torch.equal(rm, torch.zeros(3, dtype=DT))  # nothing mutated
    erm, erv = rm.clone(), rv.clone()
    expected = F.batch_norm(x, erm, erv, w, b, training=True, momentum=0.3)
    assert _rel(y, expected) < 1e-13 and _rel(new_mean, erm) < 1e-13 and _rel(new_var, erv) < 1e-13
    y2 = pnt.batch_norm(x, weight=w, bias=b, running_mean=rm, running_var=rv, momentum=0.3)  # in place
    assert _rel(y2, expected) < 1e-13 and _rel(rm, erm) < 1e-13 and _rel(rv, erv) < 1e-13
    assert rm.grad_fn is None and not rm.requires_grad
    ye, m2, v2 = pnt.batch_norm(x, weight=w, bias=b, running_mean=rm, running_var=rv, training=False, return_stats=True)
    assert m2 is rm and v2 is rv
    assert _rel(ye, F.batch_norm(x, rm, rv, w, b, training=False)) < 1e-13


# =========================================================================== modules: state_dict interchange


def _module_pairs():
    """(id, our constructor, torch.nn constructor, input shape)."""
    return [
        ("LayerNorm", lambda m: m.LayerNorm((3, 4), eps=1e-4), (2, 5, 3, 4)),
        ("LayerNorm_nobias", lambda m: m.LayerNorm(4, bias=False), (3, 4)),
        ("LayerNorm_noaffine", lambda m: m.LayerNorm(4, elementwise_affine=False), (3, 4)),
        ("RMSNorm", lambda m: m.RMSNorm(4), (2, 3, 4)),
        ("RMSNorm_eps", lambda m: m.RMSNorm([3, 4], eps=1e-3, elementwise_affine=False), (2, 3, 4)),
        ("GroupNorm", lambda m: m.GroupNorm(2, 4, eps=1e-3), (2, 4, 5)),
        ("GroupNorm_noaffine", lambda m: m.GroupNorm(4, 4, affine=False), (2, 4, 2, 3)),
        ("BatchNorm1d_2d", lambda m: m.BatchNorm1d(4), (6, 4)),
        ("BatchNorm1d_3d", lambda m: m.BatchNorm1d(4, momentum=0.3, bias=False), (3, 4, 5)),
        ("BatchNorm2d", lambda m: m.BatchNorm2d(3), (2, 3, 4, 5)),
        ("BatchNorm2d_cma", lambda m: m.BatchNorm2d(3, momentum=None), (2, 3, 2, 3)),
        ("BatchNorm2d_untracked", lambda m: m.BatchNorm2d(3, track_running_stats=False), (2, 3, 2, 3)),
        ("BatchNorm3d_noaffine", lambda m: m.BatchNorm3d(2, affine=False, eps=1e-3), (2, 2, 2, 3, 2)),
        ("InstanceNorm1d", lambda m: m.InstanceNorm1d(3), (2, 3, 5)),
        ("InstanceNorm1d_unbatched", lambda m: m.InstanceNorm1d(3, affine=True), (3, 5)),
        ("InstanceNorm2d_tracked", lambda m: m.InstanceNorm2d(3, affine=True, track_running_stats=True),
         (2, 3, 3, 4)),
        ("InstanceNorm3d_cma", lambda m: m.InstanceNorm3d(2, momentum=None, track_running_stats=True),
         (2, 2, 2, 3, 2)),
        ("Linear", lambda m: m.Linear(4, 5), (2, 3, 4)),
        ("Linear_nobias", lambda m: m.Linear(4, 5, bias=False), (4,)),
        ("Conv1d", lambda m: m.Conv1d(3, 4, 3, padding="same", dilation=2), (2, 3, 7)),
        ("Conv1d_unbatched", lambda m: m.Conv1d(3, 4, 2, stride=2), (3, 7)),
        ("Conv2d", lambda m: m.Conv2d(4, 6, (2, 3), stride=(2, 1), padding=1, groups=2, bias=False),
         (2, 4, 5, 6)),
        ("Conv2d_reflect", lambda m: m.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 4, 5)),
        ("Conv2d_circular", lambda m: m.Conv2d(3, 2, 3, padding=(1, 2), padding_mode="circular"), (1, 3, 4, 5)),
        ("Conv1d_same_replicate", lambda m: m.Conv1d(2, 3, 4, padding="same", dilation=2, padding_mode="replicate"),
         (2, 2, 6)),
        ("Conv3d_reflect_unbatched", lambda m: m.Conv3d(2, 2, 2, stride=(1, 2, 1), padding=(1, 2, 1),
                                                        padding_mode="reflect"), (2, 3, 4, 2)),
        ("Conv3d", lambda m: m.Conv3d(2, 3, 2, padding="valid"), (2, 2, 3, 4, 3)),
        ("LSTM", lambda m: m.LSTM(3, 4, num_layers=2, bidirectional=True), (5, 2, 3)),
        ("LSTM_unbatched", lambda m: m.LSTM(3, 4, batch_first=True), (5, 3)),
        ("GRU", lambda m: m.GRU(3, 4, batch_first=True, bias=False), (2, 5, 3)),
        ("GRU_stacked", lambda m: m.GRU(3, 4, 2, dropout=0.0, bidirectional=True), (4, 2, 3)),
        ("RNN", lambda m: m.RNN(3, 4, nonlinearity="relu", num_layers=2), (4, 2, 3)),
        ("RNN_tanh", lambda m: m.RNN(3, 4, bidirectional=True, batch_first=True), (2, 4, 3)),
    ]


_PAIRS = _module_pairs()


def _out_tensors(out):
    return _outputs(out) if not isinstance(out, torch.Tensor) else [out]


def _compare(ours, theirs, x, what):
    a, b = _out_tensors(ours(x)), _out_tensors(theirs(x))
    assert len(a) == len(b)
    for u, v in zip(a, b):
        u, v = u.detach(), v.detach()
        assert (u - v).abs().max() <= 1e-12 * max(1.0, float(v.abs().max())), what
    for (name, u), (_, v) in zip(ours.named_buffers(), theirs.named_buffers()):
        assert torch.allclose(u, v, rtol=1e-12, atol=1e-14), f"{what}: buffer {name}"


@pytest.mark.parametrize("name,make,shape", _PAIRS, ids=[p[0] for p in _PAIRS])
def test_module_matches_torch_nn_and_swaps_state_dicts(name, make, shape):
    torch.manual_seed(0)
    ours = make(pnt).to(DT)
    torch.manual_seed(0)
    theirs = make(nn).to(DT)
    assert isinstance(ours, nn.Module)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (k, u), (_, v) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert u.shape == v.shape and u.dtype == v.dtype and torch.equal(u, v), f"initialisation of {k}"
    # Ours perturbed and loaded into torch.nn; then torch's (after a training step) loaded into ours.
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    theirs.load_state_dict(ours.state_dict())
    x = _t(*shape, grad=False, seed=3)
    for mode in ("train", "train", "eval"):
        ours.train(mode == "train")
        theirs.train(mode == "train")
        _compare(ours, theirs, x, f"{name} {mode}")
    theirs.train()
    theirs(x + 1)
    ours.load_state_dict(theirs.state_dict())
    ours.eval()
    theirs.eval()
    _compare(ours, theirs, x, f"{name} after loading torch.nn's state_dict")


def test_gradients_of_every_module_match_torch_nn():
    for name, make, shape in _PAIRS:
        torch.manual_seed(1)
        ours = make(pnt).to(DT)
        theirs = make(nn).to(DT)
        theirs.load_state_dict(ours.state_dict())
        x1, x2 = _t(*shape, seed=4), _t(*shape, seed=4)
        a, b = _out_tensors(ours(x1)), _out_tensors(theirs(x2))
        weights = [_t(*t.shape, grad=False, seed=i) for i, t in enumerate(b)]
        sum(((t * g).sum() for t, g in zip(a, weights)), torch.zeros((), dtype=DT)).backward()
        sum(((t * g).sum() for t, g in zip(b, weights)), torch.zeros((), dtype=DT)).backward()
        assert _rel(x1.grad, x2.grad) < 1e-11, name
        for (k, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert _rel(p.grad, q.grad) < 1e-11, f"{name}: {k}"


@pytest.mark.parametrize("activation,torch_act", [("relu", F.relu), ("gelu", F.gelu), (("leaky_relu", 0.2),
                                                  lambda z: F.leaky_relu(z, 0.2))], ids=["relu", "gelu", "leaky"])
def test_fused_activation_modules(activation, torch_act):
    x = _t(2, 3, 5, 4, grad=False)
    for ours, theirs in (
        (pnt.Conv2d(3, 4, 3, padding="same", activation=activation), nn.Conv2d(3, 4, 3, padding="same")),
        (pnt.Linear(4, 3, activation=activation), nn.Linear(4, 3)),
        (pnt.BatchNorm2d(3, activation=activation), nn.BatchNorm2d(3)),
        (pnt.GroupNorm(3, 3, activation=activation), nn.GroupNorm(3, 3)),
        (pnt.InstanceNorm2d(3, activation=activation), nn.InstanceNorm2d(3)),
        (pnt.LayerNorm(4, activation=activation), nn.LayerNorm(4)),
    ):
        ours, theirs = ours.to(DT), theirs.to(DT)
        theirs.load_state_dict(ours.state_dict())
        assert _rel(ours(x), torch_act(theirs(x))) < 1e-12, type(ours).__name__
        assert "activation=" in repr(ours)


def test_channels_last_modules():
    x = _t(2, 3, 4, 5, grad=False)
    last = x.permute(0, 2, 3, 1)
    for ours, theirs in (
        (pnt.BatchNorm2d(3, channel_axis=-1), nn.BatchNorm2d(3)),
        (pnt.GroupNorm(3, 3, channel_axis=-1), nn.GroupNorm(3, 3)),
        (pnt.InstanceNorm2d(3, affine=True, channel_axis=-1), nn.InstanceNorm2d(3, affine=True)),
        (pnt.Conv2d(3, 4, 3, padding=1, channel_axis=-1), nn.Conv2d(3, 4, 3, padding=1)),
    ):
        ours, theirs = ours.to(DT), theirs.to(DT)
        theirs.load_state_dict(ours.state_dict())
        assert _rel(ours(last), theirs(x).permute(0, 2, 3, 1)) < 1e-12, type(ours).__name__


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
def test_channels_last_conv_modules_with_every_padding_mode(mode):
    """Output and gradients (input, weight, bias) of channels-last convolutions against torch.nn's on
    channels-first data, for each padding_mode (the op pads; torch.nn pads with F.pad)."""
    for ours, theirs, shape in (
        (pnt.Conv1d(3, 2, 3, stride=2, padding=2, padding_mode=mode, channel_axis=-1),
         nn.Conv1d(3, 2, 3, stride=2, padding=2, padding_mode=mode), (2, 3, 5)),
        (pnt.Conv2d(3, 4, (3, 2), padding="same", dilation=(1, 2), padding_mode=mode, channel_axis=-1),
         nn.Conv2d(3, 4, (3, 2), padding="same", dilation=(1, 2), padding_mode=mode), (2, 3, 4, 5)),
        (pnt.Conv3d(2, 2, 2, padding=(1, 0, 2), groups=2, padding_mode=mode, channel_axis=-1),
         nn.Conv3d(2, 2, 2, padding=(1, 0, 2), groups=2, padding_mode=mode), (2, 3, 2, 3)),  # unbatched
    ):
        ours, theirs = ours.to(DT), theirs.to(DT)
        theirs.load_state_dict(ours.state_dict())
        assert f"padding_mode={mode}" in repr(ours) or mode == "zeros"
        channel = 1 if len(shape) == ours.weight.ndim else 0  # batched or not
        x = _t(*shape, seed=7)
        last = x.detach().movedim(channel, -1).requires_grad_()
        y_ours, y_theirs = ours(last).movedim(-1, channel), theirs(x)
        assert _rel(y_ours, y_theirs) < 1e-12, (mode, type(ours).__name__)
        dy = _t(*y_theirs.shape, grad=False, seed=8)
        (y_ours * dy).sum().backward()
        (y_theirs * dy).sum().backward()
        assert _rel(last.grad.movedim(-1, channel), x.grad) < 1e-12, (mode, type(ours).__name__)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert _rel(p.grad, q.grad) < 1e-12, (mode, type(ours).__name__)


def test_recurrent_modules_with_packed_sequences_and_lengths():
    torch.manual_seed(2)
    lengths = torch.tensor([2, 5, 3])
    for cls in ("LSTM", "GRU", "RNN"):
        ours = getattr(pnt, cls)(3, 4, num_layers=2, bidirectional=True, batch_first=True).to(DT)
        theirs = getattr(nn, cls)(3, 4, num_layers=2, bidirectional=True, batch_first=True).to(DT)
        theirs.load_state_dict(ours.state_dict())
        x1, x2 = _t(3, 5, 3), _t(3, 5, 3)
        h0 = _t(4, 3, 4, grad=False)
        hx = (h0, h0 * 0.5) if cls == "LSTM" else h0
        packed1 = nn.utils.rnn.pack_padded_sequence(x1, lengths, batch_first=True, enforce_sorted=False)
        packed2 = nn.utils.rnn.pack_padded_sequence(x2, lengths, batch_first=True, enforce_sorted=False)
        (o1, s1), (o2, s2) = ours(packed1, hx), theirs(packed2, hx)
        assert isinstance(o1, nn.utils.rnn.PackedSequence)
        assert torch.equal(o1.batch_sizes, o2.batch_sizes) and torch.equal(o1.sorted_indices, o2.sorted_indices)
        for a, b in zip(_outputs((o1.data, s1)), _outputs((o2.data, s2))):
            assert _rel(a, b) < 1e-12, cls
        (o1.data.sum() + _outputs(s1)[0].sum()).backward()
        (o2.data.sum() + _outputs(s2)[0].sum()).backward()
        assert _rel(x1.grad, x2.grad) < 1e-11, cls
        # The same through lengths= on the padded batch.
        o3, _ = ours(x1.detach(), hx, lengths=lengths)
        padded, _ = nn.utils.rnn.pad_packed_sequence(o2, batch_first=True)
        assert _rel(o3, padded) < 1e-12, cls


def test_recurrent_dropout_between_layers_follows_torch():
    torch.manual_seed(3)
    ours = pnt.LSTM(3, 4, num_layers=3, dropout=0.4).to(DT)
    theirs = nn.LSTM(3, 4, num_layers=3, dropout=0.4).to(DT)
    theirs.load_state_dict(ours.state_dict())
    x = _t(5, 2, 3, grad=False)
    torch.manual_seed(7)
    a, (ha, ca) = ours(x)
    torch.manual_seed(7)
    b, (hb, cb) = theirs(x)
    assert _rel(a, b) < 1e-12 and _rel(ha, hb) < 1e-12 and _rel(ca, cb) < 1e-12
    ours.eval()
    theirs.eval()
    assert _rel(ours(x)[0], theirs(x)[0]) < 1e-12
    assert not torch.allclose(ours(x)[0], a)


def test_gru_reset_before_form():
    """reset_after=False, checked against the recurrence written out with torch ops."""
    gru = pnt.GRU(3, 4, reset_after=False).to(DT)
    x = _t(5, 2, 3, grad=False)
    out, h_n = gru(x)
    w_ih, w_hh, b_ih, b_hh = gru.weight_ih_l0, gru.weight_hh_l0, gru.bias_ih_l0, gru.bias_hh_l0
    h = torch.zeros(2, 4, dtype=DT)
    expected = []
    for x_t in x:
        gi = x_t @ w_ih.T + b_ih
        r = torch.sigmoid(gi[:, :4] + h @ w_hh[:4].T + b_hh[:4])
        z = torch.sigmoid(gi[:, 4:8] + h @ w_hh[4:8].T + b_hh[4:8])
        n = torch.tanh(gi[:, 8:] + (r * h) @ w_hh[8:].T + b_hh[8:])
        h = (1 - z) * n + z * h
        expected.append(h)
    assert _rel(out, torch.stack(expected)) < 1e-12 and _rel(h_n[0], h) < 1e-12
    assert "reset_after=False" in repr(gru)


def test_unsupported_arguments_raise_not_implemented():
    with pytest.raises(ValueError, match="channel_axis"):
        pnt.BatchNorm2d(3, channel_axis=2)
    with pytest.raises(ValueError, match="nonlinearity"):
        pnt.RNN(3, 4, nonlinearity="gelu")
    with pytest.raises(ValueError, match="LayerNorm"):
        pnt.LayerNorm(4)(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="4D"):
        pnt.BatchNorm2d(3)(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="hx should also be 2-D"):
        pnt.GRU(3, 4)(torch.zeros(5, 3), torch.zeros(1, 2, 4))


# =========================================================================== training and torch.compile


class _Net(nn.Module):
    """conv → batch norm → relu → LSTM over the width → linear, built from a module namespace."""

    def __init__(self, m):
        super().__init__()
        self.conv = m.Conv2d(1, 3, 3, padding=1)
        self.bn = m.BatchNorm2d(3)
        self.lstm = m.LSTM(3 * 4, 5, batch_first=True)
        self.fc = m.Linear(5, 2)

    def forward(self, x):
        z = F.relu(self.bn(self.conv(x)))                 # (N, 3, 4, W)
        seq = z.flatten(1, 2).transpose(1, 2)             # (N, W, 12)
        out, (h, _) = self.lstm(seq)
        return self.fc(out[:, -1] + h[0])


def test_training_twenty_sgd_steps_matches_torch_nn():
    torch.manual_seed(4)
    ours = _Net(pnt).to(DT)
    theirs = _Net(nn).to(DT)
    theirs.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 1, 4, 6, dtype=DT, generator=gen), torch.randint(0, 2, (4,), generator=gen))
            for _ in range(20)]
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, label in data:
            opt.zero_grad()
            F.cross_entropy(model(x), label).backward()
            opt.step()
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        if a.is_floating_point():
            assert _rel(a, b) <= 1e-8, k
        else:
            assert torch.equal(a, b), k
    assert int(ours.bn.num_batches_tracked) == 20


def _recording_backend(seen):
    """aot_eager that records the ops of the forward and backward graphs AOTAutograd builds."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def recorder(kind):
        def compiler(gm, example_inputs):
            seen[kind].extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))


def test_torch_compile_keeps_our_ops_in_one_graph():
    """fullgraph=True fails on any graph break; our ops sit in the forward and backward graphs as custom
    ops (the in-place batch norm decomposed into its functional op); results match eager."""
    torch._dynamo.reset()
    torch.manual_seed(6)
    model = _Net(pnt).to(DT)
    eager = _Net(pnt).to(DT)
    eager.load_state_dict(model.state_dict())
    seen = {"forward": [], "backward": []}
    compiled = torch.compile(model, backend=_recording_backend(seen), fullgraph=True)
    x, label = _t(3, 1, 4, 5, grad=False), torch.tensor([0, 1, 1])
    gc.collect()
    base = pnt.saved_pullbacks()
    for _ in range(2):
        loss_c = F.cross_entropy(compiled(x), label)
        # The compiled forward kept our kernels' pullbacks (conv, batch norm, lstm, dense) for its backward.
        assert pnt.saved_pullbacks() == base + 4
        loss_e = F.cross_entropy(eager(x), label)
        loss_c.backward()
        loss_e.backward()
        assert pnt.saved_pullbacks() == base
        assert _rel(loss_c, loss_e) < 1e-12
    for (k, p), q in zip(model.named_parameters(), eager.parameters()):
        assert _rel(p.grad, q.grad) < 1e-10, k
    assert torch.allclose(model.bn.running_mean, eager.bn.running_mean, rtol=1e-12)
    assert int(model.bn.num_batches_tracked) == 2
    ours = [t for t in seen["forward"] if t.startswith("portable_nn.")]
    assert ours == ["portable_nn.conv.default", "portable_nn.batch_norm.default", "portable_nn.lstm.default",
                    "portable_nn.dense.default"], seen["forward"]
    backward = sorted(t for t in seen["backward"] if t.startswith("portable_nn."))
    assert backward == sorted(f"portable_nn.{n}_backward.default" for n in ("conv", "batch_norm", "lstm", "dense"))


def test_torch_compile_functions():
    torch._dynamo.reset()

    def f(x, w, b, target):
        z = pnt.max_pool(pnt.conv(x, w, b, padding="same", activation="tanh"), 2)
        z = pnt.group_norm(z, 2, activation="silu")
        return pnt.cross_entropy(z.flatten(1), target, label_smoothing=0.1)

    x, w, b = _t(2, 3, 4, 4), _t(4, 3, 3, 3), _t(4)
    target = torch.tensor([1, 5])
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(x, w, b, target)
    expected = f(x, w, b, target)
    grads = torch.autograd.grad(got, (x, w, b))
    ref = torch.autograd.grad(expected, (x, w, b))
    assert _rel(got, expected) < 1e-13
    for g, r in zip(grads, ref):
        assert _rel(g, r) < 1e-12


def test_torch_compile_dynamic_shapes():
    """dynamic=True: the fakes (the op itself on the reference, on fake tensors) take symbolic sizes, and a
    second call with other sizes gives the eager results."""
    torch._dynamo.reset()

    def f(x, w, seq, params, logits, target):
        z = pnt.max_pool(pnt.conv(x, w, padding=1, stride=2, activation="relu"), 3, stride=2, ceil_mode=True)
        out, (h, c) = pnt.lstm(seq, params)
        return z.sum() + out.sum() + h.sum() + c.sum() + pnt.cross_entropy(logits, target, reduction="none").sum()

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    params = [(_t(16, 3), _t(16, 4), None, None)]
    for n, hw, t in ((2, 9, 5), (3, 13, 7)):
        args = (_t(n, 3, hw, hw + 2), _t(4, 3, 3, 3), _t(t, n, 3), params, _t(n + 4, 5),
                torch.arange(n + 4) % 5)
        got, expected = compiled(*args), f(*args)
        assert _rel(got, expected) < 1e-12
        grads = torch.autograd.grad(got, (args[0], args[1]))
        ref = torch.autograd.grad(expected, (args[0], args[1]))
        assert all(_rel(g, r) < 1e-11 for g, r in zip(grads, ref))


def test_functions_are_generated_from_the_op_descriptions():
    """Each function has the op's signature, defaults and documentation; its custom op's schema comes
    from the argument kinds (nothing written per op)."""
    import inspect

    from portable_nn.api._common import all_specs

    for spec in all_specs():
        fn = getattr(pnt, spec.name)
        assert inspect.signature(fn) == inspect.signature(getattr(pnn, spec.name)), spec.name
        assert f":func:`portable_nn.{spec.name}`" in fn.__doc__
        assert spec.doc.partition("\n")[2].strip() in fn.__doc__
        schema = getattr(torch.ops.portable_nn, spec.name).default._schema
        given = [a.name for a in schema.arguments][:-1]  # the trailing wrt mask is the adapter's
        assert set(given) >= set(spec.arrays) - {"params"}, spec.name


@pytest.mark.slow
def test_torch_compile_inductor():
    """Inductor checks the fake implementations' shapes and strides against the real outputs."""
    torch._dynamo.reset()
    torch.manual_seed(6)
    model = _Net(pnt).to(DT)
    eager = _Net(pnt).to(DT)
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x, label = _t(3, 1, 4, 5, grad=False), torch.tensor([0, 1, 1])
    loss_c = F.cross_entropy(compiled(x), label)
    loss_e = F.cross_entropy(eager(x), label)
    loss_c.backward()
    loss_e.backward()
    assert _rel(loss_c, loss_e) < 1e-12
    for (k, p), q in zip(model.named_parameters(), eager.parameters()):
        assert _rel(p.grad, q.grad) < 1e-10, k


def test_gradient_of_class_weights_is_refused_like_torch():
    logits, weight = _t(5, 4), _t(4, grad=True)
    loss = pnt.cross_entropy(logits, torch.tensor([1, 0, 3, 2, 1]), weight=weight.abs())
    with pytest.raises(NotImplementedError, match="'weight'"):
        loss.backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of PyTorch and a device")
def test_cuda_tensors_match_cpu():
    torch.manual_seed(8)
    cpu = _Net(pnt).to(DT)
    gpu = _Net(pnt).to(DT).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, label = _t(3, 1, 4, 5, grad=False), torch.tensor([0, 1, 1])
    loss_c = F.cross_entropy(cpu(x), label)
    loss_g = F.cross_entropy(gpu(x.cuda()), label.cuda())
    loss_c.backward()
    loss_g.backward()
    assert _rel(loss_g.cpu(), loss_c) < 1e-10
    # The conv bias feeds a training batch norm: its exact gradient is 0 and each device returns its
    # own rounding noise (~1e-17), so every gradient is measured against the largest of them all.
    scale = max(float(q.grad.abs().max()) for q in cpu.parameters())
    for (k, p), q in zip(gpu.named_parameters(), cpu.parameters()):
        assert float((p.grad.cpu() - q.grad).abs().max()) <= 1e-9 * scale, k
    assert _rel(gpu.bn.running_var.cpu(), cpu.bn.running_var) < 1e-12


# =========================================================================== the fast path


def _step(make, x_shape, seed=3):
    """A module's forward and backward: (output, input grad, parameter grads, buffers after)."""
    torch.manual_seed(seed)
    module = make().to(DT)
    x = _t(*x_shape)
    y = module(x)
    y = y[0] + 2 * y[1] if isinstance(y, tuple) else y  # (a cell's (h, c))
    (y * y).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in module.parameters()), *module.buffers()]


_MODULES = [
    ("LayerNorm", lambda: pnt.LayerNorm(6, activation="gelu"), (3, 6)),
    ("RMSNorm", lambda: pnt.RMSNorm(6), (3, 6)),
    ("BatchNorm2d", lambda: pnt.BatchNorm2d(4, activation="silu"), (2, 4, 3, 3)),
    ("GroupNorm", lambda: pnt.GroupNorm(2, 4), (2, 4, 5)),
    ("Linear", lambda: pnt.Linear(6, 5), (3, 6)),
    ("Conv2d", lambda: pnt.Conv2d(4, 3, 3, padding=1), (2, 4, 5, 5)),
    ("LSTMCell", lambda: pnt.LSTMCell(6, 4), (3, 6)),
]


@pytest.mark.parametrize(("name", "make", "shape"), _MODULES, ids=[m[0] for m in _MODULES])
def test_modules_on_the_fast_path_match_the_full_path_bitwise(name, make, shape):
    """A module's repeated steps take the plan of their signature (portable_nn.plans) and give the full
    path's values, gradients and running statistics bit for bit."""
    from portable_nn import plans

    plans.set_cache_size(0)
    try:
        full = _step(make, shape)
    finally:
        plans.set_cache_size(plans.DEFAULT_CACHE_SIZE)
    _step(make, shape)
    before = plans.cache_info()
    fast = _step(make, shape)
    after = plans.cache_info()
    assert after.hits > before.hits and after.misses == before.misses, "the second step missed its plans"
    for f, g in zip(full, fast):
        assert (f is None) == (g is None) and (f is None or torch.equal(f, g))


def test_functions_without_gradients_take_the_fast_path_as_the_full_path():
    from portable_nn import plans

    x, w, b = _t(3, 6, grad=False), _t(6, grad=False), _t(6, grad=False)
    plans.set_cache_size(0)
    try:
        full = pnt.layer_norm(x, w, b, activation="tanh")
    finally:
        plans.set_cache_size(plans.DEFAULT_CACHE_SIZE)
    pnt.layer_norm(x, w, b, activation="tanh")
    before = plans.cache_info().hits
    fast = pnt.layer_norm(x, w, b, activation="tanh")
    assert plans.cache_info().hits > before and torch.equal(full, fast) and fast.grad_fn is None
    with torch.no_grad():
        assert torch.equal(pnt.layer_norm(x.requires_grad_(), w, b, activation="tanh"), full)
