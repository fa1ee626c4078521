"""Recurrent cells and sequences in the array API: forward and hand-written backward.

This is the implementation every array library can run and the oracle the
kernels are tested against.  Weights follow PyTorch: ``w_ih`` is ``(G*H, I)``,
``w_hh`` is ``(G*H, H)`` with the gates stacked along the rows (LSTM i, f, g, o;
GRU r, z, n; plain RNN G = 1).

One *direction* of one layer over a sequence ``X`` of shape ``(T, N, I)`` is::

    GI = X · w_ihᵀ + b_ih                       one matrix product for all T steps
    for t in time order (reversed for the reverse direction):
        state_t = cell(GI[t], state_{t-1})       recurrent product + cell, per step

with the cells (σ the logistic function, ⊙ elementwise)

    rnn:   h' = act(GI + h·w_hhᵀ + b_hh)                       act = tanh or relu
    lstm:  [i f g o] = [σ σ tanh σ](GI + h·w_hhᵀ + b_hh)
           c' = f ⊙ c + i ⊙ g,    h' = o ⊙ tanh(c')
    gru:   r, z = σ(GI_rz + h·w_hh,rzᵀ + b_hh,rz)
           reset_after=True:  n = tanh(GI_n + r ⊙ (h·w_hnᵀ + b_hn))
           reset_after=False: n = tanh(GI_n + (r ⊙ h)·w_hnᵀ + b_hn)
           h' = (1 − z) ⊙ n + z ⊙ h

The forward keeps the activated gates of every step in one ``(T, N, G*H)``
buffer (the GRU with ``reset_after=True`` also keeps ``h·w_hnᵀ + b_hn``, a
``(T, N, H)`` buffer, which its backward needs), plus the state entering each
step.  Backward through time writes every step's gate gradient (the gradient
of the gate pre-activations, which is also the gradient of ``GI``) into one
``(T, N, G*H)`` buffer; then each weight gradient is one matrix product over
all ``T·N`` rows (``dw_ih = dGIᵀ·X``, ``dw_hh = dGHᵀ·H_prev``; the GRU's
``w_hn`` rows take their own product because their gradient differs from the
input side's by the reset gate) and ``dX = dGI·w_ih`` is one product as well.

Variable lengths (packed sequences) are masks: at a step past a sequence's
end the state is carried over unchanged and the output is zero, so the
forward direction's final state is the one at the sequence's last step and the
reverse direction starts there from the initial state.  The backward routes
the state gradient around masked steps the same way.

Buffers are filled in place where the array library allows it (NumPy, PyTorch,
CuPy, array-api-strict); for immutable arrays (JAX) the steps are stacked once
at the end instead.  Half-precision data is computed in float32.
"""

from __future__ import annotations

from typing import Any

from .. import _arrays
from ..dispatch import Call
from . import activations
from ._common import compute_dtype, device, index_dtype

__all__ = [
    "gru_backward",
    "gru_cell_backward",
    "gru_cell_forward",
    "gru_forward",
    "lstm_backward",
    "lstm_cell_backward",
    "lstm_cell_forward",
    "lstm_forward",
    "rnn_backward",
    "rnn_cell_backward",
    "rnn_cell_forward",
    "rnn_forward",
]


# --------------------------------------------------------------------------- buffers


def _writable(a: Any) -> bool:
    """Whether step results can be written into ``a`` in place."""
    return _arrays.is_writeable(a)


class _Steps:
    """A ``(T, *shape)`` array filled one time step at a time.

    In place where the library allows it; otherwise the steps are kept in a
    list and stacked once by :meth:`array`.
    """

    def __init__(self, xp: Any, steps: int, shape: tuple[int, ...], dtype: Any, device: Any) -> None:
        self.xp = xp
        self.buffer = xp.empty((steps, *shape), dtype=dtype, device=device)
        self.inplace = _writable(self.buffer)
        self.items: list[Any] | None = None if self.inplace else [None] * steps

    def __setitem__(self, t: int, value: Any) -> None:
        if self.inplace:
            self.buffer[t, ...] = value
        else:
            self.items[t] = value  # type: ignore[index]

    def put(self, t: int, parts: list[Any]) -> Any:
        """Store the concatenation of ``parts`` (along the last axis) as step ``t``; return it."""
        if self.inplace:
            start = 0
            for part in parts:
                width = int(part.shape[-1])
                self.buffer[t, ..., start : start + width] = part
                start += width
            return self.buffer[t, ...]
        value = parts[0] if len(parts) == 1 else self.xp.concat(parts, axis=-1)
        self.items[t] = value  # type: ignore[index]
        return value

    def array(self) -> Any:
        if self.inplace or not self.items:
            return self.buffer
        return self.xp.stack(self.items)


def _cast(xp: Any, a: Any, dtype: Any) -> Any:
    return None if a is None else xp.astype(a, dtype, copy=False)


def _store(out: Any, name: Any, value: Any) -> Any:
    """Write ``value`` into the caller's buffer ``out[name]`` when one was given."""
    buffer = None
    if out is not None:
        try:
            buffer = out[name]
        except (KeyError, IndexError, TypeError):
            buffer = None
    if buffer is None:
        return value
    buffer[...] = value
    return buffer


def _sigmoid(xp: Any, z: Any) -> Any:
    return activations.sigmoid(xp, z)


# --------------------------------------------------------------------------- cells


class _DirRes:
    """What one direction's forward keeps for the backward."""

    __slots__ = ("cprev", "extra", "gates", "hprev")

    def __init__(self, gates: Any, extra: Any, hprev: Any, cprev: Any) -> None:
        self.gates = gates  # (T, N, G*H) activated gates
        self.extra = extra  # (T, N, H) or None (GRU reset_after: h·w_hnᵀ + b_hn)
        self.hprev = hprev  # (T, N, H) state entering each step
        self.cprev = cprev  # (T, N, H) cell state entering each step (LSTM) or None


class _RNN:
    gates = 1
    has_cell = False
    has_extra = False

    def __init__(self, act: Any) -> None:
        self.act = act

    def step(self, xp: Any, gi: Any, h: Any, c: Any, w_hh: Any, b_hh: Any) -> tuple[Any, Any, list, Any]:
        z = gi + xp.matmul(h, w_hh.T)
        if b_hh is not None:
            z = z + b_hh
        h_new = activations.apply(xp, z, self.act)
        return h_new, None, [h_new], None

    def step_back(self, xp: Any, res: _DirRes, t: int, dh: Any, dc: Any, w_hh: Any,
                  dgi: _Steps, dext: Any, want_prev: bool) -> tuple[Any, Any]:
        h_new = res.gates[t, ...]
        g = dgi.put(t, [dh * activations.derivative_from_output(xp, h_new, self.act)])
        return (xp.matmul(g, w_hh) if want_prev else None), None

    def hidden_grads(self, xp: Any, dgi: Any, dext: Any, res: _DirRes, bias: bool) -> tuple[Any, Any]:
        hp = _flat(xp, res.hprev)
        return xp.matmul(dgi.T, hp), (xp.sum(dgi, axis=0) if bias else None)


class _LSTM:
    gates = 4
    has_cell = True
    has_extra = False

    def step(self, xp: Any, gi: Any, h: Any, c: Any, w_hh: Any, b_hh: Any) -> tuple[Any, Any, list, Any]:
        hs = int(c.shape[-1])  # h has P < H entries with projections
        z = gi + xp.matmul(h, w_hh.T)
        if b_hh is not None:
            z = z + b_hh
        i_f = _sigmoid(xp, z[..., : 2 * hs])
        g = xp.tanh(z[..., 2 * hs : 3 * hs])
        o = _sigmoid(xp, z[..., 3 * hs :])
        c_new = i_f[..., hs:] * c + i_f[..., :hs] * g
        h_new = o * xp.tanh(c_new)
        return h_new, c_new, [i_f, g, o], None

    def step_back(self, xp: Any, res: _DirRes, t: int, dh: Any, dc: Any, w_hh: Any,
                  dgi: _Steps, dext: Any, want_prev: bool) -> tuple[Any, Any]:
        gates = res.gates[t, ...]
        c_prev = res.cprev[t, ...]
        hs = int(c_prev.shape[-1])
        i, f = gates[..., :hs], gates[..., hs : 2 * hs]
        g, o = gates[..., 2 * hs : 3 * hs], gates[..., 3 * hs :]
        tc = xp.tanh(f * c_prev + i * g)
        dct = dc + dh * o * (1.0 - tc * tc)
        parts = [
            dct * g * i * (1.0 - i),
            dct * c_prev * f * (1.0 - f),
            dct * i * (1.0 - g * g),
            dh * tc * o * (1.0 - o),
        ]
        d = dgi.put(t, parts)
        if not want_prev:
            return None, None
        return xp.matmul(d, w_hh), dct * f

    def hidden_grads(self, xp: Any, dgi: Any, dext: Any, res: _DirRes, bias: bool) -> tuple[Any, Any]:
        hp = _flat(xp, res.hprev)
        return xp.matmul(dgi.T, hp), (xp.sum(dgi, axis=0) if bias else None)


class _GRU:
    gates = 3
    has_cell = False

    def __init__(self, reset_after: bool) -> None:
        self.reset_after = reset_after
        self.has_extra = reset_after

    def step(self, xp: Any, gi: Any, h: Any, c: Any, w_hh: Any, b_hh: Any) -> tuple[Any, Any, list, Any]:
        hs = int(h.shape[-1])
        if self.reset_after:
            gh = xp.matmul(h, w_hh.T)
            if b_hh is not None:
                gh = gh + b_hh
            rz = _sigmoid(xp, gi[..., : 2 * hs] + gh[..., : 2 * hs])
            ghn = gh[..., 2 * hs :]
            n = xp.tanh(gi[..., 2 * hs :] + rz[..., :hs] * ghn)
        else:
            ghrz = xp.matmul(h, w_hh[: 2 * hs, ...].T)
            if b_hh is not None:
                ghrz = ghrz + b_hh[: 2 * hs]
            rz = _sigmoid(xp, gi[..., : 2 * hs] + ghrz)
            pre = gi[..., 2 * hs :] + xp.matmul(rz[..., :hs] * h, w_hh[2 * hs :, ...].T)
            if b_hh is not None:
                pre = pre + b_hh[2 * hs :]
            n = xp.tanh(pre)
            ghn = None
        z = rz[..., hs:]
        h_new = n + z * (h - n)
        return h_new, None, [rz, n], ghn

    def step_back(self, xp: Any, res: _DirRes, t: int, dh: Any, dc: Any, w_hh: Any,
                  dgi: _Steps, dext: Any, want_prev: bool) -> tuple[Any, Any]:
        gates = res.gates[t, ...]
        h_prev = res.hprev[t, ...]
        hs = int(h_prev.shape[-1])
        r, z, n = gates[..., :hs], gates[..., hs : 2 * hs], gates[..., 2 * hs :]
        dzz = dh * (h_prev - n) * z * (1.0 - z)
        dzn = dh * (1.0 - z) * (1.0 - n * n)
        w_rz, w_n = w_hh[: 2 * hs, ...], w_hh[2 * hs :, ...]
        if self.reset_after:
            dzr = dzn * res.extra[t, ...] * r * (1.0 - r)
            d = dgi.put(t, [dzr, dzz, dzn])
            dn_h = dext.put(t, [dzn * r])
            if not want_prev:
                return None, None
            dh_prev = dh * z + xp.matmul(d[..., : 2 * hs], w_rz) + xp.matmul(dn_h, w_n)
        else:
            drh = xp.matmul(dzn, w_n)  # gradient of r ⊙ h
            dzr = drh * h_prev * r * (1.0 - r)
            d = dgi.put(t, [dzr, dzz, dzn])
            if not want_prev:
                return None, None
            dh_prev = dh * z + drh * r + xp.matmul(d[..., : 2 * hs], w_rz)
        return dh_prev, None

    def hidden_grads(self, xp: Any, dgi: Any, dext: Any, res: _DirRes, bias: bool) -> tuple[Any, Any]:
        hp = _flat(xp, res.hprev)
        hs = int(hp.shape[-1])
        d_rz = dgi[..., : 2 * hs]
        if self.reset_after:
            d_n = _flat(xp, dext)
            rows_n = xp.matmul(d_n.T, hp)
        else:
            d_n = dgi[..., 2 * hs :]
            r = _flat(xp, res.gates)[..., :hs]
            rows_n = xp.matmul(d_n.T, r * hp)
        dw = xp.concat([xp.matmul(d_rz.T, hp), rows_n], axis=0)
        db = xp.concat([xp.sum(d_rz, axis=0), xp.sum(d_n, axis=0)], axis=0) if bias else None
        return dw, db


def _unprojected(xp: Any, res: _DirRes) -> Any:
    """``(T, N, H)``: each LSTM step's hidden state before its projection, o ⊙ tanh(c_t)."""
    hs = int(res.cprev.shape[-1])
    gates = res.gates
    i, f = gates[..., :hs], gates[..., hs : 2 * hs]
    g, o = gates[..., 2 * hs : 3 * hs], gates[..., 3 * hs :]
    return o * xp.tanh(f * res.cprev + i * g)


def _flat(xp: Any, a: Any) -> Any:
    """``(T, N, F)`` as ``(T*N, F)``."""
    return xp.reshape(a, (int(a.shape[0]) * int(a.shape[1]), int(a.shape[2])))


def _kind(call: Call) -> Any:
    kind = call.kind
    if kind == "rnn":
        return _RNN(call.activation)
    if kind == "lstm":
        return _LSTM()
    return _GRU(call.reset_after)


# --------------------------------------------------------------------------- one direction


def _forward_direction(
    kind: Any, xp: Any, X: Any, w: tuple, h0: Any, c0: Any, mask: Any, reverse: bool, save: bool
) -> tuple[Any, Any, Any, _DirRes | None]:
    """Run one layer direction over ``X`` ``(T, N, I)``: (outputs, h_T, c_T, residuals).

    ``w`` is ``(w_ih, w_hh, b_ih, b_hh)``, or with LSTM projections ``(…, w_hr)``: then each
    step's hidden state is projected, ``h = h_full·w_hrᵀ`` (``hs`` below is h's size, P).
    """
    w_ih, w_hh, b_ih, b_hh = w[:4]
    w_hr = w[4] if len(w) > 4 else None
    steps, n, features = (int(s) for s in X.shape)
    gh, hs = (int(s) for s in w_hh.shape)
    cell = gh // kind.gates
    dt, dev = X.dtype, device(X)
    gi = xp.matmul(xp.reshape(X, (steps * n, features)), w_ih.T)
    if b_ih is not None:
        gi = gi + b_ih
    gi = xp.reshape(gi, (steps, n, gh))

    out = _Steps(xp, steps, (n, hs), dt, dev)
    gates = _Steps(xp, steps, (n, gh), dt, dev) if save else None
    extra = _Steps(xp, steps, (n, hs), dt, dev) if save and kind.has_extra else None
    hprev = _Steps(xp, steps, (n, hs), dt, dev) if save else None
    cprev = _Steps(xp, steps, (n, cell), dt, dev) if save and kind.has_cell else None
    zeros = xp.zeros((n, hs), dtype=dt, device=dev) if mask is not None else None

    h, c = h0, c0
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        if save:
            hprev[t] = h
            if cprev is not None:
                cprev[t] = c
        h_new, c_new, parts, ex = kind.step(xp, gi[t, ...], h, c, w_hh, b_hh)
        if w_hr is not None:
            h_new = xp.matmul(h_new, w_hr.T)
        if save:
            gates.put(t, parts)
            if extra is not None:
                extra[t] = ex
        if mask is None:
            out[t] = h_new
            h, c = h_new, c_new
        else:
            m = mask[t, ...]
            out[t] = xp.where(m, h_new, zeros)
            h = xp.where(m, h_new, h)
            if c is not None:
                c = xp.where(m, c_new, c)
    res = None
    if save:
        res = _DirRes(
            gates.array(),
            None if extra is None else extra.array(),
            hprev.array(),
            None if cprev is None else cprev.array(),
        )
    return out.array(), h, c, res


def _backward_direction(
    kind: Any,
    xp: Any,
    X: Any,
    w: tuple,
    res: _DirRes,
    dY: Any,
    dh: Any,
    dc: Any,
    mask: Any,
    reverse: bool,
    want_dx: bool,
    want_w: bool,
    want_state: bool,
) -> tuple[Any, Any, Any, tuple | None]:
    """Backward through time of one direction: (dX, dh0, dc0, (dw_ih, dw_hh, db_ih, db_hh[, dw_hr])).

    With projections each step's dh (P entries) is kept for dw_hr and enters the cell as
    dh_full = dh·w_hr.
    """
    w_ih, w_hh, b_ih, b_hh = w[:4]
    w_hr = w[4] if len(w) > 4 else None
    steps, n, features = (int(s) for s in X.shape)
    gh, hs = (int(s) for s in w_hh.shape)
    cell = gh // kind.gates
    dt, dev = X.dtype, device(X)
    dgi = _Steps(xp, steps, (n, gh), dt, dev)
    dext = _Steps(xp, steps, (n, hs), dt, dev) if kind.has_extra else None
    dproj = _Steps(xp, steps, (n, hs), dt, dev) if w_hr is not None else None
    zeros = xp.zeros((n, hs), dtype=dt, device=dev) if mask is not None else None
    zeros_c = xp.zeros((n, cell), dtype=dt, device=dev) if mask is not None and kind.has_cell else None

    order = range(steps) if reverse else range(steps - 1, -1, -1)
    for k, t in enumerate(order):
        want_prev = want_state or k < steps - 1
        g = dh if dY is None else dh + dY[t, ...]
        gc = dc
        if mask is not None:
            m = mask[t, ...]
            g = xp.where(m, g, zeros)
            pass_h = xp.where(m, zeros, dh)
            if dc is not None:
                gc = xp.where(m, dc, zeros_c)
                pass_c = xp.where(m, zeros_c, dc)
        if w_hr is not None:
            dproj[t] = g
            g = xp.matmul(g, w_hr)
        dh_prev, dc_prev = kind.step_back(xp, res, t, g, gc, w_hh, dgi, dext, want_prev)
        if want_prev:
            dh, dc = dh_prev, dc_prev
            if mask is not None:
                dh = dh + pass_h
                if dc is not None:
                    dc = dc + pass_c

    d = _flat(xp, dgi.array())
    dX = None
    if want_dx:
        dX = xp.reshape(xp.matmul(d, w_ih), (steps, n, features))
    wgrads = None
    if want_w:
        dw_ih = xp.matmul(d.T, xp.reshape(X, (steps * n, features)))
        db_ih = xp.sum(d, axis=0) if b_ih is not None else None
        dw_hh, db_hh = kind.hidden_grads(xp, d, None if dext is None else dext.array(), res, b_hh is not None)
        wgrads = (dw_ih, dw_hh, db_ih, db_hh)
        if w_hr is not None:
            wgrads += (xp.matmul(_flat(xp, dproj.array()).T, _flat(xp, _unprojected(xp, res))),)
    return dX, (dh if want_state else None), (dc if want_state else None), wgrads


# --------------------------------------------------------------------------- cells: public entry points


def _cell_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    xp, x = call.xp, call.x
    kind = _kind(call)
    cdt = compute_dtype(xp, x)
    hs = call.hidden_size
    n = 1 if call.unbatched else int(x.shape[0])
    features = int(x.shape[-1])
    X = xp.reshape(_cast(xp, x, cdt), (1, n, features))
    h = xp.reshape(_cast(xp, call.h, cdt), (n, hs))
    c = xp.reshape(_cast(xp, call.c, cdt), (n, hs)) if kind.has_cell else None
    w = tuple(_cast(xp, call.arrays[k], cdt) for k in ("w_ih", "w_hh", "b_ih", "b_hh"))
    _, h_new, c_new, res = _forward_direction(kind, xp, X, w, h, c, None, False, call.save)
    state_shape = tuple(call.h.shape)
    outputs = [xp.reshape(xp.astype(h_new, x.dtype), state_shape)]
    if kind.has_cell:
        outputs.append(xp.reshape(xp.astype(c_new, x.dtype), state_shape))
    residuals = (call, kind, X, w, res) if call.save else None
    return tuple(outputs), residuals


def _cell_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    call, kind, X, w, res = residuals
    xp = call.xp
    cdt = X.dtype
    n, hs = int(X.shape[1]), call.hidden_size
    dh = xp.reshape(_cast(xp, cotangents[0], cdt), (n, hs))
    dc = xp.reshape(_cast(xp, cotangents[1], cdt), (n, hs)) if kind.has_cell else None
    want_w = bool(needs & {"w_ih", "w_hh", "b_ih", "b_hh"})
    want_state = bool(needs & {"h", "c"})
    dX, dh0, dc0, wgrads = _backward_direction(
        kind, xp, X, w, res, None, dh, dc, None, False, "x" in needs, want_w, want_state
    )
    grads: dict[str, Any] = {}
    if "x" in needs:
        grads["x"] = _store(out, "x", xp.reshape(xp.astype(dX, call.x.dtype), tuple(call.x.shape)))
    for name, value in (("h", dh0), ("c", dc0)):
        if name in needs:
            like = call.arrays[name]
            grads[name] = _store(out, name, xp.reshape(xp.astype(value, like.dtype), tuple(like.shape)))
    if want_w:
        for name, value in zip(("w_ih", "w_hh", "b_ih", "b_hh"), wgrads):
            if name in needs:
                grads[name] = _store(out, name, xp.astype(value, call.arrays[name].dtype))
    return grads


def rnn_cell_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    """``rnn_cell``: h' = act(x·w_ihᵀ + b_ih + h·w_hhᵀ + b_hh)."""
    return _cell_forward(call)


def rnn_cell_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    return _cell_backward(residuals, cotangents, needs, out)


def lstm_cell_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    """``lstm_cell``: outputs ``(h', c')``."""
    return _cell_forward(call)


def lstm_cell_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    return _cell_backward(residuals, cotangents, needs, out)


def gru_cell_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    """``gru_cell`` in either form (``call.reset_after``)."""
    return _cell_forward(call)


def gru_cell_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    return _cell_backward(residuals, cotangents, needs, out)


# --------------------------------------------------------------------------- sequences


def _layer_weights(call: Call, k: int, dtype: Any) -> tuple[Any, ...]:
    return tuple(_cast(call.xp, call.arrays[name], dtype) for name in call.param_names[k])


def _mask(xp: Any, call: Call, steps: int, n: int, device: Any) -> Any:
    """``(T, N, 1)`` booleans: step t is inside sequence b (``None`` without lengths)."""
    if call.lengths is None:
        return None
    lengths = xp.asarray(call.lengths, dtype=index_dtype(xp), device=device)
    t = xp.arange(steps, dtype=lengths.dtype, device=device)
    return xp.reshape(t, (steps, 1, 1)) < xp.reshape(lengths, (1, n, 1))


def _sequence_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    xp, x = call.xp, call.x
    kind = _kind(call)
    cdt = compute_dtype(xp, x)
    layers, dirs, hs = call.num_layers, call.num_directions, call.hidden_size
    X = _cast(xp, x, cdt)
    if call.batch_first:
        X = xp.permute_dims(X, (1, 0, 2))
    steps, n = int(X.shape[0]), int(X.shape[1])
    dev = device(X)
    mask = _mask(xp, call, steps, n, dev)
    if mask is not None:
        # Padding is never read (PyTorch's packed sequences): a NaN there must not reach any gradient.
        X = xp.where(mask, X, xp.zeros_like(X))

    def initial(name: str) -> Any:
        value = call.arrays.get(name)
        if value is None:
            size = (call.params.get("proj_size") or hs) if name == "h0" else hs
            return xp.zeros((layers * dirs, n, size), dtype=cdt, device=dev)
        return _cast(xp, value, cdt)

    h0 = initial("h0")
    c0 = initial("c0") if kind.has_cell else None
    inputs, dres, weights, h_n, c_n = [], [], [], [], []
    inp = X
    for layer in range(layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            w = _layer_weights(call, k, cdt)
            out, h, c, res = _forward_direction(
                kind, xp, inp, w, h0[k, ...], None if c0 is None else c0[k, ...], mask, d == 1, call.save
            )
            outs.append(out)
            h_n.append(h)
            c_n.append(c)
            dres.append(res)
            weights.append(w)
        inputs.append(inp)
        inp = outs[0] if dirs == 1 else xp.concat(outs, axis=-1)
    y = inp
    if call.batch_first:
        y = xp.permute_dims(y, (1, 0, 2))
    outputs = [xp.astype(y, x.dtype), xp.astype(xp.stack(h_n), x.dtype)]
    if kind.has_cell:
        outputs.append(xp.astype(xp.stack(c_n), x.dtype))
    residuals = (call, kind, inputs, weights, dres, mask) if call.save else None
    return tuple(outputs), residuals


def _sequence_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    call, kind, inputs, weights, dres, mask = residuals
    xp = call.xp
    cdt = inputs[0].dtype
    layers, dirs = call.num_layers, call.num_directions
    hs = call.params.get("proj_size") or call.hidden_size  # each direction's output size
    dY = _cast(xp, cotangents[0], cdt)
    if call.batch_first:
        dY = xp.permute_dims(dY, (1, 0, 2))
    d_hn = _cast(xp, cotangents[1], cdt)
    d_cn = _cast(xp, cotangents[2], cdt) if kind.has_cell else None
    want_x, want_p = "x" in needs, "params" in needs
    want_state = bool(needs & {"h0", "c0"})

    pgrads: list[Any] = [None] * (layers * dirs)
    dh0: list[Any] = [None] * (layers * dirs)
    dc0: list[Any] = [None] * (layers * dirs)
    for layer in range(layers - 1, -1, -1):
        X = inputs[layer]
        want_dx = layer > 0 or want_x
        dX = None
        for d in range(dirs):
            k = layer * dirs + d
            dYd = dY if dirs == 1 else dY[..., d * hs : (d + 1) * hs]
            dx_d, dh0[k], dc0[k], pgrads[k] = _backward_direction(
                kind, xp, X, weights[k], dres[k], dYd, d_hn[k, ...],
                None if d_cn is None else d_cn[k, ...], mask, d == 1, want_dx, want_p, want_state,
            )
            if want_dx:
                dX = dx_d if dX is None else dX + dx_d
        dY = dX

    grads: dict[str, Any] = {}
    if want_x:
        dx = dY
        if call.batch_first:
            dx = xp.permute_dims(dx, (1, 0, 2))
        grads["x"] = _store(out, "x", xp.astype(dx, call.x.dtype))
    if want_p:
        buffers = out.get("params") if out else None
        result = []
        for k, names in enumerate(call.param_names):
            entry_out = None if buffers is None else buffers[k]
            entry = []
            for j, (name, value) in enumerate(zip(names, pgrads[k])):
                like = call.arrays[name]
                entry.append(None if like is None else _store(entry_out, j, xp.astype(value, like.dtype)))
            result.append(tuple(entry))
        grads["params"] = result
    for name, values in (("h0", dh0), ("c0", dc0)):
        if name in needs:
            grads[name] = _store(out, name, xp.astype(xp.stack(values), call.arrays[name].dtype))
    return grads


def rnn_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    """``rnn``: outputs ``(outputs, h_n)``."""
    return _sequence_forward(call)


def rnn_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    return _sequence_backward(residuals, cotangents, needs, out)


def lstm_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    """``lstm``: outputs ``(outputs, h_n, c_n)`` (the api regroups the states)."""
    return _sequence_forward(call)


def lstm_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    return _sequence_backward(residuals, cotangents, needs, out)


def gru_forward(call: Call) -> tuple[tuple[Any, ...], Any]:
    """``gru``: outputs ``(outputs, h_n)``."""
    return _sequence_forward(call)


def gru_backward(residuals: Any, cotangents: tuple[Any, ...], needs: frozenset[str], out: dict) -> dict:
    return _sequence_backward(residuals, cotangents, needs, out)
