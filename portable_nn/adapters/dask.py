"""Dask arrays chunk by chunk: ``moments`` and ``batch_norm`` through the kernels of their chunks.

A Dask array is a grid of chunks, each an array of another library (NumPy, or CuPy on a GPU).
Dispatch hands ``moments`` and ``batch_norm`` calls on Dask arrays to this route
(``_arrays.CHUNKED_ROUTES``), which builds a lazy Dask graph whose tasks call the public ops on
each chunk, so dispatch picks the chunks' kernels there (``numba`` for NumPy chunks, the GPU
kernels for CuPy chunks) — kernel packages and adapters never import each other:

* per chunk, ``moments`` over the reduced axes gives the partial statistics (nᵢ, meanᵢ, M2ᵢ),
  M2ᵢ = varᵢ · nᵢ = Σ (x − meanᵢ)² (kept in float64: the merge adds no rounding of its own);
* ``dask.array.reduction`` merges them in a tree (``split_every`` from Dask's configuration)
  with :func:`~portable_nn.merge_moments`, Chan's merge: with δ = mean_b − mean_a and n = n_a + n_b,

      mean = mean_a + δ · n_b / n,    M2 = M2_a + M2_b + δ² · n_a · n_b / n

  — deviations from the means, never E[x²] − E[x]², so float32 data with a large offset keeps
  its variance; then mean and var = M2 / (n − correction);
* ``batch_norm`` normalises each chunk with the kernel's inference form,
  ``batch_norm(chunk, training=False, running_mean=mean, running_var=var)`` — the fused
  normalisation and activation with given statistics — the batch statistics (population
  variance) merged as above when training, the running ones otherwise.

Which route runs is visible: ``pnn.explain`` names the kernel the chunks run and says the chunked
route runs instead of the reference.  The backend configuration applies to the chunks:
``use_backend("numba")`` runs every chunk on ``numba`` or raises ``BackendUnavailableError``
at the call, saying why (CuPy chunks, an unsupported dtype); ``use_backend("reference")`` runs
the reference on the whole Dask array (lazy Dask operations), as before this route existed.
The configuration is read when the graph is built and travels with it, so worker threads and
``dask.distributed`` worker processes run the chunks as the caller asked.  Under ``auto``, a
call the route cannot take runs on the reference, reported as a fallback (``explain``,
``set_fallback``): chunks of a dtype or layout no kernel takes, a reduction over
no axis, and ``vjp``, which the route has no backward for.

Running statistics keep ``batch_norm``'s contract for Dask arrays (they must be Dask arrays, like
``x``): ``return_stats=True`` returns the new ones as lazy Dask arrays; otherwise they are
updated in place by Dask's item assignment, lazily — nothing is computed by the call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _arrays, backends, config, dispatch
from ..api._common import spec_of
from ..api.norm import batch_norm, merge_moments, moments
from ..errors import BackendUnavailableError
from ..kernel_plans import momentum_update

__all__ = ["ROUTE", "DaskRoute"]

#: The ops that run chunk by chunk, and the ops each runs on every chunk.
_CHUNK_OPS = {"moments": ("moments",), "batch_norm": ("moments", "batch_norm")}

Requests = tuple[tuple[str, str], ...]


class DaskRoute:
    """The chunked route of Dask arrays (dispatch's ``_arrays.CHUNKED_ROUTES["dask"]``).

    Attributes:
        ops: the ops it routes.
    """

    ops = frozenset(_CHUNK_OPS)

    def select(self, call: dispatch.Call, need_backward: bool) -> dispatch.Selection | tuple[str, str] | None:
        """How ``call`` (a Dask ``x``) runs: chunk by chunk, declined, or not this route's call.

        Args:
            call: the validated call on Dask arrays.
            need_backward: whether ``vjp`` asks for a backward.

        Returns:
            A :class:`~portable_nn.dispatch.Selection` whose implementation builds the chunked
            graph (its backend: the kernel the chunks run); ``(backend, reason)`` when the route
            declines under ``auto`` (the whole array then runs on the reference, as a fallback);
            ``None`` when the reference is forced, a kernel takes Dask arrays whole, or no kernel
            takes the chunks' library (the reference takes the whole array, as any array no
            kernel targets).

        Raises:
            BackendUnavailableError: a forced backend cannot run the call chunk by chunk.
        """
        requested, source = config.get_backend(call.op)
        if backends.is_oracle(requested) or _whole_array_kernel(call, requested, need_backward):
            return None
        x = call.x
        meta = getattr(x, "_meta", None)
        if not _arrays.is_array(meta):
            return None
        chunk_calls = _chunk_calls(call, meta)
        forced = requested != "auto"
        where = f"backend {requested!r} (set by {source})"
        chunks = _describe_chunks(x, meta)
        try:
            chosen = {op: dispatch.select(c, report=False) for op, c in chunk_calls.items()}
        except BackendUnavailableError as exc:
            marker = "cannot run this call: "
            why = str(exc).split(marker, 1)[1] if marker in str(exc) else str(exc)
            raise BackendUnavailableError(
                f"{call.op}: {where} cannot run this Dask array: a Dask array runs chunk by chunk, and for its "
                f"chunks ({chunks}) {why}") from None
        main = chosen[call.op]
        if backends.is_oracle(main.impl.backend):  # only under auto: no kernel takes the chunks
            targeted = _targeting_kernel(call.op, chunk_calls[call.op])
            if targeted is None:
                return None
            why = dict(main.passed_over).get(targeted, "declines them")
            return targeted, f"would run each chunk of this Dask array ({chunks}) but {why}"
        reason = _declines(call, meta, need_backward, main.impl.backend)
        if reason is not None:
            if forced:
                raise BackendUnavailableError(f"{call.op}: {where} cannot run this Dask array: {reason}")
            return main.impl.backend, f"would run each chunk of this Dask array ({chunks}), but {reason}"
        requests = tuple((op, config.get_backend(op)[0]) for op in _CHUNK_OPS[call.op])
        impl = dispatch.Implementation(
            call.op, main.impl.backend, functools.partial(_forward, requests), None,
            dispatch.Support(families=("dask",), description="Dask arrays chunk by chunk"), origin="route")
        passed = [(backends.oracle_name(), _route_note(call, chosen, chunks, requested, source))]
        passed += _others(call.op, chunk_calls[call.op], main.impl.backend, requested, source)
        return dispatch.Selection(impl, requested, source, [], passed, False)


#: The route dispatch uses for Dask arrays.
ROUTE = DaskRoute()


# --------------------------------------------------------------------------- selection helpers


def _whole_array_kernel(call: dispatch.Call, requested: str, need_backward: bool) -> bool:
    """Whether a kernel declared for Dask arrays themselves (``Support(families=("dask", …))``)
    takes the call whole: it then runs as any other kernel would, not chunk by chunk."""
    for impl in dispatch.implementations(call.op):
        families = impl.supports.families
        if families is None or call.family not in families or requested not in ("auto", impl.backend):
            continue
        if dispatch._candidate_reason(impl, call, need_backward)[0] is None:
            return True
    return False


def _stand_in(meta: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An array of the chunks' library, ``shape`` and ``dtype`` that holds no memory (a broadcast
    zero): what the op validates and dispatch selects on for one chunk."""
    xp = _arrays.namespace(meta)
    return xp.broadcast_to(xp.zeros((), dtype=dtype), shape)


def _stats_dtype(call: dispatch.Call) -> Any:
    """float32 statistics for half-precision data (as every kernel keeps them), else x's dtype."""
    return np.dtype("float32") if call.dtype in _arrays.HALF_DTYPES else call.x.dtype


def _chunk_shape(x: Any) -> tuple[int, ...]:
    """The largest chunk along each axis (1 where chunk sizes are unknown)."""
    return tuple(max((int(c) for c in sizes if not math.isnan(c)), default=1) for sizes in x.chunks)


def _chunk_calls(call: dispatch.Call, meta: Any) -> dict[str, dispatch.Call]:
    """The call each op the route runs per chunk makes, validated by the op itself on a stand-in chunk."""
    x = call.x
    chunk = _stand_in(meta, _chunk_shape(x), x.dtype)
    if call.op == "moments":
        return {"moments": spec_of("moments").prepare(chunk, call.axes, keepdims=True).call}
    channels = int(chunk.shape[call.channel_axis])
    param = _stand_in(meta, (channels,), _stats_dtype(call))
    calls = {}
    if call.use_batch_stats:
        calls["moments"] = spec_of("moments").prepare(chunk, call.axes).call
    calls["batch_norm"] = spec_of("batch_norm").prepare(
        chunk, weight=None if call.weight is None else param, bias=None if call.bias is None else param,
        running_mean=param, running_var=param, training=False, eps=call.eps, channel_axis=call.channel_axis,
        activation=call.activation).call
    return calls


def _describe_chunks(x: Any, meta: Any) -> str:
    """``"16 chunks, each a NumPy array on cpu, float32"``."""
    count, kind = x.npartitions, _arrays.describe_family(_arrays.family(meta))
    return (f"{count} chunk{'s' * (count != 1)}, each {kind} on {_arrays.device_of(meta)}, "
            f"{_arrays.dtype_name(None, x.dtype)}")


def _targeting_kernel(op: str, chunk_call: dispatch.Call) -> str | None:
    """The first available kernel made for the chunks' library and device (it declined them), if any."""
    for impl in dispatch.implementations(op):
        if backends.is_oracle(impl.backend) or not dispatch.backend_status(impl.backend):
            continue
        if impl.supports.matches_arrays(chunk_call) is None:
            return impl.backend
    return None


def _declines(call: dispatch.Call, meta: Any, need_backward: bool, backend: str) -> str | None:
    """Why the route cannot run ``call`` although a kernel takes its chunks, else ``None``."""
    if need_backward:
        return (f"vjp needs a backward and the chunked route ({backend} on each chunk) has none: vjp of a Dask "
                "array runs on the reference, over the whole array (auto or use_backend('reference'))")
    if call.op == "moments" and not call.axes:
        return "the call reduces no axis (there are no partial statistics to merge)"
    return None


def _route_note(call: dispatch.Call, chosen: dict[str, dispatch.Selection], chunks: str, requested: str,
                source: str) -> str:
    """The reference's line in ``explain``: what the chunked route runs in its place."""
    kernel = {op: f"{op}[{sel.impl.backend}]" for op, sel in chosen.items()}
    copies = any(sel.impl.supports.contiguous for sel in chosen.values())
    merge = "their (count, mean, M2) merged by Chan's merge (merge_moments) in a Dask tree reduction"
    if call.op == "moments":
        steps = f"{kernel['moments']} on each chunk, {merge}"
    elif "moments" in kernel:
        steps = (f"{kernel['moments']} on each chunk, {merge} into the batch statistics, then "
                 f"{kernel['batch_norm']} on each chunk with them (its inference form: normalisation and "
                 "activation with given statistics)")
    else:
        steps = f"{kernel['batch_norm']} on each chunk with the running statistics"
    lead = "" if requested == "auto" else f"not requested ({requested} forced by {source}); "
    return (f"{lead}the Dask chunked route runs instead: {steps} ({chunks}"
            f"{'; a chunk not in C order is copied first' if copies else ''}); the reference runs on the whole "
            "Dask array for vjp and under use_backend('reference')")


def _others(op: str, chunk_call: dispatch.Call, chosen: str, requested: str, source: str) -> list[tuple[str, str]]:
    """Why each other kernel does not run the chunks (as ``explain`` reports for a plain call)."""
    passed = []
    for impl in dispatch.implementations(op):
        if impl.backend == chosen or backends.is_oracle(impl.backend):
            continue
        reason, _ = dispatch._candidate_reason(impl, chunk_call, False)
        if reason is None:
            reason = (f"not requested ({requested} forced by {source})" if requested != "auto"
                      else f"lower priority than {chosen}")
        passed.append((impl.backend, f"{reason} (for the chunks)"))
    return passed


# --------------------------------------------------------------------------- the graphs


def _forward(requests: Requests, call: dispatch.Call) -> tuple[tuple[Any, ...], None]:
    """The implementation dispatch runs: the lazy Dask graph of ``call.op`` (no residuals: no backward)."""
    if call.op == "moments":
        return _moments_graph(call, requests), None
    return _batch_norm_graph(call, requests), None


def _partials(x: Any, axes: tuple[int, ...], keepdims: bool, requests: Requests) -> Any:
    """A Dask array whose blocks are the merged partial statistics ``{"n", "mean", "m2"}`` over ``axes``.

    Its chunks are those of the result (``keepdims`` or not); the blocks are dicts, so only
    :func:`_statistic` reads them.
    """
    import dask.array as da
    from dask.array.utils import meta_from_array

    ndim = x.ndim if keepdims else x.ndim - len(axes)
    return da.reduction(
        x, functools.partial(_chunk_partial, requests=requests), _aggregate, combine=_combine, axis=axes,
        keepdims=keepdims, dtype=np.float64, concatenate=False,
        meta=meta_from_array(x._meta, ndim=ndim, dtype=np.float64), name="pnn-moments")


def _statistic(partials: Any, which: str, correction: float, dtype: Any, like: Any) -> Any:
    """The mean or variance from :func:`_partials`, in ``dtype``, as a Dask array of ``like``'s library."""
    from dask.array.utils import meta_from_array

    meta = meta_from_array(like, ndim=partials.ndim, dtype=dtype)
    return partials.map_blocks(_finish_statistic, which=which, correction=correction, out_dtype=dtype,
                               dtype=dtype, meta=meta, token=f"pnn-{which}")


def _moments_graph(call: dispatch.Call, requests: Requests) -> tuple[Any, Any]:
    x = call.x
    partials = _partials(x, call.axes, call.keepdims, requests)
    dtype = _stats_dtype(call)
    return (_statistic(partials, "mean", call.correction, dtype, x._meta),
            _statistic(partials, "var", call.correction, dtype, x._meta))


def _batch_norm_graph(call: dispatch.Call, requests: Requests) -> tuple[Any, Any, Any]:
    import dask.array as da
    from dask.array.utils import meta_from_array

    x, axis = call.x, call.channel_axis
    dtype = _stats_dtype(call)
    new_mean = new_var = None
    if call.use_batch_stats:
        partials = _partials(x, call.axes, False, requests)
        mean = _statistic(partials, "mean", 0.0, dtype, x._meta)
        var = _statistic(partials, "var", 0.0, dtype, x._meta)
        count = math.prod(int(x.shape[a]) for a in call.axes)
        if call.update_running and count > 0:  # an empty batch leaves them as they are (as the reference does)
            new_mean, new_var = _running_update(call, mean, var, count)
    else:
        mean, var = call.running_mean, call.running_var
    params = [mean, var, call.weight, call.bias]
    if call.dtype in _arrays.HALF_DTYPES:
        # Half data with half weights: the statistics stay float32, so every parameter goes float32 (exactly).
        params = [None if p is None else p.astype(np.float32) for p in params]
    index = tuple(range(x.ndim))
    args: list[Any] = [x, index]
    for p in params:  # each chunk gets the parameters of its channels: one Dask chunk per channel chunk of x
        args += [None, None] if p is None else [p.rechunk((x.chunks[axis],)), (axis,)]
    y = da.blockwise(
        _chunk_batch_norm, index, *args, dtype=x.dtype, meta=meta_from_array(x._meta, ndim=x.ndim, dtype=x.dtype),
        token="pnn-batch_norm", requests=requests, eps=call.eps, channel_axis=axis, activation=call.activation)
    return y, new_mean, new_var


def _running_update(call: dispatch.Call, mean: Any, var: Any, count: int) -> tuple[Any, Any]:
    """PyTorch's running-statistics update (unbiased variance), as lazy Dask arrays."""
    xp, rm, rv = call.xp, call.running_mean, call.running_var
    new_mean, new_var = momentum_update(
        xp, xp.astype(rm, mean.dtype), xp.astype(rv, var.dtype), xp.reshape(mean, (1, -1)),
        xp.reshape(var, (1, -1)), call.momentum, count)
    return xp.astype(new_mean, rm.dtype), xp.astype(new_var, rv.dtype)


# --------------------------------------------------------------------------- what the tasks run


def _requested(requests: Requests) -> Any:
    """The caller's backend request for each op the chunks run: context-local settings do not reach
    Dask's worker threads or processes, so the graph carries them."""
    return config.use_backend(**dict(requests))


def _chunk_partial(block: Any, axis: tuple[int, ...], keepdims: bool, requests: Requests,
                   computing_meta: bool = False) -> Any:
    """One chunk's ``{"n", "mean", "m2"}`` over ``axis`` (kept), by the op's kernel for the chunk."""
    if computing_meta:  # Dask asks what a block looks like: the intermediate blocks are dicts
        return block
    with _requested(requests):
        mean, var = moments(block, axis, keepdims=True)
    count = math.prod(int(block.shape[a]) for a in axis)
    xp = _arrays.namespace(mean)
    return {"n": count, "mean": xp.astype(mean, xp.float64), "m2": xp.astype(var, xp.float64) * count}


def _leaves(parts: Any) -> Iterator[dict[str, Any]]:
    """The partials Dask hands a combine step: one, or lists nested once per reduced axis."""
    if isinstance(parts, list):
        for part in parts:
            yield from _leaves(part)
    else:
        yield parts


def _merge(parts: Any) -> dict[str, Any]:
    """Chan's merge of every partial, pairwise in a balanced tree (a fixed order: deterministic)."""
    stats = [(p["n"], p["mean"], p["m2"]) for p in _leaves(parts)]
    while len(stats) > 1:
        merged = [merge_moments(a, b) for a, b in zip(stats[0::2], stats[1::2])]
        stats = merged + stats[len(merged) * 2:]
    n, mean, m2 = stats[0]
    return {"n": n, "mean": mean, "m2": m2}


def _combine(parts: Any, axis: tuple[int, ...], keepdims: bool, computing_meta: bool = False) -> Any:
    """A level of Dask's reduction tree: the merged partial statistics of ``parts`` (axes kept)."""
    return parts if computing_meta else _merge(parts)


def _aggregate(parts: Any, axis: tuple[int, ...], keepdims: bool, computing_meta: bool = False) -> Any:
    """The tree's root: the merged partial statistics, the reduced axes dropped unless ``keepdims``."""
    if computing_meta:
        return parts
    merged = _merge(parts)
    if not keepdims:
        xp = _arrays.namespace(merged["mean"])
        merged["mean"] = xp.squeeze(merged["mean"], axis=axis)
        merged["m2"] = xp.squeeze(merged["m2"], axis=axis)
    return merged


def _finish_statistic(part: dict[str, Any], which: str, correction: float, out_dtype: Any) -> Any:
    """mean, or var = M2 / (n − correction), in ``out_dtype``: NaN where undefined, as the op's
    reference gives (an empty reduction; n <= correction for the variance)."""
    n, mean = part["n"], part["mean"]
    xp = _arrays.namespace(mean)
    if which == "mean":
        value = mean if n > 0 else xp.full_like(mean, float("nan"))
    else:
        denominator = n - correction
        value = part["m2"] / denominator if denominator > 0 and n > 0 else xp.full_like(mean, float("nan"))
    return xp.astype(value, out_dtype)


def _chunk_batch_norm(block: Any, mean: Any, var: Any, weight: Any, bias: Any, *, requests: Requests, eps: float,
                      channel_axis: int, activation: Any) -> Any:
    """One chunk normalised by the kernel with given statistics (its channels' mean and biased variance)."""
    with _requested(requests):
        return batch_norm(block, weight=weight, bias=bias, running_mean=mean, running_var=var, training=False,
                          eps=eps, channel_axis=channel_axis, activation=activation)
