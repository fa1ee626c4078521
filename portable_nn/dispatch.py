"""Registry of implementations and the selection of one per call.

Every public op validates its arguments in :mod:`portable_nn.api` and then
hands a :class:`Call` to :func:`run`.  A :class:`Call` carries the normalised
arguments plus the facts dispatch selects on: the array family (``numpy``,
``torch``, ``cupy``, ``jax``, ``array_api_strict`` …), the device, the dtype
and the data layout.

Each implementation declares what it can take in a :class:`Support`; dispatch
checks that declaration (kernel bodies never re-check) and either

* runs the backend the configuration forces, or raises
  :class:`~portable_nn.errors.BackendUnavailableError` saying why it cannot, or
* under ``auto``, runs the highest-priority implementation that accepts the
  call, ending with the array-API reference, which accepts everything.

Kernels that work on NumPy arrays declare ``native="numpy"``; dispatch then
hands them zero-copy NumPy views of CPU torch tensors and wraps their results
back into tensors, so torch users get the CPU kernels without a copy.  GPU
kernels declare ``native="cupy"`` and get zero-copy CuPy views of CUDA torch
tensors, run on torch's current stream (:class:`~portable_nn.bridge.Bridge`).  What a call would run,
and why, is :func:`portable_nn.explain` (:mod:`portable_nn.introspection`).

A call may carry input maps (:class:`InputMap`): linear maps of an argument (conv's padding
modes) that :func:`run` applies before the implementation, whichever it is, and whose adjoints
take that argument's gradient back, so implementations never see them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import _arrays, backends, config, preference
from .backends import BackendStatus
from .bridge import Bridge, NoGrad
from .errors import BackendUnavailableError, FallbackWarning

__all__ = [
    "BackendStatus",
    "Call",
    "Implementation",
    "InputMap",
    "Support",
    "available_backends",
    "backend_names",
    "op_names",
    "register_kernel",
]

#: Every op that goes through dispatch, by name -> its op family (the ``portable_nn.api`` module that
#: declares it: ``"norm"``, ``"rnn"`` …).  Filled by the api's ``@public_op`` (:func:`declare_op`), in
#: the order the api declares them; nothing else lists ops.
_OPS: dict[str, str] = {}


def declare_op(name: str, family: str) -> None:
    """Make ``name`` a dispatched op of ``family`` (called by ``portable_nn.api``'s ``@public_op``)."""
    _OPS[name] = family


# --------------------------------------------------------------------------- calls


class Call:
    """One validated call of an op, as implementations receive it.

    Built by the public op after validation (kernels never re-check arguments);
    :func:`register_kernel` describes what each op puts in ``arrays`` and
    ``params``.

    Attributes:
        op: the op name (``"layer_norm"`` …).
        xp: the array-API namespace of the arrays (for a kernel bridged with
            ``Support.native``, its native library's namespace).
        family: the array library (``"numpy"``, ``"torch"``, ``"cupy"`` …; the
            native library for a bridged kernel).
        device: normalised device string (``"cpu"``, ``"cuda:0"`` …).
        dtype: array-API name of the main input's dtype (``"float32"`` …).
        layout: ``"channels_first"``, ``"channels_last"``, ``"channels_other"``
            (a norm's channel axis elsewhere), or ``None`` where the op has no
            channel axis.
        arrays: the array arguments by name (``None`` where not given).
        params: every other (normalised) argument by name.
        save: whether the forward must return residuals for a backward pass.
        needs: when ``save`` is true, the gradient names the backward may be asked
            for (``vjp``'s ``wrt``, e.g. ``frozenset({"weight", "bias"})``), or
            ``None`` when not known (then any gradient of a given argument may be
            asked for).  A forward may use it to keep less, e.g. record autograd
            history only for these arguments.
        input_maps: :class:`InputMap` by array name: linear maps :func:`run` applies to
            those arrays before the implementation runs (``params`` describe the
            mapped arrays); empty in every call an implementation receives.

    Arguments are also readable as attributes: ``call.x``, ``call.eps``
    (arrays first, then params; ``AttributeError`` for other names).
    """

    #: The call's own attributes; an argument of the same name is read from ``arrays``/``params``.
    CORE = ("op", "xp", "family", "device", "dtype", "layout", "arrays", "params", "save", "needs", "input_maps")

    def __init__(
        self,
        op: str,
        arrays: Mapping[str, Any],
        params: Mapping[str, Any] | None = None,
        *,
        xp: Any,
        family: str,
        device: str,
        dtype: str,
        layout: str | None = None,
        save: bool = False,
        needs: frozenset[str] | None = None,
        input_maps: Mapping[str, InputMap] | None = None,
    ) -> None:
        arrays = dict(arrays)
        params = dict(params or {})
        # Arguments are plain instance attributes (arrays over params, the call's own attributes over
        # both), not looked up through __getattr__: a kernel reads a dozen of them per call, and a
        # failed normal lookup before __getattr__ cost ~0.5 us each (a tenth of a small layer_norm).
        attributes = self.__dict__
        attributes.update(params)
        attributes.update(arrays)
        attributes.update(op=op, xp=xp, family=family, device=device, dtype=dtype, layout=layout, arrays=arrays,
                          params=params, save=save, needs=needs, input_maps=dict(input_maps or {}))
        for name in _CALL_METHODS.intersection(attributes):  # an argument never hides a method
            del attributes[name]

    def __getattr__(self, name: str) -> Any:
        # Reached only for names that are neither attributes nor arguments.
        op = self.__dict__.get("op", "an op")
        raise AttributeError(f"{op} call has no argument {name!r}")

    def replace(self, **changes: Any) -> Call:
        """A copy with some attributes replaced.

        Args:
            **changes: new values by attribute name (``arrays=``, ``params=``,
                ``xp=``, ``family=``, ``device=``, ``dtype=``, ``layout=``, ``save=``,
                ``needs=``, ``input_maps=``).

        Returns:
            A new :class:`Call` for the same op; this one is unchanged.
        """
        attributes = self.__dict__
        fields = {name: attributes[name] for name in self.CORE if name != "op"}
        fields.update(changes)
        arrays = fields.pop("arrays")
        params = fields.pop("params")
        return Call(self.op, arrays, params, **fields)

    def derive(self, arrays: dict[str, Any], changes: Mapping[str, Any]) -> Call:
        """A copy with ``arrays`` (a new dict, same names) and some core attributes replaced (as
        :meth:`replace`, without re-copying the parameters: the dispatch fast path's form)."""
        new = Call.__new__(Call)
        attributes = new.__dict__
        attributes.update(self.__dict__)
        attributes.update(arrays)
        attributes.update(changes)
        attributes["arrays"] = arrays
        return new

    @classmethod
    def assemble(cls, template: Mapping[str, Any], arrays: dict[str, Any]) -> Call:
        """The call of a signature whose every other attribute is ``template`` (the ``__dict__`` of
        an earlier call of the same signature without its arrays), with ``arrays``: how the plan
        cache builds a call without validating it again (:mod:`portable_nn.plans`)."""
        new = cls.__new__(cls)
        attributes = new.__dict__
        attributes.update(template)
        attributes.update(arrays)
        attributes["arrays"] = arrays
        return new

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.arrays.items() if v is not None}
        return (
            f"Call({self.op}, family={self.family}, device={self.device}, dtype={self.dtype}, "
            f"layout={self.layout}, shapes={shapes})"
        )

    def mapped(self) -> Call:
        """This call with its :attr:`input_maps` applied: the arrays its implementation receives.

        ``self`` when it has none; otherwise a copy whose mapped arrays are replaced by
        ``map.apply(xp, array)`` and which has no maps left.
        """
        if not self.input_maps:
            return self
        arrays = dict(self.arrays)
        for name, input_map in self.input_maps.items():
            arrays[name] = input_map.apply(self.xp, arrays[name])
        return self.replace(arrays=arrays, input_maps={})


#: What an argument of the same name must not hide on a :class:`Call`.
_CALL_METHODS = frozenset(name for name in vars(Call) if not name.startswith("__"))


class InputMap:
    """A linear map ``A`` applied to one array argument before dispatch, and its adjoint ``Aᵀ``.

    Some calls are a simpler call on a transformed input: a convolution with
    ``padding_mode="reflect"`` is a convolution without padding of ``x`` padded by
    reflection.  Rather than each implementation learning the transform, the op's
    validation declares it on the :class:`Call` (``Call.input_maps``, by array name)
    and describes the mapped array in ``params``; :func:`run` applies it after
    selecting the implementation (on every backend and array library alike, with the
    call's own namespace), and :meth:`Executed.backward` maps that argument's gradient
    back: for the loss ``L``, ``∂L/∂a = Aᵀ (∂L/∂(A a))``.  The map being linear, its
    adjoint needs nothing from the forward.  ``explain`` lists the maps; selection sees
    the call as validated (only the mapped arrays' values and shapes differ, which
    ``params`` already describe).

    Subclasses implement :meth:`apply` and :meth:`adjoint` with array-API functions
    only, functionally (JAX arrays are immutable), and ``__str__`` (for ``explain``).
    """

    def apply(self, xp: Any, a: Any) -> Any:
        """``A a``: the array the implementation receives in place of ``a``."""
        raise NotImplementedError

    def adjoint(self, xp: Any, g: Any) -> Any:
        """``Aᵀ g``, for ``g`` shaped like ``A a``: the gradient with respect to ``a`` itself."""
        raise NotImplementedError


def adjoin_gradients(input_maps: Mapping[str, InputMap], xp: Any, grads: dict[str, Any]) -> dict[str, Any]:
    """``grads`` (by argument name, with respect to the mapped arrays; updated in place and returned)
    with each mapped argument's gradient taken back through its map's adjoint."""
    for name, input_map in input_maps.items():
        if grads.get(name) is not None:
            grads[name] = input_map.adjoint(xp, grads[name])
    return grads


# --------------------------------------------------------------------------- support


@dataclass(frozen=True)
class Support:
    """What an implementation accepts; dispatch checks it before choosing it.

    A call is taken only when every declared rule holds: family, device kind,
    dtype, layout, mixed precision, then the ``check`` predicate.  Kernel bodies
    can therefore rely on the declaration without re-checking.  The same
    declarations build :func:`~portable_nn.capabilities` and the reasons :func:`~portable_nn.explain`
    gives.

    Args:
        families: array libraries accepted, e.g. ``("numpy", "torch")``
            (``None``: any).
        devices: device kinds accepted, ``"cpu"``/``"cuda"`` (``None``: any).
        dtypes: dtype names of the main input accepted, e.g.
            ``("float32", "float64")`` (``None``: any floating).
        layouts: layouts accepted, from ``"channels_first"``, ``"channels_last"``
            and ``"channels_other"`` (``None``: any); ops without a channel axis
            ignore it.
        contiguous: whether the kernel needs C-contiguous arrays; dispatch then
            makes contiguous copies of strided inputs and ``explain`` reports them.
        mixed_precision: whether half-precision ``x`` with float32 parameters is taken.
        check: optional ``check(call) -> str | None`` returning why the call is
            declined (sizes, argument values), or ``None`` to accept.
        native: ``"numpy"`` if the kernel body works on NumPy arrays: CPU torch
            tensors then reach it as zero-copy NumPy views (bfloat16, which NumPy
            lacks, as ``uint16`` bits; a ``uint16`` result of a bfloat16 call
            returns as a bfloat16 tensor); ``"cupy"`` if it works
            on CuPy arrays: CUDA torch tensors reach it as zero-copy CuPy views
            (bfloat16 as ``uint16`` bits when CuPy lacks the type), run on
            torch's current stream, and its results return as tensors.
        description: one line for the capability table (sizes, limits).
    """

    families: tuple[str, ...] | None = None
    devices: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    layouts: tuple[str, ...] | None = None
    contiguous: bool = False
    mixed_precision: bool = True
    check: Callable[[Call], str | None] | None = None
    native: str | None = None
    description: str = ""

    def matches_arrays(self, call: Call) -> str | None:
        """Why the array family or device rules this call out, else ``None``.

        Args:
            call: the validated call.

        Returns:
            A reason such as ``"takes numpy/torch arrays, not cupy"``, or ``None``
            when the family and device kind are accepted.
        """
        if self.families is not None and call.family not in self.families:
            return f"takes {'/'.join(self.families)} arrays, not {call.family}"
        kind = _arrays.device_kind(call.device)
        if self.devices is not None and kind not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not on {call.device}"
        return None

    def declines(self, call: Call) -> str | None:
        """Why this call is outside the declared support (dtype, layout, sizes), else ``None``.

        Args:
            call: the validated call (its family and device already accepted).

        Returns:
            The first failing rule's reason (dtype, mixed precision, layout, then
            the ``check`` predicate's own), or ``None`` to accept.
        """
        if self.dtypes is not None and call.dtype not in self.dtypes:
            return f"supports dtypes {', '.join(self.dtypes)}, not {call.dtype}"
        if not self.mixed_precision and call.params.get("mixed_precision"):
            return "does not support half-precision input with float32 parameters"
        if self.layouts is not None and call.layout is not None and call.layout not in self.layouts:
            return f"supports layouts {', '.join(self.layouts)}, not {call.layout}"
        if self.check is not None:
            return self.check(call)
        return None


# --------------------------------------------------------------------------- implementations


def _resolve(target: Any) -> Callable[..., Any]:
    """A function, or ``"module:attr"`` imported on first use."""
    if callable(target):
        return target
    module, _, attr = str(target).partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass
class Implementation:
    """One implementation of one op on one backend.

    ``forward(call) -> (outputs, residuals)`` where ``outputs`` is a tuple of
    arrays; ``backward(residuals, cotangents, needs, out) -> {name: gradient}``
    where ``cotangents`` has one array per differentiable output, ``needs`` is the
    set of gradient names wanted and ``out`` maps names to preallocated buffers
    the backward may write into (it may also ignore them).  Forward and backward
    may be given as ``"module:function"`` strings, imported on first use.
    """

    op: str
    backend: str
    forward: Any
    backward: Any = None
    supports: Support = field(default_factory=Support)
    priority: float = 0
    origin: str = "builtin"
    scope: Any = None
    #: ``plan(call) -> forward``: the forward specialised to ``call``'s signature (shapes, dtypes,
    #: parameters: what a kernel wrapper decides before its kernels run), holding no array; the same
    #: results as ``forward``.  Optional: dispatch's :class:`Route` binds it on its first call.
    plan: Any = None

    def forward_fn(self) -> Callable[..., Any]:
        resolved = self.__dict__.get("_forward_resolved")
        if resolved is None:
            resolved = self.__dict__["_forward_resolved"] = _resolve(self.forward)
        return resolved

    def plan_fn(self) -> Callable[..., Any] | None:
        if self.plan is None:
            return None
        resolved = self.__dict__.get("_plan_resolved")
        if resolved is None:
            resolved = self.__dict__["_plan_resolved"] = _resolve(self.plan)
        return resolved

    def backward_fn(self) -> Callable[..., Any] | None:
        if self.backward is None:
            return None
        resolved = self.__dict__.get("_backward_resolved")
        if resolved is None:
            fn = _resolve(self.backward)
            resolved = self.__dict__["_backward_resolved"] = fn if _accepts_out(fn) else _without_out(fn)
        return resolved

    def runtime_scope(self) -> Any:
        """The context its backend's runtime wants around each forward and backward (or a null one).

        The numba backend limits BLAS threads for the duration of a call (``kernels_cpu._runtime``).
        """
        if self.scope is None:
            return contextlib.nullcontext()
        resolved = self.__dict__.get("_scope_resolved")
        if resolved is None:
            resolved = self.__dict__["_scope_resolved"] = _resolve(self.scope)
        return resolved()


def _accepts_out(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins, C callables
        return False
    return "out" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _without_out(fn: Callable[..., Any]) -> Callable[..., Any]:
    def backward(residuals: Any, cotangents: Any, needs: Any, out: Any = None) -> Any:
        return fn(residuals, cotangents, needs)

    return backward


_registry: dict[str, list[Implementation]] = {}
_registry_lock = threading.RLock()
_providers_loaded = False
_extra_backends: dict[str, str] = {}


def _load_providers() -> None:
    """Declare every op (the api) and load every backend package (:mod:`portable_nn.backends`), once."""
    global _providers_loaded
    if _providers_loaded:
        return
    with _registry_lock:
        if _providers_loaded:
            return
        _providers_loaded = True
        importlib.import_module("portable_nn.api")
        backends.load()


def _add(impl: Implementation) -> None:
    with _registry_lock:
        impls = [i for i in _registry.get(impl.op, []) if i.backend != impl.backend]
        impls.append(impl)
        _registry[impl.op] = impls
        _forget_choices()


def register_builtin(
    op: str,
    backend: str,
    *,
    forward: Any,
    backward: Any = None,
    supports: Support | None = None,
    priority: float = 0,
    scope: Any = None,
    plan: Any = None,
) -> None:
    """Declare a built-in implementation (used by the reference and kernel packages).

    ``scope`` (a callable or ``"module:function"``) returns the context manager entered around
    every forward and backward of the implementation: its runtime's per-call arrangement.
    ``plan`` (a callable or ``"module:function"``, optional) binds the forward to a call's signature
    (:attr:`Implementation.plan`).
    """
    if op not in op_names():
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(op_names())}")
    _add(Implementation(op, backend, forward, backward, supports or Support(), priority, scope=scope, plan=plan))


def register_kernel(
    op: str,
    backend: str,
    *,
    forward: Callable[..., Any] | str,
    backward: Callable[..., Any] | str | None = None,
    supports: Support | None = None,
    priority: int = 10,
) -> None:
    """Plug a third-party kernel into dispatch without touching the library.

    The kernel then runs wherever its :class:`Support` accepts a call: under
    ``auto`` in ``priority`` order (ahead of the built-in kernels by default),
    or whenever its backend is forced with ``set_backend``/``use_backend``.  It
    appears in :func:`~portable_nn.capabilities`, :func:`available_backends` and
    :func:`~portable_nn.explain` like a built-in one.

    Args:
        op: the op it implements (``"layer_norm"`` …: any dispatched op, every
            public op but ``merge_moments``).
        backend: a backend name; a new name (``"onednn"``) becomes selectable with
            ``set_backend``/``use_backend`` like the built-in ones.  Registering
            the same ``(op, backend)`` again replaces the earlier kernel.
        forward: ``forward(call) -> (outputs, residuals)``, a function or a
            ``"module:function"`` string imported on first use (see the kernel
            contract below).
        backward: ``backward(residuals, cotangents, needs[, out]) -> {name: grad}``,
            a function or a ``"module:function"`` string; without one, the op is
            forward-only on this backend and ``vjp`` passes it over.
        supports: the :class:`Support` it declares (default: any array).
        priority: order under ``auto``, highest first; built-in kernels use 0-5,
            the reference always comes last.

    Raises:
        ValueError: an unknown op, or a backend name that is empty or ``"auto"``.
        TypeError: a ``forward`` that is neither callable nor a
            ``"module:function"`` string, a ``supports`` that is not a
            :class:`Support`.

    Kernel contract:
        ``forward(call)`` receives a :class:`Call` whose arguments are already
        validated and normalised.  It returns ``(outputs, residuals)``:
        ``outputs`` is a tuple with one array per output of the op, in the
        library of ``call.xp`` — ``(y,)`` for most ops; ``(mean, var)`` for
        ``moments``; ``(y, new_running_mean, new_running_var)`` for
        ``batch_norm`` and ``instance_norm``, ``None`` for the statistics when
        ``call.update_running`` is false (the op then applies or returns them);
        ``(h', c')`` for ``lstm_cell``; ``(outputs, h_n)`` for ``rnn`` and
        ``gru``; ``(outputs, h_n, c_n)`` for ``lstm``.  ``residuals`` is
        anything the backward needs, or ``None`` when ``call.save`` is false.

        ``backward(residuals, cotangents, needs, out)`` receives those residuals,
        one cotangent array per differentiable output (``y`` alone for the
        norms with running statistics; every output of ``moments``,
        ``lstm_cell`` and the sequence ops, zeros where the caller passed
        ``None``), ``needs`` — the frozenset of gradient names wanted (the op's
        ``vjp`` fields, e.g. ``{"x", "weight"}``) — and optionally ``out``, a
        dict of preallocated buffers by name that it may write into and return
        (or ignore; a backward without an ``out`` parameter is called without
        it).  It returns ``{name: gradient}`` for exactly the names in
        ``needs``, each with its argument's shape and dtype; the ``params``
        gradient of ``rnn``/``lstm``/``gru`` is a list of ``(w_ih, w_hh, b_ih,
        b_hh)`` tuples, ``None`` for absent biases.  Both run under
        ``torch.no_grad()`` for torch arrays.

    What a Call carries:
        Every call has ``call.op``, ``call.xp`` (array-API namespace),
        ``call.family`` (``"numpy"``, ``"torch"``, ``"cupy"`` …), ``call.device``
        (``"cpu"``, ``"cuda:0"`` …), ``call.dtype`` (the main input's dtype name),
        ``call.layout`` (``"channels_first"``, ``"channels_last"``,
        ``"channels_other"`` or ``None``), ``call.save`` and ``call.needs`` (with
        ``save``, the gradient names the backward may be asked for, or ``None``
        when not known).  ``call.arrays``
        maps the array arguments by name and ``call.params`` the normalised
        other ones; both read as attributes (``call.x``, ``call.eps``).  Axes are
        non-negative ints, activations :class:`Activation` objects (use
        ``.code`` and ``.slope``), and ``mixed_precision`` is true for
        float16/bfloat16 data with float32 parameters.  Per op family:

        - ``moments``: array ``x``; ``axes``, ``keepdims``, ``correction``.
        - norms (``batch_norm``, ``layer_norm``, ``group_norm``,
          ``instance_norm``, ``rms_norm``): arrays ``x``, ``weight``, ``bias``
          (plus ``running_mean``, ``running_var`` for batch and instance norm);
          ``kind``, ``eps``, ``activation``, ``view_shape`` (the shape ``x`` is
          viewed as: group norm splits C into ``(num_groups, C/num_groups)``),
          ``axes`` (the reduced axes of that view), ``param_shape`` (how
          ``weight``/``bias`` broadcast against the view),
          ``stat_param_shape``, ``use_batch_stats``, ``center`` (false for
          ``rms_norm``), ``update_running``, ``momentum``, ``stats_batch_axis``
          (0 for instance norm: running statistics average over it),
          ``mixed_precision``; ``channel_axis`` for batch, group and instance
          norm; ``num_groups`` for group norm.
        - cells (``rnn_cell``, ``lstm_cell``, ``gru_cell``): arrays ``x``, ``h``
          (and ``c``), ``w_ih``, ``w_hh``, ``b_ih``, ``b_hh``; ``kind``
          (``"rnn"``, ``"lstm"``, ``"gru"``), ``activation`` (rnn_cell; else
          ``None``), ``reset_after``, ``hidden_size``, ``unbatched``,
          ``mixed_precision``.
        - sequences (``rnn``, ``lstm``, ``gru``): arrays ``x``, ``h0`` (and
          ``c0``) and each layer's weights named ``w_ih_l0``, ``w_hh_l0``,
          ``b_ih_l0_reverse`` …; ``kind``, ``activation``, ``reset_after``,
          ``num_layers``, ``num_directions``, ``hidden_size``, ``proj_size``
          (0, or with LSTM projections the size of h: each layer and direction
          then has a fifth array ``w_hr_l0`` …), ``batch_first``,
          ``lengths`` (a tuple of ints, or ``None`` when every sequence is
          full), ``param_names`` (per layer and direction, the four or five
          array names), ``mixed_precision``.
        - ``conv``: arrays ``x``, ``weight``, ``bias``; ``spatial_axes``,
          ``channel_axis``, ``batched``, ``groups``, ``kernel``, ``stride``,
          ``dilation``, ``pad_lo``, ``pad_hi``, ``in_size``, ``out_size`` (per
          spatial axis), ``activation``, ``mixed_precision``.  The padding is
          zeros: with another ``padding_mode``, ``x`` arrives padded (an
          :class:`InputMap`) and ``pad_lo``/``pad_hi`` are 0.
        - ``conv_transpose``: arrays ``x``, ``weight`` (``(C, O/groups, *k)``),
          ``bias``; the fields of the convolution it transposes, named as
          ``conv``'s (``spatial_axes``, ``channel_axis``, ``batched``,
          ``groups``, ``kernel``, ``stride``, ``dilation``, ``pad_lo``,
          ``pad_hi``, ``in_size`` — this op's *output* size —, ``out_size`` —
          its input size), ``output_padding``, ``activation``,
          ``mixed_precision``.
        - ``dense``: arrays ``x``, ``weight``, ``bias``; ``activation``,
          ``in_features``, ``out_features``, ``mixed_precision``.
        - pooling (``max_pool``, ``avg_pool``): array ``x``; ``spatial_axes``,
          ``window``, ``stride``, ``padding``, ``dilation``, ``ceil_mode``,
          ``batched``, ``in_size``, ``out_size``, ``pad_lo``, ``pad_hi`` (the
          high side includes the room ``ceil_mode`` needs); ``max_pool`` adds
          ``return_indices`` (then the outputs are ``(y, indices)``, indices
          int64 flat positions in each spatial plane of ``x``, −1 for a window
          of padding only); ``avg_pool`` adds
          ``count_include_pad``, ``divisor_override`` (``None`` or the divisor,
          already folded into ``divisors``) and ``divisors`` (per axis, the
          divisor of each output position; their product divides).
        - ``max_unpool``: arrays ``x``, ``indices`` (integer, ``x``'s shape, in
          range: the api checked the values); ``spatial_axes``, ``window``,
          ``stride``, ``padding``, ``batched``, ``in_size`` (x's spatial sizes),
          ``out_size``; the last entry of duplicate indices must win, and the
          gradient reaches only the entries written.
        - ``log_softmax``: array ``x``; ``axis``, ``scalar`` (0-d ``x``).
        - ``cross_entropy``: arrays ``logits``, ``target``, ``weight``;
          ``axis``, ``classes``, ``probabilities`` (float targets),
          ``ignore_index``, ``label_smoothing``, ``reduction``, ``positions``
          (the number of loss terms), ``mixed_precision``.
    """
    if op not in op_names():
        raise ValueError(f"register_kernel: unknown op {op!r}; expected one of {', '.join(op_names())}")
    if not isinstance(backend, str) or not backend or backend == "auto":
        raise ValueError("register_kernel: backend must be a non-empty name other than 'auto'")
    if not callable(forward) and not (isinstance(forward, str) and ":" in forward):
        raise TypeError("register_kernel: forward must be callable or 'module:function'")
    if supports is not None and not isinstance(supports, Support):
        raise TypeError("register_kernel: supports must be a portable_nn.Support")
    _load_providers()
    if backend not in backends.declared():
        _extra_backends[backend] = "registered with register_kernel"
    _add(Implementation(op, backend, forward, backward, supports or Support(), priority, "user"))


def unregister_kernel(op: str, backend: str) -> None:
    """Remove an implementation added with :func:`register_kernel`.

    Built-in implementations are never removed.  Once no op has a kernel of
    ``backend`` left, a backend name that register_kernel introduced is no
    longer selectable.  Removing a kernel that is not registered does nothing.

    Args:
        op: the op the kernel was registered for (``"rms_norm"`` …).
        backend: the backend name it was registered under.
    """
    with _registry_lock:
        _registry[op] = [
            i for i in _registry.get(op, []) if not (i.backend == backend and i.origin == "user")
        ]
        _forget_choices()
        if not any(i.backend == backend for impls in _registry.values() for i in impls):
            _extra_backends.pop(backend, None)
            _status_cache.pop(backend, None)


#: op -> its implementations in preference order; cleared whenever the registry changes.
_sorted: dict[str, tuple[Implementation, ...]] = {}
#: Selections that depend only on the call's signature (see select); cleared with _sorted.
_choices: dict[tuple, tuple[Implementation, tuple, tuple, tuple]] = {}


def _forget_choices() -> None:
    _sorted.clear()
    _choices.clear()
    config.bump_generation()  # plans made with the former registry are stale (portable_nn.plans)


def implementations(op: str) -> list[Implementation]:
    """The implementations of ``op``, best first (reference last)."""
    ordered = _sorted.get(op)
    if ordered is None:
        _load_providers()
        with _registry_lock:
            impls = list(_registry.get(op, []))
        ordered = tuple(sorted(impls, key=lambda i: (backends.is_oracle(i.backend), -_effective_priority(i, impls))))
        _sorted[op] = ordered
    return list(ordered)


# --------------------------------------------------------------------------- measured GPU preference
# (stored by portable_nn.preference; here it only reorders the built-in kernels)


def gpu_preference() -> dict[str, str]:
    """``{op: backend}`` measured by ``gpu-check`` (empty: the static order applies)."""
    return preference.load(op_names())


def save_gpu_preference(measured: Mapping[str, str], measured_on: str) -> Path:
    """Store ``{op: backend}`` as the ``auto`` order between GPU backends; returns the file."""
    unknown = [op for op in measured if op not in op_names()]
    if unknown:
        raise ValueError(f"save_gpu_preference: unknown ops {unknown}")
    with _registry_lock:
        path = preference.store(measured, measured_on)
        _forget_choices()
    return path


def _effective_priority(impl: Implementation, impls: list[Implementation]) -> float:
    """A built-in kernel measured fastest for its op ranks just above the other built-in kernels for
    the same arrays (the measurement compares the GPU backends on CuPy arrays), and no higher: a
    kernel of another library that outranks them all (PyTorch's cuDNN convolution and recurrences on
    CUDA tensors) stays ahead."""
    if impl.origin == "builtin" and gpu_preference().get(impl.op) == impl.backend:
        arrays = backend_arrays(impl.backend)
        peers = [i.priority for i in impls if i.origin == "builtin" and backend_arrays(i.backend) == arrays]
        return max(peers) + 0.1
    return impl.priority


def op_names() -> tuple[str, ...]:
    """Names of every dispatched op, in the order the api declares them."""
    if not _OPS:
        importlib.import_module("portable_nn.api")
    return tuple(_OPS)


def op_family(op: str) -> str:
    """The op family (api module name: ``"norm"``, ``"rnn"`` …) that declares ``op``."""
    op_names()
    return _OPS[op]


def backend_names() -> tuple[str, ...]:
    """The declared backends (the reference first, then by priority) and those added with :func:`register_kernel`."""
    _load_providers()
    return (*backends.declared(), *_extra_backends, *backends.load_errors())


def backends_taking(arrays: str) -> tuple[str, ...]:
    """The declared backends whose kernels take ``arrays`` natively (``"numpy"``, ``"cupy"``, ``"torch"``),
    in :func:`backend_names` order: the GPU backends are ``backends_taking("cupy")``."""
    _load_providers()
    return backends.native_backends(arrays)


def backend_arrays(name: str) -> str:
    """The array library ``name``'s kernels take natively (its ``Backend.arrays``; ``"any"`` for the
    reference and for backends added with :func:`register_kernel`)."""
    _load_providers()
    declared = backends.declared().get(name)
    return "any" if declared is None else declared.arrays


# --------------------------------------------------------------------------- availability


_status_cache: dict[str, BackendStatus] = {}


def _probe(name: str) -> BackendStatus:
    declared = backends.declared().get(name)
    if declared is not None:
        try:
            available, reason = declared.probe()
        except Exception as exc:  # a probe must not take dispatch down: report it
            available, reason = False, f"its availability probe failed: {type(exc).__name__}: {exc}"
        return BackendStatus(name, available, reason + (_none_declared(name) if available else ""))
    failed = backends.load_errors().get(name)
    if failed is not None:
        return BackendStatus(name, False, failed)
    if name in _extra_backends:
        return BackendStatus(name, True, _extra_backends[name])
    return BackendStatus(name, False, "unknown backend")


def _none_declared(backend: str) -> str:
    with _registry_lock:
        declared = any(i.backend == backend for impls in _registry.values() for i in impls)
    return "" if declared else " (no kernels declared yet: every op runs on the reference)"


def backend_status(name: str) -> BackendStatus:
    """Availability of one backend (probed once, then cached).

    Args:
        name: a backend name.

    Returns:
        Its :class:`BackendStatus`; an unknown name is reported unavailable.
    """
    status = _status_cache.get(name)
    if status is None:
        _load_providers()
        status = _status_cache[name] = _probe(name)
    return status


def available_backends() -> dict[str, BackendStatus]:
    """Every backend, built-in or registered, and whether it can run here.

    ``pnn.available_backends()["numba"].reason`` says why a backend is missing:
    package not installed, no GPU driver, no device.  Each backend is probed
    once (looking its package up, asking for a GPU) and the answer cached;
    probing ``numba`` and ``aten`` imports neither numba nor torch.

    Returns:
        A dict from backend name (``"reference"``, ``"numba"``,
        ``"numba_cuda"``, ``"cupy"``, ``"aten"``, then names added with
        :func:`register_kernel`) to its :class:`BackendStatus`, truthy when
        available.
    """
    return {name: backend_status(name) for name in backend_names()}


# --------------------------------------------------------------------------- selection


@dataclass
class Selection:
    """The outcome of choosing an implementation for one call."""

    impl: Implementation
    requested: str
    source: str
    copies: list[str]
    passed_over: list[tuple[str, str]]
    fallback: bool
    #: the kernels for these arrays that declined the call (what ``set_fallback`` reports)
    declined: tuple[tuple[str, str], ...] = ()


def _copies_needed(impl: Implementation, call: Call) -> list[str]:
    if not impl.supports.contiguous:
        return []
    # A mapped array is replaced by the map's result before it runs (see run: checked then).
    return [
        name
        for name, value in call.arrays.items()
        if value is not None and name not in call.input_maps and not _arrays.is_c_contiguous(value)
    ]


def _candidate_reason(impl: Implementation, call: Call, need_backward: bool) -> tuple[str | None, bool]:
    """(why ``impl`` cannot take ``call`` or None, whether it targets these arrays)."""
    reason = impl.supports.matches_arrays(call)
    if reason is not None:
        return reason, False
    status = backend_status(impl.backend)
    if not status:
        return f"backend unavailable: {status.reason}", False
    reason = impl.supports.declines(call)
    if reason is None and need_backward and impl.backward is None:
        reason = "has no backward (gradient) kernel"
    return reason, True


def select(call: Call, need_backward: bool = False, report: bool = True) -> Selection:
    """Choose the implementation for ``call`` under the current configuration.

    ``report=False`` skips the warning/error of ``set_fallback`` (for ``explain``).  A choice is
    remembered by the call's signature (op, requested backend, family, device, dtype, layout,
    mixed precision, backward needed), so hot loops of small calls do not re-run the candidate
    checks; only the ``Support.check`` predicates it consulted (which may read argument values)
    are asked again, and a different answer makes the full choice again.

    Arrays made of chunks of another library's arrays (Dask's) first go to their family's chunked
    route (:func:`_chunked_route`): it runs the op chunk by chunk through the selected kernels, or
    declines (under ``auto`` the whole array then takes the selection below, reported as a
    fallback), or leaves the call alone (the reference forced).
    """
    route_declined: tuple[str, str] | None = None
    route = _chunked_route(call)
    if route is not None:
        routed = route.select(call, need_backward)
        if isinstance(routed, Selection):
            return routed
        route_declined = routed
    requested, source = config.get_backend(call.op)
    key = (call.op, requested, call.family, call.device, call.dtype, call.layout,
           bool(call.params.get("mixed_precision")), need_backward)
    # A declined route's reason is this call's own (its chunks, its dtype): such choices are not remembered.
    known = _choices.get(key) if route_declined is None else None
    if known is not None:
        impl, passed, declined, rechecked = known
        if all(_candidate_reason(i, call, need_backward)[0] == reason for i, reason in rechecked):
            if declined and report:
                _report_fallback(call, impl, list(declined))
            return Selection(impl, requested, source, _copies_needed(impl, call), list(passed), bool(declined),
                             tuple(declined))
    impls = implementations(call.op)
    if requested != "auto":
        selection = _select_forced(call, impls, requested, source, need_backward)
        if route_declined is None:
            _choices[key] = (selection.impl, (), (), _value_checks([selection.impl], [None]))
        return selection
    passed: list[tuple[str, str]] = [route_declined] if route_declined else []
    declined: list[tuple[str, str]] = list(passed)  # kernels made for these arrays that refused the call
    reasons: list[str | None] = []
    for k, impl in enumerate(impls):
        reason, targeted = _candidate_reason(impl, call, need_backward)
        reasons.append(reason)
        if reason is None:
            if declined and report:
                _report_fallback(call, impl, declined)
            if route_declined is None:
                _choices[key] = (impl, tuple(passed), tuple(declined), _value_checks(impls[: k + 1], reasons))
            return Selection(impl, requested, source, _copies_needed(impl, call), passed, bool(declined),
                             tuple(declined))
        if route_declined is None or impl.backend != route_declined[0]:  # the route said more about it
            passed.append((impl.backend, reason))
        if targeted:
            declined.append((impl.backend, reason))
    raise BackendUnavailableError(  # pragma: no cover - the reference accepts every call
        f"no implementation of {call.op} accepts {call!r}"
    )


def _value_checks(considered: Sequence[Implementation], reasons: Sequence[str | None]) -> tuple:
    """What a remembered choice must re-ask of a later call of the same signature: each considered
    implementation with a ``Support.check`` predicate (whose answer depends on argument values, as
    cross_entropy's ignore_index does) and the reason it gave, ``None`` for the one chosen.  Every
    other rule depends on the signature alone, so the choice stands when these answers repeat."""
    return tuple((impl, reason) for impl, reason in zip(considered, reasons) if impl.supports.check is not None)


def _chunked_route(call: Call) -> Any:
    """The chunked route of ``call``'s array family when it routes ``call.op``, else ``None``.

    A route (``_arrays.CHUNKED_ROUTES``: family -> ``"module:attr"``, imported on first use, when
    the caller already holds such arrays) has ``ops``, the op names it routes, and
    ``select(call, need_backward)`` returning a :class:`Selection` (the route runs), a
    ``(backend, reason)`` pair (it declines under ``auto``: the ordinary selection follows, with
    this entry passed over as a fallback) or ``None`` (not its call: the reference was forced).
    A forced backend the route cannot run raises :class:`BackendUnavailableError` there.
    """
    target = _arrays.CHUNKED_ROUTES.get(call.family)
    if target is None:
        return None
    route = _resolve(target)
    return route if call.op in route.ops else None


def _select_forced(
    call: Call, impls: list[Implementation], requested: str, source: str, need_backward: bool
) -> Selection:
    status = backend_status(requested)
    where = f"backend {requested!r} (set by {source})"
    if not status:
        raise BackendUnavailableError(f"{call.op}: {where} is not available: {status.reason}")
    chosen = [i for i in impls if i.backend == requested]
    if not chosen:
        raise BackendUnavailableError(f"{call.op}: {where} has no implementation of {call.op}")
    impl = chosen[0]
    reason, _ = _candidate_reason(impl, call, need_backward)
    if reason is not None:
        raise BackendUnavailableError(
            f"{call.op}: {where} cannot run this call: it {reason} "
            f"({_arrays.describe_family(call.family)} on {call.device}, dtype {call.dtype}"
            f"{', layout ' + call.layout if call.layout else ''})"
        )
    return Selection(impl, requested, source, _copies_needed(impl, call), [], False)


def _report_fallback(call: Call, impl: Implementation, declined: list[tuple[str, str]], stacklevel: int = 4) -> None:
    """Warn or raise (``set_fallback``) naming the kernels for these arrays that declined the call."""
    mode = config.get_fallback()
    if mode == "allow":
        return
    why = "; ".join(f"{backend} {reason}" for backend, reason in declined)
    message = f"{call.op}: falling back to the {impl.backend} implementation because {why}"
    if mode == "error":
        raise BackendUnavailableError(message + " (set_fallback('error') is in force)")
    warnings.warn(message, FallbackWarning, stacklevel=stacklevel)


# --------------------------------------------------------------------------- running


class Executed:
    """A forward that ran: its outputs and what a backward needs (with the call's input maps
    and namespace, to take the mapped arguments' gradients back)."""

    __slots__ = ("__weakref__", "_inward", "_outward", "bridge", "family", "impl", "input_maps", "outputs", "residuals",
                 "xp")

    def __init__(self, outputs: tuple[Any, ...], residuals: Any, impl: Implementation, bridge: Bridge, family: str,
                 input_maps: Mapping[str, InputMap] | None = None, xp: Any = None,
                 converters: tuple[Any, Any] | None = None) -> None:
        self.outputs = outputs
        self.residuals = residuals
        self.impl = impl
        self.bridge = bridge
        self.family = family
        self.input_maps = {} if input_maps is None else input_maps
        self.xp = xp
        # The bridge's one-array forms (see Bridge.array_inward), when the caller has them made.
        self._inward, self._outward = converters or (bridge.array_inward(), bridge.array_outward())

    def take_outputs(self) -> tuple[Any, ...]:
        """The outputs, forgotten here: a backward kept for later then does not keep them alive
        (their memory goes when the caller drops them, as a framework's own op would let it)."""
        outputs, self.outputs = self.outputs, ()
        return outputs

    def backward(self, cotangents: tuple[Any, ...], needs: frozenset[str], out: Mapping[str, Any]) -> dict:
        fn = self.impl.backward_fn()
        if fn is None:  # pragma: no cover - select() rules this out for vjp
            raise BackendUnavailableError(f"{self.impl.backend} has no backward for {self.impl.op}")
        bridge = self.bridge
        if bridge.active:
            inward = self._inward
            cotangents = tuple([inward(c) for c in cotangents])
        # A mapped argument's buffer has its own shape, not the mapped array's: vjp fills it afterwards.
        buffers = {k: bridge.inward(v) for k, v in out.items() if v is not None and k not in self.input_maps} \
            if out else {}
        if (self.family == "torch" and not bridge.active) or bridge.has_context or self.impl.scope is not None:
            with NoGrad(self.family), bridge.context(), self.impl.runtime_scope():
                grads = fn(self.residuals, cotangents, needs, buffers)
        else:  # NumPy arrays (a torch call's, bridged) on a kernel without a runtime scope: no context to enter
            grads = fn(self.residuals, cotangents, needs, buffers)
        if bridge.active:
            outward, general = self._outward, bridge.outward
            grads = {k: outward(v) if v is None or type(v) is np.ndarray else general(v) for k, v in grads.items()}
        if not self.input_maps:
            return grads
        with NoGrad(self.family):
            return adjoin_gradients(self.input_maps, self.xp, grads)


class Route:
    """How every call of one signature runs: the implementation :func:`select` chose, the bridge
    to its native arrays, the contiguous copies, and what the forward keeps for a backward.

    Made once per signature by :func:`route`; :func:`run` is ``route(call, ...).run(call)``, and the
    plan cache (:mod:`portable_nn.plans`) keeps the route of each signature it has seen, so that a
    repeated call runs exactly the code the first one ran, without choosing again.  Everything a
    route holds depends on the signature only (no array, no value): the arrays of each call are
    bridged, copied and handed to the implementation afresh.

    Attributes:
        selection: the :class:`Selection` (implementation, request, passed-over candidates).
        impl: the implementation that runs.
        bridge: the zero-copy bridge between the caller's arrays and the implementation's.
        copies: names of the arrays made C-contiguous first (their signature is not).
        save: whether the forward keeps residuals for a backward.
        needs: with ``save``, the gradient names the backward may be asked for (``None``: any).
        recorded: whether the forward runs in the caller's grad mode (torch's autograd records it).
    """

    __slots__ = (
        "_bind",
        "_changes",
        "_direct",
        "_fn",
        "_inward",
        "_no_grad",
        "_outward",
        "_plain",
        "_scoped",
        "bridge",
        "copies",
        "impl",
        "needs",
        "rechecked",
        "recorded",
        "save",
        "selection",
    )

    def __init__(self, selection: Selection, call: Call, need_backward: bool = False,
                 needs: frozenset[str] | None = None, recorded: bool = False) -> None:
        impl = selection.impl
        self.selection = selection
        self.impl = impl
        self.bridge = bridge = Bridge(call.family, impl.supports.native, call.device, call.dtype)
        self.copies = tuple(selection.copies)
        self.save = need_backward
        self.needs = needs if need_backward else None
        self.recorded = recorded
        self._fn = impl.forward_fn()
        self._bind = impl.plan_fn()  # bound to the signature on the first forward (it needs the bridged call)
        self.rechecked = _user_checks(call, selection, need_backward)
        # An implementation bridged to NumPy or CuPy views runs no torch op: there is no autograd to
        # keep out (torch.no_grad() cost ~1 us of a small call), and nothing to record.
        self._no_grad = call.family == "torch" and not bridge.active and not recorded
        self._scoped = impl.scope is not None or bridge.has_context
        self._inward, self._outward = bridge.array_inward(), bridge.array_outward()
        changes: dict[str, Any] = {"save": self.save, "needs": self.needs}
        if bridge.active:
            changes.update(xp=bridge.native_namespace(), family=bridge.native)
        self._changes = changes
        # The implementation may take the caller's own call when nothing is to be copied or bridged
        # (and the call already says what the forward keeps: a plan's calls do, see Plan).
        self._direct = not self.copies and not bridge.active
        # ... and, with no context to enter, _forward calls it straight away once it is bound (a
        # small call's commonest case).
        self._plain = self._direct and not self._no_grad and not self._scoped and not call.input_maps

    def _inner(self, call: Call, copies: Sequence[str]) -> Call:
        """The call as the implementation gets it: copies made, arrays bridged, ``save``/``needs`` set."""
        if self._direct and not copies and call.save is self.save and call.needs == self.needs:
            return call
        arrays = call.arrays
        if copies:
            arrays = dict(arrays)
            for name in copies:
                arrays[name] = _arrays.ascontiguous(arrays[name])
        if self.bridge.active:
            inward = self._inward
            arrays = {k: inward(v) for k, v in arrays.items()}
        return call.derive(arrays, self._changes)

    def holds_for(self, call: Call) -> bool:
        """Whether this route is still the choice for ``call``: every ``Support.check`` predicate of a
        kernel added with :func:`register_kernel` that the choice consulted answers as it did
        (such a predicate may read argument values; the built-in ones read only the signature)."""
        need_backward = self.save
        return all(_candidate_reason(impl, call, need_backward)[0] == reason for impl, reason in self.rechecked)

    def report_fallback(self, call: Call) -> None:
        """Warn or raise as ``set_fallback`` says when kernels for these arrays declined the call (as
        :func:`select` did for the first call of the signature; the plan cache calls this for the others)."""
        declined = self.selection.declined
        if declined and config.get_fallback() != "allow":
            _report_fallback(call, self.impl, list(declined), stacklevel=5)

    def _forward(self, call: Call) -> tuple[tuple[Any, ...], Any]:
        if self._plain and self._bind is None and call.save is self.save and call.needs == self.needs:
            outputs, residuals = self._fn(call)  # the caller's own call, nothing to enter: straight in
            return tuple(outputs), residuals
        copies = self.copies
        mapped = call
        if call.input_maps:
            with (contextlib.nullcontext() if self.recorded else NoGrad(call.family)):
                mapped = call.mapped()  # in the caller's library, before any bridge
            copies = _copies_needed(self.impl, mapped)
        inner = self._inner(mapped, copies)
        if self._bind is not None:
            self._fn, self._bind = self._bind(inner), None
        if self._no_grad or self._scoped:
            with (NoGrad(call.family) if self._no_grad else contextlib.nullcontext()), self.bridge.context(), \
                    self.impl.runtime_scope():
                outputs, residuals = self._fn(inner)
        else:
            outputs, residuals = self._fn(inner)
        if self.bridge.active:
            outward = self._outward
            return tuple([outward(y) for y in outputs]), residuals
        return tuple(outputs), residuals

    def forward(self, call: Call) -> tuple[Any, ...]:
        """Run the forward of ``call`` (of this route's signature) and return its outputs."""
        return self._forward(call)[0]

    def run(self, call: Call) -> Executed:
        """Run the forward of ``call`` (of this route's signature), keeping what a backward needs."""
        outputs, residuals = self._forward(call)
        return Executed(outputs, residuals, self.impl, self.bridge, call.family, call.input_maps, call.xp,
                        (self._inward, self._outward))


def _user_checks(call: Call, selection: Selection, need_backward: bool) -> tuple:
    """The ``Support.check`` predicates of kernels added with :func:`register_kernel` that choosing
    ``selection`` consulted (the candidates up to the chosen one under ``auto``; the forced one), each
    with its answer for ``call``: what :meth:`Route.holds_for` asks again."""
    impls = implementations(call.op)
    if selection.requested != "auto":
        considered = [i for i in impls if i is selection.impl]
    else:
        considered = impls[: impls.index(selection.impl) + 1] if selection.impl in impls else []
    return tuple((impl, _candidate_reason(impl, call, need_backward)[0]) for impl in considered
                 if impl.origin == "user" and impl.supports.check is not None)


def route(call: Call, need_backward: bool = False, needs: frozenset[str] | None = None, *,
          recorded: bool = False) -> Route:
    """Select an implementation for ``call`` (reporting a fallback as ``set_fallback`` says) and
    return the :class:`Route` its signature takes; arguments as :func:`run`."""
    return Route(select(call, need_backward), call, need_backward, needs, recorded)


def run(call: Call, need_backward: bool = False, needs: frozenset[str] | None = None, *,
        recorded: bool = False) -> Executed:
    """Select an implementation for ``call`` and run its forward.

    Args:
        call: the validated call.
        need_backward: whether a backward will follow (the forward keeps residuals).
        needs: the gradient names that backward may be asked for, when known
            (``Call.needs``); ``None``: any.
        recorded: run the input maps and the forward in the caller's grad mode rather than
            under ``torch.no_grad()``, so that PyTorch's autograd records them: for an
            implementation written in torch's differentiable ops (``aten``), whose outputs
            autograd then differentiates itself (the torch adapter's direct path).
    """
    return route(call, need_backward, needs, recorded=recorded).run(call)
