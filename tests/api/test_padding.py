"""The padding modes' input map: NumPy's (PyTorch's) padding, and its adjoint against the explicit
scatter-add, in every array library the tests run (the map is array-API code, run before dispatch)."""

from __future__ import annotations

import numpy as np
import pytest

from pnn_testing import ARRAY_LIBS, Case, assert_close, to_numpy
from portable_nn import _arrays
from portable_nn.api._padding import ModePadding, source_indices

#: PyTorch's mode names -> NumPy's: the same padding (reflect without repeating the edge).
NUMPY_MODES = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}
#: (size, low, high) per axis: small and large pads, both borders reading one position, a 1-long axis.
AXES = [(5, 2, 1), (3, 2, 2), (4, 0, 3), (1, 0, 0), (2, 1, 1), (6, 5, 0)]


def _allowed(mode: str, length: int, lo: int, hi: int) -> bool:
    limit = {"reflect": length - 1, "circular": length, "replicate": 10**9}[mode]
    return max(lo, hi) <= limit


@pytest.mark.parametrize("mode", list(NUMPY_MODES))
@pytest.mark.parametrize("length, lo, hi", AXES)
def test_source_indices_are_numpys_padding(mode, length, lo, hi):
    if not _allowed(mode, length, lo, hi):
        pytest.skip("beyond the mode's limit (refused by conv)")
    expected = np.pad(np.arange(length), (lo, hi), mode=NUMPY_MODES[mode])
    np.testing.assert_array_equal(source_indices(mode, length, lo, hi), expected)


def _scatter_add(g: np.ndarray, mode: str, axes, sizes, lo, hi) -> np.ndarray:
    """The adjoint written out: every padded position's gradient added to its source, axis by axis."""
    for axis, n, low, high in reversed(list(zip(axes, sizes, lo, hi))):
        out = np.zeros((*g.shape[:axis], n, *g.shape[axis + 1:]))
        src = source_indices(mode, n, low, high)
        for p, j in enumerate(src):
            index = (slice(None),) * axis
            out[(*index, j)] += g[(*index, p)]
        g = out
    return g


@pytest.mark.parametrize("lib", ARRAY_LIBS)
@pytest.mark.parametrize("mode", list(NUMPY_MODES))
def test_map_pads_like_numpy_and_its_adjoint_sums_back(lib, mode):
    """Two padded axes (channels last, so not the trailing ones) of every library: A a is NumPy's
    padding, Aᵀ g the explicit scatter-add, and ⟨A a, g⟩ = ⟨a, Aᵀ g⟩."""
    rng = np.random.default_rng(1)
    case = Case(lib, "reference", "float64")
    shape, axes = (2, 3, 4, 3), (1, 2)
    sizes = (3, 4)
    lo, hi = ((2, 0) if mode == "reflect" else (3, 0)), (2, 3)
    pad_map = ModePadding(mode, axes, sizes, lo, hi)
    a = rng.standard_normal(shape)
    xa = case.asarray(a)
    xp = _arrays.namespace(xa)
    padded = pad_map.apply(xp, xa)
    widths = [(0, 0), (lo[0], hi[0]), (lo[1], hi[1]), (0, 0)]
    np.testing.assert_array_equal(to_numpy(padded), np.pad(a, widths, mode=NUMPY_MODES[mode]))
    g = rng.standard_normal(tuple(padded.shape))
    back = pad_map.adjoint(xp, case.asarray(g))
    assert tuple(back.shape) == shape
    assert_close(to_numpy(back), _scatter_add(g, mode, axes, sizes, lo, hi), 1e-14, "adjoint")
    assert abs(np.sum(to_numpy(padded) * g) - np.sum(a * to_numpy(back))) < 1e-10


def test_unpadded_axes_are_left_alone():
    pad_map = ModePadding("reflect", (2, 3), (4, 5), (0, 1), (0, 2))
    assert [g.axis for g in pad_map.axes] == [3]
    assert "axis 3: (1, 2)" in str(pad_map)
