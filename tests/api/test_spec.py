"""The op descriptions (``OpSpec``): every op is described once, and what is derived from it agrees."""

from __future__ import annotations

import inspect

import pytest

import portable_nn as pnn
from portable_nn import dispatch
from portable_nn.api import _types
from portable_nn.api._common import all_specs, spec_of

SPECS = all_specs()


def test_every_public_op_is_described_and_dispatched():
    names = [s.name for s in SPECS]
    assert tuple(names) == dispatch.op_names()
    for name in names:
        assert name in pnn.__all__
        assert spec_of(getattr(pnn, name)).name == name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_argument_has_a_known_kind(spec):
    unknown = {name: kind for name, kind in spec.arguments.items() if kind not in _types.KINDS}
    assert not unknown, f"{spec.name}: annotate with a kind from portable_nn.api._types: {unknown}"
    assert set(spec.grad_fields) <= set(spec.arrays), spec.name
    assert set(spec.updates) <= set(spec.arrays), spec.name
    if spec.updates:
        assert spec.arguments.get("return_stats") == "bool", spec.name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_public_op_is_the_described_function(spec):
    fn = getattr(pnn, spec.name)
    assert inspect.signature(fn) == spec.signature
    assert fn.__doc__ == spec.prepare.__doc__
    assert spec.family == fn.__module__.rpartition(".")[2]
    assert dispatch.op_family(spec.name) == spec.family


def test_both_adapters_carry_every_kind():
    pytest.importorskip("torch")
    from portable_nn.adapters.torch._defs import KINDS

    assert set(KINDS) == set(_types.KINDS)


def test_the_jax_functions_are_generated_from_the_descriptions():
    pytest.importorskip("jax")
    import portable_nn.jax as pnj
    from portable_nn.adapters.jax.functional import _AXIS_NAME_DOC

    for spec in SPECS:
        fn = getattr(pnj, spec.name)
        params = list(inspect.signature(fn).parameters.values())
        if spec.name in ("batch_norm", "moments"):  # the adapter's one addition: statistics across devices
            assert params[-1].name == "axis_name" and params[-1].default is None and _AXIS_NAME_DOC in fn.__doc__
            params = params[:-1]
        assert inspect.signature(fn).replace(parameters=params) == spec.signature
        assert f":func:`portable_nn.{spec.name}`" in fn.__doc__
