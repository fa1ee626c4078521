"""The JAX adapter's machinery: call signatures, routes (host callback or traced reference), the
plans around a host callback, the derivatives (a ``custom_jvp`` whose tangent is a linear primitive
transposed by the route's backward), ``explain`` and ``reference_autodiff``."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import jax
    import jax.numpy as jnp
    from jax.core import ShapedArray
    from jax.custom_derivatives import SymbolicZero
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir
except ImportError as exc:  # pragma: no cover - exercised only without JAX
    raise ImportError("portable_nn.jax needs JAX: pip install jax") from exc

from ... import backends, config, dispatch
from ...api._common import Prepared, spec_of

CALLBACK = "callback"
TRACED = "traced"

#: Ops that ``auto`` runs through the host callback on the CPU: the recurrent sequences, whose
#: compiled Numba time loop beats XLA's unrolled trace of the reference (see the module docstring).
AUTO_CALLBACK_OPS = frozenset({"rnn", "lstm", "gru"})


# --------------------------------------------------------------------------- signatures


def _is_jax_array(value: Any) -> bool:
    return isinstance(value, jax.Array)


def _is_tracer(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _as_jax_tree(value: Any) -> Any:
    """NumPy leaves converted to JAX arrays; anything that is not an array is left for validation."""
    if isinstance(value, (list, tuple)):
        return type(value)(_as_jax_tree(v) for v in value)
    if isinstance(value, np.ndarray):
        return jnp.asarray(value)
    return value


def _array_leaves_valid(value: Any) -> bool:
    """Whether every non-None leaf of a (nested list/tuple) argument is a JAX array."""
    if value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_array_leaves_valid(v) for v in value)
    return _is_jax_array(value)


def _standin(leaf: Any, updated: bool = False) -> np.ndarray:
    """A NumPy array validation can look at in place of ``leaf``.

    Integer arrays whose values are known (class targets, lengths) are used as
    they are, so their values are checked; an argument the op updates in place
    (``updated``: a running statistic, small) is a writable array of zeros, so
    validation gets as far as saying whether it would be updated; everything
    else is a zero-stride view of one zero (no memory), which has the right
    shape and dtype.
    """
    dtype = np.dtype(leaf.dtype)
    if not _is_tracer(leaf) and np.issubdtype(dtype, np.integer):
        return np.asarray(leaf)
    if updated:
        return np.zeros(tuple(leaf.shape), dtype=dtype)
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(leaf.shape))


def _steps(x: Any, static: Mapping[str, Any]) -> int:
    """T, the padded sequence length of a sequence op's ``x`` (1 when x is malformed: validation reports it)."""
    if not hasattr(x, "shape") or len(x.shape) != 3:
        return 1
    return int(x.shape[1] if static.get("batch_first") is True else x.shape[0])


def _kernel_view(a: np.ndarray) -> np.ndarray:
    """``a`` as a writable C-contiguous array: an alias of read-only memory, or a copy if strided."""
    if a.flags.writeable:
        return a
    if not a.flags.c_contiguous or a.size == 0:
        return np.array(a, order="C")
    memory = (ctypes.c_char * a.nbytes).from_address(a.ctypes.data)
    return np.frombuffer(memory, dtype=a.dtype).reshape(a.shape)


def _detached(value: Any, inputs: list[np.ndarray]) -> Any:
    """``value`` (an array, ``None`` or nested lists/tuples) with any array sharing memory with ``inputs`` copied."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v, inputs) for v in value)
    if any(np.may_share_memory(value, a) for a in inputs):
        return np.array(value)
    return value


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Route:
    """How a JAX call of a portable_nn op runs (see the module docstring).

    Attributes:
        op: the op name.
        kind: ``"callback"`` (portable_nn kernels on NumPy buffers through
            ``jax.pure_callback``) or ``"traced"`` (the reference traced with
            ``jax.numpy``, compiled by XLA).
        backend: the portable_nn backend whose kernels run (``"numba"``,
            ``"reference"`` …).
        reason: why this route was taken.
    """

    op: str
    kind: str
    backend: str
    reason: str

    def __str__(self) -> str:
        how = (
            f"{self.backend} kernels on NumPy buffers through jax.pure_callback"
            if self.kind == CALLBACK
            else "the array-API reference traced with jax.numpy (compiled by XLA)"
        )
        return f"{self.op}: {self.kind} route: {how}; {self.reason}"


def _choose_route(prepared: Prepared, op: str) -> Route:
    """The route for a validated call (``prepared`` was built on NumPy stand-ins)."""
    requested, source = config.get_backend(op)
    if requested == "reference":
        return Route(op, TRACED, "reference", f"backend 'reference' requested by {source}")
    if requested == "auto" and jax.default_backend() != "cpu":
        return Route(
            op, TRACED, "reference",
            f"JAX runs on {jax.default_backend()}: the reference compiles for that device (no host round trip)",
        )
    if requested == "auto" and op not in AUTO_CALLBACK_OPS:
        return Route(
            op, TRACED, "reference",
            "auto: XLA fuses this op's traced reference as well as a kernel would, without a host round trip",
        )
    # Dispatch decides as for NumPy arrays of these shapes and dtypes; a forced backend that cannot
    # take them raises BackendUnavailableError here, at trace time.
    selection = dispatch.select(prepared.call, need_backward=True)
    backend = selection.impl.backend
    if backend == "reference":
        passed = "; ".join(f"{b} {why}" for b, why in selection.passed_over) or "no kernel declared"
        return Route(op, TRACED, "reference", f"no CPU kernel takes the call ({passed})")
    return Route(op, CALLBACK, backend, f"backend {requested!r} (from {source}) runs {op}[{backend}] on the CPU")


class _Plan:
    """One traced call: validated arguments, the route, and how to run forward and backward.

    Built at trace time from the call's static arguments and the shapes and
    dtypes of its arrays.  ``arrays`` maps each array argument to a JAX array,
    ``None`` or (for RNN ``params``) a list of tuples of them.
    """

    def __init__(self, op: str, arrays: dict[str, Any], static: dict[str, Any]) -> None:
        self.op = op
        self.spec = spec_of(op)
        self.static = static
        self.treedef = jax.tree_util.tree_structure(arrays)
        leaves = jax.tree_util.tree_leaves(arrays)
        self.fields = tuple(sorted(arrays))  # the order in which JAX flattens a dict
        self.leaf_fields = tuple(name for name in self.fields for _ in jax.tree_util.tree_leaves(arrays[name]))
        #: Each field with its leaves replaced by their positions in the flat list.
        self.templates = jax.tree_util.tree_unflatten(self.treedef, list(range(len(leaves))))
        self.leaf_structs = tuple(jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in leaves)
        self.standins = [_standin(v, f in self.spec.updates) for v, f in zip(leaves, self.leaf_fields)]
        if _is_tracer(arrays.get("lengths")):
            # Traced lengths are checked at run time; validation at trace time sees full-length sequences.
            k = self.leaf_fields.index("lengths")
            self.standins[k] = np.full(self.standins[k].shape, _steps(arrays["x"], static), self.standins[k].dtype)
        standin_arrays = jax.tree_util.tree_unflatten(self.treedef, self.standins)
        self.prepared = self._prepare(standin_arrays)
        self.grad_fields = frozenset(self.prepared.grad_fields)
        self.n_diff = self.prepared.n_diff_outputs
        if self.prepared.mutates:
            raise ValueError(
                f"{op}: {' and '.join(self.spec.updates)} cannot be updated in place (JAX arrays are immutable); "
                "pass return_stats=True to get (y, new_running_mean, new_running_var)"
            )
        self.route = _choose_route(self.prepared, op)
        #: Lengths read at run time (callback route): the reference, which reads them at trace time,
        #: cannot give this call's derivatives beyond the first reverse-mode one.
        self.traced_lengths = "lengths" in arrays
        if self.route.kind == TRACED and "lengths" in arrays:
            raise TypeError(
                f"{op}: lengths is a traced value, but the traced reference reads the lengths at trace time; "
                "pass concrete lengths (a NumPy array or tuple closed over, or a static argument), or run the "
                "Numba kernels (callback route, JAX on the CPU) which read them at run time"
            )
        self._reference = next(i for i in dispatch.implementations(op) if backends.is_oracle(i.backend))

    # ---- shared

    def _prepare(self, arrays: dict[str, Any]) -> Prepared:
        """Validate the call with portable_nn's own ``prepare`` on ``arrays`` (NumPy)."""
        return self.spec.prepare(**self.static, **arrays)

    def needs(self, perturbed: Mapping[str, bool]) -> frozenset[str]:
        """The gradient fields wanted, from which array arguments JAX differentiates."""
        wanted = set()
        for name, moving in perturbed.items():
            if not moving:
                continue
            if name not in self.grad_fields:
                raise ValueError(
                    f"{self.op}: {name} has no gradient in portable_nn (only "
                    f"{', '.join(self.prepared.grad_fields)} do); wrap it in jax.lax.stop_gradient"
                )
            wanted.add(name)
        return frozenset(wanted)

    @functools.cached_property
    def out_structs(self) -> tuple[Any, ...]:
        """Shapes and dtypes of the implementation's outputs (``None`` where absent)."""
        return jax.eval_shape(lambda leaves: self._traced_forward(leaves, save=False)[0], list(self.leaf_structs))

    # ---- traced reference

    def _reference_call(self, leaves: list[Any], save: bool) -> dispatch.Call:
        """The prepared call with the stand-ins swapped for ``leaves`` and jax.numpy as namespace."""
        by_id = {id(s): v for s, v in zip(self.standins, _jax_values(leaves))}
        arrays = {}
        for name, value in self.prepared.call.arrays.items():
            if value is not None and id(value) not in by_id:  # pragma: no cover - a prepare that copies
                raise RuntimeError(f"{self.op}: argument {name} was transformed during validation")
            arrays[name] = None if value is None else by_id[id(value)]
        return self.prepared.call.replace(arrays=arrays, xp=jnp, family="jax", save=save)

    def _traced_forward(self, leaves: list[Any], save: bool) -> tuple[tuple[Any, ...], Any]:
        # The call's input maps (conv's padding modes) are traced too, as dispatch would apply them.
        outputs, residuals = self._reference.forward_fn()(self._reference_call(leaves, save).mapped())
        return tuple(outputs), residuals

    def _traced_backward(self, leaves: list[Any], needs: frozenset[str], cts: list[Any]) -> dict[str, Any]:
        outputs, residuals = self._traced_forward(leaves, save=True)
        full = tuple(jnp.zeros_like(outputs[i]) if ct is None else ct for i, ct in enumerate(cts))
        grads = self._reference.backward_fn()(residuals, full, needs, {})
        return dispatch.adjoin_gradients(self.prepared.call.input_maps, jnp, grads)

    # ---- host callback

    def _host_run(self, leaves: list[np.ndarray], needs: frozenset[str] | None, cts: list[Any]) -> Any:
        """Forward (``needs is None``) or gradients, on NumPy arrays, on the route's backend.

        JAX hands a callback read-only views of its buffers.  Numba types a
        read-only array as a type of its own, so every kernel would compile a
        second time for them (and a kernel that types a write into an argument
        slot fails to compile); the kernels never write their inputs (the
        suite checks it), so they get writable aliases of the same memory: no
        copy, no extra compilation.  Results that share memory with an input
        are copied, so nothing returned to JAX points into its input buffers.
        """
        inputs = [_kernel_view(np.asarray(v)) for v in leaves]
        arrays = jax.tree_util.tree_unflatten(self.treedef, inputs)
        with config.use_backend(**{self.op: self.route.backend}):
            prepared = self._prepare(arrays)  # values (targets, traced lengths) are checked here
            executed = dispatch.run(prepared.call, need_backward=needs is not None, needs=needs)
            if needs is None:
                return _detached(executed.outputs, inputs)
            full = []
            for i, ct in enumerate(cts):
                full.append(np.zeros_like(executed.outputs[i]) if ct is None else _kernel_view(np.asarray(ct)))
                inputs.append(full[-1])
            return {name: _detached(g, inputs) for name, g in executed.backward(tuple(full), needs, {}).items()}

    def _host_forward(self, leaves: list[Any]) -> tuple[Any, ...]:
        structs = self.out_structs if any(_is_tracer(v) for v in leaves) else None
        if structs is None:
            outputs = self._host_run([np.asarray(v) for v in leaves], None, [])
            return tuple(None if o is None else jnp.asarray(o) for o in outputs)
        present = [i for i, s in enumerate(structs) if s is not None]

        def callback(*host_leaves: np.ndarray) -> tuple[np.ndarray, ...]:
            outputs = self._host_run(list(host_leaves), None, [])
            return tuple(np.asarray(outputs[i], dtype=structs[i].dtype) for i in present)

        results = jax.pure_callback(
            callback, tuple(structs[i] for i in present), *leaves, vmap_method="sequential"
        )
        full: list[Any] = [None] * len(structs)
        for i, r in zip(present, results):
            full[i] = r
        return tuple(full)

    def _host_backward(self, leaves: list[Any], needs: frozenset[str], cts: list[Any]) -> list[Any]:
        wanted = [k for k, f in enumerate(self.leaf_fields) if f in needs]
        given = [i for i, ct in enumerate(cts) if ct is not None]

        def host(host_leaves: list[Any], host_cts: list[Any]) -> list[np.ndarray]:
            full_cts: list[Any] = [None] * len(cts)
            for i, ct in zip(given, host_cts):
                full_cts[i] = ct
            grads = self._host_run(host_leaves, needs, full_cts)
            flat = self._grad_leaves(grads, needs)
            return [np.asarray(flat[k], dtype=self.leaf_structs[k].dtype) for k in wanted]

        operands = [*leaves, *(cts[i] for i in given)]
        if any(_is_tracer(v) for v in operands):
            n = len(leaves)
            results = jax.pure_callback(
                lambda *ops: tuple(host(list(ops[:n]), list(ops[n:]))),
                tuple(self.leaf_structs[k] for k in wanted),
                *operands,
                vmap_method="sequential",
            )
        else:
            host_grads = host([np.asarray(v) for v in leaves], [np.asarray(cts[i]) for i in given])
            results = [jnp.asarray(g) for g in host_grads]
        flat: list[Any] = [None] * len(leaves)
        for k, g in zip(wanted, results):
            flat[k] = g
        return flat

    # ---- gradient trees

    def _grad_leaves(self, grads: Mapping[str, Any], needs: frozenset[str]) -> list[Any]:
        """The gradients (``{field: array or list of tuples}``) as one entry per leaf of the arrays tree."""
        flat: list[Any] = []
        for name in self.fields:
            flat.extend(_aligned_leaves(self.templates[name], grads.get(name) if name in needs else None))
        return flat

    # ---- entry points used by the custom_jvp (see the derivatives section)

    def forward(self, leaves: list[Any]) -> tuple[Any, ...]:
        """The implementation's outputs (``None`` where it has none, e.g. untracked running statistics)."""
        if self.route.kind == TRACED:
            return self._traced_forward(leaves, save=False)[0]
        return self._host_forward(leaves)

    def backward(self, leaves: list[Any], needs: frozenset[str], cts: list[Any]) -> list[Any]:
        """Per leaf, its gradient (``None`` for leaves outside ``needs``)."""
        if self.route.kind == TRACED:
            return self._grad_leaves(self._traced_backward(leaves, needs, cts), needs)
        return self._host_backward(leaves, needs, cts)

    def kernel_vjp(self, leaves: list[Any], mask: tuple[int, ...], cts: list[Any]) -> list[Any]:
        """x̄ₖ = Σᵢ (∂yᵢ/∂xₖ)ᵀ ȳᵢ for the leaves k in ``mask``, given a cotangent ȳᵢ per differentiable
        output, by the route's backward (the fused kernels, or the reference's hand-written backward)."""
        grads = self.backward(leaves, frozenset(self.leaf_fields[k] for k in mask), _jax_values(cts))
        return [jnp.zeros(self.leaf_structs[k].shape, self.leaf_structs[k].dtype) if grads[k] is None else grads[k]
                for k in mask]

    def _reference_outputs(self, leaves: list[Any], mask: tuple[int, ...], moving: tuple[Any, ...]) -> tuple[Any, ...]:
        """The differentiable outputs y by the traced reference, the leaves at ``mask`` set to ``moving``."""
        if self.traced_lengths:
            raise TypeError(
                f"{self.op}: lengths is a traced value, which the reference (that forward-mode and higher-order "
                "derivatives differentiate) reads at trace time; pass concrete lengths (a NumPy array or tuple "
                "closed over, or a static argument) — first-order jax.grad works with traced lengths")
        full = list(leaves)
        for k, value in zip(mask, moving):
            full[k] = value
        return self._traced_forward(full, save=False)[0][: self.n_diff]

    def reference_jvp(self, leaves: list[Any], mask: tuple[int, ...], tangents: list[Any]) -> tuple[Any, ...]:
        """ẏᵢ = Σₖ (∂yᵢ/∂xₖ) ẋₖ over the leaves k in ``mask``: JAX's forward mode through the traced reference."""
        return jax.jvp(lambda *moving: self._reference_outputs(leaves, mask, moving),
                       tuple(leaves[k] for k in mask), tuple(_jax_values(tangents)))[1]

    def reference_vjp(self, leaves: list[Any], mask: tuple[int, ...], cts: list[Any]) -> list[Any]:
        """What :meth:`kernel_vjp` computes, by JAX's reverse mode through the traced reference (which JAX
        can differentiate again)."""
        _, pullback = jax.vjp(lambda *moving: self._reference_outputs(leaves, mask, moving),
                              *(leaves[k] for k in mask))
        return list(pullback(tuple(_jax_values(cts))))


def _jax_values(values: list[Any]) -> list[Any]:
    """``values`` with NumPy arrays made JAX arrays: an eagerly evaluated derivative rule gets JAX's own
    constants (zero cotangents …) as NumPy subclasses, and the reference asks arrays for their device."""
    return [jnp.asarray(v) if isinstance(v, np.ndarray) else v for v in values]


def _aligned_leaves(template: Any, value: Any) -> Iterator[Any]:
    """The entries of ``value`` at the leaf positions of ``template`` (a field with numbered leaves)."""
    if template is None:
        return
    if isinstance(template, (list, tuple)):
        for i, t in enumerate(template):
            yield from _aligned_leaves(t, None if value is None else value[i])
        return
    yield value


# --------------------------------------------------------------------------- derivatives
#
# Every op is a ``jax.custom_jvp`` (``_apply``): its primal is the route's forward, and its tangent
# ẏ = J ẋ (J the Jacobian of the differentiable outputs) is ``_tangent_p``, a primitive linear in ẋ:
#
# * evaluated (forward mode: ``jax.jvp``, ``jax.jacfwd``) it is JAX's forward mode through the
#   traced reference;
# * transposed (reverse mode: ``jax.grad`` linearises the op and transposes ẏ = J ẋ) it is
#   ``_kernel_vjp``, x̄ = Jᵀ ȳ by the route's backward: the fused kernels through a callback, or the
#   reference's hand-written backward — what the plain ``custom_vjp`` ran before forward mode;
# * differentiated (forward over forward, reverse over forward) in its primal inputs it is JAX's
#   derivative of the reference's forward mode;
# * vmapped, it keeps its batch axes as parameters and vmaps both the reference and the backward.
#
# ``_kernel_vjp`` is itself a ``custom_jvp`` whose tangent is JAX's forward mode through the
# reference's reverse mode, so a gradient (the transpose) can be differentiated again (``jax.grad``
# of ``jax.grad``, ``jax.hessian``).  JAX's own ``linear_call`` has this shape but no batching rule
# and no derivative with respect to its residuals (JAX 0.10), hence the primitive.
#
# Cost: a first-order ``jax.grad`` runs exactly what the ``custom_vjp`` ran (forward, then the
# backward, with the primal inputs as residuals); forward mode adds the reference's forward and JVP
# to the forward; each further order differentiates the reference.

_tangent_p = Primitive("portable_nn_tangent")
_tangent_p.multiple_results = True


def _vmapped(fn: Callable[..., Any], vmaps: tuple[tuple[tuple[int | None, ...], int], ...]) -> Callable[..., Any]:
    """``fn`` under the batch axes ``vmaps`` collected by the batching rule (innermost first): each
    entry is ``(in_axes, size)``, every output batched along axis 0."""
    for in_axes, size in vmaps:
        fn = jax.vmap(fn, in_axes=in_axes, out_axes=0, axis_size=size)
    return fn


def _tangent_impl(*operands: Any, plan: _Plan, mask: tuple[int, ...], vmaps: Any) -> list[Any]:
    """ẏ = J ẋ from ``(*leaves, *ẋ)`` (ẋ: one tangent per leaf in ``mask``) by the traced reference."""
    n = len(plan.leaf_structs)

    def tangent(*ops: Any) -> tuple[Any, ...]:
        return tuple(plan.reference_jvp(list(ops[:n]), mask, list(ops[n:])))

    return list(_vmapped(tangent, vmaps)(*operands))


def _tangent_abstract_eval(*avals: Any, plan: _Plan, mask: tuple[int, ...], vmaps: Any) -> list[Any]:
    """ẏ has the differentiable outputs' shapes and dtypes, behind the batch axes (outermost first)."""
    batch = tuple(size for _, size in reversed(vmaps))
    return [ShapedArray(batch + tuple(s.shape), s.dtype) for s in plan.out_structs[: plan.n_diff]]


def _tangent_jvp(primals: Any, tangents: Any, *, plan: _Plan, mask: tuple[int, ...], vmaps: Any) -> Any:
    """d(J ẋ) = J dẋ + (dJ) ẋ: the first term is the primitive again (linear in dẋ, so a later reverse
    pass still reaches the backward kernels), the second JAX's derivative of the reference's JVP."""
    n = len(plan.leaf_structs)
    params = {"plan": plan, "mask": mask, "vmaps": vmaps}
    out = _tangent_p.bind(*primals, **params)
    leaves, dots = list(primals[:n]), list(primals[n:])
    terms = []
    if any(type(d) is not ad.Zero for d in tangents[n:]):
        terms.append(_tangent_p.bind(*leaves, *(ad.instantiate_zeros(d) for d in tangents[n:]), **params))
    moving = [k for k, d in enumerate(tangents[:n]) if type(d) is not ad.Zero and d.dtype != jax.dtypes.float0]
    if moving:
        def along(*moved: Any) -> tuple[Any, ...]:
            full = list(leaves)
            for k, value in zip(moving, moved):
                full[k] = value
            return tuple(_tangent_impl(*full, *dots, **params))

        terms.append(jax.jvp(along, tuple(leaves[k] for k in moving), tuple(tangents[k] for k in moving))[1])
    if not terms:
        return out, [jnp.zeros_like(o) for o in out]
    return out, [sum(parts[1:], parts[0]) for parts in zip(*terms)]


def _tangent_transpose(cts: Any, *operands: Any, plan: _Plan, mask: tuple[int, ...], vmaps: Any) -> list[Any]:
    """ẋ̄ = Jᵀ ẏ̄ by ``_kernel_vjp`` (the route's backward), under the same batch axes."""
    n = len(plan.leaf_structs)
    leaves = operands[:n]
    if any(ad.is_undefined_primal(v) for v in leaves):  # pragma: no cover - JAX transposes linear inputs only
        raise ValueError(f"{plan.op}: the tangent is linear in the tangents only, not in the primal inputs")
    cts = [ad.instantiate_zeros(ct) for ct in cts]

    def pullback(*ops: Any) -> tuple[Any, ...]:
        return _kernel_vjp(plan, mask, tuple(ops[:n]), tuple(ops[n:]))

    vmaps_t = tuple((tuple(axes[:n]) + (0,) * len(cts), size) for axes, size in vmaps)
    grads = _vmapped(pullback, vmaps_t)(*leaves, *cts)
    return [None] * n + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, operands[n:])]


def _tangent_batch(args: Any, dims: Any, *, plan: _Plan, mask: tuple[int, ...], vmaps: Any) -> Any:
    """vmap: the batch axis of every batched operand to the front, the tangents all batched (so the
    transpose's gradients are too), the axes recorded as a new innermost-last ``vmaps`` entry."""
    n = len(plan.leaf_structs)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved, axes = [], []
    for i, (a, d) in enumerate(zip(args, dims)):
        if d is None and i < n:
            moved.append(a)
            axes.append(None)
        else:
            moved.append(jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0))
            axes.append(0)
    out = _tangent_p.bind(*moved, plan=plan, mask=mask, vmaps=(*vmaps, (tuple(axes), size)))
    return out, [0] * len(out)


_tangent_p.def_impl(_tangent_impl)
_tangent_p.def_abstract_eval(_tangent_abstract_eval)
ad.primitive_jvps[_tangent_p] = _tangent_jvp
ad.primitive_transposes[_tangent_p] = _tangent_transpose
batching.primitive_batchers[_tangent_p] = _tangent_batch
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=True))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel_vjp(plan: _Plan, mask: tuple[int, ...], leaves: tuple[Any, ...], cts: tuple[Any, ...]) -> tuple[Any, ...]:
    """x̄ = Jᵀ ȳ for the leaves in ``mask`` by the route's backward (see :meth:`_Plan.kernel_vjp`)."""
    return tuple(plan.kernel_vjp(list(leaves), mask, list(cts)))


@_kernel_vjp.defjvp
def _kernel_vjp_jvp(plan: _Plan, mask: tuple[int, ...], primals: Any, tangents: Any) -> Any:
    """The derivative of Jᵀ ȳ (in the inputs and in ȳ): JAX's forward mode through the reference's VJP."""
    leaves, cts = primals
    out = _kernel_vjp(plan, mask, leaves, cts)
    _, tangent = jax.jvp(lambda ls, cs: tuple(plan.reference_vjp(list(ls), mask, list(cs))), primals, tangents)
    return out, tangent


def _zero_tangent(value: Any) -> Any:
    """The zero tangent of an output (``float0`` for an integer one, as JAX requires)."""
    if jnp.issubdtype(value.dtype, jnp.inexact):
        return jnp.zeros_like(value)
    return np.zeros(value.shape, dtype=jax.dtypes.float0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _apply(plan: _Plan, leaves: list[Any]) -> tuple[Any, ...]:
    return plan.forward(leaves)


def _apply_jvp(plan: _Plan, primals: Any, tangents: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The route's forward, and ẏ = J ẋ for the perturbed leaves (zero for the other outputs)."""
    (leaves,), (dots,) = primals, tangents
    perturbed: dict[str, bool] = {}
    moving = []
    for k, (field_name, d) in enumerate(zip(plan.leaf_fields, dots)):
        here = not isinstance(d, SymbolicZero) and d.dtype != jax.dtypes.float0
        perturbed[field_name] = perturbed.get(field_name, False) or here
        if here:
            moving.append(k)
    plan.needs(perturbed)  # a ValueError for an argument without a gradient
    # The op itself, not plan.forward: when an outer derivative differentiates this rule's primal
    # (a Hessian), it must meet this rule again, never the callback, which has no derivative.
    outputs = _apply(plan, leaves)
    diff: list[Any] = []
    if moving:
        diff = _tangent_p.bind(*leaves, *(dots[k] for k in moving), plan=plan, mask=tuple(moving), vmaps=())
    result = []
    for i, o in enumerate(outputs):
        result.append(None if o is None else diff[i] if i < len(diff) else _zero_tangent(o))
    return outputs, tuple(result)


_apply.defjvp(_apply_jvp, symbolic_zeros=True)


# --------------------------------------------------------------------------- calling an op


def _collect(op: str, arrays: dict[str, Any], static: dict[str, Any]) -> tuple[_Plan, list[Any]]:
    """Convert NumPy inputs, validate on stand-ins, choose the route."""
    arrays = {name: _as_jax_tree(value) for name, value in arrays.items()}
    bad = [name for name, value in arrays.items() if not _array_leaves_valid(value)]
    if bad:
        # Not JAX arrays: let portable_nn's own validation name the argument and the problem.
        spec_of(op).prepare(**static, **arrays)
        raise TypeError(f"{op}: {bad[0]} must be a JAX array (or NumPy array)")
    plan = _Plan(op, arrays, static)
    return plan, jax.tree_util.tree_leaves(arrays)


def _run(op: str, arrays: dict[str, Any], static: dict[str, Any]) -> Any:
    plan, leaves = _collect(op, arrays, static)
    return _finish(plan, _apply(plan, leaves), leaves)


def _finish(plan: _Plan, outputs: tuple[Any, ...], leaves: list[Any]) -> Any:
    """The caller's result from the implementation's outputs (as the portable_nn op returns it)."""
    # Outputs past the differentiable ones (new running statistics) carry no gradient.
    outputs = tuple(o if i < plan.n_diff or o is None else jax.lax.stop_gradient(o) for i, o in enumerate(outputs))
    result = plan.prepared.finish(outputs, plan.prepared.call)
    # finish() returns the running statistics themselves when it did not update them: give back
    # the caller's arrays, not the NumPy stand-ins validation saw.
    originals = {id(s): v for s, v in zip(plan.standins, leaves)}
    return _replace_standins(result, originals)


def _replace_standins(value: Any, originals: Mapping[int, Any]) -> Any:
    if isinstance(value, tuple):
        return tuple(_replace_standins(v, originals) for v in value)
    if isinstance(value, np.ndarray) and id(value) in originals:
        return originals[id(value)]
    return value


def explain(op: Any, *args: Any, **kwargs: Any) -> Route:
    """The :class:`Route` a call of a ``portable_nn.jax`` op would take (nothing is computed).

    ``op`` is a ``portable_nn.jax`` function, a ``portable_nn`` op or the op's
    name; the arguments are validated as the call would.
    """
    name = getattr(op, "_pnj_op", None) or spec_of(op).name
    fn = _OPS[name]
    captured: list[_Plan] = []
    fn(*args, _capture=captured, **kwargs)
    return captured[0][0].route


def reference_autodiff(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The call's result from the reference traced with ``jax.numpy``, *without* the custom derivatives.

    JAX differentiates this version itself, through the reference forward, so
    its gradients are an independent check of portable_nn's hand-written
    backward (the tests compare the two).  Slower than the op; not for models.
    """
    name = getattr(op, "_pnj_op", None) or spec_of(op).name
    captured: list[tuple[_Plan, list[Any]]] = []
    _OPS[name](*args, _capture=captured, **kwargs)
    plan, leaves = captured[0]
    outputs = plan._traced_forward(leaves, save=False)[0]
    return _finish(plan, outputs, leaves)


_OPS: dict[str, Callable[..., Any]] = {}


def register_op(name: str, fn: Callable[..., Any]) -> None:
    """Register how to plan a call of op ``name`` without running it: ``fn(*args, _capture=list, **kwargs)``
    appends ``(plan, leaves)`` (for :func:`explain` and :func:`reference_autodiff`)."""
    _OPS[name] = fn


def run_op(op: str, arrays: dict[str, Any], static: dict[str, Any], capture: list | None = None) -> Any:
    """Run a call of ``op`` split into traced ``arrays`` and ``static`` arguments; with ``capture``,
    only validate and plan it, appending ``(plan, leaves)`` (for :func:`explain`)."""
    if capture is not None:
        capture.append(_collect(op, arrays, static))
        return None
    return _run(op, arrays, static)
