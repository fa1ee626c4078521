"""Numba-CUDA recurrent kernels in Numba's CUDA simulator, through dispatch, against the reference.

Run as a script in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (``tests/kernel_packages/numba_cuda/test_rnn.py``
does); prints one JSON object per case: ``{"id", "errors": {output or gradient: relative error},
"tol"}``.  Under the simulator the kernels take NumPy arrays, so the module's ``cell_*``/``sequence_*``
functions are registered with :func:`portable_nn.register_kernel` under the backend name
``numba_cuda_sim`` (NumPy, CPU) — the same functions ``kernels_gpu.numba_cuda`` declares for CuPy —
and each case runs ``pnn.vjp`` with that backend forced: validation, the Call, dispatch, the
launchers, every step kernel, the array-module GEMMs, the column-sum reduction and the pullback's
cotangent handling (``None`` cotangents, ``out=`` buffers) all run.  Launch settings are tiny
(8-thread blocks, 4×4 column tiles, many row chunks) so the grid-stride and multi-chunk paths run.
The oracle is ``portable_nn.reference`` in float64 on the same (rounded) values.

``python tests/kernel_packages/numba_cuda/_rnn_sim_checks.py [substring ...]`` runs the matching cases (all without
arguments).  ``CASES`` (ids) is importable without the simulator.
"""

from __future__ import annotations

import sys

import numpy as np

try:
    from ._sim_checks import as_f64, case_registry, rel, run_cases  # imported by the tests, as part of their package
except ImportError:
    from _sim_checks import as_f64, case_registry, rel, run_cases  # run as a script: its own folder is on sys.path

#: Backend name the simulator registration uses.
SIM_BACKEND = "numba_cuda_sim"
#: Tiny launch settings: several blocks per step, two or more row chunks per bias sum (the simulator
#: runs every thread of a barrier-synchronised block as a Python thread, so chunks are kept few).
SMALL = {"block": 8, "tile_x": 4, "tile_y": 2, "target_blocks": 4, "min_chunk": 3}
#: Many small row chunks (one per row at most) for the column-sum case.
MANY_CHUNKS = {"block": 8, "tile_x": 4, "tile_y": 4, "target_blocks": 64, "min_chunk": 3}
_TOL = {"float64": 1e-11, "float32": 2e-5}
CELLS = ("rnn_cell", "lstm_cell", "gru_cell")
SEQUENCES = ("rnn", "lstm", "gru")

_REGISTRY, case = case_registry()


def register_for_simulator() -> None:
    """The kernels' entry points under ``numba_cuda_sim`` for NumPy arrays (the simulator's arrays)."""
    import portable_nn as pnn
    from portable_nn.dispatch import Support

    for op in (*CELLS, *SEQUENCES):
        kind = "cell" if op in CELLS else "sequence"
        pnn.register_kernel(op, SIM_BACKEND, forward=f"kernels_gpu.numba_cuda.rnn:{kind}_forward",
                            backward=f"kernels_gpu.numba_cuda.rnn:{kind}_backward",
                            supports=Support(families=("numpy",), devices=("cpu",), dtypes=("float32", "float64"),
                                             contiguous=True, mixed_precision=False))


# --------------------------------------------------------------------------- arguments


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _gates(op: str) -> int:
    return {"rnn": 1, "lstm": 4, "gru": 3}[op.replace("_cell", "")]


def cell_args(op, n, features, hs, dtype, biases=(True, True), unbatched=False, seed=0):
    """(args, kwargs-free) of a cell call: x, h[, c], w_ih, w_hh, b_ih, b_hh."""
    r = _rng(seed)
    g = _gates(op)
    lead = () if unbatched else (n,)
    x = r.standard_normal((*lead, features))
    states = [0.5 * r.standard_normal((*lead, hs)) for _ in range(2 if op == "lstm_cell" else 1)]
    w = [0.6 * r.standard_normal((g * hs, features)), 0.6 * r.standard_normal((g * hs, hs))]
    b = [0.3 * r.standard_normal(g * hs) if keep else None for keep in biases]
    return [None if a is None else a.astype(dtype) for a in (x, *states, *w, *b)]


def sequence_args(op, steps, n, features, hs, layers, dirs, dtype, biases=(True, True), states=True, seed=0,
                  batch_first=False, proj=0):
    """(x, params, states...) of a sequence call (``proj``: LSTM projections of that size)."""
    r = _rng(seed)
    g = _gates(op)
    out = proj or hs
    x = r.standard_normal((n, steps, features) if batch_first else (steps, n, features)).astype(dtype)
    params = []
    for layer in range(layers):
        f = features if layer == 0 else dirs * out
        for _ in range(dirs):
            entry = (0.6 * r.standard_normal((g * hs, f)), 0.6 * r.standard_normal((g * hs, out)),
                     0.3 * r.standard_normal(g * hs) if biases[0] else None,
                     0.3 * r.standard_normal(g * hs) if biases[1] else None)
            if proj:
                entry = (*entry, 0.6 * r.standard_normal((proj, hs)))
            params.append(tuple(None if a is None else a.astype(dtype) for a in entry))
    count = 2 if op == "lstm" else 1
    st = [(0.5 * r.standard_normal((layers * dirs, n, out if k == 0 else hs))).astype(dtype) if states else None
          for k in range(count)]
    return [x, params, *st]


def _to64(a):
    if isinstance(a, (list, tuple)):
        return type(a)(_to64(v) for v in a)
    return as_f64(a)


def _leaves(prefix, value):
    """(name, array) pairs of a result or gradient (nested tuples/lists flattened)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(f"{prefix}[{i}]", v)]
    return [(prefix, value)]


def _cotangent(result, rng, drop_states=False):
    """A random cotangent mirroring ``result`` (state entries ``None`` with ``drop_states``)."""
    def draw(v):
        if isinstance(v, (list, tuple)):
            return type(v)(draw(u) for u in v)
        return rng.standard_normal(v.shape).astype(v.dtype)

    ct = draw(result)
    if drop_states and isinstance(ct, tuple):
        ct = (ct[0], None)
    return ct


def vjp_check(op, args, kw, dtype, drop_states=False, wrt=None, use_out=False, settings=SMALL):
    """Forward and gradients of ``pnn.<op>`` on ``numba_cuda_sim`` against the float64 reference."""
    import portable_nn as pnn
    from kernels_gpu.numba_cuda import _runtime as rt

    fn = getattr(pnn, op)
    vkw = {} if wrt is None else {"wrt": wrt}
    with pnn.use_backend(SIM_BACKEND), rt.use_settings(**settings):
        backend = pnn.explain(fn, *args, **kw).backend
        assert backend == SIM_BACKEND, backend
        result, pullback = pnn.vjp(fn, *args, **kw, **vkw)
        ct = _cotangent(result, _rng(9), drop_states)
        if use_out:
            template = pullback(ct)
            out = {f: (None if v is None else
                       ([tuple(None if a is None else np.full_like(a, np.nan) for a in t) for t in v]
                        if isinstance(v, list) else np.full_like(v, np.nan)))
                   for f, v in zip(template._fields, template)}
            grads = pullback(ct, out=out)
            for name, buf in out.items():
                got = getattr(grads, name)
                for (_, b), (_, g) in zip(_leaves(name, buf), _leaves(name, got)):
                    assert b is g, f"{name}: out buffer not returned"
        else:
            grads = pullback(ct)
    with pnn.use_backend("reference"):
        result_r, pull_r = pnn.vjp(fn, *_to64(args), **kw, **vkw)
        grads_r = pull_r(_to64(ct))
    errors = {}
    for (name, a), (_, e) in zip(_leaves("y", result), _leaves("y", result_r)):
        assert a.dtype == np.dtype(dtype), (name, a.dtype)
        errors[name] = rel(as_f64(a), e)
    assert len(_leaves("y", result)) == len(_leaves("y", result_r))
    for field in grads_r._fields:
        mine, ref = _leaves(field, getattr(grads, field)), _leaves(field, getattr(grads_r, field))
        assert [n for n, _ in mine] == [n for n, _ in ref], (field, [n for n, _ in mine], [n for n, _ in ref])
        for (name, a), (_, e) in zip(mine, ref):
            assert a.dtype == np.dtype(dtype), (name, a.dtype)
            errors["d" + name] = rel(as_f64(a), e)
    return {"errors": errors, "tol": _TOL[dtype]}


# --------------------------------------------------------------------------- cases

for _op in CELLS:
    for _dt in ("float64", "float32"):
        case(f"{_op}/batched/{_dt}")(
            lambda op=_op, dt=_dt: vjp_check(op, cell_args(op, 3, 5, 4, dt), {}, dt))
    case(f"{_op}/unbatched-no-b_ih/float64")(
        lambda op=_op: vjp_check(op, cell_args(op, 1, 3, 4, "float64", (False, True), unbatched=True), {},
                                 "float64"))
case("rnn_cell/relu-no-biases/float64")(
    lambda: vjp_check("rnn_cell", cell_args("rnn_cell", 3, 4, 3, "float64", (False, False)),
                      {"activation": "relu"}, "float64"))
case("gru_cell/reset_before/float64")(
    lambda: vjp_check("gru_cell", cell_args("gru_cell", 3, 4, 4, "float64"), {"reset_after": False}, "float64"))
case("gru_cell/reset_before-no-b_hh/float32")(
    lambda: vjp_check("gru_cell", cell_args("gru_cell", 2, 3, 4, "float32", (True, False)),
                      {"reset_after": False}, "float32"))
case("lstm_cell/wrt-h-c-out-buffers/float64")(
    lambda: vjp_check("lstm_cell", cell_args("lstm_cell", 2, 3, 4, "float64"), {}, "float64",
                      wrt=("h", "c", "b_hh"), use_out=True))

_SEQ = {
    # name: (steps, n, features, hs, layers, dirs, kwargs, biases, states, batch_first)
    "plain": (4, 3, 3, 4, 1, 1, {}, (True, True), False, False),
    "stacked-bidir-lengths": (4, 3, 3, 3, 2, 2, {"lengths": [4, 2, 1]}, (True, True), True, False),
    "batch_first-lengths-no-b_ih": (3, 3, 2, 4, 1, 2, {"batch_first": True, "lengths": [2, 3, 1]},
                                    (False, True), True, True),
}
for _op in SEQUENCES:
    for _name, (_t, _n, _f, _h, _l, _d, _kw, _b, _s, _bf) in _SEQ.items():
        _kw = {**_kw, "bidirectional": _d == 2}
        case(f"{_op}/{_name}/float64")(
            lambda op=_op, t=_t, n=_n, f=_f, h=_h, nl=_l, d=_d, kw=_kw, b=_b, s=_s, bf=_bf: vjp_check(
                op, sequence_args(op, t, n, f, h, nl, d, "float64", b, s, batch_first=bf), kw, "float64"))
    case(f"{_op}/stacked-bidir-lengths/float32")(
        lambda op=_op: vjp_check(op, sequence_args(op, 4, 2, 3, 3, 2, 2, "float32"),
                                 {"bidirectional": True, "lengths": [3, 4]}, "float32"))
case("rnn/relu-stacked-no-state-cotangent/float64")(
    lambda: vjp_check("rnn", sequence_args("rnn", 4, 2, 3, 4, 2, 1, "float64"), {"activation": "relu"}, "float64",
                      drop_states=True))
case("gru/reset_before-stacked-bidir-lengths/float64")(
    lambda: vjp_check("gru", sequence_args("gru", 4, 3, 2, 3, 2, 2, "float64"),
                      {"reset_after": False, "bidirectional": True, "lengths": [1, 4, 3]}, "float64"))
case("gru/reset_before-batch_first-no-biases/float32")(
    lambda: vjp_check("gru", sequence_args("gru", 3, 2, 3, 4, 1, 1, "float32", (False, False), False,
                                           batch_first=True), {"reset_after": False, "batch_first": True},
                      "float32"))
case("lstm/wrt-params-out-buffers/float64")(
    lambda: vjp_check("lstm", sequence_args("lstm", 3, 2, 3, 2, 2, 2, "float64"), {"bidirectional": True},
                      "float64", wrt=("params",), use_out=True))
case("lstm/projections-stacked-bidir-lengths/float64")(
    lambda: vjp_check("lstm", sequence_args("lstm", 4, 3, 3, 4, 2, 2, "float64", proj=2),
                      {"bidirectional": True, "lengths": [4, 2, 1]}, "float64"))
case("lstm/projections-batch_first-no-biases-no-state/float32")(
    lambda: vjp_check("lstm", sequence_args("lstm", 3, 2, 3, 4, 1, 1, "float32", (False, False), False,
                                            batch_first=True, proj=3), {"batch_first": True, "lengths": [2, 3]},
                      "float32"))
case("lstm/projections-out-buffers/float64")(
    lambda: vjp_check("lstm", sequence_args("lstm", 3, 2, 3, 3, 1, 2, "float64", proj=1), {"bidirectional": True},
                      "float64", use_out=True))
case("gru/wrt-x-h0-only/float64")(
    lambda: vjp_check("gru", sequence_args("gru", 3, 2, 3, 2, 2, 1, "float64"), {"lengths": [1, 3]}, "float64",
                      wrt=("x", "h0")))
for _op in SEQUENCES:
    for _t, _n in ((0, 2), (3, 0)):
        case(f"{_op}/zero-size-T{_t}-N{_n}/float64")(
            lambda op=_op, t=_t, n=_n: vjp_check(op, sequence_args(op, t, n, 2, 3, 1, 2, "float64"),
                                                 {"bidirectional": True}, "float64"))
case("lstm_cell/zero-rows/float64")(
    lambda: vjp_check("lstm_cell", cell_args("lstm_cell", 0, 3, 2, "float64"), {}, "float64"))


@case("column_sums/multi-chunk/float32")
def _column_sums_case():
    from kernels_gpu.numba_cuda import _runtime as rt
    from kernels_gpu.numba_cuda import rnn

    a = _rng(3).standard_normal((23, 9)).astype(np.float32)
    errors = {}
    for label, settings in (("many-chunks", MANY_CHUNKS), ("one-chunk", {"block": 8, "tile_x": 32, "tile_y": 8})):
        with rt.use_settings(**settings):
            got = rnn.column_sums(a)
        assert got.dtype == np.float64
        errors[label] = rel(got, a.astype(np.float64).sum(axis=0))
    return {"errors": errors, "tol": 1e-12}


# --------------------------------------------------------------------------- entry point

#: Every case id (importable without running anything).
CASES = tuple(_REGISTRY)


def main(argv: list[str]) -> int:
    return run_cases(_REGISTRY, argv, setup=register_for_simulator)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
