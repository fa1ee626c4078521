"""Helpers shared by the numba kernel tests."""

from __future__ import annotations

import numpy as np


def _data(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)

