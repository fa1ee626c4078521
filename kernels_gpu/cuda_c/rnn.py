"""Launchers of the recurrent cells on CuPy: cuBLAS projections and the fused kernels of ``rnn.cu``.

One step of ``rnn_cell``/``lstm_cell``/``gru_cell`` (batched or not)::

    forward:   gi = x W_ihᵀ + b_ih,  gh = h W_hhᵀ + b_hh           (cuBLAS)
               one kernel: gate nonlinearities, the new state, the gates kept for the backward
    backward:  one kernel: the gate pre-activations' gradients dgi, dgh (and dc, the direct dh)
               dx = dgi W_ih,  dh = dgh W_hh + direct,  dW_ih = dgiᵀ x,  dW_hh = dghᵀ h,
               db_ih = Σ dgi,  db_hh = Σ dgh                           (cuBLAS, fixed-order sums)

``gru_cell(reset_after=False)`` applies W_hn to r·h, so its n-gate product runs between two
stages of the kernels.

The sequences ``rnn``/``lstm``/``gru`` (stacked, bidirectional, batch_first, ``lengths``,
optional biases and initial states, both GRU forms), per layer::

    GI = X · [W_ih,fwd; W_ih,rev]ᵀ                    one GEMM: all T steps, both directions
    per direction, per step t (in its time order):
        gh = h_prev · W_hhᵀ                           cuBLAS into a preallocated buffer
        one seq_fwd kernel: biases, gates, state update, lengths mask, output column, saved gates
    backward through time, per direction, per step t (reverse order):
        one seq_bwd kernel: dY[t] + carried dh, gate gradients into DGI[t] (and DGH[t]), masks
        dh_gemm = DGH[t] · W_hh                       cuBLAS; the next kernel adds the direct part
    dW_hh = DGHᵀ · H_prev,  db_hh = Σ DGH             per direction, single GEMM / reduction over T·N rows
    dW_ih = DGIᵀ · X,  db_ih = Σ DGI,  dX = DGI · W_ih   per layer, both directions in one GEMM each

An LSTM projection (``w_hr``, PyTorch's ``proj_size``) keeps the kernel as it is: its state and
output are the unprojected o ⊙ tanh(c) in scratch rows, then one GEMM per step projects them and
the projected state is kept (and written to Y) only for sequences still running
(:func:`_project_step`); the backward hands the kernel dh·w_hr and keeps each step's dh for
dw_hr = Σ dhᵀ·(o ⊙ tanh c) (:func:`_unproject_step`).

The GRU with ``reset_after=False`` runs two kernel stages and two GEMMs per step (its n gate
needs (r·h)·W_hnᵀ).  States live in per-direction (T+1, N, H) buffers (the state entering
step t sits next to the one leaving it), so the backward reads H_prev without copies; without
``save`` (no gradient recorded) two slots alternate.  Sums are cuBLAS GEMMs and CuPy's
fixed-order reductions: no atomics, bitwise reproducible.  ``batch_first`` data is transposed
to time-major once on entry and back on exit.  float32 and float64.

Next step (not done: it can only be verified on a device): capture the per-step loop of a
direction in a CUDA graph (``cupy.cuda.Graph`` via stream capture) keyed on the shapes, and
replay it; every step's launches already use fixed buffers, so only ``t`` and the step's
buffer offsets differ between steps.
"""

from __future__ import annotations

from typing import Any

from portable_nn.kernel_codes import CELL_FAMILIES, GATES
from portable_nn.kernel_plans import caller_layout, project_step, time_major, unproject_step, without_padding

from . import _runtime as rt

FAMILY = "rnn"
#: Threads per block of the cell kernels.
BLOCK = 256
#: At most this many blocks per launch; the kernels stride over the rest.
MAX_BLOCKS = 65535 * 8

_KINDS = CELL_FAMILIES
_GATES = {family: GATES[code] for family, code in CELL_FAMILIES.items()}
rt.declare(FAMILY, [f"{k}<{t}>" for k in ("cell_fwd", "cell_bwd", "seq_fwd", "seq_bwd") for t in ("float", "double")])


def _grid(total: int) -> tuple[int]:
    return (min(rt.blocks(total, BLOCK), MAX_BLOCKS),)


def _act(call: Any) -> tuple[int, float]:
    act = call.activation
    return (act.code, act.slope) if act is not None else (0, 0.0)


def _launch_fwd(call, gi, gh, h2, c2, h_out, c_out, gates, rh, stage):
    code, slope = _act(call)
    n, hs = h2.shape
    rt.launch(FAMILY, f"cell_fwd<{rt.ctype(call.dtype)}>", _grid(n * hs), (BLOCK,),
              [gi, gh, h2, rt.ptr(c2), rt.ptr(h_out), rt.ptr(c_out), gates, rt.ptr(rh), rt.i64(n), rt.i64(hs),
               rt.i32(_KINDS[call.kind]), rt.i32(stage), rt.i32(code), rt.f64(slope)])


def cell_forward(call: Any) -> tuple[tuple[Any, ...], Any]:
    """``(h',)`` or ``(h', c')`` of one step (see the module docstring)."""
    x, h = call.x, call.h
    xp = rt.array_module(x)
    kind, hs = call.kind, int(call.hidden_size)
    n = 1 if call.unbatched else int(x.shape[0])
    x2 = x.reshape(n, -1)
    h2 = xp.ascontiguousarray(h).reshape(n, hs)
    c2 = xp.ascontiguousarray(call.c).reshape(n, hs) if kind == "lstm" else None
    w_ih, w_hh, b_ih, b_hh = call.w_ih, call.w_hh, call.b_ih, call.b_hh
    gi = xp.matmul(x2, w_ih.T)
    if b_ih is not None:
        gi += b_ih
    gates = xp.empty((n, 4 * hs), x.dtype)
    h_out = xp.empty((n, hs), x.dtype)
    c_out = xp.empty((n, hs), x.dtype) if kind == "lstm" else None
    rh = None
    if kind == "gru" and not call.reset_after:
        gh = xp.empty((n, 3 * hs), x.dtype)
        gh[:, : 2 * hs] = xp.matmul(h2, w_hh[: 2 * hs].T)
        if b_hh is not None:
            gh[:, : 2 * hs] += b_hh[: 2 * hs]
        rh = xp.empty((n, hs), x.dtype)
        _launch_fwd(call, gi, gh, h2, c2, h_out, c_out, gates, rh, 1)
        gh[:, 2 * hs:] = xp.matmul(rh, w_hh[2 * hs:].T)
        if b_hh is not None:
            gh[:, 2 * hs:] += b_hh[2 * hs:]
        _launch_fwd(call, gi, gh, h2, c2, h_out, c_out, gates, rh, 2)
    else:
        gh = xp.matmul(h2, w_hh.T)
        if b_hh is not None:
            gh += b_hh
        _launch_fwd(call, gi, gh, h2, c2, h_out, c_out, gates, rh, 0)
    shape = tuple(h.shape)
    outputs = (h_out.reshape(shape), c_out.reshape(shape)) if kind == "lstm" else (h_out.reshape(shape),)
    residuals = (call.replace(arrays={**call.arrays}), x2, h2, c2, c_out, gates, rh) if call.save else None
    return outputs, residuals


def cell_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """Gradients of one step for the names in ``needs``."""
    call, x2, h2, c2, c_new, gates, rh = residuals
    out = out or {}
    xp = rt.array_module(x2)
    kind, hs = call.kind, int(call.hidden_size)
    n = int(h2.shape[0])
    g_count = _GATES[kind]
    code, slope = _act(call)

    def cotangent(k):
        if k >= len(cotangents) or cotangents[k] is None:
            return None
        ct = xp.ascontiguousarray(cotangents[k]).reshape(n, hs)
        return ct if ct.dtype == x2.dtype else ct.astype(x2.dtype)

    dh_out, dc_out = cotangent(0), (cotangent(1) if kind == "lstm" else None)
    dgi = xp.empty((n, g_count * hs), x2.dtype)
    dgh = xp.empty_like(dgi)
    dh_dir = xp.empty((n, hs), x2.dtype)
    dc = xp.empty((n, hs), x2.dtype) if kind == "lstm" else None
    two_stage = kind == "gru" and not call.reset_after
    name = f"cell_bwd<{rt.ctype(call.dtype)}>"

    def launch(stage, drh):
        rt.launch(FAMILY, name, _grid(n * hs), (BLOCK,),
                  [gates, h2, rt.ptr(c2), rt.ptr(c_new), rt.ptr(dh_out), rt.ptr(dc_out), rt.ptr(drh), dgi, dgh,
                   dh_dir, rt.ptr(dc), rt.i64(n), rt.i64(hs), rt.i32(_KINDS[kind]), rt.i32(stage), rt.i32(code),
                   rt.f64(slope)])

    w_ih, w_hh = call.w_ih, call.w_hh
    if two_stage:
        launch(1, None)
        drh = xp.ascontiguousarray(xp.matmul(dgh[:, 2 * hs:], w_hh[2 * hs:]))
        launch(2, drh)
    else:
        launch(0, None)
    grads = {}
    if "x" in needs:
        grads["x"] = rt.into(out, "x", xp.matmul(dgi, w_ih).reshape(call.x.shape))
    if "h" in needs:
        if two_stage:
            dh = xp.matmul(dgh[:, : 2 * hs], w_hh[: 2 * hs]) + dh_dir
        else:
            dh = xp.matmul(dgh, w_hh) + dh_dir
        grads["h"] = rt.into(out, "h", dh.reshape(call.h.shape))
    if "c" in needs:
        grads["c"] = rt.into(out, "c", dc.reshape(call.c.shape))
    if "w_ih" in needs:
        grads["w_ih"] = rt.into(out, "w_ih", xp.matmul(dgi.T, x2))
    if "w_hh" in needs:
        if two_stage:
            dw = xp.concatenate([xp.matmul(dgh[:, : 2 * hs].T, h2), xp.matmul(dgh[:, 2 * hs:].T, rh)], axis=0)
        else:
            dw = xp.matmul(dgh.T, h2)
        grads["w_hh"] = rt.into(out, "w_hh", dw)
    if "b_ih" in needs:
        grads["b_ih"] = rt.into(out, "b_ih", dgi.sum(axis=0)) if call.b_ih is not None else None
    if "b_hh" in needs:
        grads["b_hh"] = rt.into(out, "b_hh", dgh.sum(axis=0)) if call.b_hh is not None else None
    return grads


# --------------------------------------------------------------------------- sequences

#: Saved gate values per unit and step (see ``seq_fwd`` in rnn.cu).
_SAVED_GATES = {"rnn": 1, "lstm": 4, "gru": 4}


class _Dir:
    """One direction's forward state: its weights and what its backward reads.

    ``hseq``/``cseq`` ``(T+1, N, H)`` hold the state entering step t at ``t + reverse`` and the
    one leaving it at ``t + 1 - reverse`` (with ``save``; otherwise two slots alternate).
    """

    __slots__ = ("b_hh", "b_ih", "cseq", "gates", "hseq", "reverse", "rh", "w_hh", "w_hr", "w_ih")

    def __init__(self, weights, reverse):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh = weights[:4]
        self.w_hr = weights[4] if len(weights) > 4 else None  # an LSTM projection (P, H)
        self.reverse = reverse
        self.hseq = self.cseq = self.gates = self.rh = None

    @property
    def out(self) -> int:
        """The size of h and of this direction's outputs: P with a projection, else H."""
        return int(self.w_hr.shape[0]) if self.w_hr is not None else int(self.w_hh.shape[1])

    def slots(self, t, k, save):
        """(entering, leaving) slot of step t, the k-th in this direction's order."""
        if not save:
            return k % 2, (k + 1) % 2
        return (t + 1, t) if self.reverse else (t, t + 1)

    def h_prev(self, steps):
        """The states entering each step, (T, N, H) in time order (a view)."""
        return self.hseq[1:] if self.reverse else self.hseq[:steps]

    def c_next(self, steps):
        """The cell states leaving each step, (T, N, H) in time order (a view; LSTM, saved)."""
        return self.cseq[:steps] if self.reverse else self.cseq[1:]


def _stacked(xp, mats):
    """Row-wise stack of the directions' matrices (the array itself for one direction)."""
    return mats[0] if len(mats) == 1 else xp.concatenate(mats, axis=0)


def _seq_forward_direction(call, xp, gi, d, w, y, h_init, c_init, lengths, work):
    """Run direction ``d`` over the layer's GI ``(T, N, D·G·H)``, writing its columns of ``y``.

    Returns the final states ``(h, c)`` (``c`` None but for lstm) as views of its state buffers.
    """
    kind, hs = call.kind, int(call.hidden_size)
    steps, n = int(gi.shape[0]), int(gi.shape[1])
    dtype, save = gi.dtype, bool(call.save)
    original = kind == "gru" and not call.reset_after
    w.hseq = xp.empty((steps + 1 if save else 2, n, w.out), dtype)
    w.cseq = xp.empty((steps + 1 if save else 2, n, hs), dtype) if kind == "lstm" else None
    proj = w.w_hr is not None
    order = [steps - 1 - k if w.reverse else k for k in range(steps)]
    first = w.slots(order[0], 0, save)[0] if steps else 0
    last = w.slots(order[-1], steps - 1, save)[1] if steps else first
    for seq, init in ((w.hseq, h_init), (w.cseq, c_init)):
        if seq is not None:
            seq[first] = 0 if init is None else init
    rows = steps if save else 1
    w.gates = xp.empty((rows, n, _SAVED_GATES[kind] * hs), dtype)
    w.rh = xp.empty((rows, n, hs), dtype) if original else None
    w_rec_t = (w.w_hh[: 2 * hs] if original else w.w_hh).T
    w_hn_t = w.w_hh[2 * hs:].T if original else None
    code, slope = _act(call)
    name = f"seq_fwd<{rt.ctype(call.dtype)}>"
    gh, ghn = work["gh"], work.get("ghn")
    gw = _GATES[kind] * hs
    for k, t in enumerate(order):
        i_in, i_out = w.slots(t, k, save)
        s = t if save else 0
        xp.matmul(w.hseq[i_in], w_rec_t, out=gh)
        c_prev, c_next = (None, None) if w.cseq is None else (w.cseq[i_in], w.cseq[i_out])
        # With a projection the kernel's state and output are the unprojected o ⊙ tanh(c) (scratch),
        # projected and masked by _project_step.
        h_in, h_out, y_t, y_col = (work["hf"], work["hf"], work["ysc"], 0) if proj else \
            (w.hseq[i_in], w.hseq[i_out], y[t], d * hs)
        args = [gi[t], gh, None, rt.ptr(w.b_ih), rt.ptr(w.b_hh), h_in, rt.ptr(c_prev), h_out,
                rt.ptr(c_next), w.gates[s], rt.ptr(w.rh[s] if original else None), y_t, rt.ptr(lengths),
                rt.i64(t), rt.i64(n), rt.i64(hs), rt.i64(gi.shape[2]), rt.i64(d * gw), rt.i64(gh.shape[1]),
                rt.i64(y_t.shape[-1]), rt.i64(y_col), rt.i32(_KINDS[kind]), None, rt.i32(code), rt.f64(slope)]
        stages = (1, 2) if original else (0,)
        for stage in stages:
            if stage == 2:
                xp.matmul(w.rh[s], w_hn_t, out=ghn)
            args[2] = rt.ptr(ghn if stage == 2 else None)
            args[-3] = rt.i32(stage)
            rt.launch(FAMILY, name, _grid(n * hs), (BLOCK,), args)
        if proj:
            _project_step(xp, work, w, w.hseq[i_in], w.hseq[i_out], y[t], d * w.out, lengths, t)
    return w.hseq[last], (None if w.cseq is None else w.cseq[last])


def _project_step(xp, work, w, h_in, h_out, y_t, col, lengths, t):
    """An LSTM projection's step (:func:`~portable_nn.kernel_plans.project_step`) on the scratch state."""
    active = None if lengths is None else (lengths > t)[:, None]
    project_step(xp, work["hf"], w.w_hr, work["hq"], h_in, h_out, y_t[:, col:col + w.out], active)


def sequence_forward(call: Any) -> tuple[tuple[Any, ...], Any]:
    """``rnn``/``lstm``/``gru``: ``(outputs, h_n)`` or ``(outputs, h_n, c_n)`` (see the module docstring)."""
    x = call.x
    xp = rt.array_module(x)
    dtype = x.dtype
    kind, layers, dirs, hs = call.kind, int(call.num_layers), int(call.num_directions), int(call.hidden_size)
    original = kind == "gru" and not call.reset_after
    X = without_padding(xp, time_major(xp, x, call.batch_first, dtype), call.lengths)
    steps, n = int(X.shape[0]), int(X.shape[1])
    lengths = None if call.lengths is None else xp.asarray(call.lengths, dtype=xp.int64)
    h0, c0 = call.arrays.get("h0"), call.arrays.get("c0")
    proj = int(call.params.get("proj_size") or 0)
    out = proj or hs
    h_n = xp.empty((layers * dirs, n, out), dtype)
    c_n = xp.empty((layers * dirs, n, hs), dtype) if kind == "lstm" else None
    gw = _GATES[kind] * hs
    work = {"gh": xp.empty((n, 2 * hs if original else gw), dtype)}
    if original:
        work["ghn"] = xp.empty((n, hs), dtype)
    if proj:
        work.update(hf=xp.empty((n, hs), dtype), ysc=xp.empty((n, hs), dtype), hq=xp.empty((n, proj), dtype))
    inputs, stacks, directions = [], [], []
    inp = X
    for layer in range(layers):
        ws = [_Dir(tuple(call.arrays[name] for name in call.param_names[layer * dirs + d]), d == 1)
              for d in range(dirs)]
        w_stack = _stacked(xp, [w.w_ih for w in ws])
        features = int(inp.shape[2])
        gi = xp.matmul(inp.reshape(steps * n, features), w_stack.T).reshape(steps, n, dirs * gw)
        y = xp.empty((steps, n, dirs * out), dtype)
        for d, w in enumerate(ws):
            k = layer * dirs + d
            h_last, c_last = _seq_forward_direction(
                call, xp, gi, d, w, y, None if h0 is None else h0[k], None if c0 is None else c0[k],
                lengths, work)
            h_n[k] = h_last
            if c_n is not None:
                c_n[k] = c_last
        inputs.append(inp)
        stacks.append(w_stack)
        directions.append(ws)
        inp = y
    outputs = (caller_layout(xp, inp, call.batch_first), h_n) + (() if c_n is None else (c_n,))
    residuals = (call.replace(arrays={**call.arrays}), inputs, stacks, directions, lengths) if call.save else None
    return outputs, residuals


def _seq_backward_direction(call, xp, w, dgi, d, dy, dh_n, dc_n, lengths, want_state, want_w):
    """Backward through time of direction ``d``; fills its columns of ``dgi`` ``(T, N, D·G·H)``.

    Returns (dh0, dc0, dw_hh, db_hh, dw_hr): the entering states' gradients (when ``want_state``)
    and the hidden-side weight gradients (when ``want_w``; dw_hr with a projection), ``None``
    otherwise.  With a projection each step's dh (P columns, dY's included, zero past a
    sequence's end) is kept for dw_hr and enters the kernel as dh·w_hr.
    """
    kind, hs = call.kind, int(call.hidden_size)
    steps, n = int(dgi.shape[0]), int(dgi.shape[1])
    dtype = dgi.dtype
    original = kind == "gru" and not call.reset_after
    gw = _GATES[kind] * hs
    proj, out = w.w_hr is not None, w.out
    dh_dir = xp.zeros((n, out), dtype) if dh_n is None else xp.array(dh_n, dtype=dtype, order="C")
    dc = None
    if kind == "lstm":
        dc = xp.zeros((n, hs), dtype) if dc_n is None else xp.array(dc_n, dtype=dtype, order="C")
    # The hidden-side gradient differs from the input side's for the GRU; for one direction of
    # rnn/lstm it is DGI itself (contiguous), else its own buffer keeps the per-step GEMMs' inputs
    # contiguous.
    separate = kind == "gru" or dgi.shape[2] != gw
    dgh = xp.empty((steps, n, 2 * hs if original else gw), dtype) if separate else None
    dghn = xp.empty((steps, n, hs), dtype) if original else None
    drh = xp.empty((n, hs), dtype) if original else None
    dh_gemm = xp.empty((n, out), dtype)
    dh_full = xp.empty((n, hs), dtype) if proj else None
    dproj = xp.empty((steps, n, out), dtype) if proj else None
    w_rec = w.w_hh[: 2 * hs] if original else w.w_hh
    w_hn = w.w_hh[2 * hs:] if original else None
    code, slope = _act(call)
    name = f"seq_bwd<{rt.ctype(call.dtype)}>"
    gemm_done = False
    for k in range(steps):
        t = k if w.reverse else steps - 1 - k
        i_in, i_out = w.slots(t, 0, True)
        dgh_t = dgh[t] if separate else dgi[t]
        step_dy, step_gemm, step_dh = (None if dy is None else dy[t]), (dh_gemm if gemm_done else None), dh_dir
        if proj:
            passed = _unproject_step(xp, w, dh_dir, dh_gemm if gemm_done else None, dy, t, d * out, lengths,
                                     dproj, dh_full)
            step_dy, step_gemm, step_dh = None, None, dh_full
        args = [w.gates[t], w.hseq[i_in], rt.ptr(None if dc is None else w.cseq[i_in]),
                rt.ptr(None if dc is None else w.cseq[i_out]), rt.ptr(step_dy),
                rt.ptr(step_gemm), step_dh, rt.ptr(dc), None, dgi[t],
                rt.ptr(dgh_t if separate else None), rt.ptr(dghn[t] if original else None), rt.ptr(lengths),
                rt.i64(t), rt.i64(n), rt.i64(hs), rt.i64(dgi.shape[2]), rt.i64(d * gw), rt.i64(dgh_t.shape[1]),
                rt.i64(0 if dy is None else dy.shape[2]), rt.i64(d * hs), rt.i32(_KINDS[kind]), None,
                rt.i32(code), rt.f64(slope)]
        for stage in (1, 2) if original else (0,):
            if stage == 2:
                xp.matmul(dghn[t], w_hn, out=drh)
            args[8] = rt.ptr(drh if stage == 2 else None)
            args[-3] = rt.i32(stage)
            rt.launch(FAMILY, name, _grid(n * hs), (BLOCK,), args)
        if proj:  # what the step passes on besides dh_gemm: dh of a sequence that had ended, else 0
            dh_dir[...] = passed
        if want_state or k < steps - 1:  # the last step's product only feeds dh0
            xp.matmul(dgh_t, w_rec, out=dh_gemm)
            gemm_done = True
    dh0 = (dh_dir + dh_gemm if gemm_done else dh_dir) if want_state else None
    dc0 = dc if want_state else None
    dw_hh = db_hh = dw_hr = None
    if want_w:
        m = steps * n
        h_prev = w.h_prev(steps).reshape(m, out)
        hidden = (dgh if separate else dgi).reshape(m, int((dgh if separate else dgi).shape[2]))
        if original:
            rh = w.rh.reshape(m, hs)
            dghn2 = dghn.reshape(m, hs)
            dw_hh = xp.concatenate([xp.matmul(hidden.T, h_prev), xp.matmul(dghn2.T, rh)], axis=0)
            db_hh = xp.concatenate([hidden.sum(axis=0), dghn2.sum(axis=0)])
        else:
            dw_hh = xp.matmul(hidden.T, h_prev)
            db_hh = hidden.sum(axis=0)
        if proj:  # Σ_t dh_tᵀ·(o ⊙ tanh(c_t)), the unprojected states rebuilt from the saved gates
            unprojected = w.gates[..., 3 * hs:] * xp.tanh(w.c_next(steps))
            dw_hr = xp.matmul(dproj.reshape(m, out).T, unprojected.reshape(m, hs))
    return dh0, dc0, dw_hh, db_hh, dw_hr


def _unproject_step(xp, w, dh_dir, dh_gemm, dy, t, col, lengths, dproj, dh_full):
    """A projected step's backward (:func:`~portable_nn.kernel_plans.unproject_step`) for step t."""
    active = None if lengths is None else (lengths > t)[:, None]
    dy_cols = None if dy is None else dy[t][:, col:col + w.out]
    return unproject_step(xp, dh_dir, dh_gemm, dy_cols, active, w.w_hr, dproj[t], dh_full)


def _deliver(buffer: Any, value: Any) -> Any:
    """``value`` in the caller's ``out`` buffer when one is given."""
    if buffer is None or buffer is value:
        return value
    buffer[...] = value.reshape(buffer.shape)
    return buffer


def sequence_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """Gradients of the sequence ops: ``x``, ``params`` (a list of 4-tuples), ``h0``, ``c0``."""
    call, inputs, stacks, directions, lengths = residuals
    out = out or {}
    X0 = inputs[0]
    xp = rt.array_module(X0)
    dtype = X0.dtype
    kind, layers, dirs, hs = call.kind, int(call.num_layers), int(call.num_directions), int(call.hidden_size)
    steps, n = int(X0.shape[0]), int(X0.shape[1])
    gw = _GATES[kind] * hs

    def cotangent(k):
        if k >= len(cotangents) or cotangents[k] is None:
            return None
        return xp.asarray(cotangents[k], dtype=dtype)

    d_out = cotangent(0)
    dY = None if d_out is None else time_major(xp, d_out, call.batch_first, dtype)
    d_hn = cotangent(1)
    d_cn = cotangent(2) if kind == "lstm" else None
    want_x, want_p = "x" in needs, "params" in needs
    want_state = bool(needs & {"h0", "c0"})
    proj = int(call.params.get("proj_size") or 0)
    dh0 = xp.empty((layers * dirs, n, proj or hs), dtype) if want_state else None
    dc0 = xp.empty((layers * dirs, n, hs), dtype) if want_state and kind == "lstm" else None
    pgrads: list[list[Any]] = [[None] * 5 for _ in range(layers * dirs)]
    for layer in range(layers - 1, -1, -1):
        X = inputs[layer]
        features = int(X.shape[2])
        dgi = xp.empty((steps, n, dirs * gw), dtype)
        for d, w in enumerate(directions[layer]):
            k = layer * dirs + d
            dh, dc, dw_hh, db_hh, pgrads[k][4] = _seq_backward_direction(
                call, xp, w, dgi, d, dY, None if d_hn is None else d_hn[k],
                None if d_cn is None else d_cn[k], lengths, want_state, want_p)
            if want_state:
                dh0[k] = dh
                if dc0 is not None:
                    dc0[k] = dc
            pgrads[k][1], pgrads[k][3] = dw_hh, db_hh
        dgi2 = dgi.reshape(steps * n, dirs * gw)
        if want_p:
            dw_ih = xp.matmul(dgi2.T, X.reshape(steps * n, features))
            db_ih = dgi2.sum(axis=0)
            for d in range(dirs):
                k = layer * dirs + d
                pgrads[k][0] = dw_ih[d * gw:(d + 1) * gw]
                pgrads[k][2] = db_ih[d * gw:(d + 1) * gw]
        dY = None
        if layer > 0 or want_x:
            dY = xp.matmul(dgi2, stacks[layer]).reshape(steps, n, features)
    grads: dict[str, Any] = {}
    if want_x:
        grads["x"] = _deliver(out.get("x"), caller_layout(xp, dY, call.batch_first))
    if want_p:
        buffers = out.get("params")
        result = []
        for k, names in enumerate(call.param_names):
            entry = []
            for j, name in enumerate(names):
                value = pgrads[k][j] if call.arrays[name] is not None else None
                buffer = None if buffers is None or value is None else buffers[k][j]
                entry.append(None if value is None else _deliver(buffer, value))
            result.append(tuple(entry))
        grads["params"] = result
    if "h0" in needs:
        grads["h0"] = _deliver(out.get("h0"), dh0)
    if "c0" in needs:
        grads["c0"] = _deliver(out.get("c0"), dc0)
    return grads
