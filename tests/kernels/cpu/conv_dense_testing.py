"""Helpers shared by the numba conv and dense kernel tests (the serial/parallel path fixture, one vjp run)."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

pytest.importorskip("numba")

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")



from kernels_cpu import conv as kc  # noqa: E402  (imports numba)
from kernels_cpu import dense as kd  # noqa: E402

#: Small geometries that reach every branch of the canonical form: 1-D/3-D, strides, dilation,
#: asymmetric padding, groups (depthwise with a multiplier), a 1x1 kernel, unbatched input.
GEOMS = {
    "2d-s2-d2-g2-pad": dict(x=(3, 4, 7, 6), w=(6, 2, 3, 2), stride=2, padding=(1, (0, 2)), dilation=2, groups=2),
    "2d-same-depthwise": dict(x=(2, 3, 5, 6), w=(6, 1, 3, 3), stride=1, padding="same", dilation=1, groups=3),
    "1d-k4-s3": dict(x=(3, 2, 11), w=(3, 2, 4), stride=3, padding=((2, 1),), dilation=1, groups=1),
    "3d-mixed": dict(x=(2, 2, 4, 5, 4), w=(4, 1, 2, 3, 2), stride=(1, 2, 1), padding=(1, 0, (0, 1)),
                     dilation=(2, 1, 1), groups=2),
    "2d-1x1-unbatched": dict(x=(3, 5, 4), w=(2, 3, 1, 1), stride=1, padding=0, dilation=1, groups=1),
    "lenet-like": dict(x=(5, 3, 9, 9), w=(4, 3, 5, 5), stride=1, padding=0, dilation=1, groups=1),
}



def _run(op, args, kwargs, backend, seed=1, out=None, wrt=None):
    with pnn.use_backend(backend):
        y, pullback = pnn.vjp(op, *args, wrt=wrt, **kwargs)
        dy = np.random.default_rng(seed).standard_normal(y.shape).astype(y.dtype)
        grads = pullback(dy) if out is None else pullback(dy, out=out)
    return (y, *grads)


@pytest.fixture(params=["serial", "parallel"])
def path(request, monkeypatch):
    """Force the serial or the parallel kernels (the size thresholds pick them otherwise)."""
    parallel = request.param == "parallel"
    monkeypatch.setattr(kc, "PARALLEL_MIN_MACS", 0 if parallel else 1 << 62)
    monkeypatch.setattr(kd, "SERIAL_MAX_MACS", -1 if parallel else 1 << 62)
    if parallel:  # several parts even for tiny layers
        monkeypatch.setattr(kd, "PART_MACS", 1)
        monkeypatch.setattr(kd, "MIN_PART_ROWS", 1)
    return request.param

