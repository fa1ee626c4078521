"""Numba kernels for recurrent cells and sequences, forward and backward (backend ``"numba"``).

One *direction* of one layer over a time-major sequence ``X`` ``(T, N, F)`` runs in
**one compiled function** (:func:`_forward_direction`)::

    GI = X · w_ihᵀ                                    one GEMM for all T steps
    for t in time order (reversed for the reverse direction):
        GH = h · w_hhᵀ                                recurrent GEMM (BLAS, preallocated out)
        gates, state = cell(GI[t] + GH + b)           one fused elementwise pass per row

and backward through time in another (:func:`_backward_direction`)::

    for t in reverse time order:
        dG[t] = cell'(dh + dY[t], dc, gates[t], state[t])   fused elementwise pass
        db   += Σ_n dG[t, n]                          in the same pass (float64, fixed order)
        dh    = dG[t] · w_hh (+ the cell's direct term)     recurrent GEMM
    dw_ih = dGᵀ · X,  dw_hh = dGᵀ · H_prev,  dX = dG · w_ih    single GEMMs over all T·N rows

Cells (σ the logistic function, ⊙ elementwise; gates stacked as in PyTorch):

    rnn:   h' = act(x·w_ihᵀ + b_ih + h·w_hhᵀ + b_hh),  act = tanh or relu
    lstm:  [i f g o] = [σ σ tanh σ](…),  c' = f ⊙ c + i ⊙ g,  h' = o ⊙ tanh(c')
    gru:   r, z = σ(…);  reset_after=True:  n = tanh(GI_n + b_in + r ⊙ (h·w_hnᵀ + b_hn))
                         reset_after=False: n = tanh(GI_n + b_in + (r ⊙ h)·w_hnᵀ + b_hn)
           h' = n + z ⊙ (h − n)

The bias of a gate is added inside the cell pass (one vector, ``b_ih + b_hh`` wherever the
two simply add; only the GRU's ``b_hn`` with ``reset_after=True`` stays apart, since r
multiplies it), so the big ``GI`` buffer is written once by BLAS and read once.

The cell ops are sequences of one step through the same two functions.  Everything else
(which gates, which GRU form, tanh or relu) is a runtime code, so the whole family compiles
to two functions, each once per dtype.

Transcendentals: PyPI's numba has no SVML, so ``math.exp``/``math.tanh`` would be scalar
libm calls that keep the cell loops from vectorising.  ``_exp`` is :func:`kernels_cpu._vmath.exp`
(the package's one vectorisable exponential, first written for this module: a range reduction
``x = k·ln2 + r``, a polynomial in ``r`` and ``2**k`` built from its exponent bits).
σ(z) = 1/(1 + e^−z) and tanh(z) = 2σ(2z) − 1 (one exp for a whole LSTM row, see _gates_row).
Measured maximum errors: exp 1.2e-7 (float32) and 3.2e-16 (float64) relative; σ and tanh
1.8e-7 and 3.3e-16 absolute, so float64 results match the reference to ~1e-15.  A row of
65536 float32 LSTM gates takes ~55 us (libm: ~4x that).
Constants are float32 scalars, exact in float64, so float32 code never widens to float64.

Variable lengths (packed sequences): a step past a sequence's end leaves its state
unchanged and writes a zero output; in the backward its gate gradients are zero and the
state gradients pass through, as in the reference.  Without ``lengths`` every length is T.

Threading: the kernels themselves are serial (no Numba thread pool, nothing to pay on small
calls); the GEMMs run on SciPy's OpenBLAS through ``np.dot``, which splits a product over
its threads above ~2**18 multiply-adds and runs smaller ones on the calling thread.  All
GEMMs of a call use that one BLAS (none goes through NumPy's), so two BLAS thread pools
never spin against each other.  Why not Numba threads as well: the time loop is a chain of
short GEMM + cell steps, and a second pool woken every step would fight the BLAS threads
for the cores; splitting the batch across threads instead needs one-thread BLAS calls,
which only small (sub-threshold) products get, at 2.4x their cost (measured).  On an
oversubscribed machine BLAS's per-step thread hand-offs dominate: ``OPENBLAS_NUM_THREADS=1``
(or threadpoolctl) is then several times faster.  Results are bitwise reproducible for a
given BLAS and thread count.

LSTM projections (``w_hr``, PyTorch's ``proj_size``): each step's new state o ⊙ tanh(c') goes
to a scratch row block and one GEMM per step projects it (h = h_full·w_hrᵀ, P columns); the
backward keeps each step's dh (P columns) for dw_hr = Σ dhᵀ·(o ⊙ tanh(c')), one GEMM at the end,
and feeds dh·w_hr to the cell.  (T=50, N=64, I=128, H=256, P=128, 2 layers, float32, 2 threads
on the AVX-512 Xeon: forward 21.9 ms vs PyTorch's 26.9, forward+backward 72.4 vs 95.6.)

Supported: ``rnn_cell``, ``lstm_cell``, ``gru_cell``, ``rnn``, ``lstm``, ``gru`` with every
argument of the api (tanh/relu, both GRU forms, stacked layers, bidirectional,
batch_first, ``lengths``, optional biases and initial states, LSTM projections, zero sizes), float32 and
float64 NumPy arrays (CPU torch tensors arrive as zero-copy NumPy views).  ``batch_first``
data is transposed to time-major once on entry and back on exit.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from portable_nn.kernel_codes import GATES, GRU, GRU_ORIGINAL, LSTM, RNN_RELU, RNN_TANH
from portable_nn.kernel_plans import caller_layout, time_major, without_padding

from . import _runtime
from ._blas import parallel_gemm
from ._vmath import exp as _exp

# ``contract`` lets LLVM fuse a*b + c into one FMA: it shortens the polynomials and is at
# least as accurate (measured: the float32 LSTM cell pass 124 -> 97 us).  Helpers are inlined
# into the two kernels (``_INLINE``), so each dtype compiles two units: ~16 s cold per dtype
# on this machine, then loaded from Numba's cache.
_OPTS = {"cache": True, "error_model": "numpy", "nogil": True, "fastmath": {"contract"}}
_INLINE = {**_OPTS, "inline": "always"}


# float32 constants: exact in float64, and they keep float32 arithmetic in float32.
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_TWO = np.float32(2.0)


# --------------------------------------------------------------------------- σ, tanh (exp: _vmath)


@njit(**_INLINE)
def _sigmoid(z):
    return _ONE / (_ONE + _exp(-z))


@njit(**_INLINE)
def _tanh(z):
    # tanh z = 2σ(2z) − 1: one exp and one division, like σ; absolute error ~1 ulp of 1.
    return _TWO * _sigmoid(_TWO * z) - _ONE


# --------------------------------------------------------------------------- row helpers


@njit(**_INLINE)
def _gates_row(a, m, b, beta, out):
    """out = β σ(β (a + m + b)) + 1 − β: σ where β = 1, tanh where β = 2 (see :func:`_tanh`).

    One loop over a whole LSTM row (i, f, g, o) instead of one per gate kind: longer
    vector loops and less code to compile.
    """
    for j in range(out.shape[0]):
        s = beta[j]
        out[j] = s * _sigmoid(s * (a[j] + m[j] + b[j])) + (_ONE - s)


@njit(**_INLINE)
def _copy_row(src, dst):
    for j in range(dst.shape[0]):
        dst[j] = src[j]


@njit(**_INLINE)
def _zero_row(dst):
    for j in range(dst.shape[0]):
        dst[j] = _ZERO


@njit(**_INLINE)
def _add_row(src, dst):
    for j in range(dst.shape[0]):
        dst[j] += src[j]


@njit(**_INLINE)
def _accumulate_row(src, acc):
    """acc += src in float64 (the bias gradient; fixed order, so deterministic)."""
    for j in range(acc.shape[0]):
        acc[j] += np.float64(src[j])


@njit(**_INLINE)
def _emit(h, y_t, col, n, active):
    """Output row n: the new state of an active sequence, zero past its end."""
    hs = h.shape[1]
    yr = y_t[n][col : col + hs]
    if active:
        _copy_row(h[n], yr)
    else:
        _zero_row(yr)


@njit(**_INLINE)
def _blend_row(nn, z, hr):
    """The GRU state update h' = n + z ⊙ (h − n), in place."""
    for j in range(hr.shape[0]):
        hr[j] = nn[j] + z[j] * (hr[j] - nn[j])


# --------------------------------------------------------------------------- forward steps


@njit(**_INLINE)
def _rnn_step(code, t, gi_t, gh, w_a, b_i, beta, g_s, h, y_t, col, lengths):
    np.dot(h, w_a.T, gh)
    n_rows, hs = h.shape
    for n in range(n_rows):
        a = gi_t[n]
        m = gh[n]
        g = g_s[n]
        if code == RNN_TANH:
            _gates_row(a, m, b_i, beta, g)
        else:
            for j in range(hs):
                v = a[j] + m[j] + b_i[j]
                g[j] = v if v > _ZERO else _ZERO
        active = t < lengths[n]
        if active:
            _copy_row(g, h[n])
        _emit(h, y_t, col, n, active)


@njit(**_INLINE)
def _lstm_step(t, gi_t, gh, w_a, b_i, beta, g_s, e_s, h, c, y_t, col, lengths, w_hr, hf, hq):
    """e_s receives tanh(c'), which the backward needs.

    With projections (``w_hr`` ``(P, H)``, P > 0) the new state o ⊙ tanh(c') goes to the
    scratch ``hf`` and h = hf·w_hrᵀ (one GEMM for the rows, through ``hq``); h has P columns.
    """
    np.dot(h, w_a.T, gh)
    n_rows = h.shape[0]
    hs = c.shape[1]
    proj = w_hr.shape[0] > 0
    for n in range(n_rows):
        g = g_s[n]
        _gates_row(gi_t[n], gh[n], b_i, beta, g)
        active = t < lengths[n]
        if active:
            i = g[:hs]
            f = g[hs : 2 * hs]
            gg = g[2 * hs : 3 * hs]
            o = g[3 * hs :]
            cr = c[n]
            hr = hf[n] if proj else h[n]
            e = e_s[n]
            for j in range(hs):
                cr[j] = f[j] * cr[j] + i[j] * gg[j]
            for j in range(hs):
                e[j] = _tanh(cr[j])
            for j in range(hs):
                hr[j] = o[j] * e[j]
        if not proj:
            _emit(h, y_t, col, n, active)
    if proj:
        np.dot(hf, w_hr.T, hq)
        for n in range(n_rows):
            active = t < lengths[n]
            if active:
                _copy_row(hq[n], h[n])
            _emit(h, y_t, col, n, active)


@njit(**_INLINE)
def _gru_step(t, gi_t, gh, w_a, b_i, b_n, beta, g_s, e_s, h, y_t, col, lengths):
    """reset_after=True; e_s receives h·w_hnᵀ + b_hn (the backward needs it)."""
    np.dot(h, w_a.T, gh)
    n_rows, hs = h.shape
    for n in range(n_rows):
        a = gi_t[n]
        m = gh[n]
        g = g_s[n]
        e = e_s[n]
        _gates_row(a[: 2 * hs], m[: 2 * hs], b_i[: 2 * hs], beta[: 2 * hs], g[: 2 * hs])
        mn = m[2 * hs :]
        for j in range(hs):
            e[j] = mn[j] + b_n[j]
        r = g[:hs]
        an = a[2 * hs :]
        bn = b_i[2 * hs :]
        nn = g[2 * hs :]
        for j in range(hs):
            nn[j] = _tanh(an[j] + bn[j] + r[j] * e[j])
        active = t < lengths[n]
        if active:
            _blend_row(nn, g[hs : 2 * hs], h[n])
        _emit(h, y_t, col, n, active)


@njit(**_INLINE)
def _gru_original_step(t, gi_t, gh, w_a, w_b, b_i, beta, g_s, e_s, h, y_t, col, lengths):
    """reset_after=False: two GEMMs per step; e_s receives r ⊙ h (the second GEMM's input)."""
    n_rows, hs = h.shape
    gh_rz = gh[: n_rows * 2 * hs].reshape(n_rows, 2 * hs)
    gh_n = gh[n_rows * 2 * hs : n_rows * 3 * hs].reshape(n_rows, hs)
    np.dot(h, w_a.T, gh_rz)
    for n in range(n_rows):
        g = g_s[n]
        _gates_row(gi_t[n][: 2 * hs], gh_rz[n], b_i[: 2 * hs], beta[: 2 * hs], g[: 2 * hs])
        r = g[:hs]
        hr = h[n]
        e = e_s[n]
        for j in range(hs):
            e[j] = r[j] * hr[j]
    np.dot(e_s, w_b.T, gh_n)
    for n in range(n_rows):
        g = g_s[n]
        _gates_row(gi_t[n][2 * hs :], gh_n[n], b_i[2 * hs :], beta[2 * hs :], g[2 * hs :])
        active = t < lengths[n]
        if active:
            _blend_row(g[2 * hs :], g[hs : 2 * hs], h[n])
        _emit(h, y_t, col, n, active)


@njit(**_OPTS)
def _forward_rows(code, w_a, w_b, b_i, b_n, beta, lengths, reverse, save, h, c, y, col, gi, gh, gates, hprev,
                  cprev, extra, w_hr, hf, hq, n0, n1):
    """Rows [n0, n1) of the batch through every step of one layer direction, ``GI`` given.

    A batch row's recurrence never meets another row's, so row blocks run on separate threads
    with nothing shared but the (read-only) weights.  Arguments as :func:`_forward_direction`.
    """
    steps = gi.shape[0]
    width = gi.shape[2]
    rows = n1 - n0
    ghb = gh[n0 * width : n1 * width]
    gh2 = ghb.reshape(rows, width)
    hb = h[n0:n1]
    lb = lengths[n0:n1]
    for k in range(steps):
        t = steps - 1 - k if reverse else k
        s = t if save else 0
        if save:
            for n in range(rows):
                _copy_row(hb[n], hprev[t, n0 + n])
                if code == LSTM:
                    _copy_row(c[n0 + n], cprev[t, n0 + n])
        gi_t = gi[t][n0:n1]
        y_t = y[t][n0:n1]
        g_s = gates[s][n0:n1]
        if code == LSTM:
            _lstm_step(t, gi_t, gh2, w_a, b_i, beta, g_s, extra[s][n0:n1], hb, c[n0:n1], y_t, col, lb, w_hr,
                       hf[n0:n1], hq[n0:n1])
        elif code == GRU:
            _gru_step(t, gi_t, gh2, w_a, b_i, b_n, beta, g_s, extra[s][n0:n1], hb, y_t, col, lb)
        elif code == GRU_ORIGINAL:
            _gru_original_step(t, gi_t, ghb, w_a, w_b, b_i, beta, g_s, extra[s][n0:n1], hb, y_t, col, lb)
        else:
            _rnn_step(code, t, gi_t, gh2, w_a, b_i, beta, g_s, hb, y_t, col, lb)


@njit(**_OPTS)
def _forward_direction(code, x, w_ih, w_a, w_b, b_i, b_n, beta, lengths, reverse, save,
                       h, c, y, col, gi, gh, gates, hprev, cprev, extra, w_hr, hf, hq):
    """One layer direction over ``x`` ``(T, N, F)``; the state ``h``/``c`` ``(N, H)`` is updated in place.

    ``w_a`` is ``w_hh`` (its r, z rows for GRU_ORIGINAL, whose ``w_hn`` is ``w_b``); ``b_i``
    ``(G*H,)`` every bias that simply adds, ``b_n`` the GRU's ``b_hn``; ``beta`` ``(G*H,)``
    is 1 for σ gates and 2 for tanh ones (see :func:`_gates_row`).  Outputs go to
    ``y[:, :, col:col+H]``.  ``gi`` ``(T, N, G*H)`` and ``gh`` ``(N*G*H,)`` are scratch.
    With ``save`` the activated gates, the states entering each step and ``extra`` (see the
    steps) are kept for the backward, indexed by t; without it only their row 0 is used.
    LSTM projections: ``w_hr`` ``(P, H)`` (``(0, 0)`` for none), ``hf`` ``(N, H)`` and ``hq``
    ``(N, P)`` scratch; ``h`` is then ``(N, P)`` and ``y`` takes P columns.
    """
    steps, n_rows, features = x.shape
    width = gi.shape[2]
    np.dot(x.reshape(steps * n_rows, features), w_ih.T, gi.reshape(steps * n_rows, width))
    _forward_rows(code, w_a, w_b, b_i, b_n, beta, lengths, reverse, save, h, c, y, col, gi, gh, gates, hprev, cprev,
                  extra, w_hr, hf, hq, np.int64(0), n_rows)  # typed 0: a literal 0 compiled a second _forward_rows


@njit(parallel=True, **_OPTS)
def _forward_blocks(code, w_a, w_b, b_i, b_n, beta, lengths, reverse, save, h, c, y, col, gi, gh, gates, hprev,
                    cprev, extra, w_hr, hf, hq, block):
    """:func:`_forward_rows` over blocks of ``block`` batch rows, in parallel (``GI`` given)."""
    n = h.shape[0]
    for b in prange((n + block - 1) // block):
        n0 = np.int64(b) * block
        _forward_rows(code, w_a, w_b, b_i, b_n, beta, lengths, reverse, save, h, c, y, col, gi, gh, gates, hprev,
                      cprev, extra, w_hr, hf, hq, n0, min(n, n0 + block))


# --------------------------------------------------------------------------- backward steps


@njit(**_INLINE)
def _take_dy(dh, dy_t, col, n, has_dy):
    """dh[n] += dY[t, n, col:col+H]: the output's gradient joins the carried state gradient."""
    if has_dy:
        hs = dh.shape[1]
        _add_row(dy_t[n][col : col + hs], dh[n])


@njit(**_INLINE)
def _rnn_back(code, t, g_t, dh, dy_t, col, has_dy, da_t, lengths):
    """dA = dh ⊙ act'(h'), from the kept output h' (tanh: 1 − h'², relu: h' > 0)."""
    n_rows, hs = dh.shape
    for n in range(n_rows):
        da = da_t[n]
        if t < lengths[n]:
            _take_dy(dh, dy_t, col, n, has_dy)
            d = dh[n]
            g = g_t[n]
            if code == RNN_TANH:
                for j in range(hs):
                    da[j] = d[j] * (_ONE - g[j] * g[j])
            else:
                for j in range(hs):
                    da[j] = d[j] if g[j] > _ZERO else _ZERO
        else:
            _zero_row(da)


@njit(**_INLINE)
def _lstm_back(t, g_t, cp_t, tc_t, dh, dc, dy_t, col, has_dy, da_t, lengths, w_hr, dhf, dp_t):
    """Gate gradients [di df dg do] of one step; dc becomes the gradient of the entering c.

    One output stream per loop (a loop writing four gate streams at once measured 4x slower).
    tc = tanh(c'), kept by the forward.
    With projections (``w_hr`` ``(P, H)``, P > 0) the step's dh (P columns, dY included) is
    kept in ``dp_t`` for dw_hr and enters the cell as dh·w_hr (one GEMM, into ``dhf``).
    """
    n_rows = dh.shape[0]
    hs = cp_t.shape[1]
    proj = w_hr.shape[0] > 0
    if proj:
        for n in range(n_rows):
            if t < lengths[n]:
                _take_dy(dh, dy_t, col, n, has_dy)
                _copy_row(dh[n], dp_t[n])
            else:
                _zero_row(dp_t[n])
        np.dot(dp_t, w_hr, dhf)
    for n in range(n_rows):
        da = da_t[n]
        if t < lengths[n]:
            if not proj:
                _take_dy(dh, dy_t, col, n, has_dy)
            g = g_t[n]
            i = g[:hs]
            f = g[hs : 2 * hs]
            gg = g[2 * hs : 3 * hs]
            o = g[3 * hs :]
            cp = cp_t[n]
            tc = tc_t[n]
            d = dhf[n] if proj else dh[n]
            dcr = dc[n]
            for j in range(hs):
                dcr[j] = dcr[j] + d[j] * o[j] * (_ONE - tc[j] * tc[j])
            da_i = da[:hs]
            for j in range(hs):
                da_i[j] = dcr[j] * gg[j] * i[j] * (_ONE - i[j])
            da_f = da[hs : 2 * hs]
            for j in range(hs):
                da_f[j] = dcr[j] * cp[j] * f[j] * (_ONE - f[j])
            da_g = da[2 * hs : 3 * hs]
            for j in range(hs):
                da_g[j] = dcr[j] * i[j] * (_ONE - gg[j] * gg[j])
            da_o = da[3 * hs :]
            for j in range(hs):
                da_o[j] = d[j] * tc[j] * o[j] * (_ONE - o[j])
            for j in range(hs):
                dcr[j] = dcr[j] * f[j]
        else:
            _zero_row(da)


@njit(**_INLINE)
def _gru_back(t, g_t, hp_t, e_t, dh, dy_t, col, has_dy, da_t, db_t, lengths):
    """reset_after=True: da = gradient of the input-side pre-activations [dr dz dn], db that of
    the hidden-side ones h·w_hhᵀ + b_hh (equal to da except its n block, dn ⊙ r)."""
    n_rows, hs = dh.shape
    for n in range(n_rows):
        da = da_t[n]
        db = db_t[n]
        if t < lengths[n]:
            _take_dy(dh, dy_t, col, n, has_dy)
            d = dh[n]
            g = g_t[n]
            r = g[:hs]
            z = g[hs : 2 * hs]
            nn = g[2 * hs :]
            hp = hp_t[n]
            e = e_t[n]
            da_z = da[hs : 2 * hs]
            for j in range(hs):
                da_z[j] = d[j] * (hp[j] - nn[j]) * z[j] * (_ONE - z[j])
            da_n = da[2 * hs :]
            for j in range(hs):
                da_n[j] = d[j] * (_ONE - z[j]) * (_ONE - nn[j] * nn[j])
            db_n = db[2 * hs :]
            for j in range(hs):
                db_n[j] = da_n[j] * r[j]
            da_r = da[:hs]
            for j in range(hs):
                da_r[j] = da_n[j] * e[j] * r[j] * (_ONE - r[j])
            _copy_row(da[: 2 * hs], db[: 2 * hs])
        else:
            _zero_row(da)
            _zero_row(db)


@njit(**_INLINE)
def _gru_original_back(t, g_t, hp_t, w_b, dh, dy_t, col, has_dy, da_t, db_t, drh, lengths):
    """reset_after=False: db = dn (N, H), da = [dr dz] (N, 2H); drh = dn·w_hn is the gradient of r ⊙ h."""
    n_rows, hs = dh.shape
    for n in range(n_rows):
        da = da_t[n]
        db = db_t[n]
        if t < lengths[n]:
            _take_dy(dh, dy_t, col, n, has_dy)
            d = dh[n]
            g = g_t[n]
            z = g[hs : 2 * hs]
            nn = g[2 * hs :]
            hp = hp_t[n]
            for j in range(hs):
                db[j] = d[j] * (_ONE - z[j]) * (_ONE - nn[j] * nn[j])
            da_z = da[hs:]
            for j in range(hs):
                da_z[j] = d[j] * (hp[j] - nn[j]) * z[j] * (_ONE - z[j])
        else:
            _zero_row(da)
            _zero_row(db)
    np.dot(db_t, w_b, drh)
    for n in range(n_rows):
        if t < lengths[n]:
            g = g_t[n]
            r = g[:hs]
            hp = hp_t[n]
            q = drh[n]
            da_r = da_t[n][:hs]
            for j in range(hs):
                da_r[j] = q[j] * hp[j] * r[j] * (_ONE - r[j])


@njit(**_INLINE)
def _state_grad(code, t, g_t, w_a, da_t, db_t, drh, cur, nxt, lengths):
    """nxt = the gradient of the state entering step t (cur: the one leaving it).

    Past a sequence's end the step did not touch the state: its gradient passes through.
    """
    n_rows, hs = cur.shape
    if code == GRU:
        np.dot(db_t, w_a, nxt)
    else:
        np.dot(da_t, w_a, nxt)
    for n in range(n_rows):
        dst = nxt[n]
        d = cur[n]
        if t >= lengths[n]:
            _copy_row(d, dst)
        elif code == GRU:
            z = g_t[n][hs : 2 * hs]
            for j in range(hs):
                dst[j] += d[j] * z[j]
        elif code == GRU_ORIGINAL:
            g = g_t[n]
            r = g[:hs]
            z = g[hs : 2 * hs]
            q = drh[n]
            for j in range(hs):
                dst[j] += d[j] * z[j] + q[j] * r[j]


@njit(**_INLINE)
def _gemm_into(a, b, out, add):
    """out = a·b, or out += a·b."""
    if add:
        part = np.empty_like(out)
        np.dot(a, b, part)
        for i in range(out.shape[0]):
            _add_row(part[i], out[i])
    else:
        np.dot(a, b, out)


@njit(**_OPTS)
def _backward_rows(code, w_a, w_b, gates, hprev, cprev, extra, lengths, reverse, dy, col, has_dy, dh, dc,
                   want_state, da, db, dh2, tmp, acc_a, acc_b, want_w, w_hr, dhf, dproj, n0, n1):
    """Backward through time of rows [n0, n1) of the batch (arguments as :func:`_backward_direction`;
    ``acc_a``/``acc_b`` are this block's float64 bias sums)."""
    steps = gates.shape[0]
    cur = dh[n0:n1]
    nxt = dh2[n0:n1]
    dcb = dc[n0:n1] if code == LSTM else dc
    tb_ = tmp[n0:n1]
    lb = lengths[n0:n1]
    rows = n1 - n0
    flipped = False
    two = code == GRU or code == GRU_ORIGINAL  # whether db is a real (T, N, ·) buffer
    for k in range(steps):
        t = k if reverse else steps - 1 - k
        tb = t if two else 0
        g_t = gates[t][n0:n1]
        da_t = da[t][n0:n1]
        db_t = db[tb][n0:n1]
        dy_t = dy[t][n0:n1]
        if code == LSTM:
            dp_t = dproj[t][n0:n1] if w_hr.shape[0] > 0 else dproj[0]
            _lstm_back(t, g_t, cprev[t][n0:n1], extra[t][n0:n1], cur, dcb, dy_t, col, has_dy, da_t, lb, w_hr,
                       dhf[n0:n1], dp_t)
        elif code == GRU:
            _gru_back(t, g_t, hprev[t][n0:n1], extra[t][n0:n1], cur, dy_t, col, has_dy, da_t, db_t, lb)
        elif code == GRU_ORIGINAL:
            _gru_original_back(t, g_t, hprev[t][n0:n1], w_b, cur, dy_t, col, has_dy, da_t, db_t, tb_, lb)
        else:
            _rnn_back(code, t, g_t, cur, dy_t, col, has_dy, da_t, lb)
        if want_w & 4:
            for n in range(rows):
                _accumulate_row(da_t[n], acc_a)
                if two:
                    _accumulate_row(db_t[n], acc_b)
        if want_state or k < steps - 1:
            _state_grad(code, t, g_t, w_a, da_t, db_t, tb_, cur, nxt, lb)
            cur, nxt = nxt, cur
            flipped = not flipped
    if flipped:
        for n in range(rows):
            _copy_row(cur[n], dh[n0 + n])


@njit(**_OPTS)
def _forward_blocks_serial(code, w_a, w_b, b_i, b_n, beta, lengths, reverse, save, h, c, y, col, gi, gh, gates,
                           hprev, cprev, extra, w_hr, hf, hq, block):
    """The same blocks one after another (one thread allowed): the same results, bit for bit."""
    n = h.shape[0]
    for b in range((n + block - 1) // block):
        n0 = b * block
        _forward_rows(code, w_a, w_b, b_i, b_n, beta, lengths, reverse, save, h, c, y, col, gi, gh, gates, hprev,
                      cprev, extra, w_hr, hf, hq, n0, min(n, n0 + block))


@njit(parallel=True, **_OPTS)
def _backward_blocks(code, w_a, w_b, gates, hprev, cprev, extra, lengths, reverse, dy, col, has_dy, dh, dc,
                     want_state, da, db, dh2, tmp, acc_a, acc_b, want_w, w_hr, dhf, dproj, block):
    """:func:`_backward_rows` over blocks of ``block`` batch rows in parallel; block b sums its bias
    gradients into ``acc_a[b]``/``acc_b[b]`` (added in block order afterwards)."""
    n = dh.shape[0]
    for b in prange((n + block - 1) // block):
        n0 = np.int64(b) * block
        _backward_rows(code, w_a, w_b, gates, hprev, cprev, extra, lengths, reverse, dy, col, has_dy, dh, dc,
                       want_state, da, db, dh2, tmp, acc_a[b], acc_b[b], want_w, w_hr, dhf, dproj, n0,
                       min(n, n0 + block))


@njit(**_OPTS)
def _backward_blocks_serial(code, w_a, w_b, gates, hprev, cprev, extra, lengths, reverse, dy, col, has_dy, dh, dc,
                            want_state, da, db, dh2, tmp, acc_a, acc_b, want_w, w_hr, dhf, dproj, block):
    """The same blocks one after another (one thread allowed): the same results, bit for bit."""
    n = dh.shape[0]
    for b in range((n + block - 1) // block):
        n0 = b * block
        _backward_rows(code, w_a, w_b, gates, hprev, cprev, extra, lengths, reverse, dy, col, has_dy, dh, dc,
                       want_state, da, db, dh2, tmp, acc_a[b], acc_b[b], want_w, w_hr, dhf, dproj, n0,
                       min(n, n0 + block))


@njit(**_OPTS)
def _backward_direction(code, x, w_ih, w_a, w_b, gates, hprev, cprev, extra, lengths, reverse,
                        dy, col, has_dy, dh, dc, want_state, da, db, dh2, tmp, acc_a, acc_b,
                        want_w, dw_ih, dw_hh, want_dx, dx, dx_add, w_hr, dhf, dproj):
    """Backward through time of one direction (arguments as in :func:`_forward_direction`).

    ``dh``/``dc`` ``(N, H)`` enter as the gradients of the final states and leave as those of
    the initial ones (when ``want_state``).  ``da`` ``(T, N, ·)`` receives the gradient of
    the input-side pre-activations, ``db`` the hidden-side one where it differs (GRU), and
    ``acc_a``/``acc_b`` (float64) their sums over steps and rows, the bias gradients.
    ``want_w`` is a bit mask: 1 writes ``dw_ih``, 2 ``dw_hh``, 4 the bias sums.  ``dx``
    ``(T, N, F)`` is written when ``want_dx``, or added to with ``dx_add`` (a layer's second
    direction).  LSTM projections: ``w_hr`` ``(P, H)`` (``(0, 0)`` for none), ``dhf`` ``(N, H)``
    scratch, ``dproj`` ``(T, N, P)`` receives each step's dh for dw_hr (the caller's product).
    """
    steps, n_rows, features = x.shape
    hs = dh.shape[1]
    _backward_rows(code, w_a, w_b, gates, hprev, cprev, extra, lengths, reverse, dy, col, has_dy, dh, dc,
                   want_state, da, db, dh2, tmp, acc_a, acc_b, want_w, w_hr, dhf, dproj, np.int64(0), n_rows)

    m = steps * n_rows
    x2 = x.reshape(m, features)
    if code == GRU_ORIGINAL:
        a2 = da.reshape(m, 2 * hs)
        b2 = db.reshape(m, hs)
        if want_w & 1:
            np.dot(a2.T, x2, dw_ih[: 2 * hs])
            np.dot(b2.T, x2, dw_ih[2 * hs :])
        if want_w & 2:
            np.dot(a2.T, hprev.reshape(m, hs), dw_hh[: 2 * hs])
            np.dot(b2.T, extra.reshape(m, hs), dw_hh[2 * hs :])
        if want_dx:
            dx2 = dx.reshape(m, features)
            _gemm_into(a2, w_ih[: 2 * hs], dx2, dx_add)
            _gemm_into(b2, w_ih[2 * hs :], dx2, True)
    else:
        width = da.shape[2]
        a2 = da.reshape(m, width)
        if want_w & 1:
            np.dot(a2.T, x2, dw_ih)
        if want_w & 2:
            hidden = db.reshape(m, width) if code == GRU else a2
            np.dot(hidden.T, hprev.reshape(m, hs), dw_hh)
        if want_dx:
            _gemm_into(a2, w_ih, dx.reshape(m, features), dx_add)


# --------------------------------------------------------------------------- host side: buffers and plans

#: Bits of the kernel's ``want_w`` mask.
W_IH, W_HH, BIASES = 1, 2, 4
_CELL_WEIGHTS = ("w_ih", "w_hh", "b_ih", "b_hh")


def _code(call):
    """The runtime cell code of a call."""
    if call.kind == "lstm":
        return LSTM
    if call.kind == "gru":
        return GRU if call.reset_after else GRU_ORIGINAL
    return RNN_TANH if call.activation.name == "tanh" else RNN_RELU


def _plain(a, dtype):
    """``a`` as a C-contiguous, writable array of ``dtype`` (itself when it already is one).

    Numba compiles a specialisation per distinct array type, and read-only or strided
    arrays are distinct types: normalising here keeps one specialisation per dtype.
    """
    if a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=dtype, order="C")


@functools.cache
def _dummy(dtype, ndim):
    """A stand-in for an array argument the kernels do not touch in this call (shared, never written)."""
    return np.zeros((1,) * ndim, dtype)


@functools.cache
def _no_projection(dtype):
    """The ``w_hr`` of a call without LSTM projections: ``(0, 0)`` (the kernels test its rows)."""
    return np.zeros((0, 0), dtype)


def _direct(buffer, shape, dtype):
    """The caller's ``out`` buffer viewed as ``shape`` when the kernel can write into it, else None."""
    if buffer is None or buffer.dtype != dtype or not buffer.flags.c_contiguous:
        return None
    return buffer.reshape(shape)


def _into(buffer, value):
    """``value`` delivered in the caller's buffer (a no-op when the kernel wrote there)."""
    if buffer is None:
        return value
    if not np.may_share_memory(buffer, value):
        buffer[...] = value.reshape(buffer.shape)
    return buffer


@functools.lru_cache(maxsize=256)
def _betas(code, hs, dtype):
    """Per gate row: 1 for a σ gate, 2 for a tanh one (see :func:`_gates_row`); shared, never written."""
    beta = np.ones(GATES[code] * hs, dtype)
    if code == LSTM:
        beta[2 * hs : 3 * hs] = 2.0
    elif code in (GRU, GRU_ORIGINAL):
        beta[2 * hs :] = 2.0
    elif code == RNN_TANH:
        beta[:] = 2.0
    return beta


class _Direction:
    """One layer direction's weights as the kernels take them (see :func:`_forward_direction`);
    ``w_hr`` is the LSTM projection, ``(0, 0)`` without one."""

    __slots__ = ("b_i", "b_n", "beta", "has_bias", "w_a", "w_b", "w_hh", "w_hr", "w_ih")

    def __init__(self, code, w_ih, w_hh, b_ih, b_hh, dtype, w_hr=None):
        gh = w_hh.shape[0]
        hs = gh // GATES[code]  # the cell's size (w_hh has P < H columns with projections)
        self.w_hr = _no_projection(dtype) if w_hr is None else _plain(w_hr, dtype)
        self.w_ih = _plain(w_ih, dtype)
        self.w_hh = _plain(w_hh, dtype)
        self.has_bias = (b_ih is not None, b_hh is not None)
        self.b_i = np.zeros(gh, dtype)
        self.b_n = np.zeros(hs, dtype)
        if b_ih is not None:
            self.b_i += b_ih
        if b_hh is not None:
            if code == GRU:  # r multiplies h·w_hnᵀ + b_hn, so b_hn cannot join b_in
                self.b_i[: 2 * hs] += b_hh[: 2 * hs]
                self.b_n[:] = b_hh[2 * hs :]
            else:
                self.b_i += b_hh
        if code == GRU_ORIGINAL:
            self.w_a, self.w_b = self.w_hh[: 2 * hs], self.w_hh[2 * hs :]
        else:
            self.w_a, self.w_b = self.w_hh, _dummy(dtype, 2)
        self.beta = _betas(code, hs, dtype)


class _Saved:
    """One direction's residuals: activated gates, entering states, each cell's extra rows.

    Without ``save`` only one step's rows exist (the forward's per-step scratch).  ``hs`` is the
    cell's size, ``out`` the state's (P with LSTM projections, else ``hs``).
    """

    __slots__ = ("cprev", "extra", "gates", "hprev")

    def __init__(self, code, steps, n, hs, dtype, save, out=None):
        rows = steps if save else 1
        self.gates = _runtime.empty((rows, n, GATES[code] * hs), dtype)
        self.hprev = _runtime.empty((steps, n, out or hs), dtype) if save else _dummy(dtype, 3)
        self.cprev = _runtime.empty((steps, n, hs), dtype) if save and code == LSTM else _dummy(dtype, 3)
        self.extra = _runtime.empty((rows, n, hs), dtype) if code in (LSTM, GRU, GRU_ORIGINAL) else _dummy(dtype, 3)


class _Workspace:
    """Scratch shared by every direction of one call: ``GI``, one step's ``GH`` and, with LSTM
    projections (``proj`` = P), one step's unprojected and projected states."""

    def __init__(self, code, steps, n, hs, dtype, proj=0):
        width = GATES[code] * hs
        self.gi = _runtime.empty((steps, n, width), dtype)
        self.gh = np.empty(n * width, dtype)
        self.hf = np.empty((n, hs), dtype) if proj else _dummy(dtype, 2)
        self.hq = np.empty((n, proj), dtype) if proj else _dummy(dtype, 2)


#: Batch rows per block of the blocked time loops (about; blocks are equal).  Fixed by the shape,
#: so results do not depend on the thread count: two threads run the two 128-row blocks of an
#: N=256 batch side by side, one thread runs them one after the other.
BLOCK_ROWS = 128
#: A batch smaller than two BLOCK_ROWS still splits in two blocks down to this many rows each: one
#: block left the second core idle (2 threads, Xeon AVX-512; fwd+bwd ms, one block -> two, PyTorch):
#: lstm 2 layers I=H=64 at T=50, N=64: 17.2 -> 9.9 (13.6); T=35, N=32: 6.4 -> 5.2 (5.4-6.1);
#: T=35, N=16: 4.2 -> 3.6 (2.6); gru T=50, N=64: 12.3 -> 8.2 (19.6).  Not for a few steps' work
#: (under 4 BLOCKED_MIN_MACS): an lstm_cell at N=128 measured 0.45 -> 0.47 ms split in two.
MIN_BLOCK_ROWS = 8
#: Multiply-adds of one direction's products below which it runs unblocked, in one compiled call
#: (small layers: a parallel launch costs more than it saves below ~50 us of work).  An lstm_cell at
#: N = 256, I = H = 64 (8.4M) is above it: fwd+bwd 0.94 -> 0.88 ms blocked, 2 threads.
BLOCKED_MIN_MACS = 1 << 22


def _block_rows(code, steps, n, features, hs):
    """Rows per block of the blocked path, or 0 for the unblocked one (see BLOCK_ROWS)."""
    if _runtime.every_variant_active() and n >= 2:  # the ahead-of-time compile's small samples
        return -(-n // 2)
    blocks = max(1, (n + BLOCK_ROWS // 2) // BLOCK_ROWS)
    macs = steps * n * GATES[code] * hs * (features + hs)
    if blocks < 2 and n >= 2 * MIN_BLOCK_ROWS and macs >= 4 * BLOCKED_MIN_MACS:
        blocks = 2
    if blocks < 2 or macs < BLOCKED_MIN_MACS:
        return 0
    return -(-n // blocks)


def _forward_one(code, x, w, lengths, reverse, save, h, c, y, col, work):
    steps, n, features = x.shape
    hs = w.w_hh.shape[0] // GATES[code]
    saved = _Saved(code, steps, n, hs, x.dtype, save, h.shape[1])
    block = _block_rows(code, steps, n, features, hs)
    if not block:
        _forward_direction(code, x, w.w_ih, w.w_a, w.w_b, w.b_i, w.b_n, w.beta, lengths, reverse, save,
                           h, c, y, col, work.gi, work.gh, saved.gates, saved.hprev, saved.cprev, saved.extra,
                           w.w_hr, work.hf, work.hq)
        return saved
    width = work.gi.shape[2]
    parallel_gemm(0, 1, steps * n, width, features, x.reshape(-1), 0, features, w.w_ih.reshape(-1), 0, features,
                  0.0, work.gi.reshape(-1))
    # On our threads when more than one may run, else the same blocks one after another.
    _runtime.run_sized(_forward_blocks, _forward_blocks_serial, True, code, w.w_a, w.w_b, w.b_i, w.b_n, w.beta,
                       lengths, reverse, save, h, c, y, col, work.gi, work.gh, saved.gates, saved.hprev, saved.cprev,
                       saved.extra, w.w_hr, work.hf, work.hq, block)
    return saved


class _Grads:
    """Backward scratch shared by every direction of one call (``proj``: P with LSTM projections)."""

    def __init__(self, code, steps, n, hs, dtype, proj=0):
        if code == GRU_ORIGINAL:
            wa, wb = 2 * hs, hs
        elif code == GRU:
            wa = wb = 3 * hs
        else:
            wa, wb = GATES[code] * hs, 1
        self.da = _runtime.empty((steps, n, wa), dtype)
        self.db = _runtime.empty((steps, n, wb), dtype) if code in (GRU, GRU_ORIGINAL) else _dummy(dtype, 3)
        self.dh2 = np.empty((n, proj or hs), dtype)
        self.tmp = np.empty((n, hs), dtype)
        self.wa, self.wb = wa, wb
        self.dhf = np.empty((n, hs), dtype) if proj else _dummy(dtype, 2)
        self.dproj = _runtime.empty((steps, n, proj), dtype) if proj else _dummy(dtype, 3)


def _bias_sums(code, acc_a, acc_b):
    """(Σ d b_ih, Σ d b_hh) from the kernel's float64 sums."""
    if code == GRU_ORIGINAL:
        both = np.concatenate([acc_a, acc_b])
        return both, both
    if code == GRU:
        return acc_a, acc_b
    return acc_a, acc_a


def _backward_one(code, x, w, saved, lengths, reverse, dy, col, has_dy, dh, dc, want_state,
                  grads, wanted, buffers, dx, dx_add):
    """One direction's backward; returns (dw_ih, dw_hh, db_ih, db_hh[, dw_hr]), ``None`` where not wanted.

    ``buffers``: the caller's four (five) ``out`` buffers (or ``None``s), written directly when possible.
    """
    dtype = x.dtype
    dw = [None, None]
    for j, (bit, like) in enumerate(((W_IH, w.w_ih), (W_HH, w.w_hh))):
        if wanted & bit:
            dw[j] = _direct(buffers[j], like.shape, dtype)
            if dw[j] is None:
                dw[j] = np.empty_like(like)
    steps, n, features = x.shape
    block = _block_rows(code, steps, n, features, w.w_hh.shape[0] // GATES[code])
    if not block:
        acc_a = np.zeros(grads.wa)
        acc_b = np.zeros(grads.wb)
        _backward_direction(code, x, w.w_ih, w.w_a, w.w_b, saved.gates, saved.hprev, saved.cprev, saved.extra,
                            lengths, reverse, dy, col, has_dy, dh, dc, want_state, grads.da, grads.db,
                            grads.dh2, grads.tmp, acc_a, acc_b, wanted,
                            _dummy(dtype, 2) if dw[0] is None else dw[0],
                            _dummy(dtype, 2) if dw[1] is None else dw[1],
                            dx is not None, _dummy(dtype, 3) if dx is None else dx, dx_add,
                            w.w_hr, grads.dhf, grads.dproj)
    else:
        blocks = -(-n // block)
        acc_a = np.zeros((blocks, grads.wa))
        acc_b = np.zeros((blocks, grads.wb))
        _runtime.run_sized(_backward_blocks, _backward_blocks_serial, True, code, w.w_a, w.w_b, saved.gates,
                           saved.hprev, saved.cprev, saved.extra, lengths, reverse, dy, col, has_dy, dh, dc, want_state,
                           grads.da, grads.db, grads.dh2, grads.tmp, acc_a, acc_b, wanted, w.w_hr, grads.dhf,
                           grads.dproj, block)
        _weight_products(code, x, w, saved, grads, wanted, dw, dx, dx_add)
        acc_a, acc_b = acc_a.sum(axis=0), acc_b.sum(axis=0)  # block sums in block order
    result = [None if dw[j] is None else _into(buffers[j], dw[j]) for j in range(2)]
    sums = _bias_sums(code, acc_a, acc_b)
    for j in range(2):
        present = w.has_bias[j] and wanted & BIASES
        result.append(_into(buffers[2 + j], sums[j].astype(dtype)) if present else None)
    if w.w_hr.shape[0]:
        result.append(_projection_grad(saved, grads, lengths, buffers[4]) if wanted & W_HH else None)
    return tuple(result)


def _projection_grad(saved, grads, lengths, buffer):
    """dw_hr = Σ_t dh_tᵀ·(o ⊙ tanh(c_t)) over the active steps (one GEMM over all T·N rows)."""
    steps, n, hs = saved.extra.shape
    active = np.arange(steps)[:, None] < lengths[None, :]
    # Only the active steps are multiplied: the others were never written (their memory may hold
    # anything, NaN included, which warned "invalid value" through np.where).
    unprojected = np.zeros_like(saved.extra)
    np.multiply(saved.gates[:, :, 3 * hs:], saved.extra, out=unprojected, where=active[:, :, None])
    dw = np.dot(grads.dproj.reshape(steps * n, -1).T, unprojected.reshape(steps * n, hs))
    return _into(buffer, dw)


def _weight_products(code, x, w, saved, grads, wanted, dw, dx, dx_add):
    """The blocked path's products over all T·N rows, split across our threads (see
    :func:`_backward_direction`, whose serial tail computes the same): dw_ih = dAᵀ·X,
    dw_hh = dAᵀ·H_prev (GRU: the hidden-side gradient, and r ⊙ h for the original form's n rows),
    dX (+)= dA·w_ih."""
    steps, n, features = x.shape
    m = steps * n
    hs = saved.hprev.shape[2]
    xf, da, db = x.reshape(-1), grads.da.reshape(-1), grads.db.reshape(-1)
    hprev = saved.hprev.reshape(-1)
    if code == GRU_ORIGINAL:
        # (gradient, its width, its rows of w, the state its w_hh rows multiply)
        parts = ((da, 2 * hs, 0, hprev), (db, hs, 2 * hs, saved.extra.reshape(-1)))
    else:
        width = grads.wa
        parts = ((da, width, 0, db if code == GRU else da),)
    w_ih = w.w_ih.reshape(-1)
    for k, (grad, width, row0, state) in enumerate(parts):
        if wanted & W_IH:
            parallel_gemm(1, 0, width, features, m, grad, 0, width, xf, 0, features, 0.0, dw[0].reshape(-1),
                          row0 * features)
        if wanted & W_HH:
            hidden, st = (state, hprev) if code != GRU_ORIGINAL else (grad, state)
            parallel_gemm(1, 0, width, hs, m, hidden, 0, width, st, 0, hs, 0.0, dw[1].reshape(-1), row0 * hs)
        if dx is not None:
            parallel_gemm(0, 0, m, features, width, grad, 0, width, w_ih, row0 * features, features,
                          1.0 if dx_add or k else 0.0, dx.reshape(-1))


# --------------------------------------------------------------------------- cells: entry points


def cell_forward(call):
    """``rnn_cell``/``lstm_cell``/``gru_cell``: a sequence of one step; outputs ``(h',)`` or ``(h', c')``."""
    code = _code(call)
    x = call.x
    dtype = x.dtype
    hs = call.hidden_size
    n = 1 if call.unbatched else x.shape[0]
    X = _plain(x, dtype).reshape(1, n, x.shape[-1])
    h = np.array(call.h, dtype).reshape(n, hs)  # copies: the kernel updates the state in place
    c = np.array(call.c, dtype).reshape(n, hs) if code == LSTM else _dummy(dtype, 2)
    w = _Direction(code, call.w_ih, call.w_hh, call.b_ih, call.b_hh, dtype)
    lengths = np.ones(n, np.int64)
    y = np.empty((1, n, hs), dtype)
    saved = _forward_one(code, X, w, lengths, False, call.save, h, c, y, 0, _Workspace(code, 1, n, hs, dtype))
    shape = tuple(call.h.shape)
    outputs = (h.reshape(shape), c.reshape(shape)) if code == LSTM else (h.reshape(shape),)
    residuals = (code, call, X, w, saved, lengths) if call.save else None
    return outputs, residuals


def cell_backward(residuals, cotangents, needs, out=None):
    """Gradients of the cell ops for the names in ``needs``, into ``out`` buffers where given."""
    code, call, X, w, saved, lengths = residuals
    out = out or {}
    dtype = X.dtype
    n = X.shape[1]
    hs = call.hidden_size
    dh = np.array(cotangents[0], dtype).reshape(n, hs)
    dc = np.array(cotangents[1], dtype).reshape(n, hs) if code == LSTM else _dummy(dtype, 2)
    wanted = (W_IH if "w_ih" in needs else 0) | (W_HH if "w_hh" in needs else 0)
    wanted |= BIASES if needs & {"b_ih", "b_hh"} else 0
    dx = None
    if "x" in needs:
        dx = _direct(out.get("x"), X.shape, dtype)
        dx = np.empty_like(X) if dx is None else dx
    buffers = [out.get(name) for name in _CELL_WEIGHTS]
    weight_grads = _backward_one(code, X, w, saved, lengths, False, _dummy(dtype, 3), 0, False, dh, dc,
                                 bool(needs & {"h", "c"}), _Grads(code, 1, n, hs, dtype), wanted, buffers,
                                 dx, False)
    grads = {}
    if "x" in needs:
        grads["x"] = _into(out.get("x"), dx.reshape(call.x.shape))
    for name, value in (("h", dh), ("c", dc)):
        if name in needs:
            grads[name] = _into(out.get(name), value.reshape(call.arrays[name].shape))
    for name, value in zip(_CELL_WEIGHTS, weight_grads):
        if name in needs:
            grads[name] = value
    return grads


# --------------------------------------------------------------------------- sequences: entry points


def _lengths(lengths, steps, n):
    """Per-sequence lengths as int64 (every length T when the api normalised them away)."""
    if lengths is None:
        return np.full(n, steps, np.int64)
    return np.asarray(lengths, dtype=np.int64)


def _initial(value, shape, dtype):
    """A fresh state array: the kernels update it in place into the final states."""
    return np.zeros(shape, dtype) if value is None else np.array(value, dtype=dtype, order="C")


def sequence_forward(call):
    """``rnn``/``lstm``/``gru``: outputs ``(y, h_n)`` or ``(y, h_n, c_n)``."""
    code = _code(call)
    x = call.x
    dtype = x.dtype
    layers, dirs, hs = call.num_layers, call.num_directions, call.hidden_size
    proj = call.params.get("proj_size") or 0
    out = proj or hs  # the state's size and each direction's output columns
    X = _plain(time_major(np, x, call.batch_first, dtype), dtype)
    steps, n = X.shape[0], X.shape[1]
    lengths = _lengths(call.lengths, steps, n)
    X = _plain(without_padding(np, X, call.lengths), dtype)
    h_n = _initial(call.arrays.get("h0"), (layers * dirs, n, out), dtype)
    c_n = _initial(call.arrays.get("c0"), (layers * dirs, n, hs), dtype) if code == LSTM else None
    work = _Workspace(code, steps, n, hs, dtype, proj)
    inputs, weights, saved = [], [], []
    inp = X
    for layer in range(layers):
        y = _runtime.empty((steps, n, dirs * out), dtype)
        for d in range(dirs):
            k = layer * dirs + d
            names = call.param_names[k]
            w = _Direction(code, *(call.arrays[name] for name in names[:4]), dtype,
                           call.arrays[names[4]] if proj else None)
            c = _dummy(dtype, 2) if c_n is None else c_n[k]
            saved.append(_forward_one(code, inp, w, lengths, d == 1, call.save, h_n[k], c, y, d * out, work))
            weights.append(w)
        inputs.append(inp)
        inp = y
    outputs = (caller_layout(np, inp, call.batch_first), h_n) + (() if c_n is None else (c_n,))
    residuals = (code, call, inputs, weights, saved, lengths) if call.save else None
    return outputs, residuals


def sequence_backward(residuals, cotangents, needs, out=None):
    """Gradients of the sequence ops: ``x``, ``params`` (a list of 4-tuples), ``h0``, ``c0``."""
    code, call, inputs, weights, saved, lengths = residuals
    out = out or {}
    dtype = inputs[0].dtype
    layers, dirs, hs = call.num_layers, call.num_directions, call.hidden_size
    proj = call.params.get("proj_size") or 0
    steps, n = inputs[0].shape[0], inputs[0].shape[1]
    dY = _plain(time_major(np, cotangents[0], call.batch_first, dtype), dtype)
    dh = np.array(cotangents[1], dtype=dtype, order="C")  # becomes dh0 in place
    dc = np.array(cotangents[2], dtype=dtype, order="C") if code == LSTM else None
    want_x, want_p = "x" in needs, "params" in needs
    want_state = bool(needs & {"h0", "c0"})
    grads = _Grads(code, steps, n, hs, dtype, proj)
    param_out = out.get("params")
    pgrads = [None] * (layers * dirs)
    for layer in range(layers - 1, -1, -1):
        X = inputs[layer]
        dX = None
        if layer > 0 or want_x:
            if layer == 0 and not call.batch_first:
                dX = _direct(out.get("x"), X.shape, dtype)
            dX = _runtime.empty_like(X) if dX is None else dX
        for d in range(dirs):
            k = layer * dirs + d
            buffers = (None,) * 5 if param_out is None else (*tuple(param_out[k]), None)
            pgrads[k] = _backward_one(code, X, weights[k], saved[k], lengths, d == 1, dY, d * (proj or hs), True, dh[k],
                                      _dummy(dtype, 2) if dc is None else dc[k], want_state, grads,
                                      W_IH | W_HH | BIASES if want_p else 0, buffers, dX, d == 1)
        dY = dX
    result = {}
    if want_x:
        result["x"] = _into(out.get("x"), caller_layout(np, dY, call.batch_first))
    if want_p:
        result["params"] = [tuple(g) for g in pgrads]
    if "h0" in needs:
        result["h0"] = _into(out.get("h0"), dh)
    if "c0" in needs:
        result["c0"] = _into(out.get("c0"), dc)
    return result
