"""The kernel packages' on-disk Numba cache, kept in step with their sources.

Numba re-validates a cached kernel against its own source file only.  Our kernels inline
functions from sibling modules (``activations.py`` into ``norm.py``, runtime helpers …), so an edit
there would leave stale machine code in the cache.  Each kernel package therefore fingerprints
all of its sources and drops its cache entries when the fingerprint changes.  Every kernel package
(``kernels_cpu``, ``kernels_gpu.numba_cuda``) calls :func:`drop_stale_cache` from here, so no
kernel package imports another.
"""

from __future__ import annotations

import contextlib
import os

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
