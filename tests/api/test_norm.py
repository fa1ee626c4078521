"""Statistics and normalisation: moments, merge_moments and the five norms, forward and gradients.

Every norm (batch, layer, group, instance, rms) is compared with PyTorch (CPU, float64): output,
running statistics (updated in place or returned) and every gradient field of ``pnn.vjp``.  The
oracle runs on the float64 version of the very values a case converted its inputs to, so
float16/bfloat16 cases are compared fairly, with the case's tolerance (1e-10 for float64).  Each
test runs over every (array library, backend, dtype) that declares the op (``cases``) times a
pairwise argument grid; the full Cartesian grids are marked ``slow``.

Then: directional finite differences, float32 and float16/bfloat16 stability for data with a large offset, zero-size
batches, the vjp plumbing (``wrt``, ``out`` buffers, repeated and ``None`` cotangents), results
without autograd history on torch, and every validation error (type, message naming the
argument, nothing mutated).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import portable_nn as pnn
from pnn_testing import (
    assert_close,
    cases,
    directional_check,
    family_of,
    grid,
    rel_err,
    snapshot,
    to_numpy,
    unchanged,
)
from portable_nn import dispatch
from portable_nn.api._common import spec_of
from torch_oracle import TORCH_ACT, activation_arg

NORM_OPS = ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm")
HALF = ("float16", "bfloat16")

#: Grid name -> (pnn ``activation=`` argument, the same activation in PyTorch).
ACTIVATIONS = {label: (activation_arg(label), fn) for label, fn in TORCH_ACT.items() if label != "leaky_relu(-0.3)"}

#: Grid name -> (weight given, bias given, ``wrt``).
PARAMS = {
    "wb": (True, True, None),
    "none": (False, False, None),
    "w": (True, False, None),
    "wb-wrt-params": (True, True, ("weight", "bias")),
    "wb-wrt-x": (True, True, ("x",)),
}
RMS_PARAMS = {
    "w": (True, False, None),
    "none": (False, False, None),
    "w-wrt-weight": (True, False, ("weight",)),
    "w-wrt-x": (True, False, "x"),  # a single name is accepted too
}

#: How running statistics take part: none, updated in place, returned, or used (inference).
MODES = ("train", "running", "return_stats", "eval")


def _id(cfg: dict) -> str:
    fmt = {tuple: lambda v: "x".join(map(str, v)) or "scalar"}
    return "-".join(f"{k}={fmt.get(type(v), str)(v)}" for k, v in cfg.items())


def _seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode())


def op_cases(ops, *, dtype: str | None = None, libs=None, mixed: bool = True) -> list[Any]:
    """pytest params ``(op, case)`` over ``cases(op)`` for each op, optionally one dtype only."""
    return [
        pytest.param(op, p.values[0], id=f"{op}-{p.id}")
        for op in ops
        for p in cases(op, libs=libs, mixed=mixed)
        if dtype is None or p.values[0].dtype == dtype
    ]


def float64_numpy_cases(op: str) -> list[Any]:
    return [p for p in cases(op, libs=["numpy"]) if p.values[0].dtype == "float64"]


def to_layout(a: Any, channels_last: bool) -> Any:
    """A channels-first (PyTorch layout) NumPy array in the tested layout."""
    return np.moveaxis(a, 1, -1) if channels_last and a is not None else a


def from_layout(a: Any, channels_last: bool) -> Any:
    return np.moveaxis(a, -1, 1) if channels_last and a is not None else a


def assert_like(a: Any, like: Any, what: str) -> None:
    """``a`` is an array of ``like``'s library, dtype and shape (and has no autograd history)."""
    assert family_of(a) == family_of(like), f"{what}: {family_of(a)} result for {family_of(like)} input"
    assert a.dtype == like.dtype, f"{what}: dtype {a.dtype} != {like.dtype}"
    assert tuple(a.shape) == tuple(like.shape), f"{what}: shape {tuple(a.shape)} != {tuple(like.shape)}"
    if family_of(a) in ("torch", "torch_cuda"):
        assert not a.requires_grad, f"{what} has autograd history"


def norm_args(op: str, x: Any, weight: Any, bias: Any = None, num_groups: int | None = None) -> tuple[Any, ...]:
    """Positional arguments of a norm (group_norm takes ``num_groups`` second; rms_norm has no bias;
    batch and instance norm take ``weight``/``bias`` by keyword: see :func:`norm_kwargs`)."""
    if op in KEYWORD_PARAMS:
        return (x,)
    if op == "rms_norm":
        return (x, weight)
    if op == "group_norm":
        return (x, num_groups, weight, bias)
    return (x, weight, bias)


#: The norms whose ``weight`` and ``bias`` are keyword-only (PyTorch's functional forms put the running
#: statistics first, so a positional port must fail).
KEYWORD_PARAMS = ("batch_norm", "instance_norm")


def norm_kwargs(op: str, weight: Any, bias: Any = None) -> dict[str, Any]:
    """The keyword arguments that go with :func:`norm_args`."""
    return {"weight": weight, "bias": bias} if op in KEYWORD_PARAMS else {}


def grad_fields(op: str) -> tuple[str, ...]:
    return ("x", "weight") if op == "rms_norm" else ("x", "weight", "bias")


# --------------------------------------------------------------------------- PyTorch oracle


def torch_norm(
    op: str,
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    dy: np.ndarray,
    *,
    activation: str = "identity",
    running_mean: np.ndarray | None = None,
    running_var: np.ndarray | None = None,
    **kwargs: Any,
) -> tuple[np.ndarray, dict[str, Any], Any, Any]:
    """PyTorch's float64 result for a channels-first norm followed by an activation.

    Returns ``(y, grads, running_mean, running_var)``: ``grads`` maps x/weight/bias to the
    gradient of Σ dy·y (``None`` for absent parameters); the running statistics are PyTorch's
    after its in-place update (``None`` when not given).  ``kwargs``: ``training``/``momentum``
    (batch_norm), ``use_input_stats``/``momentum`` (instance_norm), ``num_groups`` (group_norm),
    ``axes`` (the normalised axes, non-negative and sorted: layer_norm, rms_norm), and ``eps``.
    """
    leaves = {
        name: None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=True)
        for name, a in (("x", x), ("weight", weight), ("bias", bias))
    }
    xt, wt, bt = leaves.values()
    rm = None if running_mean is None else torch.tensor(running_mean, dtype=torch.float64)
    rv = None if running_var is None else torch.tensor(running_var, dtype=torch.float64)
    eps = kwargs["eps"]
    if op == "batch_norm":
        z = F.batch_norm(xt, rm, rv, wt, bt, training=kwargs["training"], momentum=kwargs["momentum"], eps=eps)
    elif op == "instance_norm":
        z = F.instance_norm(
            xt, rm, rv, wt, bt, use_input_stats=kwargs["use_input_stats"], momentum=kwargs["momentum"], eps=eps
        )
    elif op == "group_norm":
        z = F.group_norm(xt, kwargs["num_groups"], wt, bt, eps=eps)
    elif op in ("layer_norm", "rms_norm"):
        # Over any axes: PyTorch's trailing-axes norm of the permutation that puts them last.
        axes = kwargs["axes"]
        order = [i for i in range(x.ndim) if i not in axes] + list(axes)
        moved = xt.permute(order)
        shape = tuple(x.shape[i] for i in axes)
        if op == "layer_norm":
            z = F.layer_norm(moved, shape, wt, bt, eps=eps)
        else:
            z = F.rms_norm(moved, shape, wt, eps=eps)
        z = z.permute([order.index(i) for i in range(x.ndim)])
    else:  # pragma: no cover
        raise AssertionError(op)
    y = ACTIVATIONS[activation][1](z)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    grads = {name: None if t is None else t.grad.numpy() for name, t in leaves.items()}
    stats = [None if r is None else r.numpy() for r in (rm, rv)]
    return y.detach().numpy(), grads, *stats


# --------------------------------------------------------------------------- one norm call vs PyTorch


@dataclass
class NormProblem:
    """One norm call to compare with PyTorch; shapes are channels-first (PyTorch's layout)."""

    op: str
    shape: tuple[int, ...]
    param_shape: tuple[int, ...]
    params: str = "wb"  # key of PARAMS (RMS_PARAMS for rms_norm)
    activation: str = "identity"
    channel_axis: int | None = None  # None: the op has no channel axis (layer/rms norm)
    mode: str = "train"  # MODES; batch_norm and instance_norm only
    num_groups: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # to both pnn and the oracle (eps, momentum)
    pnn_kwargs: dict[str, Any] = field(default_factory=dict)
    torch_kwargs: dict[str, Any] = field(default_factory=dict)


def check_against_torch(case: Any, p: NormProblem, seed: int) -> None:
    """Run ``p`` through ``pnn.vjp`` on ``case`` and compare everything with PyTorch."""
    rng = np.random.default_rng(seed)
    has_w, has_b, wrt = (RMS_PARAMS if p.op == "rms_norm" else PARAMS)[p.params]
    last = p.channel_axis == -1
    channels = p.shape[1] if p.channel_axis is not None else None

    x = case.asarray(to_layout(rng.normal(0.5, 2.0, p.shape), last))
    weight = case.param(rng.normal(1.0, 0.5, p.param_shape) if has_w else None)
    bias = case.param(rng.normal(0.0, 0.5, p.param_shape) if has_b else None)
    dy = case.asarray(to_layout(rng.standard_normal(p.shape), last))
    kwargs = dict(p.kwargs, **p.pnn_kwargs)
    torch_kwargs = dict(p.kwargs, **p.torch_kwargs)
    kwargs["activation"] = ACTIVATIONS[p.activation][0]
    if p.channel_axis is not None:
        kwargs["channel_axis"] = p.channel_axis
    running_mean = running_var = None
    if p.op in ("batch_norm", "instance_norm"):
        flag = "training" if p.op == "batch_norm" else "use_input_stats"
        kwargs[flag] = torch_kwargs[flag] = p.mode != "eval"
        if p.mode != "train":
            running_mean = case.param(rng.normal(0.0, 1.0, channels))
            running_var = case.param(rng.uniform(0.5, 2.0, channels))
            kwargs.update(running_mean=running_mean, running_var=running_var)
        if p.mode == "return_stats":
            kwargs["return_stats"] = True

    inputs = [x, weight, bias]
    before_inputs, before_stats = snapshot(inputs), snapshot([running_mean, running_var])
    with case.use():
        result, pullback = pnn.vjp(
            getattr(pnn, p.op), *norm_args(p.op, x, weight, bias, p.num_groups), **norm_kwargs(p.op, weight, bias),
            wrt=wrt, **kwargs
        )
        grads = pullback(dy)

    y_ref, grads_ref, rm_ref, rv_ref = torch_norm(
        p.op,
        from_layout(to_numpy(x), last),
        to_numpy(weight),
        to_numpy(bias),
        from_layout(to_numpy(dy), last),
        activation=p.activation,
        running_mean=before_stats[0],  # as they were before the call updated them
        running_var=before_stats[1],
        **torch_kwargs,
    )
    tol = case.tol
    assert unchanged(inputs, before_inputs), "x, weight or bias was modified"

    # Output and running statistics.
    if p.mode == "return_stats":
        assert isinstance(result, tuple) and len(result) == 3
        y, new_mean, new_var = result
        assert unchanged([running_mean, running_var], before_stats), "return_stats=True mutated the statistics"
        assert_like(new_mean, running_mean, "new running_mean")
        assert_like(new_var, running_var, "new running_var")
        assert_close(new_mean, rm_ref, tol, "returned running_mean")
        assert_close(new_var, rv_ref, tol, "returned running_var")
    else:
        y = result
        if p.mode == "running":
            assert_close(running_mean, rm_ref, tol, "running_mean updated in place")
            assert_close(running_var, rv_ref, tol, "running_var updated in place")
        else:
            assert unchanged([running_mean, running_var], before_stats), "statistics changed"
    assert_like(y, x, "y")
    assert_close(from_layout(to_numpy(y), last), y_ref, tol, "y")

    # Gradients: one field per differentiable argument; None unless given and wanted.
    fields = grad_fields(p.op)
    assert grads._fields == fields
    wanted = fields if wrt is None else (wrt,) if isinstance(wrt, str) else wrt
    for name, arg in zip(fields, inputs):
        g = getattr(grads, name)
        if arg is None or name not in wanted:
            assert g is None, f"d{name} should be None"
            continue
        assert_like(g, arg, f"d{name}")
        actual = to_numpy(g)
        if name == "x":
            actual = from_layout(actual, last)
        assert_close(actual, grads_ref[name], tol, f"d{name}")


# --------------------------------------------------------------------------- the grids

_COMMON = {"eps": 1e-3}  # not the default, so a dropped eps shows
_STATS = {"eps": 1e-3, "momentum": 0.3}


def _num_groups(shape: tuple[int, ...], which: str) -> int:
    """'one' group; 'some': the smallest proper divisor of C (else 1); 'each': one group per channel.

    Groups of a single element (x̂ = 0) are degenerate for a relative comparison and have their
    own test, so 'each' on (N, C) input falls back to 'some'.
    """
    channels = shape[1]
    if which == "one":
        return 1
    if which == "each" and len(shape) > 2:
        return channels
    return next((g for g in range(2, channels) if channels % g == 0), 1)


def _norm_axes(ndim: int, which: str) -> tuple[int | tuple[int, ...], tuple[int, ...]]:
    """(``axis`` argument, the normalised axes): -1; the last two as a tuple ((-1,) for 1-D); and
    the others where x has the axes for them — "1" the channel axis of (N, C, *), "(1,2)" a middle
    block of two, "(0,2)" a scattered set — else the trailing -1."""
    if which == "-1" or (which == "1" and ndim < 2) or (which == "(1,2)" and ndim < 4) \
            or (which == "(0,2)" and ndim < 3):
        return -1, (ndim - 1,)
    if which == "(-2,-1)":
        k = min(2, ndim)
        return tuple(range(-k, 0)), tuple(range(ndim - k, ndim))
    axes = {"1": (1,), "(1,2)": (1, 2), "(0,2)": (0, 2)}[which]
    return (axes[0] if len(axes) == 1 else axes), axes


def norm_problem(op: str, cfg: dict[str, Any]) -> NormProblem:
    """The NormProblem of a grid point (activation identity and weight+bias unless the grid says)."""
    shape = cfg["shape"]
    params, activation = cfg.get("params", "w" if op == "rms_norm" else "wb"), cfg.get("activation", "identity")
    if op in ("layer_norm", "rms_norm"):
        axis, axes = _norm_axes(len(shape), cfg["axis"])
        return NormProblem(
            op, shape, tuple(shape[i] for i in axes), params, activation,
            kwargs=_COMMON, pnn_kwargs={"axis": axis}, torch_kwargs={"axes": axes},
        )
    common = dict(params=params, activation=activation, channel_axis=cfg["channel_axis"])
    if op == "group_norm":
        groups = _num_groups(shape, cfg["groups"])
        return NormProblem(
            op, shape, (shape[1],), num_groups=groups, kwargs=_COMMON, torch_kwargs={"num_groups": groups}, **common
        )
    return NormProblem(op, shape, (shape[1],), mode=cfg["mode"], kwargs=_STATS, **common)


def check_grid_point(case: Any, op: str, cfg: dict[str, Any]) -> None:
    check_against_torch(case, norm_problem(op, cfg), _seed(op, cfg))


# Two grids per op: the *structure* grid (shapes from 1-D to 5-D with batch 1, one channel and odd
# sizes; layouts; running-statistics modes; parameters given and gradients asked for) and the
# *activation* grid (every activation in training and inference, both layouts, with and without
# weight and bias, on one shape; how running statistics are kept does not involve the activation).
# Their full Cartesian products (``slow``, times the cases) are ~10.5k items; one grid over every key
# would be ~67k items, whose mere collection would cost the default run ~9 s.
_ACTS = list(ACTIVATIONS)
_BN_SHAPES = [(5, 3), (1, 3, 5), (3, 1, 4, 2), (2, 3, 3, 2, 3)]
_IN_SHAPES = [(2, 3, 5), (1, 2, 3, 4), (3, 1, 6), (2, 3, 2, 3, 2)]
_GN_SHAPES = [(3, 6), (2, 6, 5), (1, 4, 3, 3), (3, 1, 4), (2, 6, 2, 3, 2)]
_LN_SHAPES = [(7,), (4, 5), (1, 3, 5), (3, 1, 2, 5), (2, 1, 3, 2, 3)]
_AXES = ["-1", "(-2,-1)"]

GRIDS = {
    "batch_norm": (
        {"shape": _BN_SHAPES, "channel_axis": [1, -1], "mode": list(MODES), "params": list(PARAMS)},
        {"shape": [(5, 3, 4)], "activation": _ACTS, "mode": ["train", "eval"], "channel_axis": [1, -1],
         "params": ["wb", "none"]},
    ),
    "instance_norm": (
        {"shape": _IN_SHAPES, "channel_axis": [1, -1], "mode": list(MODES), "params": list(PARAMS)},
        {"shape": [(2, 3, 6)], "activation": _ACTS, "mode": ["train", "eval"], "channel_axis": [1, -1],
         "params": ["wb", "none"]},
    ),
    "group_norm": (
        {"shape": _GN_SHAPES, "channel_axis": [1, -1], "groups": ["one", "some", "each"], "params": list(PARAMS)},
        {"shape": [(2, 6, 5)], "groups": ["some"], "activation": _ACTS, "channel_axis": [1, -1],
         "params": ["wb", "none"]},
    ),
    "layer_norm": (
        {"shape": _LN_SHAPES, "axis": _AXES, "params": list(PARAMS)},
        {"shape": [(3, 4, 5)], "activation": _ACTS, "axis": _AXES, "params": ["wb", "none"]},
    ),
    "rms_norm": ({"shape": _LN_SHAPES, "axis": _AXES, "params": list(RMS_PARAMS)},
                 {"shape": [(3, 4, 5)], "activation": _ACTS, "axis": _AXES, "params": ["w", "none"]}),
}


#: Layer and RMS norm over axes that are not the trailing ones (ConvNeXt's channels, a middle block,
#: a scattered set) on their own grid: the trailing grids above are the common case.
AXES_GRIDS = {
    "layer_norm": {"shape": [(3, 4, 5), (2, 4, 3, 5), (2, 3, 70, 7)], "axis": ["1", "(1,2)", "(0,2)"],
                   "params": ["wb", "none", "wb-wrt-params", "wb-wrt-x"], "activation": ["identity", "relu"]},
    "rms_norm": {"shape": [(3, 4, 5), (2, 4, 3, 5)], "axis": ["1", "(1,2)", "(0,2)"], "params": list(RMS_PARAMS)},
}


def structure_grid(op: str) -> list[Any]:
    return grid(GRIDS[op][0], id_fn=_id)


def activation_grid(op: str) -> list[Any]:
    return grid(GRIDS[op][1], id_fn=lambda c: _id({k: v for k, v in c.items() if k not in ("shape", "groups")}))


@pytest.mark.parametrize("case", cases("batch_norm"))
@pytest.mark.parametrize("cfg", structure_grid("batch_norm"))
def test_batch_norm_matches_torch(case, cfg):
    check_grid_point(case, "batch_norm", cfg)


@pytest.mark.parametrize("case", cases("batch_norm"))
@pytest.mark.parametrize("cfg", activation_grid("batch_norm"))
def test_batch_norm_activations_match_torch(case, cfg):
    check_grid_point(case, "batch_norm", cfg)


@pytest.mark.parametrize("case", cases("instance_norm"))
@pytest.mark.parametrize("cfg", structure_grid("instance_norm"))
def test_instance_norm_matches_torch(case, cfg):
    check_grid_point(case, "instance_norm", cfg)


@pytest.mark.parametrize("case", cases("instance_norm"))
@pytest.mark.parametrize("cfg", activation_grid("instance_norm"))
def test_instance_norm_activations_match_torch(case, cfg):
    check_grid_point(case, "instance_norm", cfg)


@pytest.mark.parametrize("case", cases("group_norm"))
@pytest.mark.parametrize("cfg", structure_grid("group_norm"))
def test_group_norm_matches_torch(case, cfg):
    check_grid_point(case, "group_norm", cfg)


@pytest.mark.parametrize("case", cases("group_norm"))
@pytest.mark.parametrize("cfg", activation_grid("group_norm"))
def test_group_norm_activations_match_torch(case, cfg):
    check_grid_point(case, "group_norm", cfg)


@pytest.mark.parametrize("case", cases("layer_norm"))
@pytest.mark.parametrize("cfg", structure_grid("layer_norm"))
def test_layer_norm_matches_torch(case, cfg):
    check_grid_point(case, "layer_norm", cfg)


@pytest.mark.parametrize("case", cases("layer_norm"))
@pytest.mark.parametrize("cfg", activation_grid("layer_norm"))
def test_layer_norm_activations_match_torch(case, cfg):
    check_grid_point(case, "layer_norm", cfg)


@pytest.mark.parametrize("case", cases("rms_norm"))
@pytest.mark.parametrize("cfg", structure_grid("rms_norm"))
def test_rms_norm_matches_torch(case, cfg):
    check_grid_point(case, "rms_norm", cfg)


@pytest.mark.parametrize("case", cases("rms_norm"))
@pytest.mark.parametrize("cfg", activation_grid("rms_norm"))
def test_rms_norm_activations_match_torch(case, cfg):
    check_grid_point(case, "rms_norm", cfg)


def check_axes_grid_point(case: Any, op: str, cfg: dict[str, Any]) -> None:
    """As :func:`check_grid_point`; a backend whose declared support declines the axes' layout (forced
    here) raises BackendUnavailableError, naming the layout, instead of running."""
    p = norm_problem(op, cfg)
    x = case.asarray(np.zeros(p.shape))
    call = spec_of(getattr(pnn, op)).prepare(x, axis=p.pnn_kwargs["axis"]).call
    impl = next(i for i in dispatch.implementations(op) if i.backend == case.backend)
    reason = impl.supports.declines(call)
    if reason is None:
        check_against_torch(case, p, _seed(op, cfg))
        return
    assert call.layout in reason
    with case.use(), pytest.raises(pnn.BackendUnavailableError, match=call.layout):
        getattr(pnn, op)(x, axis=p.pnn_kwargs["axis"])


@pytest.mark.parametrize("case", cases("layer_norm"))
@pytest.mark.parametrize("cfg", grid(AXES_GRIDS["layer_norm"], id_fn=_id))
def test_layer_norm_over_any_axes_matches_torch(case, cfg):
    check_axes_grid_point(case, "layer_norm", cfg)


@pytest.mark.parametrize("case", cases("rms_norm"))
@pytest.mark.parametrize("cfg", grid(AXES_GRIDS["rms_norm"], id_fn=_id))
def test_rms_norm_over_any_axes_matches_torch(case, cfg):
    check_axes_grid_point(case, "rms_norm", cfg)


#: Inputs of 48·24·30 = 34560 elements: above the Numba kernels' PARALLEL_MIN_ELEMENTS (2**15),
#: so their parallel forward and chunked backward run (float32, as in tests/kernel_packages/cpu/test_norm.py).
_LARGE = [
    ("batch_norm", {"channel_axis": 1, "mode": "running", "activation": "gelu"}),
    ("batch_norm", {"channel_axis": -1, "mode": "return_stats", "params": "w"}),
    ("batch_norm", {"channel_axis": -1, "mode": "eval", "activation": "relu"}),
    ("instance_norm", {"channel_axis": 1, "mode": "eval", "activation": "silu"}),
    ("instance_norm", {"channel_axis": -1, "mode": "running", "params": "wb-wrt-x"}),
    ("group_norm", {"channel_axis": 1, "groups": "some", "activation": "tanh"}),
    ("group_norm", {"channel_axis": -1, "groups": "some", "params": "wb-wrt-params"}),
    ("layer_norm", {"axis": "-1", "activation": "gelu_tanh"}),
    ("layer_norm", {"axis": "(-2,-1)", "params": "w"}),
    ("rms_norm", {"axis": "-1"}),
    ("rms_norm", {"axis": "(-2,-1)", "params": "w-wrt-weight"}),
    ("layer_norm", {"axis": "1", "activation": "silu"}),
    ("rms_norm", {"axis": "1", "params": "w-wrt-x"}),
]


def _large_params():
    return [
        pytest.param(op, cfg, p.values[0], id=f"{op}-{_id(cfg)}-{p.id}")
        for op, cfg in _LARGE
        for p in cases(op, libs=["numpy"])
        if p.values[0].dtype == "float32"
    ]


@pytest.mark.parametrize("op, cfg, case", _large_params())
def test_large_inputs_match_torch(op, cfg, case):
    cfg = dict(cfg, shape=(48, 24, 30))
    assert np.prod(cfg["shape"]) >= 1 << 15
    check_grid_point(case, op, cfg)


@pytest.mark.parametrize("case", cases("layer_norm", mixed=False))
def test_activation_objects_and_default_leaky_slope(case):
    """pnn.Activation.leaky_relu(0.2) is ('leaky_relu', 0.2); plain 'leaky_relu' has slope 0.01."""
    x = case.asarray(np.random.default_rng(7).standard_normal((4, 6)))
    with case.use():
        by_object = pnn.layer_norm(x, activation=pnn.Activation.leaky_relu(0.2))
        by_tuple = pnn.layer_norm(x, activation=("leaky_relu", 0.2))
        default = pnn.layer_norm(x, activation="leaky_relu")
        explicit = pnn.layer_norm(x, activation=("leaky_relu", 0.01))
    np.testing.assert_array_equal(to_numpy(by_object), to_numpy(by_tuple))
    np.testing.assert_array_equal(to_numpy(default), to_numpy(explicit))
    assert not np.array_equal(to_numpy(by_tuple), to_numpy(default))


@pytest.mark.parametrize("case", cases("group_norm"))
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_group_norm_groups_of_one_element(case, channel_axis):
    """(N, C) input with C groups: x̂ = 0, so y = act(bias), dx = dweight = 0 and dbias = Σ dy·act'(bias)."""
    rng = np.random.default_rng(8)
    x = case.asarray(rng.standard_normal((3, 4)))
    w, b = case.param(rng.standard_normal(4)), case.param(rng.standard_normal(4))
    dy = case.asarray(rng.standard_normal((3, 4)))
    with case.use():
        y, pullback = pnn.vjp(pnn.group_norm, x, 4, w, b, activation="tanh", channel_axis=channel_axis)
        grads = pullback(dy)
    b64, dy64 = to_numpy(b), to_numpy(dy)
    assert_like(y, x, "y")
    assert_close(y, np.broadcast_to(np.tanh(b64), (3, 4)), case.tol, "y")
    assert np.max(np.abs(to_numpy(grads.x))) <= 1e-6 and np.max(np.abs(to_numpy(grads.weight))) <= 1e-6
    assert_close(grads.bias, (dy64 * (1 - np.tanh(b64) ** 2)).sum(axis=0), case.tol, "dbias")


def test_defaults_match_torch():
    """Default eps (1e-5; rms_norm 1e-6, as DESIGN.md says) and momentum (0.1) are PyTorch's."""
    rng = np.random.default_rng(0)
    x = 1e-2 * rng.standard_normal((3, 4, 5))  # a small variance, so that eps matters (~5%)
    cw, cb, lw, lb = (rng.standard_normal(n) for n in (4, 4, 5, 5))
    stats = {op: (np.zeros(4), np.ones(4)) for op in ("batch_norm", "instance_norm")}
    torch_stats = {op: (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)) for op in stats}
    t = torch.tensor
    results = {
        "batch_norm": (
            pnn.batch_norm(x, weight=cw, bias=cb, running_mean=stats["batch_norm"][0],
                           running_var=stats["batch_norm"][1]),
            F.batch_norm(t(x), *torch_stats["batch_norm"], t(cw), t(cb), training=True),
        ),
        "instance_norm": (
            pnn.instance_norm(x, weight=cw, bias=cb, running_mean=stats["instance_norm"][0],
                              running_var=stats["instance_norm"][1]),
            F.instance_norm(t(x), *torch_stats["instance_norm"], t(cw), t(cb)),
        ),
        "group_norm": (pnn.group_norm(x, 2, cw, cb), F.group_norm(t(x), 2, t(cw), t(cb))),
        "layer_norm": (pnn.layer_norm(x, lw, lb), F.layer_norm(t(x), (5,), t(lw), t(lb))),
        "rms_norm": (pnn.rms_norm(x, lw), F.rms_norm(t(x), (5,), t(lw), eps=1e-6)),
    }
    for op, (y, expected) in results.items():
        assert_close(y, expected.numpy(), 1e-10, f"{op} with default arguments")
    for op, (rm, rv) in stats.items():
        assert_close(rm, torch_stats[op][0].numpy(), 1e-10, f"{op} running_mean with the default momentum")
        assert_close(rv, torch_stats[op][1].numpy(), 1e-10, f"{op} running_var with the default momentum")


# --------------------------------------------------------------------------- results on torch tensors


def _small(op: str) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """A small channels-first x shape, its parameter shape and num_groups."""
    if op in ("layer_norm", "rms_norm"):
        return (4, 3, 5), (5,), None
    return (4, 6, 5), (6,), 2



@pytest.mark.parametrize("op, case", op_cases(NORM_OPS, libs=["torch"]))
def test_torch_results_have_no_autograd_history(op, case):
    """Tensors that require grad give plain tensors (values as without), on every backend."""
    rng = np.random.default_rng(1)
    shape, pshape, groups = _small(op)
    x = case.asarray(rng.standard_normal(shape)).requires_grad_(True)
    w = case.param(rng.standard_normal(pshape)).requires_grad_(True)
    b = case.param(rng.standard_normal(pshape)).requires_grad_(True)
    kwargs = {}
    if op in ("batch_norm", "instance_norm"):
        kwargs = {"running_mean": case.param(np.zeros(6)), "running_var": case.param(np.ones(6)), "return_stats": True}
    with case.use():
        result = getattr(pnn, op)(*norm_args(op, x, w, b, groups), **norm_kwargs(op, w, b), **kwargs)
        plain = getattr(pnn, op)(*norm_args(op, x.detach(), w.detach(), b.detach(), groups),
                                 **norm_kwargs(op, w.detach(), b.detach()), **kwargs)
        y, pullback = pnn.vjp(getattr(pnn, op), *norm_args(op, x, w, b, groups), **norm_kwargs(op, w, b), **kwargs)
        grads = pullback(torch.ones_like(y[0] if kwargs else y))
    outputs, expected = (result, plain) if kwargs else ((result,), (plain,))
    for out, ref in zip(outputs, expected):
        assert isinstance(out, torch.Tensor) and not out.requires_grad and out.grad_fn is None
        assert torch.equal(out, ref)
    for name, g in zip(grads._fields, grads):
        assert isinstance(g, torch.Tensor) and not g.requires_grad, name


def test_moments_on_torch_have_no_autograd_history():
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    (mean, var), pullback = pnn.vjp(pnn.moments, x, 0)
    dx = pullback((torch.ones(5, dtype=torch.float64), None)).x
    for out in (*pnn.moments(x, 0), mean, var, dx):
        assert isinstance(out, torch.Tensor) and not out.requires_grad and out.grad_fn is None


# --------------------------------------------------------------------------- running statistics: edge cases


@pytest.mark.parametrize("op, case", op_cases(["batch_norm", "instance_norm"]))
def test_running_stats_momentum_edges_and_inference_with_return_stats(op, case):
    """momentum=0 keeps the statistics, momentum=1 replaces them (as PyTorch); inference with
    return_stats=True returns the statistics it used and mutates nothing."""
    rng = np.random.default_rng(_seed(op, "edges"))
    x = case.asarray(rng.normal(1.0, 2.0, (3, 4, 5)))
    flag = "training" if op == "batch_norm" else "use_input_stats"
    torch_fn = F.batch_norm if op == "batch_norm" else F.instance_norm
    for momentum in (0.0, 1.0):
        rm, rv = case.param(rng.standard_normal(4)), case.param(rng.uniform(0.5, 2.0, 4))
        before = snapshot([rm, rv])
        with case.use():
            getattr(pnn, op)(x, running_mean=rm, running_var=rv, momentum=momentum)
        rm_t, rv_t = (torch.tensor(a) for a in before)
        torch_fn(torch.tensor(to_numpy(x)), rm_t, rv_t, momentum=momentum, **{flag: True})
        assert_close(rm, rm_t.numpy(), case.tol, f"running_mean, momentum={momentum}")
        assert_close(rv, rv_t.numpy(), case.tol, f"running_var, momentum={momentum}")
        if momentum == 0.0:
            assert unchanged([rm, rv], before)
    before = snapshot([rm, rv])
    with case.use():
        y, new_mean, new_var = getattr(pnn, op)(x, running_mean=rm, running_var=rv, return_stats=True, **{flag: False})
        y_plain = getattr(pnn, op)(x, running_mean=rm, running_var=rv, **{flag: False})
    assert unchanged([rm, rv], before)
    np.testing.assert_array_equal(to_numpy(new_mean), before[0])
    np.testing.assert_array_equal(to_numpy(new_var), before[1])
    np.testing.assert_array_equal(to_numpy(y), to_numpy(y_plain))


# --------------------------------------------------------------------------- directional derivatives

#: name -> (op, x shape, parameter shape, num_groups, keyword arguments); float64 NumPy.
_FD_PROBLEMS = {
    "batch_norm-train-gelu-last": ("batch_norm", (4, 5, 3), (3,), None, {"activation": "gelu", "channel_axis": -1}),
    "batch_norm-eval-silu": ("batch_norm", (3, 2, 4), (2,), None, {"activation": "silu", "training": False}),
    "instance_norm-train-tanh": ("instance_norm", (2, 3, 2, 3), (3,), None, {"activation": "tanh"}),
    "instance_norm-eval-sigmoid": (
        "instance_norm", (2, 3, 5), (3,), None, {"activation": "sigmoid", "use_input_stats": False}
    ),
    "group_norm-gelu_tanh-last": ("group_norm", (2, 3, 4, 6), (6,), 3, {"activation": "gelu_tanh", "channel_axis": -1}),
    "layer_norm-2axes-leaky": ("layer_norm", (3, 4, 5), (4, 5), None, {"activation": ("leaky_relu", 0.2),
                                                                        "axis": (-2, -1)}),
    "layer_norm-identity": ("layer_norm", (6, 7), (7,), None, {}),
    "rms_norm-2axes": ("rms_norm", (3, 4, 5), (4, 5), None, {"axis": (-2, -1)}),
}


def _fd_params():
    return [
        pytest.param(name, p.values[0], id=f"{name}-{p.id}")
        for name, problem in _FD_PROBLEMS.items()
        for p in float64_numpy_cases(problem[0])
    ]


@pytest.mark.parametrize("name, case", _fd_params())
def test_gradients_match_finite_differences(name, case):
    op, shape, pshape, groups, kwargs = _FD_PROBLEMS[name]
    rng = np.random.default_rng(_seed(name))
    kwargs = dict(kwargs)
    if kwargs.get("training") is False or kwargs.get("use_input_stats") is False:
        channels = shape[-1] if kwargs.get("channel_axis") == -1 else shape[1]
        kwargs.update(running_mean=rng.standard_normal(channels), running_var=rng.uniform(0.5, 2.0, channels))
    fields = grad_fields(op)
    args = {"x": rng.normal(0.3, 1.5, shape), "weight": rng.normal(1.0, 0.5, pshape)}
    if "bias" in fields:
        args["bias"] = rng.normal(0.0, 0.5, pshape)

    def f(**a):
        values = list(a.values())
        return getattr(pnn, op)(*norm_args(op, *values, num_groups=groups), **norm_kwargs(op, *values[1:]), **kwargs)

    dy = rng.standard_normal(shape)
    with case.use():
        _, pullback = pnn.vjp(getattr(pnn, op), *norm_args(op, *args.values(), num_groups=groups),
                              **norm_kwargs(op, *list(args.values())[1:]), **kwargs)
        grads = pullback(dy)._asdict()
        directional_check(f, args, grads, dy, directions=3)
        for one in fields:  # each gradient on its own as well
            directional_check(f, args, {one: grads[one]}, dy, directions=1, seed=1)


@pytest.mark.parametrize("correction", [0, 1])
def test_moments_gradient_matches_finite_differences(correction):
    rng = np.random.default_rng(2)
    x = rng.normal(2.0, 1.5, (4, 3, 5))
    axis = (0, 2)
    (mean, var), pullback = pnn.vjp(pnn.moments, x, axis, correction=correction)
    dmean, dvar = rng.standard_normal(mean.shape), rng.standard_normal(var.shape)
    grads = pullback((dmean, dvar))

    def f(x):
        m, v = pnn.moments(x, axis, correction=correction)
        return np.concatenate([m, v])

    directional_check(f, {"x": x}, {"x": grads.x}, np.concatenate([dmean, dvar]), directions=3)


# --------------------------------------------------------------------------- float32 stability


def _group_view(x: np.ndarray, groups: int) -> np.ndarray:
    n, c = x.shape[:2]
    return x.reshape(n, groups, (c // groups) * int(np.prod(x.shape[2:])))


#: op -> (x shape, pnn call, view of x whose ``axes`` are each statistic's elements, axes)
_STABLE = {
    "layer_norm": ((8, 512), lambda x: pnn.layer_norm(x), lambda a: a, (1,)),
    "batch_norm": ((64, 4, 8), lambda x: pnn.batch_norm(x), lambda a: a, (0, 2)),
    "group_norm": ((4, 8, 64), lambda x: pnn.group_norm(x, 2), lambda a: _group_view(a, 2), (2,)),
    "instance_norm": ((4, 4, 256), lambda x: pnn.instance_norm(x), lambda a: a, (2,)),
    "moments": ((2048, 3), lambda x: pnn.moments(x, 0), lambda a: a, (0,)),
}
_OFFSETS = {"mean1e4-std1": (1e4, 1.0), "mean100-std0.01": (100.0, 0.01)}


def _normalise(v: np.ndarray, mean: np.ndarray, var: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return ((v - mean) / np.sqrt(var + 1e-5)).reshape(shape)


def _stability_errors(op: str, x32: np.ndarray, result: Any) -> tuple[float, float]:
    """(error of ``result``, error of naive float32 E[x²] − E[x]²) against float64 on the same data.

    Normalised outputs: absolute error; moments: relative error of the variance.
    """
    shape, _, view, axes = _STABLE[op]
    v64 = view(x32.astype(np.float64))
    mean64, var64 = v64.mean(axis=axes, keepdims=True), v64.var(axis=axes, keepdims=True)
    v32 = view(x32)
    naive_mean = v32.mean(axis=axes, keepdims=True, dtype=np.float32)
    naive_var = (v32 * v32).mean(axis=axes, keepdims=True, dtype=np.float32) - naive_mean * naive_mean
    if op == "moments":
        mean, var = (to_numpy(r) for r in result)
        assert rel_err(mean, mean64.reshape(mean.shape)) <= 1e-6
        return rel_err(var, var64.reshape(var.shape)), rel_err(naive_var.reshape(var.shape), var64.reshape(var.shape))
    y64 = _normalise(v64, mean64, var64, shape)
    naive = _normalise(v32.astype(np.float64), naive_mean, naive_var, shape)
    abs_err = lambda a: float(np.max(np.abs(a - y64)))  # noqa: E731
    return abs_err(to_numpy(result)), abs_err(naive)


@pytest.mark.parametrize("offset", list(_OFFSETS))
@pytest.mark.parametrize("op, case", op_cases(list(_STABLE), dtype="float32"))
def test_float32_statistics_with_large_offset(op, case, offset):
    mean, std = _OFFSETS[offset]
    shape = _STABLE[op][0]
    x32 = np.random.default_rng(4).normal(mean, std, shape).astype(np.float32)
    x = case.asarray(x32)
    assert np.array_equal(to_numpy(x), x32)
    with case.use():
        result = _STABLE[op][1](x)
    err, naive_err = _stability_errors(op, x32, result)
    assert err <= 1e-3, f"{op}: error {err:.2e} vs the float64 result on the same data"
    assert not naive_err <= 1e-3, f"naive E[x²]−E[x]² should fail this check (error {naive_err:.2e})"


#: Significand bits after the point of each half type (its unit in the last place is 2^(e − bits)).
_HALF_BITS = {"float16": 10, "bfloat16": 7}
#: Half-precision data far from zero: mean 1e3, a spread of two float16 / one bfloat16 units in the last place.
_HALF_OFFSETS = {"float16": (1e3, 1.0), "bfloat16": (1e3, 4.0)}


def _ulp(v: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` at each |v| (float64), the smallest subnormal spacing at least."""
    bits = _HALF_BITS[dtype]
    tiny = 2.0 ** (-14 - bits) if dtype == "float16" else 2.0 ** (-126 - bits)
    e = np.floor(np.log2(np.maximum(np.abs(v), tiny)))
    return np.maximum(2.0 ** (e - bits), tiny)


def _rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` rounded to the half type ``dtype`` (to nearest even), back in float64."""
    import ml_dtypes

    return a.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("op, case", [p for d in HALF for p in op_cases([o for o in _STABLE if o != "moments"],
                                                                        dtype=d)])
def test_half_statistics_with_large_offset(op, case):
    """float16/bfloat16 data at mean 1e3, a spread of a few units in the last place: every output
    element is within one unit in the last place of the exact (float64) normalisation of the same
    data; statistics held in the data's own type — even correctly rounded ones — are not."""
    shape, _, view, axes = _STABLE[op]
    mean, std = _HALF_OFFSETS[case.dtype]
    x = case.asarray(np.random.default_rng(4).normal(mean, std, shape))
    x64 = to_numpy(x)  # the values the case holds, exactly
    with case.use():
        result = to_numpy(_STABLE[op][1](x))
    v64 = view(x64)
    mean64, var64 = v64.mean(axis=axes, keepdims=True), v64.var(axis=axes, keepdims=True)
    y64 = _normalise(v64, mean64, var64, shape)
    ulp = np.maximum(_ulp(y64, case.dtype), _ulp(result, case.dtype))
    worst = float(np.max(np.abs(result - y64) / ulp))
    assert worst <= 1.0, f"{op}: an element is {worst:.2f} units in the last place from the float64 result"
    naive = _normalise(v64, _rounded(mean64, case.dtype), _rounded(var64, case.dtype), shape)
    assert not np.all(np.abs(naive - y64) <= _ulp(y64, case.dtype)), f"{case.dtype} statistics should fail"


#: moments' reduction patterns (each a different path of the kernels): columns, rows, all axes, the
#: batch-norm statistics of NCL data, a middle axis.
_STABLE_MOMENTS = {
    "axis0": ((2048, 3), 0),
    "last": ((3, 2048), -1),
    "all": ((4096,), None),
    "batch-stats": ((64, 3, 32), (0, 2)),
    "middle": ((3, 2048, 2), 1),
}


@pytest.mark.parametrize("offset", list(_OFFSETS))
@pytest.mark.parametrize("pattern", list(_STABLE_MOMENTS))
@pytest.mark.parametrize("case", [p for p in cases("moments") if p.values[0].dtype == "float32"])
def test_float32_moments_with_large_offset_on_every_pattern(case, pattern, offset):
    """The variance of offset float32 data is as accurate as that of the same data centred, on every backend
    and reduction pattern; naive E[x²] − E[x]² in float32 is not."""
    shape, axis = _STABLE_MOMENTS[pattern]
    mean, std = _OFFSETS[offset]
    noise = np.random.default_rng(4).normal(0.0, std, shape)
    errors = []
    for shift in (0.0, mean):
        x32 = (noise + shift).astype(np.float32)
        x64 = x32.astype(np.float64)
        with case.use():
            m, v = pnn.moments(case.asarray(x32), axis)
        assert float(np.max(np.abs(to_numpy(m) - x64.mean(axis=axis)))) <= 1e-6 * max(mean, 1.0)
        errors.append(rel_err(v, x64.var(axis=axis)))
    naive = (x32 * x32).mean(axis=axis, dtype=np.float32) - x32.mean(axis=axis, dtype=np.float32) ** 2
    assert errors[1] <= max(8 * errors[0], 1e-5), f"offset {errors[1]:.2e} vs centred {errors[0]:.2e}"
    assert not rel_err(naive, x64.var(axis=axis)) <= 1e-3, "naive E[x²]−E[x]² should fail this check"


# --------------------------------------------------------------------------- zero-size batches


#: op -> layouts to try with an empty batch: channel_axis for channel norms, axis for the others.
_ZERO_LAYOUTS = {
    "batch_norm": [{"channel_axis": 1}, {"channel_axis": -1}],
    "instance_norm": [{"channel_axis": 1}, {"channel_axis": -1}],
    "group_norm": [{"channel_axis": 1}, {"channel_axis": -1}],
    "layer_norm": [{"axis": -1}, {"axis": (-2, -1)}],
    "rms_norm": [{"axis": -1}, {"axis": (-2, -1)}],
}


def _zero_params():
    return [
        pytest.param(op, layout, p.values[0], id=f"{op}-{_id(layout)}-{p.id}")
        for op, layouts in _ZERO_LAYOUTS.items()
        for layout in layouts
        for p in cases(op)
    ]


@pytest.mark.parametrize("op, layout, case", _zero_params())
def test_zero_size_batch(op, layout, case):
    """N = 0: empty y and dx, zero dweight/dbias, running statistics left alone (and returned as they were)."""
    shape = (0, 6, 5)  # channels-first: C = 6; layer/rms norm: normalised shape (5,) or (6, 5)
    if layout.get("channel_axis") == -1:
        shape = (0, 5, 6)
    pshape = (6,) if "channel_axis" in layout else shape[len(shape) - (2 if layout["axis"] == (-2, -1) else 1) :]
    x = case.asarray(np.zeros(shape))
    w, b = case.param(np.ones(pshape)), case.param(np.ones(pshape))
    rm, rv = case.param(np.arange(6.0)), case.param(np.arange(1.0, 7.0))
    kwargs = dict(layout)
    if op in ("batch_norm", "instance_norm"):
        kwargs.update(running_mean=rm, running_var=rv)
    before = snapshot([rm, rv])
    args = norm_args(op, x, w, b, num_groups=2)
    kwargs.update(norm_kwargs(op, w, b))
    with case.use():
        y, pullback = pnn.vjp(getattr(pnn, op), *args, **kwargs)
        grads = pullback(case.asarray(np.zeros(shape)))
        returned = getattr(pnn, op)(*args, **kwargs, return_stats=True) if "running_mean" in kwargs else None
    assert_like(y, x, "y")
    assert_like(grads.x, x, "dx")
    for name, arg in zip(grad_fields(op)[1:], (w, b)):
        g = getattr(grads, name)
        assert_like(g, arg, f"d{name}")
        assert not np.any(to_numpy(g)), f"d{name} of an empty batch must be zero"
    assert unchanged([rm, rv], before), "an empty batch changed the running statistics"
    if returned is not None:
        assert_like(returned[0], x, "y")
        np.testing.assert_array_equal(to_numpy(returned[1]), before[0])
        np.testing.assert_array_equal(to_numpy(returned[2]), before[1])


@pytest.mark.parametrize("case", cases("moments"))
def test_moments_zero_size_batch(case):
    x = case.asarray(np.zeros((0, 3, 4)))
    stat = "float32" if case.dtype in HALF else case.dtype
    with case.use():
        (mean, var), pullback = pnn.vjp(pnn.moments, x, (1, 2))
        dx = pullback((case.asarray(np.zeros(0), stat), None)).x
    assert tuple(mean.shape) == tuple(var.shape) == (0,)
    assert_like(dx, x, "dx")


@pytest.mark.parametrize("shape", [(4, 0, 5), (4, 6, 0), (0, 6, 5)], ids=["no-channel", "no-position", "no-sample"])
@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
@pytest.mark.parametrize("case", cases("batch_norm"))
def test_zero_size_axes_give_empty_results_and_zero_parameter_gradients(case, op, shape):
    """PyTorch's semantics on every backend: an empty output, the running statistics left as they were
    (nothing to average), an empty dx and zero gradients for the parameters, forward and backward."""
    if op == "instance_norm" and not any(i.backend == case.backend for i in dispatch.implementations(op)):
        pytest.skip(f"{case.backend} has no {op}")
    channels = shape[1]
    x = case.asarray(np.zeros(shape))
    w, b = case.param(np.ones(channels)), case.param(np.zeros(channels))
    rm, rv = case.param(np.full(channels, 0.5)), case.param(np.full(channels, 2.0))
    with case.use():
        y, pullback = pnn.vjp(getattr(pnn, op), x, weight=w, bias=b, running_mean=rm, running_var=rv)
        grads = pullback(case.asarray(np.zeros(shape)))
    assert_like(y, x, "y")
    assert_like(grads.x, x, "dx")
    for g, p in ((grads.weight, w), (grads.bias, b)):
        assert_like(g, p, "dparam")
        np.testing.assert_array_equal(to_numpy(g), 0.0)
    np.testing.assert_array_equal(to_numpy(rm), 0.5)
    np.testing.assert_array_equal(to_numpy(rv), 2.0)


@pytest.mark.parametrize("case", cases("moments"))
def test_moments_of_a_0d_array_have_an_array_gradient(case):
    """axis=None on a 0-d x: the mean is x, the variance 0, and dx an array like x (NumPy's arithmetic on
    0-d arrays gives scalars, which the reference must not hand back)."""
    x = case.asarray(np.array(3.0))
    stat = "float32" if case.dtype in HALF else case.dtype
    with case.use():
        (mean, var), pullback = pnn.vjp(pnn.moments, x, None)
        dx = pullback((case.asarray(np.array(2.0), stat), case.asarray(np.array(5.0), stat))).x
    assert_like(dx, x, "dx")
    assert type(dx) is type(x), type(dx)  # (a NumPy scalar is "like" a 0-d array by dtype and shape)
    assert float(to_numpy(mean)) == 3.0 and float(to_numpy(var)) == 0.0 and float(to_numpy(dx)) == 2.0


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("case", cases("moments"))
def test_moments_of_an_empty_reduction_are_nan(case, correction):
    """The mean and variance of nothing are NaN, as in NumPy and PyTorch (the docstring says so)."""
    x = case.asarray(np.zeros((0, 3)))
    with case.use():
        mean, var = pnn.moments(x, 0, correction=correction)
    assert tuple(mean.shape) == tuple(var.shape) == (3,)
    assert np.isnan(to_numpy(mean)).all() and np.isnan(to_numpy(var)).all()


@pytest.mark.parametrize("case", cases("moments", mixed=False))
def test_moments_with_correction_at_least_n_have_nan_variance(case):
    x = case.asarray(np.arange(6.0).reshape(1, 6))
    with case.use():
        mean, var = pnn.moments(x, 0, correction=1)
    np.testing.assert_array_equal(to_numpy(mean), np.arange(6.0))
    assert np.isnan(to_numpy(var)).all()


# --------------------------------------------------------------------------- vjp plumbing


@pytest.mark.parametrize("op, case", op_cases(NORM_OPS))
def test_pullback_repeatable_out_buffers_and_none_cotangent(op, case):
    rng = np.random.default_rng(_seed(op))
    shape, pshape, groups = _small(op)
    x = case.asarray(rng.standard_normal(shape))
    w, b = case.param(rng.standard_normal(pshape)), case.param(rng.standard_normal(pshape))
    dy = case.asarray(rng.standard_normal(shape))
    args = norm_args(op, x, w, b, groups)
    kwargs = {} if op == "rms_norm" else {"activation": "silu"}
    kwargs.update(norm_kwargs(op, w, b))
    values = dict(zip(grad_fields(op), (x, w, b)))
    buffers = {
        name: (case.asarray if name == "x" else case.param)(np.full(tuple(v.shape), 7.0)) for name, v in values.items()
    }
    with case.use():
        _, pullback = pnn.vjp(getattr(pnn, op), *args, **kwargs)
        first = pullback(dy)
        first_values = snapshot(first)
        second = pullback(dy)
        into = pullback(dy, out=buffers)
        zero = pullback(None)
    assert unchanged(first, first_values), "a later pullback call overwrote earlier gradients"
    for name in first._fields:
        a, again = to_numpy(getattr(first, name)), to_numpy(getattr(second, name))
        np.testing.assert_array_equal(a, again, err_msg=f"d{name} differs on a second call")
        assert getattr(into, name) is buffers[name], f"out[{name!r}] was not used"
        np.testing.assert_array_equal(to_numpy(buffers[name]), a, err_msg=f"out[{name!r}]")
        assert_like(getattr(zero, name), getattr(first, name), f"d{name} for a None cotangent")
        assert not np.any(to_numpy(getattr(zero, name))), f"d{name} for a None cotangent must be zero"


def test_out_buffers_may_be_a_grads_tuple_and_buffers_outside_wrt_are_ignored():
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((5, 3, 4)), rng.standard_normal(3), rng.standard_normal(3)
    dy = rng.standard_normal(x.shape)
    _, pullback = pnn.vjp(pnn.batch_norm, x, weight=w, bias=b)
    reference = pullback(dy)
    buffers = type(reference)(np.empty_like(x), np.empty_like(w), np.empty_like(b))
    got = pullback(dy, out=buffers)
    assert all(g is buf for g, buf in zip(got, buffers))
    for g, r in zip(got, reference):
        np.testing.assert_array_equal(g, r)
    _, pullback = pnn.vjp(pnn.batch_norm, x, weight=w, bias=b, wrt=("weight", "bias"))
    got = pullback(dy, out={"x": np.empty_like(x), "weight": buffers.weight})
    assert got.x is None and got.weight is buffers.weight and got.bias is not None
    np.testing.assert_array_equal(got.bias, reference.bias)


# --------------------------------------------------------------------------- moments and merge_moments

_MOMENTS_GRID = grid(
    {
        "axis": [None, 0, -1, (0, 2)],
        "keepdims": [False, True],
        "correction": [0, 1],
        "cotangent": ["both", "mean", "var"],
    },
    id_fn=_id,
)


@pytest.mark.parametrize("case", cases("moments"))
@pytest.mark.parametrize("cfg", _MOMENTS_GRID)
def test_moments_matches_numpy_and_torch(case, cfg):
    rng = np.random.default_rng(_seed(cfg))
    axis, keepdims, correction = cfg["axis"], cfg["keepdims"], cfg["correction"]
    x = case.asarray(rng.normal(3.0, 2.0, (3, 4, 5)))
    x64 = to_numpy(x)
    stat = "float32" if case.dtype in HALF else case.dtype
    with case.use():
        result, pullback = pnn.vjp(pnn.moments, x, axis, keepdims=keepdims, correction=correction)
    assert isinstance(result, tuple) and len(result) == 2
    mean, var = result
    mean_ref = np.mean(x64, axis=axis, keepdims=keepdims)
    var_ref = np.var(x64, axis=axis, ddof=correction, keepdims=keepdims)
    for got, ref, what in ((mean, mean_ref, "mean"), (var, var_ref, "var")):
        assert family_of(got) == case.lib and tuple(got.shape) == ref.shape, what
        assert str(got.dtype).endswith(stat), f"{what} dtype {got.dtype}, expected {stat}"
        assert_close(got, ref, case.tol, what)

    dmean = case.asarray(rng.standard_normal(mean_ref.shape), stat) if cfg["cotangent"] != "var" else None
    dvar = case.asarray(rng.standard_normal(var_ref.shape), stat) if cfg["cotangent"] != "mean" else None
    with case.use():
        grads = pullback((dmean, dvar))
    assert grads._fields == ("x",)
    assert_like(grads.x, x, "dx")
    xt = torch.tensor(x64, requires_grad=True)
    var_t, mean_t = torch.var_mean(xt, dim=axis, correction=correction, keepdim=keepdims)
    loss = sum(
        (t * torch.tensor(to_numpy(c))).sum() for t, c in ((mean_t, dmean), (var_t, dvar)) if c is not None
    )
    loss.backward()
    assert_close(grads.x, xt.grad.numpy(), case.tol, "dx")


def _parts(case: Any, x64: np.ndarray, split: int, counts: str) -> list[tuple[Any, Any, Any]]:
    """(n, mean, m2) of x[:split] and x[split:] over axis 0; an empty part is (0, 0, 0).

    ``counts``: Python ints, float arrays of the data's dtype, or int64 arrays (whose ratios
    must not change the statistics' dtype or precision).
    """
    parts = []
    for part in (x64[:split], x64[split:]):
        n = part.shape[0]
        if n:
            mean, var = pnn.moments(case.asarray(part), 0)
            m2 = var * n
        else:
            mean = m2 = case.asarray(np.zeros(x64.shape[1:]))
        if counts != "int":
            n = case.asarray(np.full(x64.shape[1:], float(n)), "int64" if counts == "int-array" else None)
        parts.append((n, mean, m2))
    return parts


@pytest.mark.parametrize("split", [4, 1, 0, 10])
@pytest.mark.parametrize("counts", ["int", "array", "int-array"])
@pytest.mark.parametrize("case", cases("moments", mixed=False))
def test_merge_moments_of_two_parts_equals_the_whole(case, counts, split):
    """Chan's merge: also with an empty part (n = 0, zero mean and m2), keeping the statistics' dtype."""
    x64 = np.random.default_rng(5).normal(5.0, 2.0, (10, 3))
    with case.use():
        n, mean, m2 = pnn.merge_moments(*_parts(case, x64, split, counts))
    if counts != "int":
        np.testing.assert_array_equal(to_numpy(n), np.full(3, 10.0))
    else:
        assert n == 10
    assert family_of(mean) == family_of(m2) == case.lib
    assert str(mean.dtype).endswith(case.dtype) and str(m2.dtype).endswith(case.dtype)
    assert_close(mean, x64.mean(axis=0), case.tol, "merged mean")
    assert_close(m2, x64.var(axis=0) * 10, case.tol, "merged m2")


def test_merge_moments_ignores_an_empty_part_from_moments():
    """merge_moments' docstring: 'a part with n = 0 contributes nothing' -- also when its statistics
    come from pnn.moments of an empty chunk, which are NaN (as in NumPy)."""
    x = np.random.default_rng(6).normal(1.0, 2.0, (5, 3))
    empty_mean, empty_var = pnn.moments(x[:0], 0)
    mean, var = pnn.moments(x, 0)
    _, merged_mean, merged_m2 = pnn.merge_moments((0, empty_mean, empty_var * 0), (5, mean, var * 5))
    assert_close(merged_mean, mean, 1e-12, "mean")
    assert_close(merged_m2, var * 5, 1e-12, "m2")


def test_merging_many_parts_one_by_one_equals_the_whole():
    rng = np.random.default_rng(6)
    x = rng.normal(-2.0, 3.0, (17, 2))
    total = (0, np.zeros(2), np.zeros(2))
    for lo, hi in [(0, 5), (5, 6), (6, 6), (6, 17)]:
        mean, var = pnn.moments(x[lo:hi], 0) if hi > lo else (np.zeros(2), np.zeros(2))
        total = pnn.merge_moments(total, (hi - lo, mean, var * (hi - lo)))
    assert total[0] == 17
    assert_close(total[1], x.mean(axis=0), 1e-12, "mean")
    assert_close(total[2], x.var(axis=0) * 17, 1e-12, "m2")


# --------------------------------------------------------------------------- validation errors


def _fresh() -> SimpleNamespace:
    """Fresh float64 arrays: x (N=4, C=3, L=5) with per-channel weight/bias/running statistics."""
    rng = np.random.default_rng(9)
    return SimpleNamespace(
        x=rng.standard_normal((4, 3, 5)),
        w=rng.standard_normal(3),
        b=rng.standard_normal(3),
        rm=rng.standard_normal(3),
        rv=rng.uniform(0.5, 2.0, 3),
        lw=rng.standard_normal(5),  # layer_norm / rms_norm weight over the last axis
    )


def _bn(a, **kw):
    """batch_norm with running statistics (which must not change when it raises)."""
    return pnn.batch_norm(kw.pop("x", a.x), weight=kw.pop("w", a.w), bias=kw.pop("b", a.b),
                          running_mean=kw.pop("rm", a.rm),
                          running_var=kw.pop("rv", a.rv), **kw)


def _inorm(a, **kw):
    return pnn.instance_norm(kw.pop("x", a.x), weight=kw.pop("w", a.w), bias=kw.pop("b", a.b),
                             running_mean=kw.pop("rm", a.rm),
                             running_var=kw.pop("rv", a.rv), **kw)


_ERRORS = {
    # ranks
    "batch_norm-1d": (lambda a: _bn(a, x=a.x[0, 0, :3]), ValueError, r"x must have at least 2 dimensions"),
    "instance_norm-2d": (lambda a: _inorm(a, x=a.x[:, :, 0]), ValueError, r"x must have at least 3 dimensions"),
    "group_norm-1d": (lambda a: pnn.group_norm(a.x[0, 0], 1), ValueError, r"x must have at least 2 dimensions"),
    "layer_norm-0d": (lambda a: pnn.layer_norm(a.x[0, 0, 0:1].reshape(())), ValueError, r"x must have at least 1"),
    "rms_norm-0d": (lambda a: pnn.rms_norm(a.x[0, 0, 0:1].reshape(())), ValueError, r"x must have at least 1"),
    # parameter shapes
    "batch_norm-weight-length": (lambda a: _bn(a, w=np.ones(4)), ValueError, r"weight must have shape \(3,\)"),
    "batch_norm-bias-length": (lambda a: _bn(a, b=np.ones(2)), ValueError, r"bias must have shape \(3,\)"),
    "batch_norm-weight-2d": (lambda a: _bn(a, w=np.ones((3, 1))), ValueError, r"weight must have shape \(3,\)"),
    "batch_norm-weight-last": (lambda a: _bn(a, channel_axis=-1), ValueError, r"weight must have shape \(5,\)"),
    "instance_norm-weight-length": (lambda a: _inorm(a, w=np.ones(5)), ValueError, r"weight must have shape \(3,\)"),
    "group_norm-weight-length": (lambda a: pnn.group_norm(a.x, 3, np.ones(4)), ValueError, r"weight must have shape"),
    "layer_norm-weight-shape": (lambda a: pnn.layer_norm(a.x, a.w), ValueError, r"weight must have shape \(5,\)"),
    "layer_norm-bias-shape": (lambda a: pnn.layer_norm(a.x, a.lw, a.w), ValueError, r"bias must have shape \(5,\)"),
    "layer_norm-2axes-weight": (lambda a: pnn.layer_norm(a.x, a.lw, axis=(-2, -1)), ValueError,
                                r"weight must have shape \(3, 5\)"),
    "rms_norm-weight-shape": (lambda a: pnn.rms_norm(a.x, a.w), ValueError, r"weight must have shape \(5,\)"),
    # num_groups
    "group_norm-groups-not-dividing": (lambda a: pnn.group_norm(a.x, 2), ValueError,
                                       r"num_groups \(2\) must divide the number of channels \(3\)"),
    "group_norm-groups-zero": (lambda a: pnn.group_norm(a.x, 0), ValueError, r"num_groups must be >= 1"),
    "group_norm-groups-float": (lambda a: pnn.group_norm(a.x, 1.5), TypeError, r"num_groups must be an int"),
    # running statistics
    "running_mean-shape": (lambda a: _bn(a, rm=np.zeros(4)), ValueError, r"running_mean must have shape \(3,\)"),
    "running_var-shape": (lambda a: _bn(a, rv=np.ones((3, 1))), ValueError, r"running_var must have shape \(3,\)"),
    "instance-running_var-shape": (lambda a: _inorm(a, rv=np.ones(2)), ValueError, r"running_var must have shape"),
    "only-running_mean": (lambda a: _bn(a, rv=None), ValueError, r"running_mean was given without running_var"),
    "only-running_var": (lambda a: _bn(a, rm=None), ValueError, r"running_var was given without running_mean"),
    "instance-only-running_mean": (lambda a: _inorm(a, rv=None), ValueError, r"running_mean was given without"),
    "same-running-arrays": (lambda a: _bn(a, rv=a.rm), ValueError, r"running_mean and running_var must be different"),
    # dtypes and array types
    "integer-x": (lambda a: _bn(a, x=a.x.astype(np.int64)), TypeError, r"x must have a floating dtype"),
    "complex-x": (lambda a: _bn(a, x=a.x.astype(np.complex128)), TypeError, r"x must have a floating dtype"),
    "integer-weight": (lambda a: _bn(a, w=np.ones(3, dtype=np.int32)), TypeError, r"weight must have a floating"),
    "integer-running_mean": (lambda a: _bn(a, rm=np.zeros(3, dtype=np.int64)), TypeError, r"running_mean must have"),
    "complex-layer-x": (lambda a: pnn.layer_norm(a.x.astype(np.complex64)), TypeError, r"x must have a floating"),
    "list-x": (lambda a: _bn(a, x=a.x.tolist()), TypeError, r"x must be an array"),
    "list-weight": (lambda a: _bn(a, w=[1.0, 1.0, 1.0]), TypeError, r"weight must be an array"),
    "list-running_var": (lambda a: _bn(a, rv=[1.0, 1.0, 1.0]), TypeError, r"running_var must be an array"),
    "list-layer-x": (lambda a: pnn.layer_norm([[1.0, 2.0]]), TypeError, r"x must be an array"),
    "float64-x-float32-weight": (lambda a: _bn(a, w=a.w.astype(np.float32)), TypeError,
                                 r"weight has dtype float32 but x has float64"),
    "float32-x-float64-bias": (lambda a: _bn(a, x=a.x.astype(np.float32), w=a.w.astype(np.float32),
                                             rm=a.rm.astype(np.float32), rv=a.rv.astype(np.float32)),
                               TypeError, r"bias has dtype float64 but x has float32"),
    "float32-x-float16-running_mean": (
        lambda a: _bn(a, x=a.x.astype(np.float32), w=None, b=None, rm=a.rm.astype(np.float16),
                      rv=a.rv.astype(np.float32)),
        TypeError, r"running_mean has dtype float16 but x has float32"),
    "float16-x-float64-weight": (lambda a: pnn.layer_norm(a.x.astype(np.float16), a.lw), TypeError,
                                 r"weight has dtype float64 but x has float16"),
    "float16-x-mixed-params": (lambda a: _bn(a, x=a.x.astype(np.float16), w=a.w.astype(np.float32),
                                             b=a.b.astype(np.float16), rm=None, rv=None),
                               TypeError, r"bias has dtype float16, unlike the other parameters"),
    "rms-float32-x-float64-weight": (lambda a: pnn.rms_norm(a.x.astype(np.float32), a.lw), TypeError,
                                     r"weight has dtype float64"),
    "numpy-x-torch-weight": (lambda a: _bn(a, w=torch.tensor(a.w)), TypeError,
                             r"different libraries.*weight is"),
    "numpy-x-torch-running_var": (lambda a: _bn(a, rv=torch.tensor(a.rv)), TypeError,
                                  r"different libraries.*running_var is"),
    "torch-x-numpy-bias": (lambda a: pnn.layer_norm(torch.tensor(a.x), torch.tensor(a.lw), a.lw), TypeError,
                           r"different libraries.*bias is"),
    # scalars
    "eps-zero": (lambda a: _bn(a, eps=0.0), ValueError, r"eps must be a positive"),
    "eps-negative": (lambda a: pnn.layer_norm(a.x, eps=-1e-5), ValueError, r"eps must be a positive"),
    "eps-nan": (lambda a: pnn.group_norm(a.x, 1, eps=float("nan")), ValueError, r"eps must be a positive"),
    "rms-eps-zero": (lambda a: pnn.rms_norm(a.x, eps=0), ValueError, r"eps must be a positive"),
    "eps-string": (lambda a: _inorm(a, eps="1e-5"), TypeError, r"eps must be a positive float"),
    "momentum-negative": (lambda a: _bn(a, momentum=-0.1), ValueError, r"momentum must be in \[0, 1\]"),
    "momentum-above-one": (lambda a: _inorm(a, momentum=1.5), ValueError, r"momentum must be in \[0, 1\]"),
    "training-not-bool": (lambda a: _bn(a, training="yes"), TypeError, r"training must be True or False"),
    "return_stats-not-bool": (lambda a: _bn(a, return_stats=None), TypeError, r"return_stats must be True or False"),
    "use_input_stats-not-bool": (lambda a: _inorm(a, use_input_stats=2), TypeError, r"use_input_stats must be"),
    # activations
    "unknown-activation": (lambda a: _bn(a, activation="swish"), ValueError, r"activation: unknown activation"),
    "layer-unknown-activation": (lambda a: pnn.layer_norm(a.x, activation="Relu"), ValueError, r"activation"),
    "bad-leaky-slope": (lambda a: _bn(a, activation=("leaky_relu", float("inf"))), ValueError,
                        r"activation: leaky_relu slope"),
    "bad-activation-tuple": (lambda a: pnn.group_norm(a.x, 1, activation=("relu", 1.0)), ValueError, r"activation"),
    # axes
    "layer_norm-axis-out-of-range": (lambda a: pnn.layer_norm(a.x, axis=3), ValueError, r"axis=3 is out of range"),
    "layer_norm-weight-not-the-named-axes": (lambda a: pnn.layer_norm(a.x, a.x[0, 0], axis=1), ValueError,
                                             r"weight must .*the shape of the normalised axes of x"),
    "layer_norm-bias-not-the-named-axes": (lambda a: pnn.layer_norm(a.x, None, a.x[0, :, 0], axis=(0, 2)),
                                           ValueError, r"bias must .*the shape of the normalised axes of x"),
    "layer_norm-axes-repeated": (lambda a: pnn.layer_norm(a.x, axis=(-1, 2)), ValueError, r"axis contains repeated"),
    "rms_norm-axis-out-of-range": (lambda a: pnn.rms_norm(a.x, axis=-4), ValueError, r"axis=-4 is out of range"),
    "rms_norm-weight-not-the-named-axes": (lambda a: pnn.rms_norm(a.x, a.x[0, 0], axis=(0,)), ValueError,
                                           r"weight must .*the shape of the normalised axes of x"),
    "batch_norm-channel_axis-0": (lambda a: _bn(a, channel_axis=0), ValueError, r"channel_axis must not be 0"),
    "group_norm-channel_axis-0": (lambda a: pnn.group_norm(a.x, 1, channel_axis=0), ValueError,
                                  r"channel_axis must not be 0"),
    "instance_norm-channel_axis--3": (lambda a: _inorm(a, channel_axis=-3), ValueError, r"channel_axis must not be 0"),
    "channel_axis-out-of-range": (lambda a: _bn(a, channel_axis=3), ValueError, r"channel_axis=3 is out of range"),
    # statistics that cannot be computed or are missing
    "batch_norm-one-value-per-channel": (lambda a: _bn(a, x=a.x[:1, :, 0]), ValueError,
                                         r"x of shape \(1, 3\) has one value per channel"),
    "batch_norm-one-value-per-channel-last": (
        lambda a: _bn(a, x=a.x[:1, :1, :3], channel_axis=-1), ValueError, r"x of shape \(1, 1, 3\) has one value per"),
    "instance_norm-one-spatial-element": (lambda a: _inorm(a, x=a.x[:, :, :1]), ValueError,
                                          r"x of shape \(4, 3, 1\) has 1 spatial element"),
    "batch_norm-eval-without-stats": (lambda a: pnn.batch_norm(a.x, weight=a.w, bias=a.b, training=False), ValueError,
                                      r"running_mean and running_var are required when training=False"),
    "instance_norm-eval-without-stats": (lambda a: pnn.instance_norm(a.x, use_input_stats=False), ValueError,
                                         r"required when use_input_stats=False"),
    # vjp
    "vjp-unknown-wrt": (lambda a: pnn.vjp(pnn.batch_norm, a.x, weight=a.w, bias=a.b, running_mean=a.rm,
                                          running_var=a.rv, wrt=("gamma",)),
                        ValueError, r"wrt: batch_norm has no differentiable"),
    "vjp-wrt-running_mean": (lambda a: pnn.vjp(pnn.batch_norm, a.x, running_mean=a.rm, running_var=a.rv,
                                               wrt="running_mean"), ValueError, r"wrt.*'running_mean'"),
    "vjp-rms-wrt-bias": (lambda a: pnn.vjp(pnn.rms_norm, a.x, a.lw, wrt=("x", "bias")), ValueError,
                         r"wrt: rms_norm has no differentiable argument 'bias'"),
    "vjp-wrt-not-names": (lambda a: pnn.vjp(pnn.layer_norm, a.x, wrt=0), TypeError, r"wrt must be a name"),
    # moments and merge_moments
    "moments-negative-correction": (lambda a: pnn.moments(a.x, 0, correction=-1), ValueError, r"correction"),
    "moments-axis-out-of-range": (lambda a: pnn.moments(a.x, 3), ValueError, r"axis=3 is out of range"),
    "moments-integer-x": (lambda a: pnn.moments(np.arange(4)), TypeError, r"x must have a floating dtype"),
    "moments-list": (lambda a: pnn.moments([1.0, 2.0]), TypeError, r"x must be an array"),
    "moments-keepdims-not-bool": (lambda a: pnn.moments(a.x, keepdims="no"), TypeError, r"keepdims"),
    "merge-not-a-triple": (lambda a: pnn.merge_moments((1, a.w), (1, a.w, a.w)), TypeError, r"a must be a tuple"),
    "merge-mixed-libraries": (lambda a: pnn.merge_moments((1, a.w, a.w), (1, torch.tensor(a.w), a.w)), TypeError,
                              r"different libraries.*mean_b is"),
}


@pytest.mark.parametrize("call, exc, match", list(_ERRORS.values()), ids=list(_ERRORS))
def test_bad_arguments_raise_and_mutate_nothing(call, exc, match):
    a = _fresh()
    arrays = list(vars(a).values())
    before = snapshot(arrays)
    with pytest.raises(exc, match=match):
        call(a)
    assert unchanged(arrays, before), "a failed call modified its arguments"


@pytest.mark.parametrize("read_only", ["running_mean", "running_var"])
@pytest.mark.parametrize("op, case", op_cases(["batch_norm", "instance_norm"], libs=["numpy"], mixed=False))
def test_read_only_running_stats_need_return_stats(op, case, read_only):
    a = _fresh()
    a.x, a.w, a.b, a.rm, a.rv = (case.asarray(v) for v in (a.x, a.w, a.b, a.rm, a.rv))
    call = _bn if op == "batch_norm" else _inorm
    getattr(a, {"running_mean": "rm", "running_var": "rv"}[read_only]).flags.writeable = False
    before = snapshot([a.rm, a.rv])
    with case.use():
        with pytest.raises(ValueError, match=rf"{read_only} is not writable.*pass return_stats=True"):
            call(a)
        with pytest.raises(ValueError, match=rf"{read_only} is not writable"):
            pnn.vjp(getattr(pnn, op), a.x, running_mean=a.rm, running_var=a.rv)
        assert unchanged([a.rm, a.rv], before)

        y, new_mean, new_var = call(a, return_stats=True)
        assert unchanged([a.rm, a.rv], before), "return_stats=True mutated the statistics"
        rm, rv = a.rm.copy(), a.rv.copy()
        y_in_place = call(a, rm=rm, rv=rv)  # the same call on writable copies
    np.testing.assert_array_equal(y, y_in_place)
    np.testing.assert_array_equal(new_mean, rm)
    np.testing.assert_array_equal(new_var, rv)
    assert not np.array_equal(rm, before[0]), "the statistics should have been updated"


@pytest.mark.parametrize("op, case", op_cases(["batch_norm", "instance_norm"], libs=["numpy"], mixed=False))
def test_inference_takes_read_only_running_stats(op, case):
    """Inference only reads the running statistics: read-only arrays need no return_stats."""
    a = _fresh()
    a.x, a.w, a.b, a.rm, a.rv = (case.asarray(v) for v in (a.x, a.w, a.b, a.rm, a.rv))
    a.rm.flags.writeable = a.rv.flags.writeable = False
    flag = {"training": False} if op == "batch_norm" else {"use_input_stats": False}
    with case.use():
        y = (_bn if op == "batch_norm" else _inorm)(a, **flag)
    expected = (a.x - a.rm[:, None]) / np.sqrt(a.rv[:, None] + 1e-5) * a.w[:, None] + a.b[:, None]
    assert_close(y, expected, case.tol, "y")


@pytest.mark.parametrize(
    "dy, exc, match",
    [
        (np.ones((4, 3)), ValueError, r"cotangent must have the output's shape \(4, 3, 5\)"),
        (np.ones((4, 3, 5), dtype=np.float32), TypeError, r"cotangent has dtype float32"),
        (torch.ones(4, 3, 5, dtype=torch.float64), TypeError, r"cotangent is"),
        ([1.0], TypeError, r"cotangent must be an array"),
    ],
    ids=["shape", "dtype", "library", "list"],
)
def test_bad_cotangents(dy, exc, match):
    a = _fresh()
    _, pullback = pnn.vjp(pnn.batch_norm, a.x, weight=a.w, bias=a.b)
    with pytest.raises(exc, match=match):
        pullback(dy)


@pytest.mark.parametrize(
    "out, exc, match",
    [
        ({"x": np.empty((4, 3))}, ValueError, r"out\['x'\] must have the shape"),
        ({"weight": np.empty(3, dtype=np.float32)}, ValueError, r"out\['weight'\] must have the shape"),
        ({"running_mean": np.empty(3)}, ValueError, r"out: unknown gradient field 'running_mean'"),
        ({"bias": torch.empty(3, dtype=torch.float64)}, TypeError, r"out\['bias'\] must be an array of the same"),
        ([np.empty(3)], TypeError, r"out must be a mapping"),
    ],
    ids=["x-shape", "weight-dtype", "unknown", "library", "not-a-mapping"],
)
def test_bad_out_buffers(out, exc, match):
    a = _fresh()
    _, pullback = pnn.vjp(pnn.batch_norm, a.x, weight=a.w, bias=a.b)
    with pytest.raises(exc, match=match):
        pullback(np.ones_like(a.x), out=out)


def test_moments_cotangent_must_be_a_pair():
    a = _fresh()
    _, pullback = pnn.vjp(pnn.moments, a.x, 0)
    with pytest.raises(ValueError, match=r"tuple of 2 cotangents"):
        pullback(np.ones((3, 5)))
    with pytest.raises(ValueError, match=r"cotangent\[1\] must have the output's shape"):
        pullback((None, np.ones(3)))


# --------------------------------------------------------------------------- statistics input checks


def test_moments_rejects_a_non_finite_or_non_numeric_correction():
    x = np.ones((3, 4))
    with pytest.raises(ValueError, match="correction"):
        pnn.moments(x, correction=float("nan"))
    with pytest.raises(ValueError, match="correction"):
        pnn.moments(x, correction=float("inf"))
    with pytest.raises(TypeError, match="correction"):
        pnn.moments(x, correction="1")


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_moments_of_a_0d_array_are_0d_arrays(backend):
    with pnn.use_backend(backend):
        mean, var = pnn.moments(np.array(3.0))
    assert isinstance(mean, np.ndarray) and isinstance(var, np.ndarray)
    assert mean.shape == var.shape == () and float(mean) == 3.0 and float(var) == 0.0


@pytest.mark.parametrize(("a", "b", "exc", "match"), [
    ((None, np.zeros(4), np.zeros(4)), (3, np.zeros(4), np.zeros(4)), TypeError, "n_a"),
    ((2, np.zeros(4), np.zeros(4)), ("3", np.zeros(4), np.zeros(4)), TypeError, "n_b"),
    ((2, np.zeros(4), np.zeros(4)), (3, np.zeros(5), np.zeros(5)), ValueError, "broadcast"),
    ((-1, 0.0, 0.0), (1, 0.0, 0.0), ValueError, "n_a"),
    ((1, "m", 0.0), (1, 0.0, 0.0), TypeError, "mean_a"),
])
def test_merge_moments_validates_counts_and_shapes(a, b, exc, match):
    with pytest.raises(exc, match=match):
        pnn.merge_moments(a, b)


def test_channels_last_data_without_channel_axis_gets_a_hint():
    with pytest.raises(ValueError, match="channel_axis=-1"):
        pnn.group_norm(np.ones((2, 5, 5, 4)), 1, np.ones(4), np.zeros(4))


def test_a_positional_port_of_f_batch_norm_fails_and_says_how_to_call_it():
    """F.batch_norm(input, running_mean, running_var, weight, bias) ported positionally must not run:
    weight and bias are keyword-only, and the error shows the call form."""
    x, stats = np.ones((4, 3)), (np.zeros(3), np.ones(3))
    for op in (pnn.batch_norm, pnn.instance_norm):
        with pytest.raises(TypeError, match=r"call it as \w+_norm\(x, \*, weight=None, bias=None, running_mean=None"):
            op(x[None], *stats)


def test_a_call_that_does_not_bind_shows_how_to_call_the_op():
    with pytest.raises(TypeError, match=r"call it as layer_norm\(x, weight=None, bias=None, \*, axis=-1"):
        pnn.layer_norm(np.ones((2, 3)), np.ones(3), np.zeros(3), -1)
