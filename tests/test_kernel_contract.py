"""``register_kernel``'s documented contract (what each op's ``Call`` carries) matches the ``Call``s the ops build."""

from __future__ import annotations

import re

import pytest

import portable_nn as pnn
from portable_nn import dispatch
from portable_nn.api._common import spec_of
from portable_nn.warmup import samples

#: One small valid call per op (the ones ``python -m portable_nn compile`` runs; tests/api/ holds the grids).
SAMPLES = {op: calls[0] for op, calls in samples("float64").items()}

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
