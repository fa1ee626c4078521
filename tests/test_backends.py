"""Backends declare themselves: entry points, probes, load failures, and no backend lists in the core."""

from __future__ import annotations

import importlib.metadata
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

import portable_nn as pnn
from portable_nn import backends, dispatch

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_package_is_found_through_its_entry_point():
    published = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=backends.ENTRY_POINT_GROUP)}
    assert {"numba", "cupy", "numba_cuda", "aten"} <= set(published)
    names = dispatch.backend_names()
    assert names[0] == "reference"  # the oracle first; the others by their declared priority
    declared = backends.declared()
    for name in published:
        assert name in names
        assert declared[name].name == name
    priorities = [declared[n].priority for n in names[1:] if n in declared]
    assert priorities == sorted(priorities, reverse=True)


def test_the_gpu_backends_are_the_ones_that_take_cupy_arrays():
    assert set(dispatch.backends_taking("cupy")) == {"cupy", "numba_cuda"}
    assert dispatch.backend_arrays("numba") == "numpy"
    assert dispatch.backend_arrays("aten") == "torch"
    assert dispatch.backend_arrays("reference") == "any"


_TOY = '''
from portable_nn.backends import Backend
from portable_nn.dispatch import Support, register_builtin

BACKEND = Backend("toy", probe=lambda: (True, "toy: always here"), priority=7, arrays="numpy")


def forward(call):
    y = call.x * 0 + 42.0
    return (y,), None


register_builtin("layer_norm", BACKEND.name, forward=forward, supports=Support(families=("numpy",)),
                 priority=BACKEND.priority)
'''


@pytest.fixture
def extra_entry_points(monkeypatch, tmp_path):
    """Publish extra entry points for the duration of a test; the registry comes back as it was."""
    (tmp_path / "toy_backend.py").write_text(textwrap.dedent(_TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, name in ((dispatch, "_registry"), (dispatch, "_status_cache"), (backends, "_declared"),
                         (backends, "_errors")):
        table = getattr(module, name)
        monkeypatch.setattr(module, name, {k: list(v) if isinstance(v, list) else v for k, v in table.items()})
    monkeypatch.setattr(dispatch, "_sorted", {})
    monkeypatch.setattr(dispatch, "_choices", {})
    real = importlib.metadata.entry_points

    def publish(*extra: tuple[str, str]) -> None:
        entries = [importlib.metadata.EntryPoint(n, v, backends.ENTRY_POINT_GROUP) for n, v in extra]

        def entry_points(**selection):
            found = list(real(**selection))
            return found + entries if selection.get("group") == backends.ENTRY_POINT_GROUP else found

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
        backends.load()
        dispatch._forget_choices()

    yield publish
    dispatch._forget_choices()


def test_a_third_party_backend_joins_through_the_same_entry_point_group(extra_entry_points):
    extra_entry_points(("toy", "toy_backend:BACKEND"))
    status = pnn.available_backends()
    assert status["toy"] and status["toy"].reason == "toy: always here"
    x = np.ones((2, 3))
    assert pnn.explain(pnn.layer_norm, x).backend == "toy"  # priority 7 beats numba's 5 under auto
    with pnn.use_backend("toy"):
        np.testing.assert_array_equal(pnn.layer_norm(x), np.full((2, 3), 42.0))
    assert "toy" in [row["backend"] for row in pnn.capabilities() if row["op"] == "layer_norm"]


def test_a_backend_that_fails_to_load_is_reported_not_fatal(extra_entry_points):
    extra_entry_points(("broken", "no_such_package_anywhere:BACKEND"), ("misnamed", "toy_backend:BACKEND"))
    status = pnn.available_backends()
    assert not status["broken"]
    assert "failed to load" in status["broken"].reason and "ModuleNotFoundError" in status["broken"].reason
    assert not status["misnamed"] and "'toy'" in status["misnamed"].reason
    with pytest.raises(pnn.BackendUnavailableError, match="broken"):
        with pnn.use_backend("broken"):
            pnn.layer_norm(np.ones((2, 3)))
    assert pnn.available_backends()["numba"]  # the others are untouched


def _code_without_docstrings(path: Path) -> str:
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            body[0].value.value = ""
    return ast.unparse(tree)


@pytest.mark.parametrize("module", ["config.py", "dispatch.py", "backends.py"])
def test_the_core_holds_no_list_of_backends(module):
    """Backends declare themselves: no backend name appears in the selection machinery's code."""
    code = _code_without_docstrings(ROOT / "portable_nn" / module)
    code = re.sub(r"#.*", "", code)
    found = [name for name in ("numba", "numba_cuda", "cupy", "aten", "kernels_cpu", "kernels_gpu", "kernels_aten")
             if re.search(rf"['\"]{name}['\"]", code)]
    assert found == [], f"{module} names backends {found}"


def test_the_how_to_page_names_what_the_toy_backend_touched():
    """docs/reference/adding-a-backend.md names the two things the toy backend above needed."""
    page = (ROOT / "docs" / "reference" / "adding-a-backend.md").read_text()
    assert 'BACKEND = Backend(' in page and "register_builtin(" in page
    assert '[project.entry-points."portable_nn.backends"]' in page
    assert "tests/test_backends.py" in page


# --------------------------------------------------------------------------- capability claims

#: Phrases a kernel's capability note may use, and what the op must take for the claim to hold.
_CLAIMS = {
    r"\bbidirectional\b": lambda spec: "bidirectional" in spec.arguments,
    r"\bbatch_first\b": lambda spec: "batch_first" in spec.arguments,
    r"\blengths\b": lambda spec: "lengths" in spec.arguments,
    r"\bstacked\b": lambda spec: "params" in spec.arguments,
    r"GRU forms|reset_after": lambda spec: "reset_after" in spec.arguments,
    r"projections?\b(?! of)": lambda spec: spec.name in ("lstm", "conv", "dense", "rnn", "gru", "rnn_cell",
                                                          "lstm_cell", "gru_cell"),
    r"LSTM projections": lambda spec: spec.name == "lstm",
    r"\bignore_index\b": lambda spec: "ignore_index" in spec.arguments,
    r"\bsmoothing\b": lambda spec: "label_smoothing" in spec.arguments,
    r"\btargets?\b": lambda spec: "target" in spec.arguments,
    r"\bactivations?\b": lambda spec: "activation" in spec.arguments,
    r"\bkeepdims\b": lambda spec: "keepdims" in spec.arguments,
    r"\bcorrection\b": lambda spec: "correction" in spec.arguments,
    r"\bceil_mode\b": lambda spec: "ceil_mode" in spec.arguments,
    r"\bdilation\b": lambda spec: "dilation" in spec.arguments,
    r"\bgroups\b": lambda spec: "groups" in spec.arguments,
    r"\bduplicate indices\b": lambda spec: "indices" in spec.arguments,
    r"tanh or relu|tanh/relu": lambda spec: spec.name in ("rnn", "rnn_cell"),
    r"\bstatistics\b": lambda spec: spec.family == "norm",
}


def _implementations():
    from portable_nn.api._common import spec_of

    for op in dispatch.op_names():
        for impl in dispatch.implementations(op):
            yield pytest.param(spec_of(op), impl, id=f"{op}-{impl.backend}")


@pytest.mark.parametrize(("spec", "impl"), list(_implementations()))
def test_every_capability_claim_holds_for_its_op(spec, impl):
    """A kernel's note (info's capability table) claims only options its op takes: a note shared by
    several ops must not name one op's options under another."""
    import re

    note = impl.supports.description
    wrong = [claim for claim, holds in _CLAIMS.items() if re.search(claim, note) and not holds(spec)]
    assert not wrong, f"{spec.name}[{impl.backend}] claims {wrong}: {note!r}"
