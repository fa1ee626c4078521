"""conv_transpose through the adapters: the ``portable_nn.torch.ConvTranspose1d/2d/3d`` drop-ins
against ``torch.nn`` (state_dict, output_size, channels last, unbatched, gradients, each CPU
backend) and ``portable_nn.jax.conv_transpose`` under ``jax.grad`` and ``jit``."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn

torch = pytest.importorskip("torch")
pt = pytest.importorskip("portable_nn.torch")

MODULES = [(1, "ConvTranspose1d", (2, 4, 7)), (2, "ConvTranspose2d", (2, 4, 5, 4)),
           (3, "ConvTranspose3d", (1, 4, 3, 2, 3))]


@pytest.mark.parametrize("backend", ["auto", "numba", "reference"])
@pytest.mark.parametrize("d, name, shape", MODULES)
def test_modules_match_torch_nn(backend, d, name, shape):
    torch.manual_seed(d)
    theirs = getattr(torch.nn, name)(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1).double()
    ours = getattr(pt, name)(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, activation="relu").double()
    ours.load_state_dict(theirs.state_dict())
    assert ours.weight.shape == (4, 3, *(3,) * d)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    size = [2 * s for s in shape[2:]]
    with pnn.use_backend(backend):
        y = ours(x, output_size=size)
        g = torch.autograd.grad((y * y).sum(), (x, ours.weight, ours.bias))
    want = torch.relu(theirs(x, output_size=size))
    w = torch.autograd.grad((want * want).sum(), (x, theirs.weight, theirs.bias))
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(g, w):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # channels last and unbatched
    last = getattr(pt, name)(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, channel_axis=-1).double()
    last.load_state_dict(theirs.state_dict())
    with pnn.use_backend(backend):
        yl = last(x.detach().movedim(1, -1).contiguous())
        y0 = ours(x.detach()[0])
    torch.testing.assert_close(yl.movedim(-1, 1), theirs(x.detach()), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y0, torch.relu(theirs(x.detach()[0])), rtol=1e-10, atol=1e-12)
    assert "activation=relu" in repr(ours) and "channel_axis=-1" in repr(last)


def test_jax_grad_and_jit_match_the_reference():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    pj = pytest.importorskip("portable_nn.jax")
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 4, 5, 5)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(6)
    kw = dict(stride=2, padding=1, output_padding=1, groups=2, activation="gelu")

    def loss(x, w, b):
        return (pj.conv_transpose(x, w, b, **kw) ** 2).sum()

    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        args = tuple(jnp.asarray(a) for a in (x, w, b))
        got = jax.grad(loss, argnums=(0, 1, 2))(*args)
        jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    finally:
        jax.config.update("jax_enable_x64", previous)
    with pnn.use_backend("reference"):
        y, pullback = pnn.vjp(pnn.conv_transpose, x, w, b, **kw)
        want = pullback(2 * y)
    for a, c, e in zip(got, jitted, want):
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(np.asarray(c), e, rtol=1e-10, atol=1e-10)
