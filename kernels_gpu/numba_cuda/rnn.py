"""Numba-CUDA kernels for recurrent cells and sequences, forward and backward (backend ``"numba_cuda"``).

One *direction* of one layer over a time-major sequence ``X`` ``(T, N, F)``::

    GI = X · w_ihᵀ                                        one GEMM for all T steps (array-module matmul)
    for t in time order (reversed for the reverse direction):
        GH = h_t · w_hhᵀ                                  recurrent GEMM into a preallocated (N, G·H) buffer
        _forward_step: gates, new state, output, masking  ONE fused elementwise kernel

and backward through time::

    for t in reverse processing order:
        _backward_step: dh = Q + D + dY[t];  dA[t] (gate pre-activation gradients), D = direct state term
        Q = dA[t] · w_hh                                  recurrent GEMM (skipped after the last step
                                                          unless the initial states' gradient is wanted)
    dw_ih = dAᵀ · X,  dw_hh = dAᵀ · H_prev,  dX = dA · w_ih       single GEMMs over all T·N rows
    db = Σ_rows dA                                        column partial sums + fixed-order second pass

The state gradient entering step t is split in two: ``Q`` (the recurrent GEMM's result, computed
after step t+1's kernel) and ``D`` (the terms that bypass the GEMM: z ⊙ dh for the GRU, the whole
dh past a sequence's end); the next step's kernel adds them, so one GEMM and one kernel per step
suffice.  The GRU with ``reset_after=False`` applies w_hn to r ⊙ h, a product that sits between
two halves of the cell, so it takes two kernel stages (and two GEMMs) per step in each direction.

Cells (σ the logistic function, ⊙ elementwise; gates stacked as in PyTorch)::

    rnn:   h' = act(x·w_ihᵀ + b_ih + h·w_hhᵀ + b_hh),  act = tanh or relu
    lstm:  [i f g o] = [σ σ tanh σ](…),  c' = f ⊙ c + i ⊙ g,  h' = o ⊙ tanh(c')
    gru:   r, z = σ(…);  reset_after=True:  n = tanh(GI_n + b_in + r ⊙ (h·w_hnᵀ + b_hn))
                         reset_after=False: n = tanh(GI_n + b_in + (r ⊙ h)·w_hnᵀ + b_hn)
           h' = n + z ⊙ (h − n)

Biases join inside the step kernel as one vector ``b_ih + b_hh`` wherever the two simply add
(the GRU's ``b_hn`` with ``reset_after=True`` stays apart, since r multiplies it).  The cell ops
run the same launchers as sequences of one step.

State buffers.  With ``save`` (a backward will follow) the hidden (and cell) states of a direction
live in one ``(T+1, N, H)`` buffer indexed by time: the forward direction reads slot t and writes
slot t+1, the reverse direction reads t+1 and writes t, so the states entering the T steps are
one contiguous ``(T, N, H)`` slice (the input of the dw_hh GEMM).  Without ``save`` two slots
alternate.  The activated gates ``(T, N, G·H)`` are kept, plus one ``(T, N, H)`` buffer for the
GRU (h·w_hnᵀ + b_hn with ``reset_after=True``, r ⊙ h without); tanh(c') of the LSTM is recomputed
from the kept c'.

Variable lengths (packed sequences): a step past a sequence's end copies the state, writes a zero
output, has zero gate gradients and passes the state gradient through, as the reference does.

Supported: every argument of ``rnn_cell``/``lstm_cell``/``gru_cell`` and ``rnn``/``lstm``/``gru``
(tanh/relu, both GRU forms, stacked layers, bidirectional, batch_first, lengths, optional biases
and initial states, zero sizes), float32 and float64 (computed in the data's type; bias sums
accumulate in float64).  Everything array-library specific goes through ``_runtime``: the same
launchers run on CuPy arrays on a GPU and on NumPy arrays in Numba's CUDA simulator.

An LSTM projection (``w_hr``, PyTorch's ``proj_size``): the step kernels run on the unprojected
state o ⊙ tanh(c) (``hfseq``, the cell's slots), one GEMM per step projects it into ``hseq`` (kept
only for sequences still running) and Y; the backward hands the kernel dh·w_hr and keeps each
step's dh for dw_hr = Σ dhᵀ·(o ⊙ tanh c).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float64

from portable_nn.kernel_codes import GATES, GRU, GRU_ORIGINAL, LSTM, RNN_RELU, RNN_TANH
from portable_nn.kernel_plans import project_step, time_major, unproject_step, without_padding

from . import _runtime as rt
from ._runtime import cast_as, device, kernel
from .activations import sigmoid

#: dtypes the kernels are declared for (the compute type is the data's own).
DTYPES = ("float32", "float64")
#: Shared-memory lanes of the column reduction: the largest block it accepts.
MAX_THREADS = 1024


_I = "int64"
_FWD = (f"void({_I}, {_I}, {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], "
        f"{{x}}[::1], {{x}}[::1], {{x}}[::1], {_I}[::1], {_I}, {_I}, {_I}, {_I}, {_I}, {_I}, {_I}, {_I})")
_BWD = (f"void({_I}, {_I}, boolean, {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], "
        f"{{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], {{x}}[::1], {_I}[::1], {_I}, {_I}, {_I}, {_I}, {_I}, {_I}, "
        f"{_I})")
_COL = f"void({{x}}[::1], float64[::1], {_I}, {_I}, {_I})"
_FOLD = f"void(float64[::1], float64[::1], {_I}, {_I})"


# --------------------------------------------------------------------------- device functions


@device
def _gate_count(code):
    """G: the gates per hidden unit of the cell ``code``."""
    if code == LSTM:
        return 4
    if code == GRU or code == GRU_ORIGINAL:
        return 3
    return 1


@device
def _rnn_cell(code, z):
    """act(z): tanh (code RNN_TANH) or relu."""
    if code == RNN_TANH:
        return math.tanh(z)
    zero_ = cast_as(z, 0.0)
    return z if z > zero_ else zero_


@device
def _lstm_cell(gi, gh, b_i, gates, a_row, h_row, s_row, j, hs, c):
    """(h', c') of one LSTM unit; the activated gates i, f, g, o go to ``gates[s_row + k·H + j]``."""
    i = sigmoid(gi[a_row + j] + gh[h_row + j] + b_i[j])
    f = sigmoid(gi[a_row + hs + j] + gh[h_row + hs + j] + b_i[hs + j])
    g = math.tanh(gi[a_row + 2 * hs + j] + gh[h_row + 2 * hs + j] + b_i[2 * hs + j])
    o = sigmoid(gi[a_row + 3 * hs + j] + gh[h_row + 3 * hs + j] + b_i[3 * hs + j])
    gates[s_row + j] = i
    gates[s_row + hs + j] = f
    gates[s_row + 2 * hs + j] = g
    gates[s_row + 3 * hs + j] = o
    c_new = f * c + i * g
    return o * math.tanh(c_new), c_new


@device
def _gru_cell(gi, gh, b_i, b_n, gates, extra, a_row, h_row, s_row, e_at, j, hs, h):
    """h' of one GRU unit (reset_after=True); keeps r, z, n and e = h·w_hnᵀ + b_hn (``extra[e_at]``)."""
    one_ = cast_as(h, 1.0)
    r = sigmoid(gi[a_row + j] + gh[h_row + j] + b_i[j])
    z = sigmoid(gi[a_row + hs + j] + gh[h_row + hs + j] + b_i[hs + j])
    e = gh[h_row + 2 * hs + j] + b_n[j]
    n = math.tanh(gi[a_row + 2 * hs + j] + b_i[2 * hs + j] + r * e)
    gates[s_row + j] = r
    gates[s_row + hs + j] = z
    gates[s_row + 2 * hs + j] = n
    extra[e_at] = e
    return (one_ - z) * n + z * h


@device
def _gru_original_gates(gi, gh_rz, b_i, gates, extra, a_row, n_row, s_row, e_at, j, hs, h):
    """Stage 1 of reset_after=False: r, z kept, and r ⊙ h (the next GEMM's input) to ``extra[e_at]``."""
    r = sigmoid(gi[a_row + j] + gh_rz[2 * n_row + j] + b_i[j])
    z = sigmoid(gi[a_row + hs + j] + gh_rz[2 * n_row + hs + j] + b_i[hs + j])
    gates[s_row + j] = r
    gates[s_row + hs + j] = z
    extra[e_at] = r * h


@device
def _gru_original_state(gi, gh_n, b_i, gates, a_row, n_row, s_row, j, hs, h):
    """Stage 2 of reset_after=False: n = tanh(GI_n + (r ⊙ h)·w_hnᵀ + b_in + b_hn), then h'."""
    one_ = cast_as(h, 1.0)
    n = math.tanh(gi[a_row + 2 * hs + j] + gh_n[n_row + j] + b_i[2 * hs + j])
    z = gates[s_row + hs + j]
    gates[s_row + 2 * hs + j] = n
    return (one_ - z) * n + z * h


# --------------------------------------------------------------------------- step kernels


@kernel(_FWD, DTYPES)
def _forward_step(code, stage, gi, gh_a, gh_b, b_i, b_n, hseq, cseq, gates, extra, y, lengths,
                  t, s, slot_in, slot_out, n_rows, hs, y_width, col):
    """One time step t of one direction, one thread per (sequence n, unit j) (grid-stride).

    Reads GI[t] (``gi``, flat (T, N, G·H)), the recurrent GEMM's ``gh_a`` (N, G·H) (the r, z
    columns (N, 2H) for GRU_ORIGINAL, whose stage 2 reads its n columns' product ``gh_b`` (N, H)),
    the state in ``hseq``/``cseq`` slot ``slot_in``; writes slot ``slot_out``, the gates and the
    GRU's extra row at save slot ``s``, and (``y_width`` > 0) the output Y[t, n, col + j].
    """
    width = _gate_count(code) * hs
    total = n_rows * hs
    e = cuda.grid(1)
    while e < total:
        n = e // hs
        j = e - n * hs
        active = t < lengths[n]
        a_row = (t * n_rows + n) * width
        s_row = (s * n_rows + n) * width
        i_in = slot_in * total + e
        i_out = slot_out * total + e
        h = hseq[i_in]
        if code == GRU_ORIGINAL and stage == 1:
            _gru_original_gates(gi, gh_a, b_i, gates, extra, a_row, n * hs, s_row, s * total + e, j, hs, h)
        else:
            if code == LSTM:
                h_new, c_new = _lstm_cell(gi, gh_a, b_i, gates, a_row, n * width, s_row, j, hs, cseq[i_in])
                cseq[i_out] = c_new if active else cseq[i_in]
            elif code == GRU:
                h_new = _gru_cell(gi, gh_a, b_i, b_n, gates, extra, a_row, n * width, s_row, s * total + e, j, hs,
                                  h)
            elif code == GRU_ORIGINAL:
                h_new = _gru_original_state(gi, gh_b, b_i, gates, a_row, n * hs, s_row, j, hs, h)
            else:
                h_new = _rnn_cell(code, gi[a_row + j] + gh_a[n * width + j] + b_i[j])
                gates[s_row + j] = h_new
            hseq[i_out] = h_new if active else h
            if y_width > 0:
                y[(t * n_rows + n) * y_width + col + j] = h_new if active else cast_as(h, 0.0)
        e += cuda.gridsize(1)


@device
def _lstm_back(gates, hseq, cseq, dc, da, g_row, a_row, i_in, i_out, st, j, hs, dh):
    """Gate gradients [di df dg do] of one unit; dc becomes the entering c's gradient (c' = f c + i g)."""
    one_ = cast_as(dh, 1.0)
    i = gates[g_row + j]
    f = gates[g_row + hs + j]
    g = gates[g_row + 2 * hs + j]
    o = gates[g_row + 3 * hs + j]
    tc = math.tanh(cseq[i_out])
    dct = dc[st] + dh * o * (one_ - tc * tc)
    da[a_row + j] = dct * g * i * (one_ - i)
    da[a_row + hs + j] = dct * cseq[i_in] * f * (one_ - f)
    da[a_row + 2 * hs + j] = dct * i * (one_ - g * g)
    da[a_row + 3 * hs + j] = dh * tc * o * (one_ - o)
    dc[st] = dct * f


@device
def _gru_back(gates, extra, da, db, g_row, a_row, e_at, j, hs, h, dh):
    """reset_after=True: da = [dr dz dn] (input side), db = [dr dz dn ⊙ r] (hidden side); returns z ⊙ dh."""
    one_ = cast_as(dh, 1.0)
    r = gates[g_row + j]
    z = gates[g_row + hs + j]
    n = gates[g_row + 2 * hs + j]
    dz = dh * (h - n) * z * (one_ - z)
    dn = dh * (one_ - z) * (one_ - n * n)
    dr = dn * extra[e_at] * r * (one_ - r)
    da[a_row + j] = dr
    da[a_row + hs + j] = dz
    da[a_row + 2 * hs + j] = dn
    db[a_row + j] = dr
    db[a_row + hs + j] = dz
    db[a_row + 2 * hs + j] = dn * r
    return z * dh


@kernel(_BWD, DTYPES)
def _backward_step(code, stage, has_q, gates, extra, hseq, cseq, q, drh, dirh, dc, dy, da, db, lengths,
                   t, slot_in, slot_out, n_rows, hs, y_width, col):
    """The gradients of step t (one thread per (n, j), grid-stride); see the module docstring.

    dh = D (``dirh``) + Q (``q``, when ``has_q``) + dY[t, n, col + j] (``y_width`` > 0).  Writes the
    gate pre-activation gradients ``da`` (T, N, Wa) and, for the GRU, ``db`` (its hidden side:
    (T, N, 3H) with reset_after, the n gate's (T, N, H) without), and the new D.  Wa = G·H, except
    GRU_ORIGINAL's [dr dz] (T, N, 2H), whose dr needs dn·w_hn first: stage 1 writes dz, dn and
    D = z ⊙ dh (dr = 0 past a sequence's end), stage 2 reads that product ``drh`` and completes
    dr and D.
    """
    width = _gate_count(code) * hs
    a_width = 2 * hs if code == GRU_ORIGINAL else width
    total = n_rows * hs
    e = cuda.grid(1)
    while e < total:
        n = e // hs
        j = e - n * hs
        active = t < lengths[n]
        row = t * n_rows + n
        g_row = row * width
        a_row = row * a_width
        i_in = slot_in * total + e
        if code == GRU_ORIGINAL and stage == 2:
            if active:
                r = gates[g_row + j]
                d = drh[e]
                da[a_row + j] = d * hseq[i_in] * r * (cast_as(d, 1.0) - r)
                dirh[e] += d * r
        else:
            dh = dirh[e]
            if has_q:
                dh += q[e]
            zero_ = cast_as(dh, 0.0)
            if not active:
                dirh[e] = dh  # the step left the state alone: its gradient passes through
                for k in range(a_width // hs):
                    da[a_row + k * hs + j] = zero_
                if code == GRU:
                    for k in range(3):
                        db[a_row + k * hs + j] = zero_
                elif code == GRU_ORIGINAL:
                    db[row * hs + j] = zero_
            else:
                if y_width > 0:
                    dh += dy[row * y_width + col + j]
                if code == LSTM:
                    _lstm_back(gates, hseq, cseq, dc, da, g_row, a_row, i_in, slot_out * total + e, e, j, hs, dh)
                    dirh[e] = zero_
                elif code == GRU:
                    dirh[e] = _gru_back(gates, extra, da, db, g_row, a_row, t * total + e, j, hs, hseq[i_in], dh)
                elif code == GRU_ORIGINAL:
                    one_ = cast_as(dh, 1.0)
                    z = gates[g_row + hs + j]
                    nn = gates[g_row + 2 * hs + j]
                    db[row * hs + j] = dh * (one_ - z) * (one_ - nn * nn)
                    da[a_row + hs + j] = dh * (hseq[i_in] - nn) * z * (one_ - z)
                    dirh[e] = z * dh
                else:
                    hv = gates[g_row + j]
                    if code == RNN_TANH:
                        da[a_row + j] = dh * (cast_as(dh, 1.0) - hv * hv)
                    else:
                        da[a_row + j] = dh if hv > zero_ else zero_
                    dirh[e] = zero_
        e += cuda.gridsize(1)


# --------------------------------------------------------------------------- bias gradients: column sums


@kernel(_COL, DTYPES)
def _column_partials(a, p, rows, width, per):
    """Block (column tile, chunk k): float64 sums of ``a`` (rows, width) over rows [k·per, (k+1)·per).

    2-D block: ``blockDim.x`` consecutive columns × ``blockDim.y`` row lanes (a power of two),
    folded by a shared-memory tree; writes p[k·width + col].
    """
    sh = cuda.shared.array(MAX_THREADS, float64)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    lanes_x = cuda.blockDim.x
    col = cuda.blockIdx.x * lanes_x + tx
    k = cuda.blockIdx.y
    r1 = min(rows, (k + 1) * per)
    acc = 0.0
    if col < width:
        r = k * per + ty
        while r < r1:
            acc += np.float64(a[r * width + col])
            r += cuda.blockDim.y
    lane = ty * lanes_x + tx
    sh[lane] = acc
    cuda.syncthreads()
    step = cuda.blockDim.y // 2
    while step > 0:
        if ty < step:
            sh[lane] += sh[lane + step * lanes_x]
        cuda.syncthreads()
        step //= 2
    if ty == 0 and col < width:
        p[k * width + col] = sh[tx]


@kernel(_FOLD, ("float64",))
def _fold_partials(p, out, chunks, width):
    """Second pass: out[col] = Σ_k p[k·width + col], in a fixed order (deterministic)."""
    col = cuda.grid(1)
    if col < width:
        acc = 0.0
        for k in range(chunks):
            acc += p[k * width + col]
        out[col] = acc


def column_sums(a2: Any) -> Any:
    """Σ over the rows of a C-contiguous ``(rows, width)`` array, in float64, without atomics."""
    xp = rt.array_module(a2)
    s = rt.settings()
    rows, width = (int(d) for d in a2.shape)
    out = xp.zeros(width, np.float64)
    if rows == 0 or width == 0:
        return out
    tiles = -(-width // s.tile_x)
    chunks = max(1, min(-(-s.target_blocks // tiles), -(-rows // max(1, s.min_chunk // s.tile_x))))
    per = -(-rows // chunks)
    chunks = -(-rows // per)
    partials = xp.empty(chunks * width, np.float64)
    rt.launch(_column_partials, (tiles, chunks), (s.tile_x, s.tile_y), a2.reshape(-1), partials, rows, width, per)
    rt.launch(_fold_partials, rt.blocks_for(width, s.block), s.block, partials, out, chunks, width)
    return out


# --------------------------------------------------------------------------- host: one direction


def _code(call) -> int:
    """The runtime cell code of a call."""
    if call.kind == "lstm":
        return LSTM
    if call.kind == "gru":
        return GRU if call.reset_after else GRU_ORIGINAL
    return RNN_TANH if call.activation.name == "tanh" else RNN_RELU


def _matmul(xp, a, b, out):
    """out = a · b (cuBLAS on CuPy arrays) into a preallocated C-contiguous buffer."""
    if out.size:
        xp.matmul(a, b, out=out)
    return out


class _Weights:
    """One layer direction's weights as the kernels take them (see the module docstring)."""

    def __init__(self, xp, code, w_ih, w_hh, b_ih, b_hh, w_hr=None):
        gw = int(w_hh.shape[0])
        hs = gw // GATES[code]  # w_hh has P < H columns with an LSTM projection
        self.w_ih, self.w_hh, self.w_hr = w_ih, w_hh, w_hr
        self.has_bias = (b_ih is not None, b_hh is not None)
        self.b_i = xp.zeros(gw, w_hh.dtype)
        self.b_n = xp.zeros(hs, w_hh.dtype)
        if b_ih is not None:
            self.b_i += b_ih
        if b_hh is not None:
            if code == GRU:  # r multiplies h·w_hnᵀ + b_hn, so b_hn cannot join b_in
                self.b_i[: 2 * hs] += b_hh[: 2 * hs]
                self.b_n[...] = b_hh[2 * hs:]
            else:
                self.b_i += b_hh
        # The recurrent GEMM's weights (GRU_ORIGINAL: the r, z rows; its n rows are w_b).
        self.w_a = w_hh[: 2 * hs] if code == GRU_ORIGINAL else w_hh
        self.w_b = w_hh[2 * hs:] if code == GRU_ORIGINAL else None


class _Direction:
    """One direction's forward pass and what its backward needs.

    ``hseq``/``cseq``: the state buffers (see the module docstring), ``gates``/``extra`` the kept
    rows, ``lengths`` the device int64 lengths.
    """

    def __init__(self, xp, code, x, w: _Weights, lengths, reverse, save, h0, c0):
        steps, n, _ = (int(d) for d in x.shape)
        hs = int(w.w_hh.shape[0]) // GATES[code]
        out = int(w.w_hr.shape[0]) if w.w_hr is not None else hs  # h's size: P with a projection
        dtype = x.dtype
        self.xp, self.code, self.x, self.w, self.lengths = xp, code, x, w, lengths
        self.reverse, self.steps, self.n, self.hs, self.out = reverse, steps, n, hs, out
        slots = steps + 1 if save else 2
        rows = steps if save else 1
        width = GATES[code] * hs
        self.hseq = xp.empty((slots, n, out), dtype)
        # With a projection the kernels' state is the unprojected o ⊙ tanh(c), in its own slots.
        self.hfseq = xp.zeros((slots, n, hs), dtype) if w.w_hr is not None else self.hseq
        self.cseq = xp.empty((slots, n, hs), dtype) if code == LSTM else xp.empty(1, dtype)
        self.gates = xp.empty((rows, n, width), dtype)
        self.extra = xp.empty((rows, n, hs), dtype) if code in (GRU, GRU_ORIGINAL) else xp.empty(1, dtype)
        first = steps if save and reverse else 0
        self.hseq[first] = 0 if h0 is None else h0
        if code == LSTM:
            self.cseq[first] = 0 if c0 is None else c0
        self.save = save

    def slots(self, k: int) -> tuple[int, int, int]:
        """(t, slot_in, slot_out) of the k-th step in processing order."""
        t = self.steps - 1 - k if self.reverse else k
        if not self.save:
            return t, k % 2, (k + 1) % 2
        return (t, t + 1, t) if self.reverse else (t, t, t + 1)

    def final_slot(self) -> int:
        if not self.save:
            return self.steps % 2
        return 0 if self.reverse else self.steps

    def run(self, y, col: int) -> None:
        """The forward over all steps; ``y`` (T, N, Y) receives columns col … col+H (or None)."""
        xp, code, w, x = self.xp, self.code, self.w, self.x
        steps, n, hs = self.steps, self.n, self.hs
        width = GATES[code] * hs
        gi = xp.empty((steps, n, width), x.dtype)
        _matmul(xp, x.reshape(steps * n, int(x.shape[2])), w.w_ih.T, gi.reshape(steps * n, width))
        gh_a = xp.empty((n, int(w.w_a.shape[0])), x.dtype)
        gh_b = xp.empty((n, hs), x.dtype) if code == GRU_ORIGINAL else xp.empty(1, x.dtype)
        proj = w.w_hr is not None
        y_flat, y_width = (xp.empty(1, x.dtype), 0) if y is None or proj else (y.reshape(-1), int(y.shape[2]))
        s_cfg = rt.settings()
        grid = rt.blocks_for(n * hs, s_cfg.block)
        flat = [a.reshape(-1) for a in (gi, gh_a, gh_b, w.b_i, w.b_n, self.hfseq, self.cseq, self.gates, self.extra)]
        hq = xp.empty((n, self.out), x.dtype) if proj else None
        for k in range(steps):
            t, slot_in, slot_out = self.slots(k)
            s = t if self.save else 0
            _matmul(xp, self.hseq[slot_in], w.w_a.T, gh_a)
            dims = (t, s, slot_in, slot_out, n, hs, y_width, col)
            if code == GRU_ORIGINAL:
                rt.launch(_forward_step, grid, s_cfg.block, code, 1, *flat, y_flat, self.lengths, *dims)
                _matmul(xp, self.extra[s], w.w_b.T, gh_b)
                rt.launch(_forward_step, grid, s_cfg.block, code, 2, *flat, y_flat, self.lengths, *dims)
            else:
                rt.launch(_forward_step, grid, s_cfg.block, code, 0, *flat, y_flat, self.lengths, *dims)
            if proj:
                self._project(hq, t, slot_in, slot_out, y, col)

    def _project(self, hq, t, slot_in, slot_out, y, col):
        """An LSTM projection's step (:func:`~portable_nn.kernel_plans.project_step`): hseq and Y[t]."""
        project_step(self.xp, self.hfseq[slot_out], self.w.w_hr, hq, self.hseq[slot_in], self.hseq[slot_out],
                     None if y is None else y[t][:, col:col + self.out], (self.lengths > t)[:, None])

    def final_h(self):
        return self.hseq[self.final_slot()]

    def final_c(self):
        return self.cseq[self.final_slot()]

    def backward(self, dy, col, dh, dc, want_state):
        """Backward through time; returns (da, db, dh0, dc0) (see :func:`_backward_step`).

        ``dy`` (T, N, Y) or None; ``dh``/``dc`` (N, H) the final states' gradients.  dh0/dc0 are
        None unless ``want_state``.
        """
        xp, code, w = self.xp, self.code, self.w
        steps, n, hs = self.steps, self.n, self.hs
        dtype = self.x.dtype
        a_width = 2 * hs if code == GRU_ORIGINAL else GATES[code] * hs
        da = xp.empty((steps, n, a_width), dtype)
        if code == GRU:
            db = xp.empty((steps, n, 3 * hs), dtype)
        elif code == GRU_ORIGINAL:
            db = xp.empty((steps, n, hs), dtype)
        else:
            db = xp.empty(1, dtype)
        proj, out = w.w_hr is not None, self.out
        dirh = xp.array(dh, dtype=dtype, copy=True).reshape(n, out)
        dcs = xp.array(dc, dtype=dtype, copy=True).reshape(n, hs) if code == LSTM else xp.empty(1, dtype)
        q = xp.empty((n, out), dtype)
        dh_full = xp.empty((n, hs), dtype) if proj else dirh
        self.dproj = xp.empty((steps, n, out), dtype) if proj else None
        drh = xp.empty((n, hs), dtype) if code == GRU_ORIGINAL else xp.empty(1, dtype)
        dy_flat, y_width = (xp.empty(1, dtype), 0) if dy is None or proj else (dy.reshape(-1), int(dy.shape[2]))
        hidden = db if code == GRU else da  # the recurrent GEMM's left operand
        s_cfg = rt.settings()
        grid = rt.blocks_for(n * hs, s_cfg.block)
        has_q = False
        for idx, k in enumerate(range(steps - 1, -1, -1)):
            t, slot_in, slot_out = self.slots(k)
            if proj:
                passed = self._unproject(dirh, q if has_q else None, dy, t, col, dh_full)
            args = (self.gates.reshape(-1), self.extra.reshape(-1), self.hfseq.reshape(-1), self.cseq.reshape(-1),
                    q.reshape(-1), drh.reshape(-1), dh_full.reshape(-1), dcs.reshape(-1), dy_flat, da.reshape(-1),
                    db.reshape(-1), self.lengths, t, slot_in, slot_out, n, hs, y_width, col)
            step_q = has_q and not proj  # with a projection, dh (q included) entered through dh_full
            if code == GRU_ORIGINAL:
                rt.launch(_backward_step, grid, s_cfg.block, code, 1, has_q, *args)
                _matmul(xp, db[t], w.w_b, drh)
                rt.launch(_backward_step, grid, s_cfg.block, code, 2, has_q, *args)
            else:
                rt.launch(_backward_step, grid, s_cfg.block, code, 0, step_q, *args)
            if proj:  # what passes on besides q: the dh of a sequence that had ended, else 0
                dirh[...] = passed
            if idx < steps - 1 or want_state:
                _matmul(xp, hidden[t], w.w_a, q)
                has_q = True
        dh0 = dc0 = None
        if want_state:
            dh0 = dirh + q if has_q else dirh
            dc0 = dcs if code == LSTM else None
        return da, db, dh0, dc0

    def _unproject(self, dirh, q, dy, t, col, dh_full):
        """A projected step's backward (:func:`~portable_nn.kernel_plans.unproject_step`) for step t."""
        dy_cols = None if dy is None else dy[t][:, col:col + self.out]
        return unproject_step(self.xp, dirh, q, dy_cols, (self.lengths > t)[:, None], self.w.w_hr, self.dproj[t],
                              dh_full)

    def hprev(self):
        """(T·N, out): the state entering each step, rows ordered like X's."""
        part = self.hseq[1:] if self.reverse else self.hseq[: self.steps]
        return part.reshape(self.steps * self.n, self.out)

    def projection_grad(self):
        """dw_hr = Σ_t dh_tᵀ·h_full_t over all T·N rows (the unprojected states the forward kept)."""
        part = self.hfseq[: self.steps] if self.reverse else self.hfseq[1:]
        m = self.steps * self.n
        return self.xp.matmul(self.dproj.reshape(m, self.out).T, part.reshape(m, self.hs))

    def weight_grads(self, da, db, want_w, want_b):
        """(dw_ih, dw_hh, db_ih, db_hh): single GEMMs over all T·N rows, bias sums by column reduction."""
        xp, code, w = self.xp, self.code, self.w
        m, hs = self.steps * self.n, self.hs
        dtype = self.x.dtype
        x2 = self.x.reshape(m, int(self.x.shape[2]))
        a2 = da.reshape(m, int(da.shape[2]))
        dw_ih = dw_hh = db_ih = db_hh = None
        if want_w:
            dw_ih = xp.empty(w.w_ih.shape, dtype)
            dw_hh = xp.empty(w.w_hh.shape, dtype)
            if code == GRU_ORIGINAL:
                b2 = db.reshape(m, hs)
                _matmul(xp, a2.T, x2, dw_ih[: 2 * hs])
                _matmul(xp, b2.T, x2, dw_ih[2 * hs:])
                _matmul(xp, a2.T, self.hprev(), dw_hh[: 2 * hs])
                _matmul(xp, b2.T, self.extra[: self.steps].reshape(m, hs), dw_hh[2 * hs:])
            else:
                _matmul(xp, a2.T, x2, dw_ih)
                _matmul(xp, (db.reshape(m, 3 * hs) if code == GRU else a2).T, self.hprev(), dw_hh)
        if want_b and any(w.has_bias):
            sa = column_sums(a2)
            if code == GRU_ORIGINAL:
                sa = xp.concatenate([sa, column_sums(db.reshape(m, hs))])
            sb = column_sums(db.reshape(m, 3 * hs)) if code == GRU else sa
            db_ih = sa.astype(dtype) if w.has_bias[0] else None
            db_hh = sb.astype(dtype) if w.has_bias[1] else None
        return dw_ih, dw_hh, db_ih, db_hh

    def input_grad(self, da, db, out, add):
        """dX (T, N, F) = dA · w_ih into ``out``, added to it with ``add`` (a layer's second direction)."""
        xp, code, w = self.xp, self.code, self.w
        m, hs = self.steps * self.n, self.hs
        out2 = out.reshape(m, int(out.shape[2]))
        a2 = da.reshape(m, int(da.shape[2]))
        if code == GRU_ORIGINAL:
            part = xp.matmul(a2, w.w_ih[: 2 * hs])
            part += xp.matmul(db.reshape(m, hs), w.w_ih[2 * hs:])
        elif add:
            part = xp.matmul(a2, w.w_ih)
        else:
            _matmul(xp, a2, w.w_ih, out2)
            return
        if add:
            out2 += part
        else:
            out2[...] = part


# --------------------------------------------------------------------------- cells: entry points

_CELL_WEIGHTS = ("w_ih", "w_hh", "b_ih", "b_hh")


def cell_forward(call):
    """``rnn_cell``/``lstm_cell``/``gru_cell``: one step of the sequence kernels; ``(h',)`` or ``(h', c')``."""
    code = _code(call)
    x = call.x
    xp = rt.array_module(x)
    hs = int(call.hidden_size)
    n = 1 if call.unbatched else int(x.shape[0])
    X = x.reshape(1, n, int(x.shape[-1]))
    w = _Weights(xp, code, call.w_ih, call.w_hh, call.b_ih, call.b_hh)
    lengths = xp.ones(n, np.int64)
    c0 = call.c.reshape(n, hs) if code == LSTM else None
    d = _Direction(xp, code, X, w, lengths, False, True, call.h.reshape(n, hs), c0)
    d.run(None, 0)
    shape = tuple(call.h.shape)
    h_new = d.final_h().reshape(shape)
    outputs = (h_new, d.final_c().reshape(shape)) if code == LSTM else (h_new,)
    return outputs, ((call, d) if call.save else None)


def cell_backward(residuals, cotangents, needs, out=None):
    """Gradients of the cell ops for the names in ``needs`` (into ``out`` buffers where given)."""
    call, d = residuals
    out = out or {}
    code, n, hs = d.code, d.n, d.hs
    dh = cotangents[0].reshape(n, hs).astype(d.x.dtype, copy=False)
    dc = cotangents[1].reshape(n, hs).astype(d.x.dtype, copy=False) if code == LSTM else None
    want_state = bool(needs & {"h", "c"})
    da, db, dh0, dc0 = d.backward(None, 0, dh, dc, want_state)
    grads = {}
    if "x" in needs:
        dx = d.xp.empty(d.x.shape, d.x.dtype)
        d.input_grad(da, db, dx, False)
        grads["x"] = rt.into(out, "x", dx.reshape(call.x.shape))
    for name, value in (("h", dh0), ("c", dc0)):
        if name in needs:
            grads[name] = rt.into(out, name, value.reshape(call.arrays[name].shape))
    want_w = bool(needs & {"w_ih", "w_hh"})
    want_b = bool(needs & {"b_ih", "b_hh"})
    if want_w or want_b:
        for name, value in zip(_CELL_WEIGHTS, d.weight_grads(da, db, want_w, want_b)):
            if name in needs:
                grads[name] = None if value is None else rt.into(out, name, value)
    return grads


# --------------------------------------------------------------------------- sequences: entry points


def _deliver(buffer, value):
    """``value``, copied into the caller's ``buffer`` when one is given (``None`` stays ``None``)."""
    if buffer is None or value is None:
        return value
    buffer[...] = value
    return buffer


def sequence_forward(call):
    """``rnn``/``lstm``/``gru``: outputs ``(y, h_n)`` or ``(y, h_n, c_n)``."""
    code = _code(call)
    x = call.x
    xp = rt.array_module(x)
    dtype = x.dtype
    layers, dirs, hs = int(call.num_layers), int(call.num_directions), int(call.hidden_size)
    X = without_padding(xp, time_major(xp, x, call.batch_first), call.lengths)
    steps, n = int(X.shape[0]), int(X.shape[1])
    lengths = xp.asarray(np.full(n, steps, np.int64) if call.lengths is None else np.asarray(call.lengths, np.int64))
    h0, c0 = call.arrays.get("h0"), call.arrays.get("c0")
    out = int(call.params.get("proj_size") or 0) or hs
    h_n = xp.empty((layers * dirs, n, out), dtype)
    c_n = xp.empty((layers * dirs, n, hs), dtype) if code == LSTM else None
    directions = []
    inp = X
    for layer in range(layers):
        y = xp.empty((steps, n, dirs * out), dtype)
        for r in range(dirs):
            k = layer * dirs + r
            w = _Weights(xp, code, *(call.arrays[name] for name in call.param_names[k]))
            d = _Direction(xp, code, inp, w, lengths, r == 1, call.save, None if h0 is None else h0[k],
                           None if c0 is None else c0[k])
            d.run(y, r * out)
            h_n[k] = d.final_h()
            if code == LSTM:
                c_n[k] = d.final_c()
            directions.append(d)
        inp = y
    y_out = xp.ascontiguousarray(xp.swapaxes(inp, 0, 1)) if call.batch_first else inp
    outputs = (y_out, h_n) + (() if c_n is None else (c_n,))
    return outputs, ((call, directions) if call.save else None)


def sequence_backward(residuals, cotangents, needs, out=None):
    """Gradients of the sequence ops: ``x``, ``params`` (a list of 4-tuples), ``h0``, ``c0``."""
    call, directions = residuals
    out = out or {}
    d0 = directions[0]
    xp, code, dtype = d0.xp, d0.code, d0.x.dtype
    layers, dirs = int(call.num_layers), int(call.num_directions)
    dY = time_major(xp, cotangents[0].astype(dtype, copy=False), call.batch_first)
    dh_n = cotangents[1].astype(dtype, copy=False)
    dc_n = cotangents[2].astype(dtype, copy=False) if code == LSTM else None
    want_x, want_p = "x" in needs, "params" in needs
    want_state = bool(needs & {"h0", "c0"})
    dh0 = xp.empty(dh_n.shape, dtype) if want_state else None
    dc0 = xp.empty(dc_n.shape, dtype) if want_state and code == LSTM else None
    pgrads = [None] * (layers * dirs)
    for layer in range(layers - 1, -1, -1):
        dX = xp.empty(directions[layer * dirs].x.shape, dtype) if layer > 0 or want_x else None
        for r in range(dirs):
            k = layer * dirs + r
            d = directions[k]
            da, db, g_h, g_c = d.backward(dY, r * d.out, dh_n[k], None if dc_n is None else dc_n[k], want_state)
            if want_state:
                dh0[k] = g_h
                if code == LSTM:
                    dc0[k] = g_c
            if want_p:
                pgrads[k] = d.weight_grads(da, db, True, True)
                if d.w.w_hr is not None:
                    pgrads[k] = (*pgrads[k], d.projection_grad())
            if dX is not None:
                d.input_grad(da, db, dX, r == 1)
        dY = dX
    grads = {}
    if want_x:
        grads["x"] = rt.into(out, "x", xp.ascontiguousarray(xp.swapaxes(dY, 0, 1)) if call.batch_first else dY)
    if want_p:
        buffers = out.get("params") or [(None,) * 5] * (layers * dirs)
        grads["params"] = [tuple(_deliver(b, g) for b, g in zip(buffers[k], pgrads[k])) for k in range(layers * dirs)]
    if "h0" in needs:
        grads["h0"] = rt.into(out, "h0", dh0)
    if "c0" in needs:
        grads["c0"] = rt.into(out, "c0", dc0)
    return grads
