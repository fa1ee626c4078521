"""The kernel packages' on-disk Numba cache: kept in step with their sources, and announced when filled.

Numba re-validates a cached kernel against its own source file only.  Our kernels inline
functions from sibling modules (``activations.py`` into ``norm.py``, runtime helpers …), so an edit
there would leave stale machine code in the cache.  Each kernel package therefore fingerprints
all of its sources and drops its cache entries when the fingerprint changes.  Every kernel package
(``kernels_cpu``, ``kernels_gpu.numba_cuda``) calls :func:`drop_stale_cache` from here, so no
kernel package imports another.

A kernel compiles on its first use with a dtype (tens of seconds for the first call of a process
with an empty cache) and loads from the cache afterwards.  :func:`announce_compiles` makes that
visible: before a kernel module's first compilation for a dtype it logs "compiling the numba conv
kernels for float32 (first use only; cached in …)" to the ``portable_nn.compile`` logger, and,
unless logging is configured for ``portable_nn`` or ``PORTABLE_NN_COMPILE_NOTICE=0``, writes it to
stderr as well: every such line on a terminal, only the first one of the process otherwise.
``python -m portable_nn compile`` fills the cache ahead of time (:mod:`portable_nn.warmup`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

_FINGERPRINT_FILE = "portable_nn-sources.txt"


#: Modules outside the kernel packages whose values Numba folds into compiled kernels: the shared
#: activation and cell codes.  A renumbered code must drop the cached machine code that compared
#: against the old number.
_SHARED_SOURCES = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_codes.py"),)


def _sources_fingerprint(directory: str) -> str:
    """Names, sizes and modification times of every ``.py`` file in ``directory`` and the shared sources."""
    paths = []
    for name in sorted(os.listdir(directory)):
        # The package's __init__.py only declares kernels to dispatch (kernel modules import their
        # siblings, never the package), so it cannot change machine code; counting it recompiled
        # every kernel whenever a declaration changed.
        if name.endswith(".py") and name != "__init__.py":
            paths.append(os.path.join(directory, name))
    entries = []
    for path in (*paths, *_SHARED_SOURCES):
        st = os.stat(path)
        entries.append(f"{os.path.basename(path)} {st.st_size} {st.st_mtime_ns}")
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


#: The suffix of the marker files :func:`warm_marker` names (dropped with the stale kernels).
_MARKER_SUFFIX = ".warm"


def warm_marker(py_file: str, name: str) -> str | None:
    """A marker file in the kernel cache of ``py_file``'s package (``None`` where that cache is not
    writable): a program that compiled what it needs ahead of time leaves it, and finds it next
    time.  It goes with the kernels when a source change drops them."""
    try:
        cache = numba_cache_dir(py_file)
    except (ImportError, AttributeError):
        return None
    if cache is None:
        return None
    existing = cache if os.path.isdir(cache) else os.path.dirname(cache)
    if not os.access(existing, os.W_OK):
        return None
    return os.path.join(cache, name + _MARKER_SUFFIX)


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
            if name.endswith((".nbi", ".nbc", _MARKER_SUFFIX)):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(cache, name))
        with open(stamp, "w") as fh:
            fh.write(fingerprint)
        return True
    except (OSError, ImportError, AttributeError):  # an unreadable cache, or Numba's internals moved
        return False


# --------------------------------------------------------------------------- compile notices

#: The logger compile notices go to (INFO).
LOGGER = logging.getLogger("portable_nn.compile")
#: Set to ``0`` to keep compile notices off stderr (they still go to :data:`LOGGER`).
NOTICE_VARIABLE = "PORTABLE_NN_COMPILE_NOTICE"
#: The kernel packages whose compilations are announced (module name prefixes).
_KERNEL_PACKAGES = {"kernels_cpu": "numba", "kernels_gpu.numba_cuda": "numba_cuda"}
_announced: set[tuple[str, str]] = set()
_notice_lock = threading.Lock()
_state = {"watching": False, "printed": False}


def _what(module: str, args: tuple) -> tuple[str, str] | None:
    """(``"numba conv"``, dtype name) for a compilation of one of our kernels, else ``None``."""
    backend = next((b for prefix, b in _KERNEL_PACKAGES.items() if module.startswith(prefix + ".")), None)
    if backend is None:
        return None
    family = module.rpartition(".")[2].lstrip("_")
    dtype = next((str(a.dtype) for a in args if hasattr(a, "dtype") and hasattr(a, "ndim")), "")
    return f"{backend} {family}", {"uint16": "bfloat16"}.get(dtype, dtype)


def compile_notice(module: str, py_file: str, args: tuple) -> str | None:
    """The message for the first compilation of ``module``'s kernels for these argument types (once)."""
    found = _what(module, args)
    if found is None:
        return None
    with _notice_lock:
        if found in _announced:
            return None
        _announced.add(found)
    kernels, dtype = found
    where = numba_cache_dir(py_file) or "nowhere: the cache directory is not writable, set NUMBA_CACHE_DIR"
    for_dtype = f" for {dtype}" if dtype else ""
    return f"portable_nn: compiling the {kernels} kernels{for_dtype} (first use only; cached in {where})"


def _announce(message: str) -> None:
    LOGGER.info(message)
    if os.environ.get(NOTICE_VARIABLE, "1") == "0" or logging.getLogger("portable_nn").hasHandlers():
        return
    stream = sys.stderr
    terminal = bool(getattr(stream, "isatty", lambda: False)())
    with _notice_lock:
        if not terminal and _state["printed"]:
            return
        _state["printed"] = True
    with contextlib.suppress(OSError, ValueError):
        stream.write(message + ("\n" if terminal else "; more kernels may follow\n"))
        stream.flush()


def announce_compiles() -> None:
    """Announce each kernel module's first compilation per dtype (see the module docstring).

    Listens to Numba's ``numba:compile`` event, which fires on a cache miss only, before the
    compilation starts; installed once per process by the kernel packages.
    """
    with _notice_lock:
        if _state["watching"]:
            return
        _state["watching"] = True
    try:
        from numba.core import event
    except ImportError:  # pragma: no cover - Numba without the event API: compile silently
        return

    class _Listener(event.Listener):
        def on_start(self, ev: object) -> None:
            data = getattr(ev, "data", None) or {}
            dispatcher = data.get("dispatcher")
            func = getattr(dispatcher, "py_func", None)
            if func is None:
                return
            module = getattr(func, "__module__", "") or ""
            message = compile_notice(module, getattr(func.__code__, "co_filename", ""), tuple(data.get("args", ())))
            if message:
                _announce(message)

        def on_end(self, ev: object) -> None:
            pass

    event.register("numba:compile", _Listener())
