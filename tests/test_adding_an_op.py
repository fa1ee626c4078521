"""docs/reference/adding-an-op.md, kept true: an op added in the two files it names works everywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Item 1 of the page: the public function, in its family's api module, listed in its __all__.
API = '''

@public_op(grad_fields=("x",))
def scale_shift(x: Array, *, scale: float = 2.0) -> Array:
    """A toy op: y = scale · x + 1.

    Args:
        x: any floating array.
        scale: the factor, > 0.

    Returns:
        ``y`` with ``x``'s shape and dtype.
    """
    check_array(x, "x")
    family, device = check_same_library({"x": x})
    dtype = floating_dtype(_arrays.namespace(x), x, "x")
    params = {"scale": check_positive_float(scale, "scale")}
    call = make_call("scale_shift", {"x": x}, params, family=family, device=device, dtype=dtype)
    return Prepared(call, ("x",), {"x": x})


__all__ += ["scale_shift"]
'''

#: Item 2: the reference, found by its naming rule in the family's reference module.
REFERENCE = '''

def scale_shift_forward(call):
    return (call.x * call.params["scale"] + 1,), call.params["scale"]


def scale_shift_backward(residuals, cotangents, needs):
    return {"x": cotangents[0] * residuals}
'''

CHECK = '''
import numpy as np
import portable_nn as pnn
from portable_nn import dispatch

assert pnn.__file__.startswith(COPY), pnn.__file__
assert "scale_shift" in dispatch.op_names() and "scale_shift" in pnn.__all__
x = np.arange(6.0).reshape(2, 3)
np.testing.assert_allclose(pnn.scale_shift(x, scale=3.0), 3 * x + 1)
y, pullback = pnn.vjp(pnn.scale_shift, x, scale=3.0)
np.testing.assert_allclose(pullback(np.ones_like(x)).x, np.full_like(x, 3.0))
assert pnn.explain(pnn.scale_shift, x).backend == "reference"
assert [r["backend"] for r in pnn.capabilities() if r["op"] == "scale_shift"] == ["reference"]
try:
    pnn.scale_shift(x, scale=-1.0)
except ValueError as exc:
    assert "scale" in str(exc)
else:
    raise AssertionError("a bad scale was accepted")

import torch
import portable_nn.torch as pnt

t = torch.arange(6.0, dtype=torch.float64, requires_grad=True)
pnt.scale_shift(t, scale=3.0).sum().backward()
assert torch.equal(t.grad, torch.full_like(t, 3.0))
compiled = torch.compile(lambda v: pnt.scale_shift(v).sum(), backend="aot_eager", fullgraph=True)
assert float(compiled(t.detach())) == float((2 * t.detach() + 1).sum())
assert "scale_shift" in pnt.__all__ and "portable_nn.scale_shift" in pnt.scale_shift.__doc__

import jax
import jax.numpy as jnp
import portable_nn.jax as pnj

g = jax.grad(lambda v: pnj.scale_shift(v, scale=3.0).sum())(jnp.arange(6.0))
np.testing.assert_allclose(np.asarray(g), np.full(6, 3.0))
print("the toy op works everywhere")
'''


@pytest.mark.skipif(any(__import__("importlib").util.find_spec(m) is None for m in ("torch", "jax")),
                    reason="needs torch and jax")
def test_an_op_added_in_the_files_the_page_names_works_everywhere(tmp_path):
    page = (ROOT / "docs" / "reference" / "adding-an-op.md").read_text()
    assert "portable_nn/api/<family>.py" in page and "portable_nn/reference/<family>.py" in page
    copy = tmp_path / "portable_nn"
    shutil.copytree(ROOT / "portable_nn", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "api" / "norm.py", "a") as fh:
        fh.write(API)
    with open(copy / "reference" / "norm.py", "a") as fh:
        fh.write(REFERENCE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("PORTABLE_NN_BACKEND", None)
    script = f"COPY = {str(copy)!r}\n" + textwrap.dedent(CHECK)
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the toy op works everywhere" in result.stdout
