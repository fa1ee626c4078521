"""Benchmark workloads: the standard shapes, float32, fwd / bwd / fwd+bwd.

A :class:`Workload` names the ops it uses (a backend competes when it implements
all of them) and builds its data once, returning closures per phase for a
portable_nn backend and for PyTorch.  ``bytes_moved`` is the minimum memory
traffic of a phase (each input read once, each output written once) for
memory-bound workloads — the numerator of the GB/s column — and empty for
compute-bound ones.

Models (LeNet-5, the MLP) chain ``pnn.vjp`` pullbacks by hand, as a user
without an autograd library would; their "gradient" is the fwd+bwd phase.  So do
the resnet18 layers (conv3x3 + BatchNorm2d in training + ReLU at each of resnet18's
shapes, batch 8, two of them also channels-last), whose fwd+bwd gives every
gradient, the input's included.

A workload's ``name`` carries its standard shapes and identifies it (``--ops``, the
JSON, the docs); ``label(quick)`` is the name with the shapes a run actually uses.

A :class:`Placement` says where the data lives: NumPy arrays and CPU tensors for
``bench``, CuPy arrays and CUDA tensors (any floating dtype) for ``gpu-check``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import portable_nn as pnn

Phases = dict[str, Callable[[], Any]]


@dataclass
class Cases:
    portable: Callable[[str], Phases]
    torch: Callable[[], Phases] | None
    bytes_moved: dict[str, int]


@dataclass(frozen=True)
class Placement:
    """Where a workload's arrays live and their floating dtype.

    portable_nn gets NumPy arrays on the CPU and CuPy arrays on a GPU (for bfloat16, which
    CuPy lacks, every array of the call as a CUDA torch tensor); PyTorch gets tensors on the
    same device.  Norm parameters stay float32 for portable_nn (its mixed-precision
    form) and take the data's dtype for PyTorch (its fused path).
    """

    device: str = "cpu"
    dtype: str = "float32"

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def array(self, a: np.ndarray, dtype: str | None = None) -> Any:
        """``a`` as a portable_nn input (integer arrays keep their dtype)."""
        if a.dtype.kind in "iu":
            dtype = a.dtype.name
        dtype = dtype or self.dtype
        if not self.on_gpu:
            return a.astype(dtype, copy=False)
        if self.dtype == "bfloat16":  # every array of the call from one library (float32 params too)
            return self.tensor(a, dtype=dtype)
        import cupy

        return cupy.asarray(a.astype(dtype, copy=False))

    def tensor(self, a: np.ndarray, grad: bool = False, dtype: str | None = None) -> Any:
        """``a`` as a torch tensor on this device (integer arrays keep their dtype)."""
        import torch

        if a.dtype.kind in "iu":
            return torch.tensor(a, device=self.device)
        return torch.tensor(a, dtype=getattr(torch, dtype or self.dtype), device=self.device, requires_grad=grad)

    def nbytes(self, a: np.ndarray) -> int:
        """Bytes of ``a`` in this placement's dtype."""
        return a.size * (2 if self.dtype in ("float16", "bfloat16") else np.dtype(self.dtype).itemsize)


CPU = Placement()


@dataclass
class Workload:
    name: str  # with the standard shapes: the workload's identity (``--ops``, JSON, docs)
    ops: tuple[str, ...]
    build: Callable[..., Cases]  # build(quick, place=CPU)
    quick_name: str | None = None  # with the quick shapes, where they differ

    @property
    def op(self) -> str:
        """The op a single-op workload measures (its first-call latency is reported per op)."""
        return self.ops[0]

    def label(self, quick: bool) -> str:
        """The name with the shapes a run actually uses (the quick ones for a quick run)."""
        return (self.quick_name or self.name) if quick else self.name

    def matches(self, selectors: Sequence[str] | None) -> bool:
        """Whether ``--ops`` selects this workload: one of its ops, or a substring of its name."""
        if not selectors:
            return True
        return any(s in self.ops or s in self.name or s in self.label(True) for s in selectors)


def _shape(shape: Sequence[int]) -> str:
    """A shape as workload names write it: ``(4096,1024)``."""
    return "(" + ",".join(str(d) for d in shape) + ")"


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# --------------------------------------------------------------------------- phase builders


def _portable_phases(backend: str, forward: Callable[[], Any], gradient: Callable[[], Any],
                     vjp: Callable[[], tuple[Any, Callable[[], Any]]] | None = None) -> Phases:
    """fwd, bwd (the pullback of one saved forward, when ``vjp`` is given) and fwd+bwd under ``backend``."""

    def under(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with pnn.use_backend(backend):
                return fn()

        return run

    phases = {"fwd": under(forward)}
    if vjp is not None:
        with pnn.use_backend(backend):
            _, pullback = vjp()
        phases["bwd"] = under(pullback)
    phases["fwd+bwd"] = under(gradient)
    return phases


def _op_phases(backend: str, fn: Callable[..., Any], args: tuple, kwargs: dict, dy: Any,
               wrt: Sequence[str] | None = None) -> Phases:
    """Phases of one op: the pullback gets ``dy``."""

    def vjp() -> tuple[Any, Callable[[], Any]]:
        y, pb = pnn.vjp(fn, *args, wrt=wrt, **kwargs)
        return y, lambda: pb(dy)

    def gradient() -> Any:
        return vjp()[1]()

    return _portable_phases(backend, lambda: fn(*args, **kwargs), gradient, vjp)


def _torch_phases(forward: Callable[[], Any], inputs: Sequence[Any], dy: Any = None,
                  loss: Callable[[Any], Any] | None = None) -> Phases:
    """fwd (no_grad), bwd (``autograd.grad`` of one kept graph) and fwd+bwd for a torch forward.

    The backward seeds the output(s) with ``dy`` (a tensor, or a tuple for several outputs), or
    differentiates the scalar ``loss(output)``.
    """
    import torch

    def seeded(y: Any) -> tuple[Any, Any]:
        if loss is not None:
            return loss(y), None
        return y, dy

    def fwd() -> Any:
        with torch.no_grad():
            return forward()

    def fwd_bwd() -> Any:
        out, grad = seeded(forward())
        return torch.autograd.grad(out, inputs, grad)

    phases = {"fwd": fwd}
    if loss is None:
        kept, grad = seeded(forward())
        phases["bwd"] = lambda: torch.autograd.grad(kept, inputs, grad, retain_graph=True)
    phases["fwd+bwd"] = fwd_bwd
    return phases


def _tensors(place: Placement, *arrays: np.ndarray, grad: bool = True) -> list[Any]:
    return [place.tensor(a, grad) for a in arrays]


# --------------------------------------------------------------------------- norms


def _norm_workload(name: str, op: str, shape: tuple[int, ...], quick_shape: tuple[int, ...],
                   channels_of: Callable[[tuple[int, ...]], int], extra: tuple = (),
                   channels_last: bool = False) -> Workload:
    """One norm op vs its ``torch.nn.functional`` twin; ``{shape}`` in ``name`` becomes the shape run.

    ``shape`` is PyTorch's logical (N, C, *spatial); with ``channels_last`` portable_nn gets the
    data as (N, *spatial, C) with ``channel_axis=-1`` and PyTorch the same memory as a
    ``torch.channels_last`` tensor.
    """

    def build(quick: bool, place: Placement = CPU) -> Cases:
        s = quick_shape if quick else shape
        rng = _rng()
        x, dy = _randn(rng, *s), _randn(rng, *s)
        c = channels_of(s)
        w, b = np.ones(c, np.float32), np.zeros(c, np.float32)
        fn = getattr(pnn, op)
        to_last = (0, *range(2, len(s)), 1)
        xs, dys = (np.ascontiguousarray(x.transpose(to_last)), np.ascontiguousarray(dy.transpose(to_last))) \
            if channels_last else (x, dy)
        xp, dyp, wp, bp = place.array(xs), place.array(dys), place.array(w, "float32"), place.array(b, "float32")
        args = (xp, *extra)
        params = {"weight": wp} if op == "rms_norm" else {"weight": wp, "bias": bp}
        if channels_last:
            params["channel_axis"] = -1

        def torch_cases() -> Phases:
            import torch
            import torch.nn.functional as F

            xt, wt, bt = _tensors(place, x, w, b)
            if channels_last:
                fmt = torch.channels_last if len(s) == 4 else torch.channels_last_3d
                xt = xt.detach().contiguous(memory_format=fmt).requires_grad_(True)
            forward = {
                "layer_norm": lambda: F.layer_norm(xt, (c,), wt, bt),
                "rms_norm": lambda: F.rms_norm(xt, (c,), wt, eps=1e-6),
                "batch_norm": lambda: F.batch_norm(xt, None, None, wt, bt, training=True),
                "group_norm": lambda: F.group_norm(xt, extra[0] if extra else 1, wt, bt),
                "instance_norm": lambda: F.instance_norm(xt, weight=wt, bias=bt),
            }[op]
            inputs = (xt, wt) if op == "rms_norm" else (xt, wt, bt)
            dyt = place.tensor(dy)
            if channels_last:
                dyt = dyt.contiguous(memory_format=fmt)
            return _torch_phases(forward, inputs, dyt)

        n = place.nbytes(x)
        return Cases(lambda be: _op_phases(be, fn, args, params, dyp), torch_cases,
                     {"fwd": 2 * n, "bwd": 3 * n, "fwd+bwd": 5 * n})

    return Workload(name.format(shape=_shape(shape)), (op,), build, name.format(shape=_shape(quick_shape)))


def _moments_workload(name: str, shape: tuple[int, ...], quick_shape: tuple[int, ...],
                      axes: tuple[int, ...]) -> Workload:
    """Mean and population variance over ``axes`` (batch_norm's statistics) vs ``torch.var_mean``."""

    def build(quick: bool, place: Placement = CPU) -> Cases:
        s = quick_shape if quick else shape
        rng = _rng()
        x = _randn(rng, *s) + 3.0
        kept = tuple(d for i, d in enumerate(s) if i not in axes)
        dmean, dvar = _randn(rng, *kept), _randn(rng, *kept)
        cotangent = (place.array(dmean), place.array(dvar))

        def torch_cases() -> Phases:
            import torch

            (xt,) = _tensors(place, x)
            return _torch_phases(lambda: torch.var_mean(xt, dim=axes, correction=0), (xt,),
                                 (place.tensor(dvar), place.tensor(dmean)))

        n = place.nbytes(x)
        return Cases(lambda be: _op_phases(be, pnn.moments, (place.array(x), axes), {}, cotangent), torch_cases,
                     {"fwd": n, "bwd": 2 * n, "fwd+bwd": 3 * n})

    return Workload(name.format(shape=_shape(shape)), ("moments",), build, name.format(shape=_shape(quick_shape)))


# --------------------------------------------------------------------------- recurrent


def _rnn_params(rng: np.random.Generator, gates: int, inp: int, hidden: int, layers: int) -> list[tuple]:
    k = 1.0 / np.sqrt(hidden)
    params = []
    for layer in range(layers):
        i = inp if layer == 0 else hidden
        params.append((_randn(rng, gates * hidden, i, scale=k), _randn(rng, gates * hidden, hidden, scale=k),
                       _randn(rng, gates * hidden, scale=k), _randn(rng, gates * hidden, scale=k)))
    return params


def _sequence_workload(op: str, hidden: int = 64) -> Workload:
    """2-layer LSTM/GRU over a whole sequence (I=H=``hidden``, N=256, T=50) vs ``nn.LSTM``/``nn.GRU``."""
    gates = {"lstm": 4, "gru": 3}[op]

    def build(quick: bool, place: Placement = CPU) -> Cases:
        t, n, h, layers = (10, 32, hidden, 2) if quick else (50, 256, hidden, 2)
        rng = _rng()
        x, dy = _randn(rng, t, n, h), _randn(rng, t, n, h)
        params = _rnn_params(rng, gates, h, h, layers)
        fn = getattr(pnn, op)

        def portable(backend: str) -> Phases:
            placed = [tuple(place.array(p) for p in layer) for layer in params]
            return _op_phases(backend, fn, (place.array(x), placed), {}, (place.array(dy), None))

        def torch_cases() -> Phases:
            import torch

            module = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[op](h, h, layers)
            with torch.no_grad():
                for layer, (w_ih, w_hh, b_ih, b_hh) in enumerate(params):
                    for attr, value in (("weight_ih", w_ih), ("weight_hh", w_hh), ("bias_ih", b_ih),
                                        ("bias_hh", b_hh)):
                        getattr(module, f"{attr}_l{layer}").copy_(torch.from_numpy(value))
            module = module.to(device=place.device, dtype=getattr(torch, place.dtype))
            (xt,) = _tensors(place, x)
            return _torch_phases(lambda: module(xt)[0], (xt, *module.parameters()), place.tensor(dy))

        return Cases(portable, torch_cases, {})

    return Workload(f"{op} 2 layers I=H={hidden} N=256 T=50", (op,), build, f"{op} 2 layers I=H={hidden} N=32 T=10")


def _cell_workload(op: str) -> Workload:
    """One LSTM/GRU cell step at N=256, I=H=64 (mostly elementwise work around two small GEMMs)."""
    gates = {"lstm_cell": 4, "gru_cell": 3}[op]

    def build(quick: bool, place: Placement = CPU) -> Cases:
        n, h = (32, 64) if quick else (256, 64)
        rng = _rng()
        x, h0, c0 = _randn(rng, n, h), _randn(rng, n, h), _randn(rng, n, h)
        ((w_ih, w_hh, b_ih, b_hh),) = _rnn_params(rng, gates, h, h, 1)
        dh, dc = _randn(rng, n, h), _randn(rng, n, h)
        if op == "lstm_cell":
            args, cot = (x, h0, c0, w_ih, w_hh, b_ih, b_hh), (place.array(dh), place.array(dc))
        else:
            args, cot = (x, h0, w_ih, w_hh, b_ih, b_hh), place.array(dh)
        placed = tuple(place.array(a) for a in args)

        def torch_cases() -> Phases:
            import torch

            ts = _tensors(place, *args)
            if op == "lstm_cell":
                xt, ht, ct, *wt = ts
                forward = lambda: torch.lstm_cell(xt, (ht, ct), *wt)  # noqa: E731
                return _torch_phases(forward, ts, (place.tensor(dh), place.tensor(dc)))
            xt, ht, *wt = ts
            return _torch_phases(lambda: torch.gru_cell(xt, ht, *wt), ts, place.tensor(dh))

        return Cases(lambda be: _op_phases(be, getattr(pnn, op), placed, {}, cot), torch_cases, {})

    return Workload(f"{op} N=256 I=H=64", (op,), build, f"{op} N=32 I=H=64")


# --------------------------------------------------------------------------- conv, pooling, losses


def _conv_workload(x_shape: tuple[int, ...], w_shape: tuple[int, ...], padding: int = 0,
                   quick_batch: int = 16) -> Workload:
    """conv + bias + relu (one fused call) vs ``F.relu(F.conv2d(...))``, stride 1, zero ``padding``."""

    def build(quick: bool, place: Placement = CPU) -> Cases:
        xs = (quick_batch, *x_shape[1:]) if quick else x_shape
        rng = _rng()
        x, w, b = _randn(rng, *xs), _randn(rng, *w_shape, scale=0.2), _randn(rng, w_shape[0], scale=0.1)
        out_hw = [s + 2 * padding - k + 1 for s, k in zip(xs[2:], w_shape[2:])]
        dy = _randn(rng, xs[0], w_shape[0], *out_hw)
        args, dyp = tuple(place.array(a) for a in (x, w, b)), place.array(dy)

        def torch_cases() -> Phases:
            import torch.nn.functional as F

            xt, wt, bt = _tensors(place, x, w, b)
            return _torch_phases(lambda: F.relu(F.conv2d(xt, wt, bt, padding=padding)), (xt, wt, bt),
                                 place.tensor(dy))

        kwargs = {"activation": "relu", "padding": padding}
        portable = lambda be: _op_phases(be, pnn.conv, args, kwargs, dyp)  # noqa: E731
        return Cases(portable, torch_cases, {})

    k = "x".join(str(d) for d in w_shape[2:])

    def name(batch: int) -> str:
        return f"conv{k}+bias+relu {_shape((batch, *x_shape[1:]))}->{w_shape[0]}"

    return Workload(name(x_shape[0]), ("conv",), build, name(quick_batch))


def _conv_transpose_workload(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int, padding: int = 0,
                             output_padding: int = 0, quick_batch: int = 2) -> Workload:
    """conv_transpose + bias + relu (one fused call) vs ``F.relu(F.conv_transpose2d(...))``: a U-Net
    decoder's upsampling (kernel = stride 2) or a decoder's 3x3 stride-2 layer."""
    geometry = {"stride": stride, "padding": padding, "output_padding": output_padding}

    def build(quick: bool, place: Placement = CPU) -> Cases:
        xs = (quick_batch, *x_shape[1:]) if quick else x_shape
        rng = _rng()
        x, w, b = _randn(rng, *xs), _randn(rng, *w_shape, scale=0.2), _randn(rng, w_shape[1], scale=0.1)
        out_hw = [(s - 1) * stride - 2 * padding + k + output_padding for s, k in zip(xs[2:], w_shape[2:])]
        dy = _randn(rng, xs[0], w_shape[1], *out_hw)
        args, dyp = tuple(place.array(a) for a in (x, w, b)), place.array(dy)

        def torch_cases() -> Phases:
            import torch.nn.functional as F

            xt, wt, bt = _tensors(place, x, w, b)
            return _torch_phases(lambda: F.relu(F.conv_transpose2d(xt, wt, bt, **geometry)), (xt, wt, bt),
                                 place.tensor(dy))

        kwargs = {"activation": "relu", **geometry}
        portable = lambda be: _op_phases(be, pnn.conv_transpose, args, kwargs, dyp)  # noqa: E731
        return Cases(portable, torch_cases, {})

    k = "x".join(str(d) for d in w_shape[2:])

    def name(batch: int) -> str:
        return f"conv_transpose{k} s{stride}+bias+relu {_shape((batch, *x_shape[1:]))}->{w_shape[1]}"

    return Workload(name(x_shape[0]), ("conv_transpose",), build, name(quick_batch))


def _chain(layers: Sequence[Layer], x: Any) -> tuple[Any, Callable[[Any], Any]]:
    """Run ``layers`` under ``pnn.vjp``; returns the output and a pullback giving every layer's gradients.

    The pullback takes the output's cotangent and returns the list of gradient named tuples,
    last layer first (each one's first field, the input's gradient, seeds the layer before).
    """
    h, tape = x, []
    for fn, params, kwargs, wrt in layers:
        h, pullback = pnn.vjp(fn, h, *params, wrt=wrt, **kwargs)
        tape.append(pullback)

    def pullback(dy: Any) -> list[Any]:
        g, grads = dy, []
        for pb in reversed(tape):
            result = pb(g)
            grads.append(result)
            g = result[0]
        return grads

    return h, pullback


def _resnet_layer_workload(cin: int, cout: int, stride: int, hw: int, batch: int = 8,
                           channels_last: bool = False) -> Workload:
    """A resnet18 layer: conv3x3 (padding 1, no bias) + BatchNorm2d (training) + ReLU, gradient w.r.t. everything.

    portable_nn: ``pnn.conv`` then ``pnn.batch_norm(..., activation="relu")``, the pullbacks
    chained with ``pnn.vjp``; PyTorch: ``F.conv2d`` + ``F.batch_norm(training=True)`` + ``F.relu``.
    ``channels_last``: NHWC arrays with ``channel_axis=-1`` for portable_nn, tensors in
    ``torch.channels_last`` memory format for PyTorch (weights too, as ``model.to(memory_format=…)`` does).
    """

    def build(quick: bool, place: Placement = CPU) -> Cases:
        n, size = (1, hw // 2) if quick else (batch, hw)
        rng = _rng()
        x = _randn(rng, n, cin, size, size)
        w = _randn(rng, cout, cin, 3, 3, scale=(9 * cin) ** -0.5)
        gamma, beta = np.ones(cout, np.float32), np.zeros(cout, np.float32)
        out = (size - 1) // stride + 1
        dy = _randn(rng, n, cout, out, out)
        to_nhwc = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) if channels_last else (lambda a: a)
        axis = -1 if channels_last else 1
        layers: list[Layer] = [
            (pnn.conv, (place.array(w),), {"stride": stride, "padding": 1, "channel_axis": axis}, ("x", "weight")),
            (pnn.batch_norm, (), {"weight": place.array(gamma), "bias": place.array(beta), "activation": "relu",
                                  "channel_axis": axis}, ("x", "weight", "bias")),
        ]
        xp, dyp = place.array(to_nhwc(x)), place.array(to_nhwc(dy))

        def portable(backend: str) -> Phases:
            def vjp() -> tuple[Any, Callable[[], Any]]:
                y, pullback = _chain(layers, xp)
                return y, lambda: pullback(dyp)

            return _portable_phases(backend, lambda: _model_forward(layers, xp), lambda: vjp()[1](), vjp)

        def torch_cases() -> Phases:
            import torch
            import torch.nn.functional as F

            fmt = torch.channels_last if channels_last else torch.contiguous_format

            def tensor(a: np.ndarray, grad: bool = True) -> Any:
                t = place.tensor(a).contiguous(memory_format=fmt) if a.ndim == 4 else place.tensor(a)
                return t.requires_grad_(grad)

            xt, wt, gt, bt = (tensor(a) for a in (x, w, gamma, beta))

            def forward() -> Any:
                h = F.conv2d(xt, wt, stride=stride, padding=1)
                return F.relu(F.batch_norm(h, None, None, gt, bt, training=True))

            return _torch_phases(forward, (xt, wt, gt, bt), tensor(dy, grad=False))

        return Cases(portable, torch_cases, {})

    def name(n: int, size: int) -> str:
        if channels_last:
            return f"resnet conv3x3+bn+relu {cin}->{cout} s{stride} NHWC {_shape((n, size, size, cin))}"
        return f"resnet conv3x3+bn+relu {cin}->{cout} s{stride} {_shape((n, cin, size, size))}"

    return Workload(name(batch, hw), ("conv", "batch_norm"), build, name(1, hw // 2))


def _pool_workload(op: str) -> Workload:
    def build(quick: bool, place: Placement = CPU) -> Cases:
        shape = (16, 6, 24, 24) if quick else (128, 6, 24, 24)
        rng = _rng()
        x = _randn(rng, *shape)
        dy = _randn(rng, shape[0], shape[1], shape[2] // 2, shape[3] // 2)
        fn = getattr(pnn, op)
        xp, dyp = place.array(x), place.array(dy)

        def torch_cases() -> Phases:
            import torch.nn.functional as F

            (xt,) = _tensors(place, x)
            tfn = {"max_pool": F.max_pool2d, "avg_pool": F.avg_pool2d}[op]
            return _torch_phases(lambda: tfn(xt, 2), (xt,), place.tensor(dy))

        n, m = place.nbytes(x), place.nbytes(dy)
        return Cases(lambda be: _op_phases(be, fn, (xp, 2), {}, dyp), torch_cases,
                     {"fwd": n + m, "bwd": m + n, "fwd+bwd": 2 * (n + m)})

    return Workload(f"{op} 2x2 (128,6,24,24)", (op,), build, f"{op} 2x2 (16,6,24,24)")


def _loss_workload(op: str, classes: int = 1000) -> Workload:
    def build(quick: bool, place: Placement = CPU) -> Cases:
        n, c = (256, classes) if quick else (4096, classes)
        rng = _rng()
        logits = _randn(rng, n, c)
        size = place.nbytes(logits)
        if op == "log_softmax":
            args, kwargs, dy = (logits,), {"axis": -1}, _randn(rng, n, c)
            moved = {"fwd": 2 * size, "bwd": 3 * size, "fwd+bwd": 5 * size}
        else:
            target = rng.integers(0, c, n)
            args, kwargs, dy = (logits, target), {}, np.ones((), np.float32)
            moved = {"fwd": size, "bwd": 2 * size, "fwd+bwd": 3 * size}
        placed, dyp = tuple(place.array(a) for a in args), place.array(dy)

        def torch_cases() -> Phases:
            import torch.nn.functional as F

            (lt,) = _tensors(place, logits)
            if op == "log_softmax":
                return _torch_phases(lambda: F.log_softmax(lt, -1), (lt,), place.tensor(dy))
            tt = place.tensor(args[1])
            return _torch_phases(lambda: F.cross_entropy(lt, tt), (lt,), place.tensor(np.ones((), np.float32)))

        portable = lambda be: _op_phases(be, getattr(pnn, op), placed, kwargs, dyp, wrt=("logits",) if  # noqa: E731
                                         op == "cross_entropy" else None)
        return Cases(portable, torch_cases, moved)

    return Workload(f"{op} (4096,{classes})", (op,), build, f"{op} (256,{classes})")


# --------------------------------------------------------------------------- models


#: A model layer: ``(op, params, kwargs, wrt)``, called as ``op(h, *params, **kwargs)``; or FLATTEN.
Layer = tuple[Callable[..., Any], tuple, dict, tuple[str, ...]]
FLATTEN = "flatten"


def _model_forward(layers: Sequence[Layer | str], x: Any) -> Any:
    h = x
    for layer in layers:
        if layer == FLATTEN:
            h = h.reshape(h.shape[0], -1)
            continue
        fn, params, kwargs, _ = layer
        h = fn(h, *params, **kwargs)
    return h


def _model_gradient(layers: Sequence[Layer | str], x: Any) -> list[Any]:
    """Gradients of ``Σ y²`` w.r.t. every layer's weight and bias, by chaining pullbacks."""
    h, tape = x, []
    for layer in layers:
        if layer == FLATTEN:
            tape.append(h.shape)
            h = h.reshape(h.shape[0], -1)
            continue
        fn, params, kwargs, wrt = layer
        h, pullback = pnn.vjp(fn, h, *params, wrt=wrt, **kwargs)
        tape.append(pullback)
    g, grads = 2.0 * h, []
    for entry in reversed(tape):
        if isinstance(entry, tuple):
            g = g.reshape(entry)
            continue
        result = entry(g)
        grads.extend(v for name, v in result._asdict().items() if name in ("weight", "bias"))
        g = result[0]
    return grads


def _place_layers(layers: Sequence[Layer | str], place: Placement) -> list[Layer | str]:
    """The layers with their parameter arrays placed (other parameters, like a pool size, kept)."""
    return [
        layer if layer == FLATTEN else
        (layer[0], tuple(place.array(p) if isinstance(p, np.ndarray) else p for p in layer[1]), *layer[2:])
        for layer in layers
    ]


def _model_workload(name: str, ops: tuple[str, ...], make: Callable[[bool], tuple[Any, list, Callable]],
                    quick_name: str | None = None) -> Workload:
    """A model's forward and parameter gradient; ``make(quick)`` gives (x, layers, torch forward maker)."""

    def build(quick: bool, place: Placement = CPU) -> Cases:
        x, layers, torch_forward = make(quick)
        xp, placed = place.array(x), _place_layers(layers, place)

        def portable(backend: str) -> Phases:
            return _portable_phases(backend, lambda: _model_forward(placed, xp), lambda: _model_gradient(placed, xp))

        def torch_cases() -> Phases:
            (xt,) = _tensors(place, x, grad=False)
            arrays = [p for layer in layers if layer != FLATTEN for p in layer[1] if isinstance(p, np.ndarray)]
            params = _tensors(place, *arrays)
            return _torch_phases(lambda: torch_forward(xt, params), params, loss=lambda y: (y * y).sum())

        return Cases(portable, torch_cases, {})

    return Workload(name, ops, build, quick_name)


def _dense_layers(rng: np.random.Generator, sizes: Sequence[int], first_wrt_x: bool) -> list[Layer]:
    """Dense layers with relu between them (none after the last)."""
    layers = []
    for k, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        params = (_randn(rng, fan_out, fan_in, scale=fan_in**-0.5), _randn(rng, fan_out, scale=0.1))
        kwargs = {"activation": "relu"} if k < len(sizes) - 2 else {}
        wrt = ("x", "weight", "bias") if k or first_wrt_x else ("weight", "bias")
        layers.append((pnn.dense, params, kwargs, wrt))
    return layers


def _torch_dense(h: Any, params: Sequence[Any]) -> Any:
    import torch.nn.functional as F

    for k in range(0, len(params), 2):
        h = F.linear(h, params[k], params[k + 1])
        if k + 2 < len(params):
            h = F.relu(h)
    return h


def _mlp(quick: bool) -> tuple[Any, list, Callable]:
    """MLP 784-32-10 (relu), batch 128."""
    rng = _rng()
    x = _randn(rng, 128, 784)
    return x, _dense_layers(rng, (784, 32, 10), first_wrt_x=False), _torch_dense


def _lenet(quick: bool) -> tuple[Any, list, Callable]:
    """LeNet-5: conv5-relu-pool2, conv5-relu-pool2, dense 256-120-84-10; batch 128 of 28x28."""
    rng = _rng()
    x = _randn(rng, 16 if quick else 128, 1, 28, 28)
    relu = {"activation": "relu"}
    conv1 = (_randn(rng, 6, 1, 5, 5, scale=0.2), _randn(rng, 6, scale=0.1))
    conv2 = (_randn(rng, 16, 6, 5, 5, scale=150**-0.5), _randn(rng, 16, scale=0.1))
    layers = [
        (pnn.conv, conv1, relu, ("weight", "bias")),
        (pnn.max_pool, (2,), {}, ("x",)),
        (pnn.conv, conv2, relu, ("x", "weight", "bias")),
        (pnn.max_pool, (2,), {}, ("x",)),
        FLATTEN,
        *_dense_layers(rng, (256, 120, 84, 10), first_wrt_x=True),
    ]

    def torch_forward(xt: Any, ps: Sequence[Any]) -> Any:
        import torch.nn.functional as F

        h = F.max_pool2d(F.relu(F.conv2d(xt, ps[0], ps[1])), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, ps[2], ps[3])), 2).flatten(1)
        return _torch_dense(h, ps[4:])

    return x, layers, torch_forward


#: The resnet18 layer shapes: (in channels, out channels, stride, input height = width), batch 8.
RESNET_LAYERS = [(64, 64, 1, 56), (64, 128, 2, 56), (128, 128, 1, 28), (128, 256, 2, 28), (256, 256, 1, 14),
                 (256, 512, 2, 14), (512, 512, 1, 7)]

WORKLOADS = [
    _norm_workload("layer_norm {shape}", "layer_norm", (4096, 1024), (256, 1024), lambda s: s[-1]),
    # 128 MiB: far past every cache, the roofline figure (fwd moves 2|x|, bwd 3|x|)
    _norm_workload("layer_norm {shape}", "layer_norm", (16384, 2048), (256, 2048), lambda s: s[-1]),
    _norm_workload("rms_norm {shape}", "rms_norm", (4096, 1024), (256, 1024), lambda s: s[-1]),
    _norm_workload("batch_norm train {shape}", "batch_norm", (128, 64, 32, 32), (8, 64, 16, 16),
                   lambda s: s[1]),
    _norm_workload("group_norm 32 groups {shape}", "group_norm", (128, 64, 32, 32), (8, 64, 16, 16),
                   lambda s: s[1], extra=(32,)),
    _norm_workload("instance_norm {shape}", "instance_norm", (128, 64, 32, 32), (8, 64, 16, 16),
                   lambda s: s[1]),
    _moments_workload("moments over (0,2,3) {shape}", (128, 64, 32, 32), (8, 64, 16, 16), (0, 2, 3)),
    _cell_workload("lstm_cell"),
    _cell_workload("gru_cell"),
    _sequence_workload("lstm"),
    _sequence_workload("gru"),
    _conv_workload((128, 1, 28, 28), (6, 1, 5, 5)),
    _conv_workload((128, 6, 12, 12), (16, 6, 5, 5)),
    _conv_workload((32, 64, 28, 28), (64, 64, 3, 3), padding=1, quick_batch=2),
    _conv_transpose_workload((16, 128, 32, 32), (128, 64, 2, 2), stride=2),
    _conv_transpose_workload((16, 64, 32, 32), (64, 32, 3, 3), stride=2, padding=1, output_padding=1),
    *(_resnet_layer_workload(*layer) for layer in RESNET_LAYERS),
    _resnet_layer_workload(64, 64, 1, 56, channels_last=True),
    _resnet_layer_workload(128, 256, 2, 28, channels_last=True),
    _pool_workload("max_pool"),
    _pool_workload("avg_pool"),
    _loss_workload("log_softmax"),
    _loss_workload("cross_entropy"),
    _model_workload("MLP 784-32-10 gradient, batch 128", ("dense",), _mlp),
    _model_workload("LeNet-5 gradient, batch 128", ("conv", "max_pool", "dense"), _lenet, "LeNet-5 gradient, batch 16"),
]
