"""The aten backend: declared without importing torch, what auto prefers, what it declines, determinism,
half precision, CUDA tensors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import rel_err, to_numpy

torch = pytest.importorskip("torch")

F = torch.nn.functional

pytestmark = pytest.mark.skipif(not pnn.available_backends()["aten"], reason="aten backend unavailable")



from .aten_testing import CONV_GEOMS, GATES, _conv_problem, _leaves, _seq_problem, _t  # noqa: E402


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
    assert set(rows) == {"conv", "conv_transpose", "dense", "rnn", "lstm", "gru"}
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

