"""Numba-CUDA recurrent kernels (``kernels_gpu/numba_cuda/rnn.py``), verified without a GPU and on one.

* declarations: the six ops' ``numba_cuda`` support (registered here for the tests' duration, exactly
  as ``kernels_gpu/numba_cuda/__init__.py`` declares them, when that file does not yet);
* PTX: every kernel of the module compiles for each dtype variant's explicit signature at sm_80, and
  at sm_90 (float32 by default, float64 with ``-m slow``);
* simulator: ``_rnn_sim_checks.py`` runs in a subprocess with
  ``NUMBA_ENABLE_CUDASIM=1``, each case through dispatch (``pnn.vjp``) on the module's entry
  points, compared with the float64 reference;
* ``-m gpu``: every op and gradient forced onto ``numba_cuda`` with CuPy arrays (and one with CUDA
  torch tensors) against the float64 reference, ``explain`` confirming the backend.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import dispatch

from . import _rnn_sim_checks as sim
from .numba_cuda_testing import (  # noqa: F401  (fixture)
    HAS_NUMBA_CUDA,
    assert_compiles_to_ptx,
    assert_simulated,
    needs_numba_cuda,
    run_simulator,
    target_device,
)

OPS = (*sim.CELLS, *sim.SEQUENCES)


# --------------------------------------------------------------------------- declarations


def _ours(op):
    return next((i for i in dispatch.implementations(op) if i.backend == "numba_cuda"), None)


@pytest.mark.parametrize("op", OPS)
def test_declared_support(op):
    impl = _ours(op)
    assert impl is not None, f"{op} is not declared on numba_cuda (kernels_gpu/numba_cuda/__init__.py)"
    s = impl.supports
    assert s.families == ("cupy", "torch") and s.devices == ("cuda",) and s.native == "cupy" and s.contiguous
    assert set(s.dtypes) == {"float32", "float64"} and not s.mixed_precision
    assert impl.backward is not None
    kind = "cell" if op in sim.CELLS else "sequence"
    assert impl.forward == f"kernels_gpu.numba_cuda.rnn:{kind}_forward"
    assert impl.backward == f"kernels_gpu.numba_cuda.rnn:{kind}_backward"


def test_declared_entry_points_exist():
    if not HAS_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    from kernels_gpu.numba_cuda import rnn

    for op in OPS:
        impl = _ours(op)
        for ref in (impl.forward, impl.backward):
            assert callable(getattr(rnn, ref.split(":")[1]))


def test_without_a_gpu_forcing_raises_and_auto_falls_back():
    if pnn.available_backends()["numba_cuda"]:
        pytest.skip("a GPU is available here")
    x, params, h0, c0 = sim.sequence_args("lstm", 2, 2, 3, 2, 1, 1, "float32")
    with pnn.use_backend("numba_cuda"), pytest.raises(pnn.BackendUnavailableError, match="numba_cuda"):
        pnn.lstm(x, params, h0, c0)
    assert pnn.explain(pnn.lstm, x, params, h0, c0).backend != "numba_cuda"


# --------------------------------------------------------------------------- PTX


def _specs():
    if not HAS_NUMBA_CUDA:
        return []
    from kernels_gpu.numba_cuda import _runtime, rnn

    return [s for s in _runtime.KERNELS if s.name.startswith(rnn.__name__ + ".")]


_SPECS = _specs()


def _ptx_params():
    params = []
    for spec in _SPECS:
        short = spec.name.rsplit(".", 1)[1]
        for sig in spec.signatures:
            variant = "float32" if "float32" in sig else "float64"
            params.append(pytest.param(spec, sig, (8, 0), id=f"{short}-{variant}-sm80"))
            marks = () if variant == "float32" else (pytest.mark.slow,)
            params.append(pytest.param(spec, sig, (9, 0), marks=marks, id=f"{short}-{variant}-sm90"))
    return params


@needs_numba_cuda
def test_every_rnn_kernel_is_declared_for_both_dtypes():
    names = {s.name.rsplit(".", 1)[1]: s for s in _SPECS}
    assert {"_forward_step", "_backward_step", "_column_partials", "_fold_partials"} <= set(names)
    for name in ("_forward_step", "_backward_step", "_column_partials"):
        sigs = names[name].signatures
        assert len(sigs) == 2 and any("float32" in s for s in sigs) and any("float32" not in s for s in sigs)


@needs_numba_cuda
@pytest.mark.parametrize(("spec", "signature", "cc"), _ptx_params())
def test_rnn_kernel_compiles_to_ptx(spec, signature, cc, target_device):
    assert_compiles_to_ptx(spec, signature, cc, target_device)


# --------------------------------------------------------------------------- simulator


@pytest.fixture(scope="module")
def simulator_results():
    return run_simulator("_rnn_sim_checks.py")


@needs_numba_cuda
@pytest.mark.parametrize("case_id", sim.CASES)
def test_simulator_matches_reference(case_id, simulator_results):
    assert_simulated(simulator_results, case_id, compared=True)


@needs_numba_cuda
def test_simulator_covers_every_op_and_gradient(simulator_results):
    ops = {r["id"].split("/")[0] for r in simulator_results.values()}
    assert set(OPS) <= ops
    grads = {k for r in simulator_results.values() for k in r["errors"] if k.startswith("d")}
    assert {"dx", "dh", "dc", "dw_ih", "dw_hh", "db_ih", "db_hh", "dh0", "dc0", "dparams[3][3]"} <= grads


# --------------------------------------------------------------------------- on a GPU


def _gpu_check(op, args, kw, dtype, wrt=None):
    """Forward and every gradient of ``op`` forced onto numba_cuda (CuPy) against the float64 reference."""
    import cupy

    def to_gpu(a):
        if isinstance(a, (list, tuple)):
            return type(a)(to_gpu(v) for v in a)
        return None if a is None else cupy.asarray(a)

    def to_host(a):
        if isinstance(a, (list, tuple)):
            return type(a)(to_host(v) for v in a)
        return None if a is None else cupy.asnumpy(a)

    fn = getattr(pnn, op)
    gargs = to_gpu(args)
    vkw = {} if wrt is None else {"wrt": wrt}
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(fn, *gargs, **kw).backend == "numba_cuda"
        result, pullback = pnn.vjp(fn, *gargs, **kw, **vkw)
        ct = sim._cotangent(to_host(result), np.random.default_rng(3))
        grads = pullback(to_gpu(ct))
    with pnn.use_backend("reference"):
        result_r, pull_r = pnn.vjp(fn, *sim._to64(args), **kw, **vkw)
        grads_r = pull_r(sim._to64(ct))
    tol = {"float64": 1e-11, "float32": 5e-5}[dtype]
    for (name, a), (_, e) in zip(sim._leaves("y", to_host(result)), sim._leaves("y", result_r)):
        assert a.dtype == np.dtype(dtype)
        assert sim.rel(a, e) <= tol, name
    for field in grads_r._fields:
        mine = sim._leaves(field, to_host(getattr(grads, field)))
        ref = sim._leaves(field, getattr(grads_r, field))
        assert [n for n, _ in mine] == [n for n, _ in ref], field
        for (name, a), (_, e) in zip(mine, ref):
            assert sim.rel(a, e) <= 10 * tol, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("op", "kw", "biases", "unbatched"), [
    ("rnn_cell", {"activation": "relu"}, (True, True), False),
    ("rnn_cell", {}, (False, True), True),
    ("lstm_cell", {}, (True, True), False),
    ("gru_cell", {}, (True, False), False),
    ("gru_cell", {"reset_after": False}, (True, True), True),
])
def test_gpu_cells_match_reference(op, kw, biases, unbatched, dtype):
    _gpu_check(op, sim.cell_args(op, 5, 7, 6, dtype, biases, unbatched), kw, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("op", "kw"), [
    ("rnn", {"activation": "relu", "lengths": [5, 2, 4, 1]}),
    ("rnn", {"bidirectional": True, "batch_first": True}),
    ("lstm", {"bidirectional": True, "lengths": [3, 5, 1, 4]}),
    ("lstm", {"batch_first": True}),
    ("gru", {"bidirectional": True, "lengths": [5, 5, 2, 3]}),
    ("gru", {"reset_after": False, "bidirectional": True, "batch_first": True, "lengths": [1, 5, 4, 2]}),
])
def test_gpu_sequences_match_reference(op, kw, dtype):
    args = sim.sequence_args(op, 5, 4, 6, 8, 2, 2 if kw.get("bidirectional") else 1, dtype,
                             batch_first=kw.get("batch_first", False))
    _gpu_check(op, args, kw, dtype)


@pytest.mark.gpu
def test_gpu_lstm_on_torch_cuda_tensors_matches_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    ref = torch.nn.LSTM(6, 8, num_layers=2, bidirectional=True).double()
    x = torch.randn(5, 3, 6, dtype=torch.float64)
    expected, (h_e, c_e) = ref(x)
    params = [tuple(getattr(ref, f"{w}_l{k // 2}{'_reverse' if k % 2 else ''}").detach().cuda()
                    for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")) for k in range(4)]
    with pnn.use_backend("numba_cuda"):
        assert pnn.explain(pnn.lstm, x.cuda(), params, bidirectional=True).backend == "numba_cuda"
        y, (h_n, c_n) = pnn.lstm(x.cuda(), params, bidirectional=True)
    for a, e in ((y, expected), (h_n, h_e), (c_n, c_e)):
        assert sim.rel(a.cpu().numpy(), e.detach().numpy()) <= 1e-11
