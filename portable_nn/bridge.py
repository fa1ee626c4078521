"""Zero-copy bridges between the caller's array library and a kernel's native one.

CPU torch tensors reach ``native="numpy"`` kernels as NumPy views, CUDA torch tensors reach
``native="cupy"`` kernels as CuPy views (run on torch's current stream), and results go back as
tensors sharing the kernels' memory.  Dispatch builds one :class:`Bridge` per call.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from . import _arrays

__all__ = ["Bridge", "NoGrad"]


class Bridge:
    """Moves arrays between the caller's library and an implementation's native one.

    Two bridges exist, both zero-copy: CPU torch tensors to NumPy views for
    ``native="numpy"`` kernels, and CUDA torch tensors to CuPy views for
    ``native="cupy"`` kernels (bfloat16, which NumPy lacks, as ``uint16`` bits).  A CuPy-native kernel runs inside
    :meth:`context`: the arrays' device is current and, for torch tensors,
    CuPy's current stream is torch's current stream, so the kernels order
    themselves with the caller's PyTorch work without a synchronisation.
    """

    def __init__(self, family: str, native: str | None, device: str = "cpu", dtype: str | None = None) -> None:
        self.family = family
        self.native = native
        self.device = device
        self.dtype = dtype
        self.active = family == "torch" and native in ("numpy", "cupy")
        #: Whether :meth:`context` has anything to enter (a CuPy-native kernel on a GPU).
        self.has_context = native == "cupy" and _arrays.device_kind(device) == "cuda"

    def inward(self, value: Any) -> Any:
        if not self.active or value is None:
            return value
        if isinstance(value, (tuple, list)):  # structured buffers (an RNN's params)
            return type(value)(self.inward(v) for v in value)
        if not _arrays.is_array(value):
            return value
        if self.native == "cupy":
            return _arrays.to_cupy_view(value)
        return _arrays.to_numpy_view(value)

    def outward(self, value: Any) -> Any:
        if not self.active or value is None:
            return value
        if isinstance(value, tuple):
            return tuple(self.outward(v) for v in value)
        if isinstance(value, list):
            return [self.outward(v) for v in value]
        if self.native == "cupy":
            return _arrays.from_cupy_like(value, self.family, self.dtype)
        return _arrays.from_numpy_like(value, self.family, self.dtype)

    def array_inward(self) -> Any:
        """:meth:`inward` for one array argument or ``None``, specialised to this bridge: a CPU torch
        tensor of a dtype NumPy has becomes its NumPy view with no further checks (a call's
        arrays are all of its library, and none is bfloat16 unless the call's dtype is)."""
        if not self.active:
            return _identity
        if self.native == "numpy" and self.dtype != "bfloat16":
            return _tensor_numpy_view
        return self.inward

    def array_outward(self) -> Any:
        """:meth:`outward` for one result array or ``None``, specialised as :meth:`array_inward`."""
        if not self.active:
            return _identity
        if self.native == "numpy" and self.dtype != "bfloat16":
            import torch

            from_numpy = torch.from_numpy
            return lambda a: None if a is None else from_numpy(a)
        return self.outward

    def native_namespace(self) -> Any:
        """The array-API namespace the kernel sees for bridged arrays."""
        if self.native == "cupy":
            import array_api_compat.cupy as cp_xp

            return cp_xp
        return _arrays.NUMPY_NAMESPACE

    def context(self) -> Any:
        """Where a CuPy-native kernel runs: the arrays' device and, for torch, torch's stream.

        Nothing to enter for CuPy arrays already on the current device (the usual call): entering
        the device took a few of the ~100 µs a small GPU call cost on an H200's host.
        """
        if self.native != "cupy" or _arrays.device_kind(self.device) != "cuda":
            return contextlib.nullcontext()
        import cupy

        index = _arrays.cuda_index(self.device)
        if self.family != "torch":
            if cupy.cuda.runtime.getDevice() == index:
                return contextlib.nullcontext()
            return cupy.cuda.Device(index)
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(index))
        stack.enter_context(_external_stream(cupy, torch.cuda.current_stream(index).cuda_stream, index))
        return stack


def _identity(value: Any) -> Any:
    return value


def _tensor_numpy_view(t: Any) -> Any:
    """The zero-copy NumPy view of a CPU torch tensor of a dtype NumPy has (``None`` stays ``None``).

    ``detach()`` only where the tensor requires grad (``numpy()`` refuses it): a detach costs
    ~0.5 µs, a third of the view."""
    if t is None:
        return None
    return t.detach().numpy() if t.requires_grad else t.numpy()


#: CuPy's handle on each torch stream seen, by (stream pointer, device): one per stream rather
#: than a new (deprecated-API, warning) object per call.
_external_streams: dict[tuple[int, int], Any] = {}


def _external_stream(cupy: Any, pointer: int, index: int) -> Any:
    """CuPy's view of the torch stream ``pointer`` on device ``index`` (made once per stream)."""
    key = (pointer, index)
    stream = _external_streams.get(key)
    if stream is None:
        if len(_external_streams) > 64:  # streams come and go in some programs: keep the table small
            _external_streams.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers Stream.from_external
            stream = _external_streams[key] = cupy.cuda.ExternalStream(pointer, index)
    return stream


class NoGrad:
    """``torch.no_grad()`` for torch calls, nothing otherwise."""

    def __init__(self, family: str) -> None:
        self.ctx = None
        if family == "torch":
            import torch

            if torch.is_grad_enabled():  # (inside an autograd.Function's forward it is not: nothing to do)
                self.ctx = torch.no_grad()

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
