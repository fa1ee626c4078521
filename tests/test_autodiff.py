"""pnn.vjp: gradient structure, wrt, cotangent handling, out buffers, repeatability."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn


@pytest.fixture
def args():
    rng = np.random.default_rng(1)
    return rng.standard_normal((5, 7)), rng.standard_normal(7), rng.standard_normal(7)


def test_fields_in_signature_order_and_types(args):
    x, w, b = args
    y, pullback = pnn.vjp(pnn.layer_norm, x, w, b)
    grads = pullback(np.ones_like(y))
    assert type(grads).__name__ == "LayerNormGrads"
    assert grads._fields == ("x", "weight", "bias")
    assert [g.shape for g in grads] == [x.shape, w.shape, b.shape]
    np.testing.assert_array_equal(y, pnn.layer_norm(x, w, b))


def test_op_may_be_given_by_name(args):
    x, w, b = args
    y1, p1 = pnn.vjp("layer_norm", x, w, b)
    y2, p2 = pnn.vjp(pnn.layer_norm, x, w, b)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(p1(y1).x, p2(y2).x)


def test_wrt_skips_gradients_and_none_arguments_give_none(args):
    x, w, _ = args
    y, pullback = pnn.vjp(pnn.layer_norm, x, w, None, wrt=("weight", "bias"))
    grads = pullback(np.ones_like(y))
    assert grads.x is None and grads.bias is None and grads.weight is not None
    _, pullback = pnn.vjp(pnn.layer_norm, x, w, wrt="x")
    grads = pullback(np.ones_like(y))
    assert grads.weight is None and grads.x is not None


def test_wrt_does_not_call_backward_for_nothing(args):
    x, _, _ = args
    _, pullback = pnn.vjp(pnn.layer_norm, x, None, None, wrt=("weight",))
    assert pullback(np.ones_like(x)) == (None, None, None)


@pytest.mark.parametrize("wrt, exc", [("input", ValueError), (("x", "gamma"), ValueError), (3, TypeError)])
def test_bad_wrt(args, wrt, exc):
    x, w, b = args
    with pytest.raises(exc, match="wrt"):
        pnn.vjp(pnn.layer_norm, x, w, b, wrt=wrt)


def test_none_cotangent_is_zero(args):
    x, w, b = args
    _, pullback = pnn.vjp(pnn.layer_norm, x, w, b)
    grads = pullback(None)
    assert all(np.all(g == 0) for g in grads)
    _, pullback = pnn.vjp(pnn.moments, x, 1)
    only_mean = pullback((np.ones(5), None)).x
    np.testing.assert_allclose(only_mean, np.full_like(x, 1 / 7))


@pytest.mark.parametrize("library", ["numpy", "torch", "array_api_strict"])
def test_none_cotangent_is_zeros_of_the_outputs_library(args, library):
    x, _w, _b = args
    if library == "torch":
        torch = pytest.importorskip("torch")
        x = torch.from_numpy(x)
    elif library == "array_api_strict":
        xp = pytest.importorskip("array_api_strict")
        x = xp.asarray(x)
    _, pullback = pnn.vjp(pnn.moments, x, 1)
    grads = pullback((None, None))
    assert type(grads.x) is type(x)
    assert grads.x.shape == x.shape and not np.any(np.asarray(grads.x))


def test_pullback_keeps_no_output_alive(args):
    """The pullback holds what the backward needs, not the outputs: a caller (or autograd) that drops
    an output frees its memory at once, as a framework's own op would."""
    import gc
    import weakref

    x, w, b = args
    y, pullback = pnn.vjp(pnn.layer_norm, x, w, b)
    held = weakref.ref(y)
    dy = np.ones_like(y)
    del y
    gc.collect()
    assert held() is None
    assert pullback(dy).x.shape == x.shape


def test_pullback_is_repeatable_and_linear(args):
    x, w, b = args
    y, pullback = pnn.vjp(pnn.layer_norm, x, w, b, activation="gelu")
    dy = np.random.default_rng(2).standard_normal(y.shape)
    first, second, doubled = pullback(dy), pullback(dy), pullback(2 * dy)
    for a, c, d in zip(first, second, doubled):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_allclose(d, 2 * a, rtol=1e-12, atol=1e-14)


def test_out_buffers_receive_gradients(args):
    x, w, b = args
    y, pullback = pnn.vjp(pnn.layer_norm, x, w, b)
    dy = np.ones_like(y)
    expected = pullback(dy)
    buffers = {"x": np.empty_like(x), "weight": np.empty_like(w)}
    grads = pullback(dy, out=buffers)
    assert grads.x is buffers["x"] and grads.weight is buffers["weight"]
    np.testing.assert_array_equal(grads.x, expected.x)
    np.testing.assert_array_equal(grads.bias, expected.bias)
    again = pullback(dy, out=grads)  # a gradients tuple works as out= too
    assert again.x is buffers["x"]


@pytest.mark.parametrize(
    "out, exc, match",
    [
        ({"x": np.empty((2, 2))}, ValueError, r"out\['x'\] must have the shape"),
        ({"gamma": np.empty(7)}, ValueError, "unknown gradient field"),
        ([np.empty(7)], TypeError, "mapping"),
    ],
)
def test_bad_out_buffers(args, out, exc, match):
    x, w, b = args
    y, pullback = pnn.vjp(pnn.layer_norm, x, w, b)
    with pytest.raises(exc, match=match):
        pullback(np.ones_like(y), out=out)


@pytest.mark.parametrize(
    "dy, exc, match",
    [
        (np.ones((5, 6)), ValueError, "cotangent must have the output's shape"),
        (np.ones((5, 7), np.float32), TypeError, "cotangent has dtype float32"),
        ([[1.0]], TypeError, "cotangent must be an array"),
    ],
)
def test_bad_cotangents(args, dy, exc, match):
    x, w, b = args
    _, pullback = pnn.vjp(pnn.layer_norm, x, w, b)
    with pytest.raises(exc, match=match):
        pullback(dy)


def test_multi_output_cotangent_needs_a_tuple(args):
    x = args[0]
    _, pullback = pnn.vjp(pnn.moments, x, 0)
    with pytest.raises(ValueError, match="tuple of 2 cotangents"):
        pullback(np.ones(7))


def test_vjp_updates_running_stats_like_a_plain_call():
    x = np.random.default_rng(3).standard_normal((6, 3, 4))
    rm1, rv1, rm2, rv2 = np.zeros(3), np.ones(3), np.zeros(3), np.ones(3)
    pnn.batch_norm(x, running_mean=rm1, running_var=rv1)
    pnn.vjp(pnn.batch_norm, x, running_mean=rm2, running_var=rv2)
    np.testing.assert_array_equal(rm1, rm2)
    np.testing.assert_array_equal(rv1, rv2)


def test_vjp_given_an_array_names_its_type_without_printing_it():
    with pytest.raises(TypeError, match=r"got a NumPy array of shape \(100, 100\)") as info:
        pnn.vjp(np.zeros((100, 100)), np.ones(3))
    assert len(str(info.value)) < 400
