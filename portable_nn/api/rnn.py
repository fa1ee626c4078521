"""Recurrent cells and sequences: signatures, validation, documentation.

Weights follow PyTorch's layout whatever the data: ``w_ih`` is ``(G*H, I)``,
``w_hh`` is ``(G*H, H)``, biases ``(G*H,)``, with the gates stacked along the
rows — LSTM i, f, g, o (G = 4); GRU r, z, n (G = 3); plain RNN G = 1 — so
weights copied from ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` (``weight_ih_l0``,
``weight_hh_l0_reverse`` …) or ``torch.lstm_cell`` work unchanged.

Every op validates its arguments once (shapes, dtypes, one library and device,
``lengths``) and hands the call to dispatch.  Implementations:
``portable_nn/reference/rnn.py`` (every array library) and kernels where
present; ``pnn.capabilities()`` lists which backend takes which case.
"""

from __future__ import annotations

import numbers
from typing import Any

from .. import _arrays
from ._common import (
    Prepared,
    all_outputs,
    check_array,
    check_bool,
    check_param_dtypes,
    check_same_library,
    check_shape,
    floating_dtype,
    make_call,
    public_op,
)
from ._types import Array, Lengths, RnnParams
from .activations import Activation, ActivationLike, parse_activation

__all__ = ["gru", "gru_cell", "lstm", "lstm_cell", "rnn", "rnn_cell"]

_WEIGHTS = ("w_ih", "w_hh", "b_ih", "b_hh", "w_hr")
_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


# --------------------------------------------------------------------------- shared validation


def _rnn_activation(activation: Any, op: str) -> Activation:
    act = parse_activation(activation)
    if act.name not in ("tanh", "relu"):
        raise ValueError(f"activation must be 'tanh' or 'relu' for {op}, got {activation!r}")
    return act


def _check_state_dtype(xp: Any, x_dtype: str, named: dict[str, Any]) -> None:
    for name, value in named.items():
        if value is None:
            continue
        dname = floating_dtype(xp, value, name)
        if dname != x_dtype:
            raise TypeError(f"{name} has dtype {dname} but x has {x_dtype}; states must have x's dtype")


def _check_ndim2(value: Any, name: str, what: str) -> None:
    if value is not None and value.ndim != 2:
        raise ValueError(f"{name} must be 2-D {what}, got shape {tuple(value.shape)}")


# --------------------------------------------------------------------------- cells


def _prepare_cell(
    op: str,
    gates: int,
    x: Any,
    h: Any,
    c: Any,
    w_ih: Any,
    w_hh: Any,
    b_ih: Any,
    b_hh: Any,
    params: dict[str, Any],
) -> Prepared:
    has_cell = op == "lstm_cell"
    if has_cell and isinstance(h, (tuple, list)):
        raise TypeError(
            "lstm_cell takes h and c as separate arguments: lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh), "
            "not PyTorch's (h, c) tuple"
        )
    states = {"h": h, "c": c} if has_cell else {"h": h}
    named = {"x": x, **states, "w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh}
    for name, value in named.items():
        check_array(value, name, optional=name in ("b_ih", "b_hh"))
    family, device = check_same_library(named)
    xp = _arrays.namespace(x)
    dtype = floating_dtype(xp, x, "x")
    _check_state_dtype(xp, dtype, states)
    mixed = check_param_dtypes(xp, dtype, {"w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh})

    if x.ndim not in (1, 2):
        raise ValueError(
            f"x must be (N, input_size), or (input_size,) for one unbatched sample; got shape {tuple(x.shape)}"
        )
    unbatched = x.ndim == 1
    for name, value in states.items():
        if value.ndim != x.ndim:
            expected = "(hidden_size,) like unbatched x" if unbatched else f"(N, hidden_size) with N={x.shape[0]}"
            raise ValueError(f"{name} must have shape {expected}, got shape {tuple(value.shape)}")
    hs = int(h.shape[-1])
    if hs < 1:
        raise ValueError(f"h must have hidden_size >= 1 in its last axis, got shape {tuple(h.shape)}")
    if not unbatched and int(h.shape[0]) != int(x.shape[0]):
        raise ValueError(
            f"h must have shape (N, hidden_size) = ({x.shape[0]}, {hs}) (N from x), got {tuple(h.shape)}"
        )
    check_shape(c, "c", tuple(h.shape), "the shape of h")
    features = int(x.shape[-1])
    where = f"hidden_size={hs} from h, input_size={features} from x"
    check_shape(w_ih, "w_ih", (gates * hs, features), f"({gates}*hidden_size, input_size); {where}")
    check_shape(w_hh, "w_hh", (gates * hs, hs), f"({gates}*hidden_size, hidden_size); {where}")
    check_shape(b_ih, "b_ih", (gates * hs,), f"({gates}*hidden_size,); {where}")
    check_shape(b_hh, "b_hh", (gates * hs,), f"({gates}*hidden_size,); {where}")

    params = {**params, "hidden_size": hs, "unbatched": unbatched, "mixed_precision": mixed}
    call = make_call(op, named, params, family=family, device=device, dtype=dtype)
    fields = tuple(named)
    if has_cell:
        return Prepared(call, fields, named, n_diff_outputs=2, finish=all_outputs)
    return Prepared(call, fields, named)


_CELL_FIELDS = ("x", "h", "w_ih", "w_hh", "b_ih", "b_hh")
_LSTM_CELL_FIELDS = ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")


@public_op(grad_fields=_CELL_FIELDS, outputs="h")
def rnn_cell(
    x: Array,
    h: Array,
    w_ih: Array,
    w_hh: Array,
    b_ih: Array | None = None,
    b_hh: Array | None = None,
    *,
    activation: ActivationLike = "tanh",
) -> Any:
    """One step of an Elman RNN, like ``torch.rnn_tanh_cell`` / ``torch.rnn_relu_cell``:

        h' = act(x·w_ihᵀ + b_ih + h·w_hhᵀ + b_hh)

    Args:
        x: ``(N, I)``, or ``(I,)`` for one unbatched sample.
        h: ``(N, H)`` (``(H,)`` when unbatched), x's dtype.
        w_ih: ``(H, I)`` input-to-hidden weights.
        w_hh: ``(H, H)`` hidden-to-hidden weights.
        b_ih: ``(H,)`` or ``None``.
        b_hh: ``(H,)`` or ``None``.
        activation: ``"tanh"`` (default) or ``"relu"``.

    Returns:
        ``h'`` with h's shape and x's dtype.  float16/bfloat16 ``x`` may come
        with float32 weights (computed in float32).

    Raises:
        ValueError: ``x`` neither 1-D nor 2-D, states or weights whose shapes do
            not fit (the message gives the expected shape), arrays on different
            devices, an activation other than tanh or relu.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, states not in ``x``'s dtype, weight dtype mixes other than
            float16/bfloat16 ``x`` with float32 weights.

    Gradients:
        ``vjp`` fields: ``(x, h, w_ih, w_hh, b_ih, b_hh)``.  With g = dh' ⊙ act'(z): dx
        = g·w_ih, dh = g·w_hh, dw_ih = gᵀ·x, dw_hh = gᵀ·h, db_ih = db_hh = Σ_N g.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them. ``pnn.explain`` reports which one a
        call runs and why the others were passed over.
    """
    params = {"kind": "rnn", "activation": _rnn_activation(activation, "rnn_cell"), "reset_after": True}
    return _prepare_cell("rnn_cell", 1, x, h, None, w_ih, w_hh, b_ih, b_hh, params)


@public_op(grad_fields=_LSTM_CELL_FIELDS, outputs=("h", "c"))
def lstm_cell(
    x: Array,
    h: Array,
    c: Array,
    w_ih: Array,
    w_hh: Array,
    b_ih: Array | None = None,
    b_hh: Array | None = None,
) -> tuple[Any, Any]:
    """One LSTM step, gate order i, f, g, o (like ``torch.lstm_cell``):

        [i f g o] = [σ σ tanh σ](x·w_ihᵀ + b_ih + h·w_hhᵀ + b_hh)
        c' = f ⊙ c + i ⊙ g,    h' = o ⊙ tanh(c')

    Args:
        x: ``(N, I)``, or ``(I,)`` for one unbatched sample.
        h: ``(N, H)`` hidden state (``(H,)`` when unbatched), x's dtype.
        c: ``(N, H)`` cell state, h's shape, x's dtype.
        w_ih: ``(4H, I)``, the four gates' rows stacked i, f, g, o.
        w_hh: ``(4H, H)``, stacked likewise.
        b_ih: ``(4H,)`` or ``None``.
        b_hh: ``(4H,)`` or ``None``.

    Returns:
        ``(h', c')``, each with h's shape and x's dtype.  float16/bfloat16 ``x``
        may come with float32 weights (computed in float32).

    Raises:
        ValueError: ``x`` neither 1-D nor 2-D, states or weights whose shapes do
            not fit (the message gives the expected shape), arrays on different
            devices.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, states not in ``x``'s dtype, weight dtype mixes other than
            float16/bfloat16 ``x`` with float32 weights.

    Gradients:
        ``vjp`` fields: ``(x, h, c, w_ih, w_hh, b_ih, b_hh)``; the pullback takes
        ``(dh', dc')``, either of which may be ``None``.  With da the gradient of
        the four gates' pre-activations, stacked i, f, g, o:

            dc_total = dc' + dh' ⊙ o ⊙ (1 − tanh²(c'))
            da_i = dc_total ⊙ g ⊙ i(1 − i),    da_f = dc_total ⊙ c ⊙ f(1 − f)
            da_g = dc_total ⊙ i ⊙ (1 − g²),    da_o = dh' ⊙ tanh(c') ⊙ o(1 − o)
            dx = da·w_ih,   dh = da·w_hh,   dc = dc_total ⊙ f
            dw_ih = daᵀ·x,  dw_hh = daᵀ·h,  db_ih = db_hh = Σ_N da

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them. ``pnn.explain`` reports which one a
        call runs and why the others were passed over.
    """
    params = {"kind": "lstm", "activation": None, "reset_after": True}
    return _prepare_cell("lstm_cell", 4, x, h, c, w_ih, w_hh, b_ih, b_hh, params)


@public_op(grad_fields=_CELL_FIELDS, outputs="h")
def gru_cell(
    x: Array,
    h: Array,
    w_ih: Array,
    w_hh: Array,
    b_ih: Array | None = None,
    b_hh: Array | None = None,
    *,
    reset_after: bool = True,
) -> Any:
    """One GRU step, gate order r, z, n:

        r, z = σ(x·w_ih,rzᵀ + b_ih,rz + h·w_hh,rzᵀ + b_hh,rz)
        reset_after=True  (PyTorch/cuDNN): n = tanh(x·w_inᵀ + b_in + r ⊙ (h·w_hnᵀ + b_hn))
        reset_after=False (original form): n = tanh(x·w_inᵀ + b_in + (r ⊙ h)·w_hnᵀ + b_hn)
        h' = (1 − z) ⊙ n + z ⊙ h

    ``reset_after=True`` is ``torch.gru_cell``.

    Args:
        x: ``(N, I)``, or ``(I,)`` for one unbatched sample.
        h: ``(N, H)`` (``(H,)`` when unbatched), x's dtype.
        w_ih: ``(3H, I)``, the gates' rows stacked r, z, n.
        w_hh: ``(3H, H)``, stacked likewise.
        b_ih: ``(3H,)`` or ``None``.
        b_hh: ``(3H,)`` or ``None``.
        reset_after: where the reset gate applies (see above).

    Returns:
        ``h'`` with h's shape and x's dtype.  float16/bfloat16 ``x`` may come
        with float32 weights (computed in float32).

    Raises:
        ValueError: ``x`` neither 1-D nor 2-D, states or weights whose shapes do
            not fit (the message gives the expected shape), arrays on different
            devices.
        TypeError: non-arrays, arrays of different libraries, a non-floating
            ``x``, states not in ``x``'s dtype, weight dtype mixes other than
            float16/bfloat16 ``x`` with float32 weights, a non-bool ``reset_after``.

    Gradients:
        ``vjp`` fields: ``(x, h, w_ih, w_hh, b_ih, b_hh)``; the pullback takes dh'. dh
        collects z ⊙ dh' and the paths through the three gates; the weight gradients are
        the gate pre-activation gradients times x (for w_ih) or h (``r ⊙ h`` for the n
        rows of w_hh with ``reset_after=False``), the bias gradients their sums over the
        batch.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them. ``pnn.explain`` reports which one a
        call runs and why the others were passed over.
    """
    params = {"kind": "gru", "activation": None, "reset_after": check_bool(reset_after, "reset_after")}
    return _prepare_cell("gru_cell", 3, x, h, None, w_ih, w_hh, b_ih, b_hh, params)


# --------------------------------------------------------------------------- sequences


def _param_label(k: int, j: int, dirs: int) -> str:
    layer, d = divmod(k, dirs)
    suffix = "_reverse" if d == 1 else ""
    return f"params[{k}][{j}] ({_WEIGHTS[j]}_l{layer}{suffix})"


def _param_name(k: int, j: int, dirs: int) -> str:
    layer, d = divmod(k, dirs)
    return f"{_WEIGHTS[j]}_l{layer}{'_reverse' if d == 1 else ''}"


def _entry_form(projections: bool) -> str:
    return "(w_ih, w_hh, b_ih, b_hh, w_hr)" if projections else "(w_ih, w_hh, b_ih, b_hh)"


def _check_entries(params: Any, dirs: int, allow_projections: bool) -> int:
    """The length of every ``params`` entry (4, or 5 with LSTM projections), after checking the list."""
    form = "(w_ih, w_hh, b_ih, b_hh)" + (" or (w_ih, w_hh, b_ih, b_hh, w_hr)" if allow_projections else "")
    if not isinstance(params, (list, tuple)) or not params:
        raise TypeError(
            f"params must be a non-empty list with one {form} tuple per layer and "
            f"direction, got {type(params).__name__}"
            + (" of length 0" if isinstance(params, (list, tuple)) else "")
        )
    if len(params) % dirs:
        raise ValueError(
            f"params has {len(params)} entries but bidirectional=True needs two per layer "
            "(layer 0 forward, layer 0 reverse, layer 1 forward, ...)"
        )
    first = params[0]
    width = len(first) if isinstance(first, (list, tuple)) and len(first) in (4, 5) else 4
    if width == 5 and not allow_projections:
        width = 4  # reported below: only lstm takes a fifth entry
    for k, entry in enumerate(params):
        if not isinstance(entry, (list, tuple)) or len(entry) != width:
            got = f"{len(entry)} entries" if isinstance(entry, (list, tuple)) else type(entry).__name__
            hint = ""
            if isinstance(entry, (list, tuple)) and len(entry) == 5 and not allow_projections:
                hint = "; only lstm takes a fifth entry (w_hr, the projection)"
            elif isinstance(entry, (list, tuple)) and len(entry) in (4, 5):
                hint = f"; every entry must have the form of params[0], {_entry_form(width == 5)}"
            raise TypeError(f"params[{k}] must be a tuple {_entry_form(width == 5)} (biases may be None), "
                            f"got {got}{hint}")
    return width


def _check_params(
    params: Any, gates: int, dirs: int, input_size: int, allow_projections: bool = False
) -> tuple[int, int, int, dict[str, Any]]:
    """(num_layers, hidden_size, proj_size (0: none), {label: array}) after checking every weight's shape."""
    width = _check_entries(params, dirs, allow_projections)
    labelled: dict[str, Any] = {}
    for k, entry in enumerate(params):
        for j, value in enumerate(entry):
            labelled[_param_label(k, j, dirs)] = check_array(value, _param_label(k, j, dirs),
                                                             optional=j in (2, 3))
    w_hh0 = params[0][1]
    label = _param_label(0, 1, dirs)
    if width == 5:
        if w_hh0.ndim != 2 or int(w_hh0.shape[1]) < 1 or int(w_hh0.shape[0]) % gates or int(w_hh0.shape[0]) < gates:
            raise ValueError(
                f"{label} must have shape ({gates}*hidden_size, proj_size) with proj_size >= 1 (params entries "
                f"have a fifth weight, w_hr: projections), got {tuple(w_hh0.shape)}"
            )
        hs, proj = int(w_hh0.shape[0]) // gates, int(w_hh0.shape[1])
        if proj >= hs:
            raise ValueError(
                f"proj_size must be smaller than hidden_size, as PyTorch requires: {label} has shape "
                f"{tuple(w_hh0.shape)}, i.e. hidden_size={hs}, proj_size={proj}"
            )
    else:
        if w_hh0.ndim != 2 or int(w_hh0.shape[1]) < 1 or int(w_hh0.shape[0]) != gates * int(w_hh0.shape[1]):
            raise ValueError(
                f"{label} must have shape ({gates}*hidden_size, hidden_size) with hidden_size >= 1, "
                f"got {tuple(w_hh0.shape)}"
            )
        hs, proj = int(w_hh0.shape[1]), 0
    out = proj or hs  # the size of h and of each direction's outputs
    layers = len(params) // dirs
    for k, entry in enumerate(params):
        w_ih, w_hh, b_ih, b_hh = entry[:4]
        layer = k // dirs
        features = input_size if layer == 0 else dirs * out
        what = "proj_size" if proj else "hidden_size"
        src = "x's features" if layer == 0 else f"{dirs}*{what}, the previous layer's output"
        check_shape(w_ih, _param_label(k, 0, dirs), (gates * hs, features),
                    f"({gates}*hidden_size, input_size) with hidden_size={hs} and input_size={features} ({src})")
        check_shape(w_hh, _param_label(k, 1, dirs), (gates * hs, out),
                    f"({gates}*hidden_size, {what}) with hidden_size={hs}" + (f", proj_size={proj}" if proj else ""))
        for j, b in ((2, b_ih), (3, b_hh)):
            check_shape(b, _param_label(k, j, dirs), (gates * hs,), f"({gates}*hidden_size,) with hidden_size={hs}")
        if proj:
            check_shape(entry[4], _param_label(k, 4, dirs), (proj, hs),
                        f"(proj_size, hidden_size) with hidden_size={hs}, proj_size={proj}")
    return layers, hs, proj, labelled


def _check_lengths(lengths: Any, n: int, steps: int) -> tuple[int, ...] | None:
    """``lengths`` as a tuple of ints in [1, T] (``None`` when absent or all equal to T)."""
    if lengths is None:
        return None
    if _arrays.is_array(lengths):
        check_array(lengths, "lengths")  # refuses a masked array
        xp = _arrays.namespace(lengths)
        dname = _arrays.dtype_name(xp, lengths.dtype)
        if dname not in _INT_DTYPES:
            raise TypeError(f"lengths must be an integer array or a sequence of ints, got dtype {dname}")
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D (one length per sequence), got shape {tuple(lengths.shape)}")
        values = tuple(int(lengths[i]) for i in range(int(lengths.shape[0])))
    elif isinstance(lengths, (list, tuple)):
        for i, v in enumerate(lengths):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"lengths[{i}] must be an int, got {type(v).__name__}")
        values = tuple(int(v) for v in lengths)
    else:
        raise TypeError(f"lengths must be an integer array or a sequence of ints, got {type(lengths).__name__}")
    if len(values) != n:
        raise ValueError(f"lengths must have one entry per sequence (N={n}), got {len(values)}")
    for i, v in enumerate(values):
        if not 1 <= v <= steps:
            raise ValueError(
                f"lengths[{i}] = {v} is out of range: each length must be between 1 and T={steps} "
                "(the padded sequence length)"
            )
    if all(v == steps for v in values):
        return None
    return values


def _flatten_lstm_cotangent(cotangent: Any) -> tuple[Any, Any, Any]:
    """``(d_outputs, (d_h_n, d_c_n))`` → the forward's flat ``(d_outputs, d_h_n, d_c_n)``."""
    message = (
        "lstm: pass the cotangent as (d_outputs, (d_h_n, d_c_n)), mirroring the result "
        "(outputs, (h_n, c_n)); any entry, or the whole state pair, may be None"
    )
    if not isinstance(cotangent, (tuple, list)) or len(cotangent) != 2:
        raise ValueError(message)
    d_out, states = cotangent
    if states is None:
        return d_out, None, None
    if not isinstance(states, (tuple, list)) or len(states) != 2:
        raise ValueError(message)
    return d_out, states[0], states[1]


def _lstm_result(outputs: tuple[Any, ...], call: Any) -> Any:
    """``lstm``'s result: ``(outputs, (h_n, c_n))``."""
    return outputs[0], (outputs[1], outputs[2])


def _prepare_sequence(
    op: str,
    gates: int,
    x: Any,
    params: Any,
    h0: Any,
    c0: Any,
    *,
    batch_first: Any,
    bidirectional: Any,
    lengths: Any,
    extra: dict[str, Any],
) -> Prepared:
    has_cell = op == "lstm"
    check_array(x, "x")
    check_array(h0, "h0", optional=True)
    if has_cell:
        check_array(c0, "c0", optional=True)
    batch_first = check_bool(batch_first, "batch_first")
    dirs = 2 if check_bool(bidirectional, "bidirectional") else 1
    if x.ndim != 3:
        layout = "(N, T, input_size)" if batch_first else "(T, N, input_size)"
        raise ValueError(f"x must be 3-D {layout} (batch_first={batch_first}), got shape {tuple(x.shape)}")
    steps, n = (int(x.shape[1]), int(x.shape[0])) if batch_first else (int(x.shape[0]), int(x.shape[1]))
    layers, hs, proj, labelled = _check_params(params, gates, dirs, int(x.shape[2]), allow_projections=has_cell)
    states = {"h0": h0, "c0": c0} if has_cell else {"h0": h0}
    family, device = check_same_library({"x": x, **states, **labelled})
    xp = _arrays.namespace(x)
    dtype = floating_dtype(xp, x, "x")
    _check_state_dtype(xp, dtype, states)
    mixed = check_param_dtypes(xp, dtype, labelled)
    for name, value in states.items():
        size, what = (proj, "proj_size") if proj and name == "h0" else (hs, "hidden_size")
        check_shape(value, name, (layers * dirs, n, size),
                    f"(num_layers*num_directions, N, {what}) with num_layers={layers}, "
                    f"num_directions={dirs}, N={n}, {what}={size}")
    norm_lengths = _check_lengths(lengths, n, steps)

    arrays = {"x": x, **states}
    names = []
    for k, entry in enumerate(params):
        row = tuple(_param_name(k, j, dirs) for j in range(len(entry)))
        names.append(row)
        arrays.update(zip(row, entry))
    call_params = {
        "kind": op,
        "activation": None,
        "reset_after": True,
        **extra,
        "num_layers": layers,
        "num_directions": dirs,
        "hidden_size": hs,
        "proj_size": proj,
        "batch_first": batch_first,
        "lengths": norm_lengths,
        "param_names": tuple(names),
        "mixed_precision": mixed,
    }
    call = make_call(op, arrays, call_params, family=family, device=device, dtype=dtype)
    fields = ("x", "params", *states)
    values = {"x": x, "params": params, **states}
    if has_cell:
        return Prepared(
            call, fields, values, n_diff_outputs=3,
            finish=_lstm_result,
            flatten_cotangent=_flatten_lstm_cotangent,
        )
    return Prepared(call, fields, values, n_diff_outputs=2, finish=all_outputs)


@public_op(grad_fields=("x", "params", "h0"), outputs=("outputs", "h_n"))
def rnn(
    x: Array,
    params: RnnParams,
    h0: Array | None = None,
    *,
    activation: ActivationLike = "tanh",
    batch_first: bool = False,
    bidirectional: bool = False,
    lengths: Lengths | None = None,
) -> tuple[Any, Any]:
    """A stacked (bidirectional) Elman RNN over whole sequences, like ``torch.nn.RNN``.

    Each layer and direction runs, over t = 1 … T (backwards for the reverse
    direction):

        h_t = act(x_t·w_ihᵀ + b_ih + h_{t−1}·w_hhᵀ + b_hh)

    (G = 1 in the shapes below); layer l > 0 takes layer l − 1's outputs as its
    x.  The input projection of all time steps is one matrix product.

    Args:
        x: ``(T, N, I)``, or ``(N, T, I)`` with ``batch_first=True``.
        params: a list with one ``(w_ih, w_hh, b_ih, b_hh)`` tuple per layer and
            direction, in PyTorch's order (layer 0 forward, layer 0 reverse,
            layer 1 forward, …): ``w_ih`` ``(G*H, I)`` for layer 0 and
            ``(G*H, D*H)`` above it, ``w_hh`` ``(G*H, H)``, biases ``(G*H,)`` or
            ``None``.  The number of layers L is ``len(params) / D``.
        h0: ``(L*D, N, H)`` initial hidden states in x's dtype, or ``None`` for zeros.
        activation: ``"tanh"`` (default, ``nonlinearity="tanh"``) or ``"relu"``,
            for every layer.
        batch_first: x and outputs are ``(N, T, ·)``; states stay ``(L*D, N, H)``.
        bidirectional: D = 2, a reverse direction per layer whose outputs are
            concatenated after the forward ones (else D = 1).
        lengths: ``(N,)`` ints in [1, T] (a sequence or an integer array of any
            library, e.g. a CPU tensor), the sequences' lengths as with
            ``pack_padded_sequence(enforce_sorted=False)``: outputs past a
            sequence's end are zero, its final state is the one at its last step,
            and the reverse direction starts at its last step.  ``None``: every
            sequence has length T.

    Returns:
        ``(outputs, h_n)``: outputs ``(T, N, D*H)`` (``(N, T, D*H)`` batch
        first), the last layer's h_t; h_n ``(L*D, N, H)``, every layer's and
        direction's final state; both in x's dtype.

    Raises:
        ValueError: ``x`` not 3-D, an odd number of ``params`` entries with
            ``bidirectional``, weights or states whose shapes do not fit (the
            message names the entry, e.g. ``params[2][0] (w_ih_l1)``), lengths
            out of [1, T] or not one per sequence, arrays on different
            devices, an activation other than tanh or relu.
        TypeError: ``params`` not a non-empty list of 4-tuples, non-arrays,
            arrays of different libraries, a non-floating ``x``, states not in
            ``x``'s dtype, weight dtype mixes other than float16/bfloat16 ``x``
            with float32 weights, non-integer ``lengths``, non-bool flags.

    Gradients:
        ``vjp`` fields: ``(x, params, h0)`` — the ``params`` gradient is a list of
        4-tuples like ``params`` (``None`` for ``None`` biases); the pullback takes
        ``(d_outputs, d_h_n)``, either may be ``None``.  Back-propagation through time;
        ``pullback(ct, out=...)`` takes ``params`` buffers as a list of 4-tuples.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them; ``aten`` (torch tensors only, CPU or CUDA:
        PyTorch's fused layer, what ``torch.nn.RNN`` runs; first under ``auto`` for torch
        tensors, where it measured faster than ``numba``).
        ``pnn.explain`` reports which one a call runs and why the others were passed over.
    """
    extra = {"activation": _rnn_activation(activation, "rnn")}
    return _prepare_sequence("rnn", 1, x, params, h0, None, batch_first=batch_first,
                             bidirectional=bidirectional, lengths=lengths, extra=extra)


@public_op(grad_fields=("x", "params", "h0", "c0"), outputs=("outputs", ("h_n", "c_n")))
def lstm(
    x: Array,
    params: RnnParams,
    h0: Array | None = None,
    c0: Array | None = None,
    *,
    batch_first: bool = False,
    bidirectional: bool = False,
    lengths: Lengths | None = None,
) -> tuple[Any, tuple[Any, Any]]:
    """A stacked (bidirectional) LSTM over whole sequences, like ``torch.nn.LSTM``.

    Each layer and direction runs :func:`lstm_cell` over t = 1 … T (backwards
    for the reverse direction), ``(h_t, c_t) = lstm_cell(x_t, h_{t−1}, c_{t−1},
    w_ih, w_hh, b_ih, b_hh)`` (G = 4, gates i, f, g, o in the shapes below);
    layer l > 0 takes layer l − 1's outputs as its x.  The input projection of
    all time steps is one matrix product.  With projections (``torch.nn.LSTM``'s
    ``proj_size``: every ``params`` entry has a fifth weight ``w_hr``), the
    hidden state is projected after each step, ``h_t = (o ⊙ tanh(c_t))·w_hrᵀ``,
    and has P entries instead of H (``c_t`` keeps H).

    Args:
        x: ``(T, N, I)``, or ``(N, T, I)`` with ``batch_first=True``.
        params: a list with one ``(w_ih, w_hh, b_ih, b_hh)`` tuple per layer and
            direction, in PyTorch's order (layer 0 forward, layer 0 reverse,
            layer 1 forward, …): ``w_ih`` ``(G*H, I)`` for layer 0 and
            ``(G*H, D*H)`` above it, ``w_hh`` ``(G*H, H)``, biases ``(G*H,)`` or
            ``None``.  The number of layers L is ``len(params) / D``.  With
            projections every entry is ``(w_ih, w_hh, b_ih, b_hh, w_hr)``:
            ``w_hr`` ``(P, H)`` (PyTorch's ``weight_hr_l{k}``) with 1 <= P < H,
            ``w_hh`` ``(G*H, P)`` and ``w_ih`` ``(G*H, D*P)`` above layer 0.
        h0: ``(L*D, N, H)`` (``(L*D, N, P)`` with projections) initial hidden
            states in x's dtype, or ``None`` for zeros.
        c0: ``(L*D, N, H)`` initial cell states in x's dtype, or ``None`` for zeros.
        batch_first: x and outputs are ``(N, T, ·)``; states stay ``(L*D, N, H)``.
        bidirectional: D = 2, a reverse direction per layer whose outputs are
            concatenated after the forward ones (else D = 1).
        lengths: ``(N,)`` ints in [1, T] (a sequence or an integer array of any
            library, e.g. a CPU tensor), the sequences' lengths as with
            ``pack_padded_sequence(enforce_sorted=False)``: outputs past a
            sequence's end are zero, its final state is the one at its last step,
            and the reverse direction starts at its last step.  ``None``: every
            sequence has length T.

    Returns:
        ``(outputs, (h_n, c_n))``: outputs ``(T, N, D*H)`` (``(N, T, D*H)``
        batch first), the last layer's h_t; h_n and c_n ``(L*D, N, H)``, every
        layer's and direction's final states; all in x's dtype.  With projections
        outputs are ``(T, N, D*P)`` and h_n ``(L*D, N, P)``.

    Raises:
        ValueError: ``x`` not 3-D, an odd number of ``params`` entries with
            ``bidirectional``, weights or states whose shapes do not fit (the
            message names the entry, e.g. ``params[2][0] (w_ih_l1)``), lengths
            out of [1, T] or not one per sequence, arrays on different
            devices.
        TypeError: ``params`` not a non-empty list of 4-tuples (or of 5-tuples
            throughout, with projections), non-arrays,
            arrays of different libraries, a non-floating ``x``, states not in
            ``x``'s dtype, weight dtype mixes other than float16/bfloat16 ``x``
            with float32 weights, non-integer ``lengths``, non-bool flags.

    Gradients:
        ``vjp`` fields: ``(x, params, h0, c0)`` — the ``params`` gradient is a list of
        4-tuples (5-tuples) like ``params`` (``None`` for ``None`` biases); with
        projections dh_full = dh·w_hr feeds the cell's backward and dw_hr =
        Σ_t dh_tᵀ·(o ⊙ tanh(c_t)); the pullback takes
        ``(d_outputs, (d_h_n, d_c_n))`` mirroring the result, any entry (or the state
        pair) ``None``.  Back-propagation through time; ``pullback(ct, out=...)`` takes
        ``params`` buffers as a list of 4-tuples.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them; ``aten`` (torch tensors only, CPU or CUDA:
        PyTorch's fused layer, what ``torch.nn.LSTM`` runs; first under ``auto`` for torch
        tensors, where it measured faster than ``numba``).  Every backend runs projections.
        ``pnn.explain`` reports which one a call runs and why the others were passed over.
    """
    return _prepare_sequence("lstm", 4, x, params, h0, c0, batch_first=batch_first,
                             bidirectional=bidirectional, lengths=lengths, extra={})


@public_op(grad_fields=("x", "params", "h0"), outputs=("outputs", "h_n"))
def gru(
    x: Array,
    params: RnnParams,
    h0: Array | None = None,
    *,
    reset_after: bool = True,
    batch_first: bool = False,
    bidirectional: bool = False,
    lengths: Lengths | None = None,
) -> tuple[Any, Any]:
    """A stacked (bidirectional) GRU over whole sequences, like ``torch.nn.GRU``.

    Each layer and direction runs :func:`gru_cell` over t = 1 … T (backwards for
    the reverse direction), ``h_t = gru_cell(x_t, h_{t−1}, w_ih, w_hh, b_ih, b_hh,
    reset_after=reset_after)`` (G = 3, gates r, z, n in the shapes below); layer
    l > 0 takes layer l − 1's outputs as its x.  The input projection of all
    time steps is one matrix product.

    Args:
        x: ``(T, N, I)``, or ``(N, T, I)`` with ``batch_first=True``.
        params: a list with one ``(w_ih, w_hh, b_ih, b_hh)`` tuple per layer and
            direction, in PyTorch's order (layer 0 forward, layer 0 reverse,
            layer 1 forward, …): ``w_ih`` ``(G*H, I)`` for layer 0 and
            ``(G*H, D*H)`` above it, ``w_hh`` ``(G*H, H)``, biases ``(G*H,)`` or
            ``None``.  The number of layers L is ``len(params) / D``.
        h0: ``(L*D, N, H)`` initial hidden states in x's dtype, or ``None`` for zeros.
        reset_after: ``True`` (default): the reset gate multiplies h·w_hnᵀ + b_hn,
            PyTorch's and cuDNN's form; ``False``: it multiplies h before the
            product, the original GRU (see :func:`gru_cell`).
        batch_first: x and outputs are ``(N, T, ·)``; states stay ``(L*D, N, H)``.
        bidirectional: D = 2, a reverse direction per layer whose outputs are
            concatenated after the forward ones (else D = 1).
        lengths: ``(N,)`` ints in [1, T] (a sequence or an integer array of any
            library, e.g. a CPU tensor), the sequences' lengths as with
            ``pack_padded_sequence(enforce_sorted=False)``: outputs past a
            sequence's end are zero, its final state is the one at its last step,
            and the reverse direction starts at its last step.  ``None``: every
            sequence has length T.

    Returns:
        ``(outputs, h_n)``: outputs ``(T, N, D*H)`` (``(N, T, D*H)`` batch
        first), the last layer's h_t; h_n ``(L*D, N, H)``, every layer's and
        direction's final state; both in x's dtype.

    Raises:
        ValueError: ``x`` not 3-D, an odd number of ``params`` entries with
            ``bidirectional``, weights or states whose shapes do not fit (the
            message names the entry, e.g. ``params[2][0] (w_ih_l1)``), lengths
            out of [1, T] or not one per sequence, arrays on different
            devices.
        TypeError: ``params`` not a non-empty list of 4-tuples, non-arrays,
            arrays of different libraries, a non-floating ``x``, states not in
            ``x``'s dtype, weight dtype mixes other than float16/bfloat16 ``x``
            with float32 weights, non-integer ``lengths``, non-bool flags.

    Gradients:
        ``vjp`` fields: ``(x, params, h0)`` — the ``params`` gradient is a list of
        4-tuples like ``params`` (``None`` for ``None`` biases); the pullback takes
        ``(d_outputs, d_h_n)``, either may be ``None``.  Back-propagation through time;
        ``pullback(ct, out=...)`` takes ``params`` buffers as a list of 4-tuples.

    Backends:
        ``reference`` (the array-API implementation: every array library, device and
        floating dtype); ``numba`` (CPU kernels for NumPy arrays and CPU torch tensors,
        zero-copy, float32 and float64); GPU kernels (``cupy``: CUDA C compiled through
        CuPy's ``RawModule``; ``numba_cuda``) for CuPy arrays and CUDA torch tensors,
        where ``pnn.capabilities()`` lists them; ``aten`` (torch tensors only, CPU or CUDA:
        PyTorch's fused layer, what ``torch.nn.GRU`` runs; ``reset_after=True`` only; after
        ``numba`` under ``auto``, which measured as fast).
        ``pnn.explain`` reports which one a call runs and why the others were passed over.
    """
    extra = {"reset_after": check_bool(reset_after, "reset_after")}
    return _prepare_sequence("gru", 3, x, params, h0, None, batch_first=batch_first,
                             bidirectional=bidirectional, lengths=lengths, extra=extra)

