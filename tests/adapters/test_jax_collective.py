"""portable_nn.jax's batch_norm and moments with axis_name: statistics of the whole batch across a
mapped axis (shard_map and pmap on two host devices in a subprocess; vmap in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pnj = pytest.importorskip("portable_nn.jax")
from portable_nn.adapters.jax import collective  # noqa: E402

_TWO_DEVICES = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import portable_nn.jax as pnj

    assert len(jax.devices()) == 2
    rng = np.random.default_rng(0)

    def close(a, b, what, rtol=1e-10):
        a, b = np.asarray(a), np.asarray(b)
        err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)
        assert err <= rtol, f"{what}: relative error {err:.2e}"

    mesh = Mesh(np.array(jax.devices()), ("data",))
    for channel_axis, act in ((1, "gelu"), (-1, "relu")):
        x = jnp.asarray(rng.standard_normal((6, 3, 4, 5)) * 2 + 3)
        c = x.shape[channel_axis]
        w, b = jnp.asarray(rng.standard_normal(c)), jnp.asarray(rng.standard_normal(c))
        dy = jnp.asarray(rng.standard_normal(x.shape))

        def full(x, w, b):
            return jnp.sum(pnj.batch_norm(x, weight=w, bias=b, activation=act, channel_axis=channel_axis) * dy)

        def local(x, w, b, dy):
            y = pnj.batch_norm(x, weight=w, bias=b, activation=act, channel_axis=channel_axis, axis_name="data")
            return jax.lax.psum(jnp.sum(y * dy), "data")

        sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")), out_specs=P())
        close(sharded(x, w, b, dy), full(x, w, b), "loss")
        grads = jax.grad(lambda *a: sharded(*a, dy), argnums=(0, 1, 2))(x, w, b)
        for name, got, want in zip("xwb", grads, jax.grad(full, argnums=(0, 1, 2))(x, w, b)):
            close(got, want, f"d{name}, channel_axis={channel_axis}")

    # moments with a correction, kept axes, under shard_map
    x = jnp.asarray(rng.standard_normal((8, 5)) + 100)
    got = jax.shard_map(lambda v: pnj.moments(v, axis=0, keepdims=True, correction=1, axis_name="data"), mesh=mesh,
                        in_specs=P("data"), out_specs=P())(x)
    close(got[0], jnp.mean(x, axis=0, keepdims=True), "mean")
    close(got[1], jnp.var(x, axis=0, keepdims=True, ddof=1), "var")

    # pmap: running statistics from the whole batch, the same on both devices
    x = jnp.asarray(rng.standard_normal((6, 3, 4)) + 1)
    rm, rv = jnp.asarray(rng.standard_normal(3)), jnp.asarray(rng.random(3) + 0.5)
    step = jax.pmap(lambda v: pnj.batch_norm(v, running_mean=rm, running_var=rv, momentum=0.3, return_stats=True,
                                             axis_name="d"), axis_name="d")
    y, new_mean, new_var = step(x.reshape(2, 3, 3, 4))
    y_full, mean_full, var_full = pnj.batch_norm(x, running_mean=rm, running_var=rv, momentum=0.3, return_stats=True)
    close(y.reshape(x.shape), y_full, "y")
    for k in range(2):
        close(new_mean[k], mean_full, "running_mean")
        close(new_var[k], var_full, "running_var")
    print("two devices: ok")
''')


def test_shard_map_and_pmap_match_the_whole_batch():
    """Outputs, every gradient and the running statistics on two devices equal one device's over
    the whole batch (float64, 1e-10)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "two devices: ok" in out.stdout


def _parts(count: int, rows: int, offset: float) -> np.ndarray:
    return (np.random.default_rng(3).standard_normal((count, rows, 4)) + offset).astype(np.float32)


def test_float32_parts_with_a_large_mean_keep_their_variance():
    """Eight parts of float32 data with mean 1e4 and standard deviation 1: the merged variance
    stays within 1e-3 of float64's; merging sums and sums of squares (E[x²] − E[x]²) does not."""
    parts = _parts(8, 16, 1e4)
    whole = parts.astype(np.float64).reshape(-1, 4)
    _, var = jax.vmap(lambda p: pnj.moments(p, axis=0, axis_name="parts"), axis_name="parts")(jnp.asarray(parts))
    assert np.max(np.abs(np.asarray(var[5]) / whole.var(axis=0) - 1)) < 1e-3

    def naive(p):
        n = jax.lax.psum(p.shape[0], "parts")
        s1, s2 = jax.lax.psum(jnp.sum(p, axis=0), "parts"), jax.lax.psum(jnp.sum(p * p, axis=0), "parts")
        return s2 / n - (s1 / n) ** 2

    naive_var = jax.vmap(naive, axis_name="parts")(jnp.asarray(parts))[0]
    assert np.max(np.abs(np.asarray(naive_var) / whole.var(axis=0) - 1)) > 1.0


def test_parts_without_values_contribute_nothing():
    """Chan's merge over parts, one of them empty (count 0, whatever its mean says)."""
    rng = np.random.default_rng(4)
    sizes = [0, 5, 3]
    data = [rng.standard_normal((n, 2)) for n in sizes]
    means = jnp.asarray([d.mean(axis=0) if len(d) else np.full(2, np.nan) for d in data])
    m2s = jnp.asarray([((d - d.mean(axis=0)) ** 2).sum(axis=0) if len(d) else np.full(2, np.nan) for d in data])
    total, mean, m2 = jax.vmap(lambda m, s, n: collective.merge_across(m, s, n, "parts"), axis_name="parts")(
        means, m2s, jnp.asarray(sizes, means.dtype))
    whole = np.concatenate(data)
    np.testing.assert_allclose(total[0], 8)
    np.testing.assert_allclose(mean[2], whole.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(m2[1], ((whole - whole.mean(axis=0)) ** 2).sum(axis=0), rtol=1e-6)


def test_running_statistics_in_evaluation_need_no_merge():
    """training=False with running statistics: nothing to merge, the plain op's result (no mapped
    axis needed)."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 3)))
    rm, rv = jnp.zeros(3), jnp.ones(3)
    got = pnj.batch_norm(x, running_mean=rm, running_var=rv, training=False, axis_name="data")
    np.testing.assert_allclose(got, pnj.batch_norm(x, running_mean=rm, running_var=rv, training=False))


def test_a_bad_axis_name_or_argument_is_named():
    x = jnp.ones((4, 3))
    with pytest.raises(TypeError, match="axis_name must be the name of a mapped axis"):
        pnj.batch_norm(x, axis_name=1.5)
    with pytest.raises(ValueError, match="weight"):
        pnj.batch_norm(x, weight=jnp.ones(5), axis_name="data")
    with pytest.raises(TypeError, match="moments"):
        pnj.moments(x, 0, 1, axis_name="data")
