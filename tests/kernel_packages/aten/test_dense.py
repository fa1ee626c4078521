"""The aten dense kernel: F.linear plus the activation against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn.api._common import spec_of

torch = pytest.importorskip("torch")


pytestmark = pytest.mark.skipif(not pnn.available_backends()["aten"], reason="aten backend unavailable")


from .aten_testing import _assert_agree, _both, _t  # noqa: E402


@pytest.mark.parametrize("lead", [(), (5,), (2, 3), (0,)], ids=str)
@pytest.mark.parametrize("act", ["identity", "relu", "gelu", ("leaky_relu", 0.2)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_dense_matches_reference(lead, act, bias):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((*lead, 6)), rng.standard_normal((4, 6))
    b = rng.standard_normal(4) if bias else None
    dy = rng.standard_normal((*lead, 4))
    _assert_agree(_both(pnn.dense, (_t(x), _t(w), _t(b)), {"activation": act}, _t(dy)), 1e-12)


def test_dense_backward_computes_only_needs():
    from kernels_aten.dense import dense_backward, dense_forward

    prepared = spec_of(pnn.dense).prepare(torch.ones(3, 4), torch.ones(2, 4), torch.ones(2),
                                                          activation="relu")
    _, residuals = dense_forward(prepared.call.replace(save=True))
    assert set(dense_backward(residuals, (torch.ones(3, 2),), frozenset({"weight"}))) == {"weight"}
    assert set(dense_backward(residuals, (torch.ones(3, 2),), frozenset({"x", "bias"}))) == {"x", "bias"}

