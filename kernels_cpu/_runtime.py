"""Numba runtime policy: the threading layer, and thread safety of parallel kernels.

PERFORMANCE.md records why this matters: if Numba's ``omp`` layer starts before
PyTorch is imported, small torch ops slow down 10-20x; the ``workqueue`` layer
is not safe for parallel kernels launched concurrently from several Python
threads.  The policy, applied once before the first parallel kernel runs:

1. A user's own ``NUMBA_THREADING_LAYER`` (or a Numba thread pool that is
   already running) is respected as is.
2. Otherwise, if the ``tbb`` package's ``libtbb.so.12`` can be loaded, it is
   loaded (it sits in ``<sys.prefix>/lib``, off the loader path) and the
   ``tbb`` layer is selected: thread safe, and it leaves torch's OpenMP alone.
3. Otherwise the ``workqueue`` layer is selected and parallel kernels are
   serialised with a lock, so concurrent calls stay safe.

No environment variable is changed; only Numba's in-process configuration,
and only while its thread pool has not started.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_serialise = threading.Lock()
_state: dict[str, object] = {}


def _load_tbb() -> bool:
    for directory in (os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")):
        for path in sorted(glob.glob(os.path.join(directory, "libtbb.so.12*"))):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    try:
        ctypes.CDLL("libtbb.so.12", mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def _pool_running() -> str | None:
    from numba.np.ufunc import parallel

    return parallel._threading_layer if parallel._is_initialized else None


def configure() -> str:
    """Apply the policy once; returns a description of the layer in use."""
    with _lock:
        if "layer" in _state:
            return str(_state["layer"])
        from numba.core import config

        running = _pool_running()
        user = os.environ.get("NUMBA_THREADING_LAYER")
        if running is not None:
            layer, why = running, "already started by the application"
        elif user:
            layer, why = config.THREADING_LAYER, "set by NUMBA_THREADING_LAYER"
        elif _load_tbb():
            config.THREADING_LAYER = "tbb"
            layer, why = "tbb", "chosen by portable_nn: thread safe, leaves PyTorch's OpenMP alone"
        else:
            config.THREADING_LAYER = "workqueue"
            layer, why = "workqueue", "chosen by portable_nn (tbb not installed); parallel kernels serialised"
        _state["layer"] = f"{layer} ({why})"
        _state["serialise"] = layer == "workqueue"
        return str(_state["layer"])


def describe() -> str:
    """The layer in use, or the one the policy would choose (without starting anything)."""
    if "layer" in _state:
        return str(_state["layer"])
    user = os.environ.get("NUMBA_THREADING_LAYER")
    if user:
        return f"{user} (from NUMBA_THREADING_LAYER; respected)"
    tbb = glob.glob(os.path.join(sys.prefix, "lib", "libtbb.so.12*"))
    return "tbb (will be selected on the first parallel kernel)" if tbb else (
        "workqueue (tbb not installed; parallel kernels will be serialised)"
    )


@contextlib.contextmanager
def parallel_section() -> Iterator[None]:
    """Wrap every parallel kernel call: configures the layer, serialises if unsafe."""
    configure()
    if _state.get("serialise"):
        with _serialise:
            yield
    else:
        yield


def run_sized(parallel_kernel, serial_kernel, parallel: bool, *args) -> None:
    """Run the parallel kernel (under :func:`parallel_section`) when ``parallel``, else the serial one.

    Each module decides ``parallel`` from its own size threshold (PERFORMANCE.md §6: the thread
    pool costs more than it saves below ~50 us of work).
    """
    if not parallel:
        serial_kernel(*args)
        return
    with parallel_section():
        parallel_kernel(*args)


def into(out, name, value):
    """``value`` as the gradient ``name``: copied into the caller's ``out`` buffer when one is given."""
    buffer = out.get(name)
    if buffer is None or buffer is value:
        return value
    buffer[...] = value
    return buffer
