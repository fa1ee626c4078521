"""The measured GPU preference: which GPU backend ``auto`` puts first, per op, on this machine.

The two GPU backends' static order under ``auto`` comes from their registered priorities;
``python -m portable_nn gpu-check --save-preference`` replaces it per op with the faster one
measured on this machine's GPU, stored as JSON in :func:`path`.  Dispatch reads it through
:func:`load` (once per process) and reorders only its built-in kernels.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

#: Overrides where the preference file lives.
PREFERENCE_ENV = "PORTABLE_NN_GPU_PREFERENCE"
_cached: dict[str, str] | None = None


def path() -> Path:
    """Where the measured GPU preference lives (``$PORTABLE_NN_GPU_PREFERENCE`` or the user cache)."""
    env = os.environ.get(PREFERENCE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "portable_nn" / "gpu_preference.json"


def load(known_ops: Iterable[str]) -> dict[str, str]:
    """``{op: backend}`` from the file, for ops in ``known_ops`` (empty if there is no readable file);
    read once per process."""
    global _cached
    if _cached is None:
        ops = set(known_ops)
        try:
            data = json.loads(path().read_text())
            prefs = data.get("preference", {}) if isinstance(data, dict) else {}
            _cached = {op: b for op, b in prefs.items() if op in ops and isinstance(b, str)}
        except (OSError, ValueError):
            _cached = {}
    return _cached


def store(preference: Mapping[str, str], measured_on: str) -> Path:
    """Write ``{op: backend}`` (measured on the device ``measured_on``) and use it from now on."""
    global _cached
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"measured_on": measured_on, "preference": dict(preference)}, indent=2))
    _cached = dict(preference)
    return target
