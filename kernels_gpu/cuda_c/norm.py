"""Launchers of the CUDA C norm kernels (``norm.cu``): batch, layer, group, instance and rms norm, and moments.

Every norm runs on the canonical view of a C-contiguous ``x`` (``portable_nn.kernel_plans.norm_view``, shared
with the Numba kernels)::

    x4 = x.reshape(nn, pp, cc, qq)        statistics per group (i, c) over (p, q)
    parameter of element (c, q)  =  c · cg + q // ss

=================  ===============  ========  ====
norm / layout      (nn, pp, cc, qq)  cg        ss
=================  ===============  ========  ====
layer, rms         (M, 1, 1, D)      D         1
batch, NC…         (1, N, C, L)      1         L
batch, N…C         (1, N·L, C, 1)    1         1
instance, NC…      (N, 1, C, L)      1         L
instance, N…C      (N, L, C, 1)      1         1
group, NC…         (N, 1, G, k·L)    k = C/G   L
group, N…C         (N, L, G, k)      k         1
=================  ===============  ========  ====

:func:`make_plan` picks, from the shape alone, *row mode* (a block per group, or ``splits``
blocks per group plus a merging pass, for long contiguous runs) or *column mode* (2-D blocks
along rows of width ``cc·qq`` with per-column partial sums, for short runs such as
channels-last data).  Forward: statistics (fused with the output in one kernel when one block
per group suffices), else partial sums → merge → elementwise output.  Backward: group sums of
``g·w`` and ``g·w·x̂`` → ``dx``; parameter gradients from per-block partials reduced by a
second kernel.  Every sum has a fixed order (no atomics), so results are reproducible.

Statistics are float32 for float32/float16/bfloat16 data (float64 for float64); ``y`` and ``dx``
have ``x``'s dtype, parameter gradients the parameters' dtype.  Block sizes and the work
targets below are module settings, read at call time, so tests can force multi-block paths on
tiny inputs.

``moments`` (any axes) runs on the plan of ``portable_nn.kernel_plans.moments_plan`` with its own kernels
(the end of ``norm.cu`` and of this module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from portable_nn.kernel_plans import (
    moments_plan,
    moments_shape,
    momentum_update,
    norm_view,
    pow2_at_most,
    row_splits,
)

from . import _runtime as rt

FAMILY = "norm"

#: Threads per block of the row-mode kernels (a group, or a split of one, per block).
BLOCK = 256
#: (threads along a row, threads along rows) of the column-mode partial-sum kernel.
COLUMN_BLOCK = (32, 8)
#: Threads per block of the elementwise and merging kernels.
APPLY_BLOCK = 256
#: About how many blocks the elementwise passes launch: four waves of resident blocks on a 132-SM
#: H200 (eight of 256 threads per SM).  One row per thread (a block row per row of the canonical view) ran batch_norm
#: (64, 256, 56, 56)'s apply at 27% of copy bandwidth there (ncu): the per-thread setup dominated.
APPLY_TARGET_BLOCKS = 4224
#: Blocks a launch should have to fill the device (about 4 per SM of an H100).
TARGET_BLOCKS = 528
#: Row mode splits a group over several blocks only when it has more elements than this.
SPLIT_MIN_ELEMENTS = 4096
#: Column mode is used when the groups' contiguous runs are shorter than this.
COLUMN_MODE_BELOW = 32
#: moments: groups of fewer elements than this are summed by one thread each.
MOMENTS_THREAD_BELOW = 32
#: The contiguous-rows kernels (layer_norm / rms_norm over trailing axes, ``norm_rows_*``) are used
#: where they apply; False forces the generic row kernels (the tests compare both).
ROWS_PATH = True
#: 16-byte vectors of a row per thread, at most, in the rows kernels (ROWS_*_VECS in norm.cu).
ROWS_FWD_VECS = 4
ROWS_BWD_VECS = 2
#: Blocks of the rows backward (each sums the parameter-gradient partials of its run of rows);
#: None: as many as fit the device at once (by threads: 2048 per multiprocessor).
ROWS_BWD_BLOCKS: int | None = None
#: The elementwise and row-mode kernels take 16-byte vectors where they can (False: scalar only).
VECTOR_APPLY = True

_ROW_KERNELS = ("norm_fwd_fused", "norm_col_partial", "norm_apply", "norm_bwd_fused", "norm_bwd_partial",
                "norm_bwd_group_finalize", "norm_bwd_dx", "norm_param_finalize")
_ROWS_KERNELS = ("norm_rows_fwd", "norm_rows_bwd")
_DATA_KERNELS = ("norm_stats_partial", "norm_stats_finalize")
_MOMENTS_KERNELS = ("moments_rows", "moments_small", "moments_cols", "moments_finalize", "moments_dx")


def kernel_names() -> list[str]:
    """Every instantiation the launcher may use (compiled together as one module)."""
    names = [f"{k}<{t}, {p}>" for k in (*_ROW_KERNELS, *_ROWS_KERNELS) for t, p in rt.TYPE_PAIRS]
    names += [f"{k}<{t}>" for k in (*_DATA_KERNELS, *_MOMENTS_KERNELS)
              for t in ("float", "double", "pnn_half", "pnn_bf16")]
    return names


rt.declare(FAMILY, kernel_names())


# --------------------------------------------------------------------------- plans (pure Python)


@dataclass(frozen=True)
class NormPlan:
    """How the kernels walk one norm's canonical view (see the module docstring).

    ``splits``: row-mode blocks per group; ``chunks``/``rows``: column-mode row chunks per ``i``
    and rows per chunk; ``param_chunks``/``param_rows``: the same over all ``nn·pp`` rows, for
    the parameter-gradient partials.
    """

    nn: int
    pp: int
    cc: int
    qq: int
    cg: int
    ss: int
    column: bool
    splits: int
    chunks: int
    rows: int
    param_chunks: int
    param_rows: int

    @property
    def groups(self) -> int:
        return self.nn * self.cc

    @property
    def width(self) -> int:
        return self.cc * self.qq


def _row_chunks(rows_total: int, width: int, per_block_rows: int, outer: int, lanes: int = 1) -> tuple[int, int]:
    """(chunks, rows per chunk) so that ``outer · chunks`` column blocks roughly fill the device
    (their threads take ``lanes`` columns each when the kernels use vectors)."""
    bx = COLUMN_BLOCK[0] * lanes
    col_blocks = max(1, rt.blocks(width, bx))
    want = max(1, rt.blocks(TARGET_BLOCKS, col_blocks * max(outer, 1)))
    most = max(1, rt.blocks(rows_total, per_block_rows))
    chunks = max(1, min(want, most, 65535 // max(outer, 1)))
    rows = max(1, rt.blocks(rows_total, chunks))
    return max(1, rt.blocks(rows_total, rows)), rows


def make_plan(geometry: tuple[int, int, int, int], cg: int, ss: int, lanes: int = 1) -> NormPlan:
    """The plan for a canonical view (pure Python; reads the module settings).  ``lanes``: columns
    per thread of the vectorised column passes (counted, the channels-last partial sums of
    batch_norm (64, 256, 56, 56) launched a quarter of the blocks meant: 132, at 25-29% of copy
    bandwidth on an H200)."""
    nn, pp, cc, qq = geometry
    # Column mode keeps per-sample partials along grid.y, so it needs nn <= 65535.
    column = qq < COLUMN_MODE_BELOW and pp > 1 and nn <= 65535
    n = pp * qq
    groups = nn * cc
    splits = 1
    if not column and groups < TARGET_BLOCKS and n > SPLIT_MIN_ELEMENTS:
        splits = max(1, min(rt.blocks(n, SPLIT_MIN_ELEMENTS), rt.blocks(TARGET_BLOCKS, max(groups, 1)), 65535))
    chunks, rows = _row_chunks(pp, cc * qq, COLUMN_BLOCK[1], nn, lanes) if column else (1, max(pp, 1))
    param_chunks, param_rows = _row_chunks(nn * pp, cc * qq, COLUMN_BLOCK[1], 1, lanes)
    return NormPlan(nn, pp, cc, qq, cg, ss, column, splits, chunks, rows, param_chunks, param_rows)


#: Plans by everything they depend on (a norm's geometry and the module settings): planning cost
#: ~9 µs of a ~100 µs small call on an H200's host, the same for every call of a training loop.
_plans: dict[tuple, NormPlan] = {}


def plan_of(call: Any) -> NormPlan:
    """The plan of a norm call (remembered per geometry and settings)."""
    shape = tuple(int(v) for v in call.x.shape)
    lanes = rt.vector_lanes(call.dtype) if VECTOR_APPLY else 1
    key = (call.kind, shape, len(call.axes), call.layout, call.params.get("num_groups"), lanes,
           COLUMN_MODE_BELOW, TARGET_BLOCKS, SPLIT_MIN_ELEMENTS, COLUMN_BLOCK)
    plan = _plans.get(key)
    if plan is None:
        geometry, cg, ss = norm_view(call.kind, shape, len(call.axes), call.layout, call.params.get("num_groups"))
        if len(_plans) > 4096:  # many shapes (variable lengths): keep the table bounded
            _plans.clear()
        plan = _plans[key] = make_plan(geometry, cg, ss, lanes)
    return plan


# --------------------------------------------------------------------------- launch helpers


def _types(call: Any) -> tuple[str, str]:
    t = rt.ctype(call.dtype)
    return t, ("float" if call.params.get("mixed_precision") else t)


def _apply_vec(call: Any, plan: NormPlan, *arrays: Any) -> int:
    """1 when the elementwise kernels can take 16-byte vectors (rows of whole vectors, aligned arrays)."""
    return int(VECTOR_APPLY and rt.whole_vectors(call.dtype, plan.width, *arrays))


def _group_vec(call: Any, plan: NormPlan, *arrays: Any) -> int:
    """1 when the row-mode kernels can walk groups in 16-byte vectors (runs of whole vectors, aligned)."""
    return int(VECTOR_APPLY and rt.whole_vectors(call.dtype, plan.qq, *arrays))


def _apply_grid(plan: NormPlan, vec: int = 0, dtype: str = "float32") -> tuple[int, int]:
    """Grid of norm_apply / norm_bwd_dx: block columns across a row's vectors, block rows striding
    the rows.  Rows narrower than a block share one (the kernel's elementwise_walk); at most about
    APPLY_TARGET_BLOCKS blocks, so each thread walks several rows and its setup (channels,
    parameters) is paid once for them."""
    nvec = rt.blocks(plan.width, rt.vector_lanes(dtype) if vec else 1)
    rows = max(plan.nn * plan.pp, 1)
    columns = rt.blocks(nvec, APPLY_BLOCK)
    rows_per_block = max(1, APPLY_BLOCK // max(nvec, 1))
    return columns, min(rt.blocks(rows, rows_per_block), rt.blocks(APPLY_TARGET_BLOCKS, columns), 65535)


def _geo(plan: NormPlan) -> list:
    return [rt.i64(plan.nn), rt.i64(plan.pp), rt.i64(plan.cc), rt.i64(plan.qq), rt.i64(plan.cg), rt.i64(plan.ss)]


def _shared(threads: int, acc: str) -> int:
    return 2 * threads * (8 if acc == "float64" else 4)


def _column_partials(plan, types, x, dy, w, b, mean, rstd, mode, per_sample, center, act, xp, acc):
    """Launch norm_col_partial: per-sample partials (nn, chunks, width) or over all rows (param_chunks, width)."""
    if per_sample:
        nn_eff, p_eff, chunks, rows = plan.nn, plan.pp, plan.chunks, plan.rows
    else:
        nn_eff, p_eff, chunks, rows = 1, plan.nn * plan.pp, plan.param_chunks, plan.param_rows
    part_a = xp.empty(nn_eff * chunks * plan.width, acc)
    part_b = xp.empty_like(part_a)
    bx, by = COLUMN_BLOCK
    rt.check_block(bx * by, "COLUMN_BLOCK threads")
    # mode 0 (statistics) is always per sample: the vector form loads each column's shift once
    width_v = rt.VECTOR_LANES[types[0]]
    vec = int(VECTOR_APPLY and (per_sample or mode == 1) and plan.width % width_v == 0 and rt.aligned(x, dy))
    per = width_v if vec else 1
    rt.launch(FAMILY, f"norm_col_partial<{types[0]}, {types[1]}>",
              (rt.blocks(rt.blocks(plan.width, per), bx), nn_eff * chunks), (bx, by),
              [x, rt.ptr(dy), rt.ptr(w), rt.ptr(b), rt.ptr(mean), rt.ptr(rstd), part_a, part_b, *_geo(plan),
               rt.i64(nn_eff), rt.i64(p_eff), rt.i64(chunks), rt.i64(rows), rt.i32(mode), rt.i32(center),
               rt.i32(act.code), rt.f64(act.slope), rt.i32(vec)],
              _shared(bx * by, acc))
    return part_a, part_b, nn_eff * chunks


def _rows_threads(call: Any, plan: NormPlan, kernel: str, vecs: int, *arrays: Any) -> tuple[int, int] | None:
    """(threads, vectors per thread) of the contiguous-rows ``kernel``, or None where it doesn't apply.

    It applies to rows of ``n`` contiguous elements with parameters indexed by position (layer_norm,
    rms_norm), ``n`` a multiple of the 16-byte vector width, at most ``vecs`` vectors per thread of
    the largest block the compiled kernel allows (its registers decide), and every array 16-byte
    aligned.
    """
    if not ROWS_PATH or plan.column or plan.splits != 1 or plan.pp != 1 or plan.cc != 1 or plan.ss != 1:
        return None
    n = plan.qq
    width = rt.vector_lanes(call.dtype)
    if plan.cg != n or n == 0 or n % width or n > 1024 * width * vecs or not rt.aligned(*arrays):
        return None
    nvec = n // width
    threads = max(32, 32 * rt.blocks(rt.blocks(nvec, vecs), 32))
    if threads > rt.max_threads(FAMILY, f"{kernel}<{', '.join(_types(call))}>") // 32 * 32:
        return None
    return threads, rt.blocks(nvec, threads)


def _rows_shared(acc: str) -> int:
    return 64 * (8 if acc == "float64" else 4)


def _finalize_grid(plan: NormPlan) -> tuple[int]:
    """A warp per group (the finalize kernels' lanes share its partials)."""
    return (rt.blocks(plan.groups * 32, APPLY_BLOCK),)


# --------------------------------------------------------------------------- forward


def _statistics(call, plan, types, x, mean, rstd, var, xp, acc) -> None:
    """Batch statistics in more than one pass: partial sums, then the merge."""
    center = bool(call.center)
    if plan.column:
        part_a, part_b, _ = _column_partials(plan, types, x, None, None, None, None, None, 0, True, center,
                                             call.activation, xp, acc)
        chunks, qp = plan.chunks, plan.qq
    else:
        block = rt.check_block(BLOCK, "BLOCK")
        part_a = xp.empty(plan.groups * plan.splits, acc)
        part_b = xp.empty_like(part_a)
        rt.launch(FAMILY, f"norm_stats_partial<{types[0]}>", (plan.groups, plan.splits), (block,),
                  [x, part_a, part_b, rt.i64(plan.nn), rt.i64(plan.pp), rt.i64(plan.cc), rt.i64(plan.qq),
                   rt.i64(plan.splits), rt.i32(center), rt.i32(_group_vec(call, plan, x))], _shared(block, acc))
        chunks, qp = plan.splits, 1
    rt.launch(FAMILY, f"norm_stats_finalize<{types[0]}>", _finalize_grid(plan), (APPLY_BLOCK,),
              [x, part_a, part_b, mean, rstd, var, rt.i64(plan.nn), rt.i64(plan.pp), rt.i64(plan.cc),
               rt.i64(plan.qq), rt.i64(chunks), rt.i64(qp), rt.i32(center), rt.f64(call.eps)])


def _running_as_float(xp, value, dtype: str, acc: str):
    """Running statistics as ``acc`` floats (bfloat16 bits in a uint16 array decoded)."""
    if dtype == "bfloat16" and str(value.dtype) == "uint16":
        return rt.bf16_bits_to_float(xp, value).astype(acc)
    return value.astype(acc)


def _running_like(xp, value, like, dtype: str):
    """``value`` (floats) in the dtype of the running statistic ``like``."""
    if dtype == "bfloat16" and str(like.dtype) == "uint16":
        return rt.float_to_bf16_bits(xp, value.astype("float32"))
    return value.astype(like.dtype)


def norm_forward(call: Any) -> tuple[tuple[Any, Any, Any], Any]:
    """Forward of every norm; outputs ``(y, new_running_mean, new_running_var)``."""
    x = call.x
    xp = rt.array_module(x)
    plan = plan_of(call)
    types = _types(call)
    acc = rt.acc_dtype(call.dtype)
    act = call.activation
    w, b = call.weight, call.bias
    y = xp.empty_like(x)
    mean = xp.empty((2, plan.groups), acc)
    rstd = xp.empty(plan.groups, acc)
    var = xp.empty(plan.groups, acc)
    train = bool(call.use_batch_stats)
    if not train:
        rm = _running_as_float(xp, call.running_mean, call.dtype, acc)
        rv = _running_as_float(xp, call.running_var, call.dtype, acc)
        mean[0].reshape(plan.nn, plan.cc)[...] = rm
        mean[1] = 0
        rstd.reshape(plan.nn, plan.cc)[...] = 1.0 / xp.sqrt(rv + call.eps)
    if x.size == 0:
        if train:
            mean[...] = 0
            var[...] = 0
            rstd[...] = 1.0 / math.sqrt(call.eps)
    elif train and (rows_launch := _rows_threads(call, plan, "norm_rows_fwd", ROWS_FWD_VECS, x, y, w, b)):
        threads, items = rows_launch
        rt.launch(FAMILY, f"norm_rows_fwd<{types[0]}, {types[1]}>", (plan.groups,), (threads,),
                  [x, rt.ptr(w), rt.ptr(b), y, mean, rstd, var, rt.i64(plan.groups), rt.i64(plan.qq), rt.i32(items),
                   rt.i32(call.center), rt.f64(call.eps), rt.i32(act.code), rt.f64(act.slope)], _rows_shared(acc))
    elif train and not plan.column and plan.splits == 1:
        block = rt.check_block(BLOCK, "BLOCK")
        rt.launch(FAMILY, f"norm_fwd_fused<{types[0]}, {types[1]}>", (plan.groups,), (block,),
                  [x, rt.ptr(w), rt.ptr(b), y, mean, rstd, var, *_geo(plan), rt.i32(1), rt.i32(call.center),
                   rt.f64(call.eps), rt.i32(act.code), rt.f64(act.slope), rt.i32(_group_vec(call, plan, x, y))],
                  _shared(block, acc))
    else:
        if train:
            _statistics(call, plan, types, x, mean, rstd, var, xp, acc)
        vec = _apply_vec(call, plan, x, y)
        rt.launch(FAMILY, f"norm_apply<{types[0]}, {types[1]}>", _apply_grid(plan, vec, call.dtype), (APPLY_BLOCK,),
                  [x, rt.ptr(w), rt.ptr(b), y, mean, rstd, *_geo(plan), rt.i32(act.code), rt.f64(act.slope),
                   rt.i32(vec)])
    new_rm = new_rv = None
    if train and call.update_running and x.size > 0:
        new_rm, new_rv = _updated_running(call, xp, plan, mean, var, acc)
    residuals = (x, mean, rstd, call, plan) if call.save else None
    return (y, new_rm, new_rv), residuals


def _updated_running(call, xp, plan, mean, var, acc):
    """PyTorch's momentum update (``kernel_plans.momentum_update``) in the accumulation dtype."""
    rm = _running_as_float(xp, call.running_mean, call.dtype, acc)
    rv = _running_as_float(xp, call.running_var, call.dtype, acc)
    new_rm, new_rv = momentum_update(xp, rm, rv, (mean[0] + mean[1]).reshape(plan.nn, plan.cc),
                                     var.reshape(plan.nn, plan.cc), call.momentum, plan.pp * plan.qq)
    return (_running_like(xp, new_rm, call.running_mean, call.dtype),
            _running_like(xp, new_rv, call.running_var, call.dtype))


# --------------------------------------------------------------------------- backward


def _group_sums(call, plan, types, x, dy, mean, rstd, dx, need_x, need_params, xp, acc):
    """Training backward of the group sums (and dx): returns reusable parameter partials or None.

    The partials come as (part_a, part_b, rows_of_parts, qp, s_eff) for norm_param_finalize.
    """
    act = call.activation
    w, b = call.weight, call.bias
    center = bool(call.center)
    rows_launch = _rows_threads(call, plan, "norm_rows_bwd", ROWS_BWD_VECS, x, dy, dx if need_x else None, w, b)
    if rows_launch and (need_x or need_params):
        threads, items = rows_launch
        per_block = rt.blocks(plan.groups, ROWS_BWD_BLOCKS or rt.multiprocessors() * max(1, 2048 // threads))
        grid = rt.blocks(plan.groups, per_block)
        part_a = xp.empty(grid * plan.qq, acc) if need_params else None
        part_b = xp.empty(grid * plan.qq, acc) if need_params else None
        rt.launch(FAMILY, f"norm_rows_bwd<{types[0]}, {types[1]}>", (grid,), (threads,),
                  [x, dy, rt.ptr(w), rt.ptr(b), mean, rstd, rt.ptr(dx if need_x else None), rt.ptr(part_a),
                   rt.ptr(part_b), rt.i64(plan.groups), rt.i64(plan.qq), rt.i64(per_block), rt.i32(items),
                   rt.i32(center), rt.i32(act.code), rt.f64(act.slope)], _rows_shared(acc))
        return (part_a, part_b, grid, plan.qq, 1) if need_params else None
    if not plan.column and plan.splits == 1:
        block = rt.check_block(BLOCK, "BLOCK")
        wfree = plan.cg == 1
        part_a = xp.empty(plan.groups, acc) if wfree else None
        part_b = xp.empty(plan.groups, acc) if wfree else None
        rt.launch(FAMILY, f"norm_bwd_fused<{types[0]}, {types[1]}>", (plan.groups,), (block,),
                  [x, dy, rt.ptr(w), rt.ptr(b), mean, rstd, rt.ptr(dx), rt.ptr(part_a), rt.ptr(part_b),
                   *_geo(plan), rt.i32(center), rt.i32(need_x), rt.i32(act.code), rt.f64(act.slope),
                   rt.i32(_group_vec(call, plan, x, dy, dx))], _shared(block, acc))
        return (part_a, part_b, plan.nn, 1, 1) if wfree else None
    if plan.column:
        part_a, part_b, _ = _column_partials(plan, types, x, dy, w, b, mean, rstd, 1, True, center, act, xp, acc)
        chunks, qp, apply_w = plan.chunks, plan.qq, True
        reusable = (part_a, part_b, plan.nn * plan.chunks, plan.qq, plan.ss)
    else:
        block = rt.check_block(BLOCK, "BLOCK")
        part_a = xp.empty(plan.groups * plan.splits, acc)
        part_b = xp.empty_like(part_a)
        rt.launch(FAMILY, f"norm_bwd_partial<{types[0]}, {types[1]}>", (plan.groups, plan.splits), (block,),
                  [x, dy, rt.ptr(w), rt.ptr(b), mean, rstd, part_a, part_b, *_geo(plan), rt.i64(plan.splits),
                   rt.i32(act.code), rt.f64(act.slope), rt.i32(_group_vec(call, plan, x, dy))], _shared(block, acc))
        chunks, qp, apply_w = plan.splits, 1, plan.cg == 1
        reusable = (part_a, part_b, plan.nn * plan.splits, 1, 1) if plan.cg == 1 else None
    if need_x:
        mgw = xp.empty(plan.groups, acc)
        mgwx = xp.empty(plan.groups, acc)
        rt.launch(FAMILY, f"norm_bwd_group_finalize<{types[0]}, {types[1]}>", _finalize_grid(plan),
                  (APPLY_BLOCK,),
                  [rt.ptr(w), part_a, part_b, mgw, mgwx, *_geo(plan), rt.i64(chunks), rt.i64(qp), rt.i32(apply_w),
                   rt.i32(center)])
        vec = _apply_vec(call, plan, x, dy, dx)
        rt.launch(FAMILY, f"norm_bwd_dx<{types[0]}, {types[1]}>", _apply_grid(plan, vec, call.dtype), (APPLY_BLOCK,),
                  [x, dy, rt.ptr(w), rt.ptr(b), mean, rstd, mgw, mgwx, dx, *_geo(plan), rt.i32(1),
                   rt.i32(act.code), rt.f64(act.slope), rt.i32(vec)])
    return reusable


def _param_grads(call, plan, types, partials, need_w, need_b, xp, acc):
    """dweight and dbias (flat, in the parameters' dtype) from partial sums."""
    part_a, part_b, rows_of_parts, qp, s_eff = partials
    size = plan.cc * plan.cg
    dw = xp.empty(size, call.weight.dtype) if need_w else None
    db = xp.empty(size, call.bias.dtype) if need_b else None
    block = rt.check_block(APPLY_BLOCK, "APPLY_BLOCK")
    rt.launch(FAMILY, f"norm_param_finalize<{types[0]}, {types[1]}>", (size,), (block,),
              [part_a, part_b, rt.ptr(dw), rt.ptr(db), rt.i64(plan.cc), rt.i64(plan.cg), rt.i64(rows_of_parts),
               rt.i64(qp), rt.i64(s_eff)], _shared(block, acc))
    return dw, db


def norm_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx, dweight and dbias of every norm (see the module docstring)."""
    x, mean, rstd, call, plan = residuals
    out = out or {}
    xp = rt.array_module(x)
    types = _types(call)
    acc = rt.acc_dtype(call.dtype)
    act = call.activation
    dy = xp.ascontiguousarray(cotangents[0])
    if dy.dtype != x.dtype:
        dy = dy.astype(x.dtype)
    need_x = "x" in needs
    need_w = "weight" in needs and call.weight is not None
    need_b = "bias" in needs and call.bias is not None
    dx = None
    if need_x:
        given = out.get("x")
        ok = given is not None and given.dtype == x.dtype and given.flags.c_contiguous
        dx = given if ok else xp.empty_like(x)
    train = bool(call.use_batch_stats)
    partials = None
    if x.size == 0:
        pass
    elif train:
        partials = _group_sums(call, plan, types, x, dy, mean, rstd, dx, need_x, need_w or need_b, xp, acc)
    elif need_x:
        vec = _apply_vec(call, plan, x, dy, dx)
        rt.launch(FAMILY, f"norm_bwd_dx<{types[0]}, {types[1]}>", _apply_grid(plan, vec, call.dtype), (APPLY_BLOCK,),
                  [x, dy, rt.ptr(call.weight), rt.ptr(call.bias), mean, rstd, rt.NULL, rt.NULL, dx, *_geo(plan),
                   rt.i32(0), rt.i32(act.code), rt.f64(act.slope), rt.i32(vec)])
    dw = db = None
    if need_w or need_b:
        if x.size == 0:
            dw = xp.zeros(call.weight.shape, call.weight.dtype) if need_w else None
            db = xp.zeros(call.bias.shape, call.bias.dtype) if need_b else None
        else:
            if partials is None:
                part_a, part_b, rows_of_parts = _column_partials(
                    plan, types, x, dy, call.weight, call.bias, mean, rstd, 1, False, bool(call.center), act, xp,
                    acc)
                partials = (part_a, part_b, rows_of_parts, plan.qq, plan.ss)
            dw, db = _param_grads(call, plan, types, partials, need_w, need_b, xp, acc)
    grads = {}
    if need_x:
        grads["x"] = rt.into(out, "x", dx)
    if "weight" in needs:
        grads["weight"] = rt.into(out, "weight", dw.reshape(call.weight.shape)) if need_w else None
    if "bias" in needs:
        grads["bias"] = rt.into(out, "bias", db.reshape(call.bias.shape)) if need_b else None
    return grads


# --------------------------------------------------------------------------- moments
#
# The plan (which rows each group reads, see ``portable_nn.kernel_plans.moments_plan``) is pure Python shared
# with the Numba kernels.  Paths:
# ``small`` (one thread per group, groups under MOMENTS_THREAD_BELOW elements), ``rows`` (row mode: a
# block per group, or per chunk of it plus a merging pass) and ``cols`` (column mode: 2-D blocks of
# columns × row lanes, split along the rows plus a merging pass when there are few).  dx is one
# elementwise kernel whatever the path.


def _tables(plan: Any, xp: Any) -> list:
    """The row-offset arguments (kstride, ktab, rstride, rtab); empty tables pass as null pointers."""
    ktab = xp.asarray(plan.ktab) if plan.ktab.size else None
    rtab = xp.asarray(plan.rtab) if plan.rtab.size else None
    return [rt.i64(plan.kstride), rt.ptr(ktab), rt.i64(plan.rstride), rt.ptr(rtab)]


def _unit_splits(units: int, rows: int, width: int) -> tuple[int, int]:
    """(rows per split, splits): each of ``units`` column tiles (``width`` elements of each of ``rows``
    rows) split along the rows until about TARGET_BLOCKS blocks, none under SPLIT_MIN_ELEMENTS elements."""
    want = max(1, rt.blocks(TARGET_BLOCKS, max(units, 1)))
    most = max(1, rt.blocks(rows * width, max(SPLIT_MIN_ELEMENTS, 1)))
    splits = max(1, min(want, most, rows))
    rper = rt.blocks(rows, splits)
    return rper, rt.blocks(rows, rper)


def moments_path(plan: Any) -> str:
    """``small`` (a thread per group: small groups), ``cols`` (column mode) or ``rows`` (a block per chunk)."""
    if plan.n < MOMENTS_THREAD_BELOW:
        return "small"
    return "cols" if plan.column else "rows"


def _moments_sums(call: Any, plan: Any, x: Any, xp: Any, outs: list, tables: list) -> None:
    """Launch the reduction of ``plan``'s path (and the merging pass when groups are split)."""
    t = rt.ctype(call.dtype)
    acc = rt.acc_dtype(call.dtype)
    corr = rt.f64(call.correction)
    path = moments_path(plan)
    if path == "small":
        rt.launch(FAMILY, f"moments_small<{t}>", (min(rt.blocks(plan.groups, APPLY_BLOCK), 65535),), (APPLY_BLOCK,),
                  [x, *outs, rt.i64(plan.L), rt.i64(plan.lk), *tables, rt.i64(plan.groups), rt.i64(plan.rout), corr])
        return
    if path == "rows":
        # A block no larger than the group (and at least a warp): short groups keep every thread busy.
        block = pow2_at_most(max(plan.n, 32), rt.check_block(BLOCK, "BLOCK"))
        splits = 1
        if plan.groups < TARGET_BLOCKS and plan.n > SPLIT_MIN_ELEMENTS:
            splits = min(rt.blocks(plan.n, SPLIT_MIN_ELEMENTS), rt.blocks(TARGET_BLOCKS, plan.groups), 65535)
        rper, rsplits, qper, qsplits = row_splits(plan, splits)
        splits = rsplits * qsplits
        part_a = xp.empty(plan.groups * splits, acc) if splits > 1 else None
        part_b = xp.empty(plan.groups * splits, acc) if splits > 1 else None
        rt.launch(FAMILY, f"moments_rows<{t}>", (plan.groups, splits), (block,),
                  [x, rt.ptr(part_a), rt.ptr(part_b), *outs, rt.i64(plan.L), *tables, rt.i64(plan.rout),
                   rt.i64(rper), rt.i64(qper), rt.i64(qsplits), rt.i64(pow2_at_most(plan.L, block)), corr],
                  _shared(block, acc))
    else:
        threads = rt.check_block(COLUMN_BLOCK[0] * COLUMN_BLOCK[1], "COLUMN_BLOCK threads")
        bx = pow2_at_most(plan.L, COLUMN_BLOCK[0])
        by = threads // bx
        tiles = rt.blocks(plan.L, bx)
        rper, splits = _unit_splits(tiles * plan.kout, plan.rout, min(plan.L, bx))
        part_a = xp.empty(plan.kout * splits * plan.L, acc) if splits > 1 else None
        part_b = xp.empty(plan.kout * splits * plan.L, acc) if splits > 1 else None
        rt.launch(FAMILY, f"moments_cols<{t}>", (tiles, min(plan.kout * splits, 65535)), (bx, by),
                  [x, rt.ptr(part_a), rt.ptr(part_b), *outs, rt.i64(plan.L), *tables, rt.i64(plan.kout),
                   rt.i64(plan.rout), rt.i64(rper), rt.i64(splits), corr], _shared(threads, acc))
    if splits > 1:
        rt.launch(FAMILY, f"moments_finalize<{t}>", (rt.blocks(plan.groups, APPLY_BLOCK),), (APPLY_BLOCK,),
                  [x, part_a, part_b, *outs, rt.i64(plan.L), rt.i64(plan.lk), *tables[:2], rt.i64(plan.groups),
                   rt.i64(splits), rt.i64(plan.n), corr])


def moments_forward(call: Any) -> tuple[tuple[Any, Any], Any]:
    """``moments``: ``(mean, var)`` over ``call.axes``, float32 for float32/float16/bfloat16 data.

    Residuals: ``(x, shift, centred mean, plan, call)`` (see ``norm.cu``).
    """
    x = call.x
    xp = rt.array_module(x)
    plan = moments_plan(tuple(x.shape), call.axes)
    shape = moments_shape(tuple(x.shape), call.axes, call.keepdims)
    acc = rt.acc_dtype(call.dtype)
    if x.size == 0:  # an empty reduction is undefined (NaN, as in NumPy); otherwise there are no groups
        return (xp.full(shape, math.nan, acc), xp.full(shape, math.nan, acc)), (
            (x, None, None, plan, call) if call.save else None)
    outs = [xp.empty(plan.groups, acc) for _ in range(4)]  # mean, var, shift, centred mean
    _moments_sums(call, plan, x, xp, outs, _tables(plan, xp))
    mean, var, shift, cm = outs
    residuals = (x, shift, cm, plan, call) if call.save else None
    return (mean.reshape(shape), var.reshape(shape)), residuals


def moments_backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> dict[str, Any]:
    """dx = dmean / n + dvar · 2 (x − mean) / (n − correction) in one elementwise kernel."""
    x, shift, cm, plan, call = residuals
    if "x" not in needs:
        return {}
    out = out or {}
    xp = rt.array_module(x)
    given = out.get("x")
    ok = given is not None and given.dtype == x.dtype and given.flags.c_contiguous
    dx = given if ok else xp.empty_like(x)
    dmean, dvar = cotangents
    denom = plan.n - call.correction
    if denom <= 0:
        dvar = None  # var is NaN: it has no gradient (as in the reference)
    if x.size == 0 or (dmean is None and dvar is None):
        dx.reshape(-1).view(xp.uint8).fill(0)  # byte-wise: bfloat16 arrays need no arithmetic support
        return {"x": rt.into(out, "x", dx)}
    acc = rt.acc_dtype(call.dtype)
    dmean, dvar = (None if c is None else xp.ascontiguousarray(c.reshape(-1), dtype=acc) for c in (dmean, dvar))
    block = rt.check_block(APPLY_BLOCK, "APPLY_BLOCK")
    bx = pow2_at_most(plan.L, block)
    by = block // bx
    rows = plan.kout * plan.rout
    rt.launch(FAMILY, f"moments_dx<{rt.ctype(call.dtype)}>", (rt.blocks(plan.L, bx), min(rt.blocks(rows, by), 65535)),
              (bx, by),
              [x, rt.ptr(dmean), rt.ptr(dvar), shift, cm, dx, rt.i64(plan.L), rt.i64(plan.lk), *_tables(plan, xp),
               rt.i64(plan.kout), rt.i64(plan.rout), rt.f64(1.0 / plan.n), rt.f64(2.0 / denom if denom > 0 else 0.0)])
    return {"x": rt.into(out, "x", dx)}
