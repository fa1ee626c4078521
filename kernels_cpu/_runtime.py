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


# --------------------------------------------------------------------------- the on-disk cache
#
# Numba re-validates a cached kernel against its own source file only.  Our kernels inline
# functions from sibling modules (activations.py into norm.py, _runtime helpers …), so an edit
# there would leave stale machine code in the cache.  Each kernel package therefore fingerprints
# all of its sources, and drops its cache entries when the fingerprint changes.

_FINGERPRINT_FILE = "portable_nn-sources.txt"


def _sources_fingerprint(directory: str) -> str:
    """Names, sizes and modification times of every ``.py`` file in ``directory``."""
    entries = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(directory, name))
            entries.append(f"{name} {st.st_size} {st.st_mtime_ns}")
    return "\n".join(entries)


def numba_cache_dir(py_file: str) -> str | None:
    """Where Numba caches kernels defined in ``py_file`` (its own locator rules), or ``None``."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    for locator in getattr(impl, "_locator_classes", ()):
        found = locator.from_function(numba_cache_dir, py_file)
        if found is not None:
            return found.get_cache_path()
    return None


def drop_stale_cache(py_file: str) -> bool:
    """Delete the cached kernels of ``py_file``'s package if any of its sources changed.

    Called by every kernel module before it defines a cached kernel.  Returns whether
    entries were dropped.  Failures (a read-only cache, a concurrent process) are ignored:
    Numba then simply recompiles or re-validates as usual.
    """
    directory = os.path.dirname(os.path.abspath(py_file))
    try:
        cache = numba_cache_dir(py_file)
        if cache is None:
            return False
        fingerprint = _sources_fingerprint(directory)
        stamp = os.path.join(cache, _FINGERPRINT_FILE)
        try:
            with open(stamp) as fh:
                if fh.read() == fingerprint:
                    return False
        except OSError:
            pass
        os.makedirs(cache, exist_ok=True)
        for name in os.listdir(cache):
            if name.endswith((".nbi", ".nbc")):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(cache, name))
        with open(stamp, "w") as fh:
            fh.write(fingerprint)
        return True
    except (OSError, ImportError, AttributeError):  # an unreadable cache, or Numba's internals moved
        return False


drop_stale_cache(__file__)


# --------------------------------------------------------------------------- BLAS bindings without scipy.linalg
#
# Numba binds ``np.dot`` to SciPy's BLAS through ``scipy.linalg.cython_blas``, and checks for
# it while loading its typing registries, i.e. before the first kernel runs or loads from the
# cache.  ``import scipy.linalg.cython_blas`` first runs ``scipy.linalg/__init__``, which
# imports all of scipy.linalg (and SciPy's copy of array-api-compat): 0.1-0.25 s of a
# process's first call, for an extension module that loads alone in ~4 ms.  So the extension
# is loaded alone, once, when nothing has imported scipy.linalg yet.  Importing scipy.linalg
# later works as usual: it finds the loaded extension in ``sys.modules``, and a one-shot finder
# makes it the package's ``cython_blas`` attribute, as a normal import would have.

_BLAS_MODULE = "scipy.linalg.cython_blas"


class _AttachBlasModule:
    """Meta-path finder: when ``scipy.linalg`` is imported, set its ``cython_blas`` attribute."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, name, path, target=None):
        if self.done or name != "scipy.linalg":
            return None
        self.done = True
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if _BLAS_MODULE in sys.modules and not hasattr(module, "cython_blas"):
                module.cython_blas = sys.modules[_BLAS_MODULE]

        spec.loader.exec_module = exec_module  # this spec's own loader instance only
        return spec


def preload_blas_bindings() -> bool:
    """Load ``scipy.linalg.cython_blas`` without its package; ``True`` if this call loaded it."""
    if _BLAS_MODULE in sys.modules or "scipy.linalg" in sys.modules:
        return False
    import importlib.machinery
    import importlib.util

    try:
        scipy_spec = importlib.util.find_spec("scipy")
        if scipy_spec is None or not scipy_spec.submodule_search_locations:
            return False
        directories = [os.path.join(d, "linalg") for d in scipy_spec.submodule_search_locations]
        spec = importlib.machinery.PathFinder.find_spec(_BLAS_MODULE, directories)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return False
        module = importlib.util.module_from_spec(spec)
        sys.modules[_BLAS_MODULE] = module
        spec.loader.exec_module(module)
    except Exception:  # any surprise: leave it to the normal import
        sys.modules.pop(_BLAS_MODULE, None)
        return False
    sys.meta_path.insert(0, _AttachBlasModule())
    return True


preload_blas_bindings()


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
    except (OSError, ImportError, AttributeError):  # an unreadable cache, or Numba's internals moved
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
