"""The kernel packages' Numba cache follows their sources (portable_nn.kernel_cache)."""

from __future__ import annotations

import pytest

import portable_nn as pnn

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

NORMS = ("layer_norm", "batch_norm", "group_norm", "instance_norm")



def test_cached_kernels_are_dropped_when_any_sibling_source_changes(tmp_path):
    """Numba checks a cached kernel against its own file only; kernels inline sibling modules."""
    from portable_nn import kernel_cache

    (tmp_path / "kernels.py").write_text("x = 1\n")
    (tmp_path / "helpers.py").write_text("y = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    (cache / "kernels.f-1.py311.nbi").write_text("stale")
    assert kernel_cache.drop_stale_cache(str(tmp_path / "kernels.py"))  # no fingerprint yet: dropped
    assert not list(cache.glob("*.nbi"))
    (cache / "kernels.f-1.py311.nbi").write_text("fresh")
    assert not kernel_cache.drop_stale_cache(str(tmp_path / "kernels.py"))  # unchanged sources: kept
    assert list(cache.glob("*.nbi"))
    (tmp_path / "helpers.py").write_text("y = 22\n")  # a sibling, not the kernel's own file
    assert kernel_cache.drop_stale_cache(str(tmp_path / "kernels.py"))
    assert not list(cache.glob("*.nbi"))

