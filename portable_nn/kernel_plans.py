"""Pure-Python plans shared by the norm kernels of every package (no numba, no cupy imported).

``canonical`` is the one view of a norm call that the CPU and Numba-CUDA norm kernels share;
``moments_plan`` is how the ``moments`` kernels of all three packages (``kernels_cpu``,
``kernels_gpu/cuda_c``, ``kernels_gpu/numba_cuda``) walk x for any set of reduced axes.
They live here, not in ``kernels_cpu.norm``, so that a GPU package using them does not import
Numba's CPU kernels.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# --------------------------------------------------------------------------- norms: running statistics


def momentum_update(xp: Any, running_mean: Any, running_var: Any, mean: Any, var: Any, momentum: float,
                    count: int) -> tuple[Any, Any]:
    """PyTorch's running-statistics update, r ← (1 − m)·r + m·s, for every backend.

    ``mean`` and ``var`` are the batch statistics per ``(instance, channel)``, shape ``(Nn, C)``
    (``Nn = 1`` for batch norm; instance norm averages its instances), ``var`` biased over the
    ``count`` elements each statistic saw: s is the mean, and the variance made unbiased
    (× count / (count − 1)).  ``xp`` is the arrays' array-API namespace.  The running statistics
    ``(C,)`` come already in the compute dtype (the caller converts, bfloat16 bit patterns
    included), and so do the results.  ``kernels_cpu`` compiles the same formula with Numba
    (``_momentum_update``): as array expressions it was 14 µs of a 95 µs batch_norm forward at
    (8, 512, 2, 2).
    """
    batch_mean = xp.mean(mean, axis=0)
    batch_var = xp.mean(var, axis=0) * (count / (count - 1))
    return ((1.0 - momentum) * running_mean + momentum * batch_mean,
            (1.0 - momentum) * running_var + momentum * batch_var)


# --------------------------------------------------------------------------- norms: the canonical view


@functools.lru_cache(maxsize=512)  # pure, and asked once per norm call with a handful of distinct shapes
def norm_view(kind: str, shape: tuple[int, ...], n_axes: int, layout: str | None,
              groups: int | None) -> tuple[tuple[int, int, int, int], int, int]:
    """``((Nn, P, C, Q), Cg, S)``: the view of a C-contiguous ``x`` of ``shape`` that the norm kernels walk.

    x is read as ``(Nn, P, C, Q)`` with statistics per ``(Nn, C)`` group, reduced over P and Q;
    ``Cg`` channels share a group (group norm) and ``S`` consecutive elements share one channel's
    weight.  ``n_axes``: the number of normalised trailing axes (layer/rms norm); ``layout``:
    ``"channels_first"`` (channel axis 1) or ``"channels_last"``; ``groups``: group norm's
    ``num_groups``.
    """
    if kind in ("layer_norm", "rms_norm"):
        lead = len(shape) - n_axes
        d = math.prod(shape[lead:])
        return (math.prod(shape[:lead]), 1, 1, d), d, 1
    n, first = shape[0], layout == "channels_first"
    ch = shape[1] if first else shape[-1]
    spatial = math.prod(shape[2:]) if first else math.prod(shape[1:-1])
    if kind == "batch_norm":
        return ((1, n, ch, spatial), 1, spatial) if first else ((1, n * spatial, ch, 1), 1, 1)
    if kind == "instance_norm":
        return ((n, 1, ch, spatial), 1, spatial) if first else ((n, spatial, ch, 1), 1, 1)
    per = ch // groups
    return ((n, 1, groups, per * spatial), per, spatial) if first else ((n, spatial, groups, per), per, 1)


def canonical(call: Any) -> tuple[tuple[int, int, int, int], int, int]:
    """:func:`norm_view` of a norm call (channel axis 1 or -1, as declared)."""
    return norm_view(call.kind, tuple(map(int, call.x.shape)), len(call.axes), call.layout,
                     call.params.get("num_groups"))


#: The layouts of a layer or RMS norm whose axes are not the trailing ones (trailing axes have
#: layout ``None``, every backend's): a block of consecutive axes followed by kept ones (the channel
#: axis of NCHW data), and any other set.  Kernels say which they take (``Support.layouts``).
MIDDLE_AXES = "middle_axes"
SCATTERED_AXES = "scattered_axes"


def middle_view(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, int, int]:
    """``(O, R, I)`` of a :data:`MIDDLE_AXES` norm: the sizes before, of and after the normalised block."""
    a, k = axes[0], len(axes)
    return math.prod(shape[:a]), math.prod(shape[a:a + k]), math.prod(shape[a + k:])


# --------------------------------------------------------------------------- moments: the plan
#
# ``moments`` reduces any set of axes of a C-contiguous x without a transpose.  Its plan (shared
# with both GPU kernel packages) merges neighbouring axes of the same kind (reduced or kept; size-1
# axes dropped) into blocks and views x as rows of the last block's length L:
#
#     element (row, i) = x.flat[row · L + i],     row(kk, rr) = off_k(kk) + off_r(rr)
#
# kk indexes the kept outer blocks and rr the reduced outer blocks (each row-major); an offset is
# idx · stride when one outer block is of that kind, a table when several are.
#
# * row mode (the last block is reduced, lk = 1): group g = kk holds the n = rout · L elements of
#   its rows, each row a contiguous run;
# * column mode (the last block is kept, lk = L): group g = kk · L + j holds column j of its rout
#   rows, so one pass along a row serves L groups at once.
#
# Groups come in the order of the output.  Rows (axis=-1 of (M, D)), columns (axis=0 of (N, C)) and
# batch-norm statistics ((0, 2, 3) of NCHW: L = H·W, kk = c, rr = n) are each one strided walk.
# Statistics are shifted sums: each group's first element is its shift, shared by every partial
# sum of the group, so partial sums add exactly and var = (Σd² − (Σd)²/n)/(n − correction) with
# d = x − shift never cancels the offset of the data (E[x²] − E[x]² is never formed).


@dataclass(frozen=True, eq=False)
class MomentsPlan:
    """How a moments call walks x (see the section comment above).

    Attributes:
        L: length of the rows (the last merged block).
        lk: L in column mode, 1 in row mode (so group g = kk · lk + j, j < lk).
        kout, rout: counts of the kept and reduced outer indices.
        kstride, rstride: row strides of kk and rr when their table is empty.
        ktab, rtab: int64 row-offset tables (empty: ``idx · stride``).
        n: elements per group (the product of the reduced sizes; 0 for an empty reduction).
        groups: number of groups (the product of the kept sizes).
    """

    L: int
    lk: int
    kout: int
    rout: int
    kstride: int
    rstride: int
    ktab: np.ndarray
    rtab: np.ndarray
    n: int
    groups: int

    @property
    def column(self) -> bool:
        return self.lk > 1

    def kept_rows(self) -> np.ndarray:
        """off_k(kk) for every kk (int64): the first row of each kept outer index."""
        if self.ktab.size:
            return self.ktab
        return np.arange(self.kout, dtype=np.int64) * self.kstride


@functools.lru_cache(maxsize=256)
def moments_plan(shape: tuple[int, ...], axes: tuple[int, ...]) -> MomentsPlan:
    """The :class:`MomentsPlan` of reducing ``axes`` of a C-contiguous array of ``shape``.

    Cached: a training loop's repeated calls skip the planning (its tables are read-only).
    """
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape[a] for a in axes)
    groups = math.prod(s for i, s in enumerate(shape) if i not in axes)
    blocks: list[list] = []  # [reduced, size]
    for i, s in enumerate(shape):
        if s == 1:
            continue
        reduced = i in axes
        if blocks and blocks[-1][0] == reduced:
            blocks[-1][1] *= s
        else:
            blocks.append([reduced, s])
    if not blocks:
        blocks = [[True, 1]]
    inner_reduced, length = blocks[-1]
    tables = {True: [np.zeros(1, np.int64), 0, 0], False: [np.zeros(1, np.int64), 0, 0]}  # offsets, stride, blocks
    stride = 1
    for reduced, size in reversed(blocks[:-1]):
        entry = tables[reduced]
        # Outer-to-inner order: earlier blocks vary slowest, so they are prepended.
        entry[0] = (np.arange(size, dtype=np.int64)[:, None] * stride + entry[0][None, :]).reshape(-1)
        entry[1] = stride
        entry[2] += 1
        stride *= size

    def finish(kind: bool) -> tuple[int, int, np.ndarray]:
        offsets, step, count = tables[kind]
        table = offsets if count > 1 else np.zeros(0, np.int64)
        table.flags.writeable = False
        return offsets.size, (step if count == 1 else 0), table

    kout, kstride, ktab = finish(False)
    rout, rstride, rtab = finish(True)
    return MomentsPlan(length, 1 if inner_reduced else length, kout, rout, kstride, rstride, ktab, rtab, n, groups)


def moments_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    """The shape of ``mean`` and ``var``: the kept axes (reduced ones as 1 with ``keepdims``)."""
    if keepdims:
        return tuple(1 if i in axes else int(s) for i, s in enumerate(shape))
    return tuple(int(s) for i, s in enumerate(shape) if i not in axes)


def row_splits(plan: MomentsPlan, splits: int) -> tuple[int, int, int, int]:
    """Split each row-mode group into about ``splits`` chunks of (rows) × (part of a row).

    Rows are split first; a group with fewer rows than ``splits`` (a single long row: ``axis=None``)
    also splits its rows' length.  Returns ``(rows per chunk, row chunks, length per chunk, length
    chunks)``; chunk k is (k // length chunks, k % length chunks) and every chunk is non-empty.
    """
    splits = max(1, int(splits))
    rsplits = max(1, min(splits, plan.rout))
    rper = -(-plan.rout // rsplits)
    rsplits = -(-plan.rout // rper)
    qsplits = max(1, min(-(-splits // rsplits), plan.L, 65535 // rsplits))
    qper = -(-plan.L // qsplits)
    return rper, rsplits, qper, -(-plan.L // qper)


def pow2_at_most(value: int, cap: int) -> int:
    """The smallest power of two >= ``value``, but at most the largest power of two <= ``cap``.

    A GPU block's extent along a dimension of ``value`` elements, within ``cap`` threads.
    """
    top = 1
    while top * 2 <= cap:
        top *= 2
    p = 1
    while p < min(value, top):
        p *= 2
    return p


# --------------------------------------------------------------------------- sequence layouts


def time_major(xp: Any, a: Any, batch_first: bool, dtype: Any = None) -> Any:
    """A sequence as ``(T, N, F)``, C-contiguous (in ``dtype`` if given), from the caller's
    ``(N, T, F)`` (``batch_first``) or ``(T, N, F)``; ``xp`` is NumPy or CuPy."""
    return xp.ascontiguousarray(xp.swapaxes(a, 0, 1) if batch_first else a, dtype=dtype)


def without_padding(xp: Any, X: Any, lengths: tuple[int, ...] | None) -> Any:
    """Time-major ``X`` ``(T, N, F)`` with every step past a sequence's end zeroed (a new array), or
    ``X`` itself when no step is padding.

    PyTorch's packed sequences never read padding; the kernels project every step's input in one
    GEMM and sum the w_ih gradient over every step, so a NaN or inf there would reach them (0 · NaN).
    Used by every kernel package; costs nothing without padding.
    """
    steps = X.shape[0]
    if lengths is None or min(lengths, default=steps) >= steps:
        return X
    keep = np.arange(steps)[:, None] < np.asarray(lengths)[None, :]
    return xp.where(xp.asarray(keep[..., None]), X, xp.zeros((), dtype=X.dtype))


def caller_layout(xp: Any, a: Any, batch_first: bool) -> Any:
    """A time-major ``(T, N, F)`` result in the caller's layout (C-contiguous when swapped back)."""
    return xp.ascontiguousarray(xp.swapaxes(a, 0, 1)) if batch_first else a


def split_axis(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """(M, C, Q) of ``shape`` around ``axis``: the sizes before, along and after it (a 0-d shape is
    one class), so an array reduced along ``axis`` is viewed as ``(M, C, Q)``."""
    if not shape:
        return 1, 1, 1
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


# --------------------------------------------------------------------------- LSTM projections (GPU launchers)


def project_step(xp: Any, h_full: Any, w_hr: Any, hq: Any, h_in: Any, h_out: Any, y_cols: Any | None,
                 active: Any | None) -> None:
    """One step of an LSTM projection: ``hq = h_full·w_hrᵀ``; ``h_out`` (and the output columns
    ``y_cols``) take it for the sequences still running (``active``, ``(N, 1)`` booleans; ``None``:
    all), else keep ``h_in`` (and 0)."""
    if hq.size:
        xp.matmul(h_full, w_hr.T, out=hq)
    if active is None:
        h_out[...] = hq
        if y_cols is not None:
            y_cols[...] = hq
        return
    h_out[...] = xp.where(active, hq, h_in)
    if y_cols is not None:
        y_cols[...] = xp.where(active, hq, xp.zeros((), hq.dtype))


def unproject_step(xp: Any, dh: Any, dh_gemm: Any | None, dy_cols: Any | None, active: Any | None, w_hr: Any,
                   dproj_t: Any, dh_full: Any) -> Any:
    """A projected step's backward: its dh = ``dh + dh_gemm + dy_cols`` (P columns) into ``dproj_t``
    (zero for ended sequences), ``dproj_t·w_hr`` into ``dh_full`` (the cell's dh); returns what
    passes through to the step before (an ended sequence's ``dh + dh_gemm``, else 0)."""
    g = dh + dh_gemm if dh_gemm is not None else dh.copy()
    zero = xp.zeros((), g.dtype)
    passed = zero if active is None else xp.where(active, zero, g)  # an ended sequence's output is 0: no dY
    if dy_cols is not None:
        g += dy_cols
    dproj_t[...] = g if active is None else xp.where(active, g, zero)
    if dh_full.size:
        xp.matmul(dproj_t, w_hr, out=dh_full)
    return passed
