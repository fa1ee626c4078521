"""``register_kernel``'s documented contract (what each op's ``Call`` carries) matches the ``Call``s the ops build."""

from __future__ import annotations

import re

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import dispatch
from portable_nn.api._common import spec_of


def _a(*shape):
    return np.random.default_rng(0).standard_normal(shape)


def _params(gates, layers=1):
    return [(_a(gates * 4, 3 if k == 0 else 4), _a(gates * 4, 4), _a(gates * 4), _a(gates * 4)) for k in range(layers)]


#: One small valid call per op (a new op adds its own; tests/api/ holds the full grids).
SAMPLES = {
    "moments": ((_a(2, 3),), {"axis": 0}),
    "batch_norm": ((_a(4, 3),), {"weight": _a(3), "bias": _a(3), "running_mean": np.zeros(3),
                                 "running_var": np.ones(3)}),
    "layer_norm": ((_a(2, 3), _a(3), _a(3)), {}),
    "group_norm": ((_a(2, 4, 3), 2, _a(4), _a(4)), {}),
    "instance_norm": ((_a(2, 3, 5),), {"weight": _a(3), "bias": _a(3)}),
    "rms_norm": ((_a(2, 3), _a(3)), {}),
    "rnn_cell": ((_a(2, 3), _a(2, 4), _a(4, 3), _a(4, 4)), {}),
    "lstm_cell": ((_a(2, 3), _a(2, 4), _a(2, 4), _a(16, 3), _a(16, 4)), {}),
    "gru_cell": ((_a(2, 3), _a(2, 4), _a(12, 3), _a(12, 4)), {}),
    "rnn": ((_a(5, 2, 3), _params(1)), {}),
    "lstm": ((_a(5, 2, 3), _params(4)), {}),
    "gru": ((_a(5, 2, 3), _params(3)), {}),
    "conv": ((_a(2, 3, 6, 6), _a(4, 3, 3, 3), _a(4)), {}),
    "dense": ((_a(2, 3), _a(4, 3), _a(4)), {}),
    "max_pool": ((_a(2, 3, 6, 6), 2), {}),
    "avg_pool": ((_a(2, 3, 6, 6), 2), {}),
    "max_unpool": ((_a(2, 3, 3, 3), np.zeros((2, 3, 3, 3), np.int64), 2), {}),
    "log_softmax": ((_a(2, 3),), {}),
    "cross_entropy": ((_a(4, 3), np.array([0, 2, 1, 0])), {}),
}

_WEIGHT_NAME = re.compile(r"[wb]_(ih|hh)_l\d+(_reverse)?")


def _bullet(doc: str, op: str) -> str:
    """The contract's bullet that names ``op``."""
    bullets = re.split(r"\n\s*- ", doc.split("Kernel contract", 1)[-1])[1:]  # [0]: the introduction
    found = [b for b in bullets if re.search(rf"``{op}``", b)]
    assert found, f"register_kernel's docstring has no entry for {op}"
    return found[0]


def test_every_op_has_a_sample():
    assert set(SAMPLES) == set(dispatch.op_names())


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_the_documented_call_fields_are_the_ones_the_op_builds(op):
    args, kwargs = SAMPLES[op]
    call = spec_of(op).prepare(*args, **kwargs).call
    bullet = " ".join(_bullet(dispatch.register_kernel.__doc__, op).split())
    keys = [k for k in (*call.arrays, *call.params) if not _WEIGHT_NAME.fullmatch(k)]
    missing = [k for k in keys if f"``{k}``" not in bullet]
    assert not missing, f"register_kernel's contract for {op} does not name {missing}"
    pnn.explain(getattr(pnn, op), *args, **kwargs)  # the sample is a valid call
