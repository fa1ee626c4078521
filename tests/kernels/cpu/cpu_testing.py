"""Helpers shared by the numba kernel tests."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

pytestmark = pytest.mark.skipif(not pnn.available_backends()["numba"], reason="numba not installed")

NORMS = ("layer_norm", "batch_norm", "group_norm", "instance_norm")



def _data(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)

