"""Launchers of the recurrent cells on CuPy: cuBLAS projections and the fused kernels of ``rnn.cu``.

One step of ``rnn_cell``/``lstm_cell``/``gru_cell`` (batched or not)::

    forward:   gi = x W_ihᵀ + b_ih,  gh = h W_hhᵀ + b_hh           (cuBLAS)
               one kernel: gate nonlinearities, the new state, the gates kept for the backward
    backward:  one kernel: the gate pre-activations' gradients dgi, dgh (and dc, the direct dh)
               dx = dgi W_ih,  dh = dgh W_hh + direct,  dW_ih = dgiᵀ x,  dW_hh = dghᵀ h,
               db_ih = Σ dgi,  db_hh = Σ dgh                           (cuBLAS, fixed-order sums)

``gru_cell(reset_after=False)`` applies W_hn to r·h, so its n-gate product runs between two
stages of the kernels.  float32 and float64.  The sequence ops (``rnn``/``lstm``/``gru``) have no
CUDA C kernel yet.
"""

from __future__ import annotations

from typing import Any

from . import _runtime as rt

FAMILY = "rnn"
#: Threads per block of the cell kernels.
BLOCK = 256
#: At most this many blocks per launch; the kernels stride over the rest.
MAX_BLOCKS = 65535 * 8

_KINDS = {"rnn": 0, "lstm": 1, "gru": 2}
_GATES = {"rnn": 1, "lstm": 4, "gru": 3}
rt.declare(FAMILY, [f"{k}<{t}>" for k in ("cell_fwd", "cell_bwd") for t in ("float", "double")])


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
