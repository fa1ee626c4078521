"""Dispatch: selection, explain, capabilities, availability, third-party kernels, array families."""

from __future__ import annotations

import numpy as np
import pytest

import portable_nn as pnn
from pnn_testing import HAS_STRICT, HAS_TORCH, to_numpy

torch = pytest.importorskip("torch") if HAS_TORCH else None


def _x(shape=(4, 6), seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def test_available_backends_reports_reasons():
    status = pnn.available_backends()
    assert set(status) >= {"reference", "numba", "numba_cuda", "cupy"}
    assert status["reference"] and status["reference"].available
    for name, st in status.items():
        assert isinstance(st.reason, str) and st.reason, name
        assert bool(st) == st.available


def test_explain_names_implementation_and_passed_over_candidates():
    x = _x()
    report = pnn.explain(pnn.layer_norm, x, np.ones(6), np.zeros(6))
    candidates = {impl.backend for impl in pnn.dispatch.implementations("layer_norm")}
    assert report.backend in candidates
    assert report.implementation == f"layer_norm[{report.backend}]"
    assert {b for b, _ in report.passed_over} == candidates - {report.backend}
    text = str(report)
    assert f"runs: layer_norm[{report.backend}]" in text
    assert "copies: none" in text
    assert "NumPy" in text and "float64" in text


def test_explain_accepts_op_names_and_validates():
    x = _x((4, 3, 2))
    assert pnn.explain("batch_norm", x).backend == pnn.explain(pnn.batch_norm, x).backend
    with pytest.raises(ValueError, match="eps"):
        pnn.explain(pnn.layer_norm, _x(), eps=0)
    with pytest.raises(TypeError, match="portable_nn op"):
        pnn.explain(np.mean, _x())


def test_explain_reports_a_forced_backend_that_would_raise():
    with pnn.use_backend("cupy"):
        text = str(pnn.explain(pnn.layer_norm, _x()))
    assert "would raise BackendUnavailableError" in text and "cupy" in text


def test_capabilities_table_comes_from_declarations():
    rows = pnn.capabilities()
    keys = {"op", "backend", "arrays", "dtypes", "layouts", "notes", "available"}
    assert rows and all(set(r) == keys for r in rows)
    ops = {r["op"] for r in rows if r["backend"] == "reference"}
    assert {"moments", "batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"} <= ops

    pnn.register_kernel(
        "rms_norm", "toy", forward=lambda call: ((call.x,), None),
        supports=pnn.Support(families=("numpy",), dtypes=("float32",), contiguous=True, description="N <= 8"),
    )
    try:
        row = next(r for r in pnn.capabilities() if r["backend"] == "toy")
        assert row["op"] == "rms_norm" and row["dtypes"] == "float32" and "numpy" in row["arrays"]
        assert "forward only" in row["notes"] and "N <= 8" in row["notes"] and "C order" in row["notes"]
    finally:
        pnn.unregister_kernel("rms_norm", "toy")


def test_register_kernel_forward_and_backward_are_used():
    seen = {}

    def forward(call):
        seen["forward"] = (call.family, call.dtype, call.save, call.eps)
        y = call.x * 2.0
        return (y,), ("saved", call.x)

    def backward(residuals, cotangents, needs):
        seen["backward"] = (residuals[0], sorted(needs))
        return {"x": cotangents[0] * 2.0}

    pnn.register_kernel("rms_norm", "doubler", forward=forward, backward=backward, priority=100)
    try:
        x = _x()
        np.testing.assert_array_equal(pnn.rms_norm(x), 2 * x)
        assert seen["forward"] == ("numpy", "float64", False, 1e-6)
        y, pullback = pnn.vjp(pnn.rms_norm, x, eps=1e-3)
        grads = pullback(np.ones_like(y))
        assert seen["forward"][2:] == (True, 1e-3)
        assert seen["backward"] == ("saved", ["x"])
        np.testing.assert_array_equal(grads.x, np.full_like(x, 2.0))
        assert grads.weight is None
        with pnn.use_backend("doubler"):
            assert pnn.explain(pnn.rms_norm, x).backend == "doubler"
        with pnn.use_backend("reference"):
            assert not np.allclose(pnn.rms_norm(x), 2 * x)
    finally:
        pnn.unregister_kernel("rms_norm", "doubler")
    assert pnn.explain(pnn.rms_norm, _x()).backend != "doubler"


def test_forward_only_kernel_is_passed_over_by_vjp():
    pnn.register_kernel("rms_norm", "fwd_only", forward=lambda call: ((call.x * 0,), None), priority=100)
    try:
        x = _x()
        assert np.all(pnn.rms_norm(x) == 0)
        y, _ = pnn.vjp(pnn.rms_norm, x)
        assert not np.all(y == 0)  # the reference ran, since fwd_only cannot give gradients
        with pnn.use_backend("fwd_only"), pytest.raises(pnn.BackendUnavailableError, match="backward"):
            pnn.vjp(pnn.rms_norm, x)
    finally:
        pnn.unregister_kernel("rms_norm", "fwd_only")


def test_remembered_choices_follow_registrations_predicates_and_fallback_mode():
    """Selections are remembered per call signature; nothing that changes the answer is missed."""
    x = _x()
    pnn.layer_norm(x)  # remembered: the best kernel for numpy float64
    odd = pnn.Support(check=lambda call: "declines odd widths" if call.x.shape[-1] % 2 else None)
    pnn.register_kernel("layer_norm", "fresh", forward=lambda call: ((call.x * 0,), None), supports=odd,
                        priority=100)
    try:
        assert np.all(pnn.layer_norm(_x((3, 4))) == 0)  # a new registration is seen at once
        report = pnn.explain(pnn.layer_norm, _x((3, 5)))  # a predicate is consulted per call
        assert report.backend != "fresh" and report.fallback
        pnn.set_fallback("warn")
        for _ in range(2):  # every fallback warns, not just the first one
            with pytest.warns(pnn.FallbackWarning, match="declines odd widths"):
                pnn.layer_norm(_x((3, 5)))
    finally:
        pnn.unregister_kernel("layer_norm", "fresh")
    assert pnn.explain(pnn.layer_norm, _x((3, 4))).backend != "fresh"
    if pnn.available_backends()["numba"]:  # a remembered fallback (numba's moments declines float16) still warns
        for _ in range(2):
            with pytest.warns(pnn.FallbackWarning, match="float16"):
                pnn.moments(_x((3, 4)).astype(np.float16), 0)


def test_a_remembered_choice_asks_its_value_predicates_again():
    """A choice made with a ``Support.check`` is remembered, but the predicate is asked on every call:
    the same signature with other values is accepted or declined afresh, under auto and forced."""
    asked = []

    def small_eps_only(call):
        asked.append(call.eps)
        return None if call.eps < 1e-3 else "declines a large eps"

    fussy = pnn.Support(families=("numpy",), check=small_eps_only)
    pnn.register_kernel("layer_norm", "fussy", forward=lambda call: ((call.x * 0,), None), supports=fussy,
                        priority=100)
    x = _x((3, 4))
    try:
        for eps, taken in [(1e-5, True), (0.1, False), (1e-5, True), (0.1, False)]:
            assert np.all(pnn.layer_norm(x, eps=eps) == 0) == taken
        with pnn.use_backend("fussy"):
            assert np.all(pnn.layer_norm(x) == 0)
            with pytest.raises(pnn.BackendUnavailableError, match="declines a large eps"):
                pnn.layer_norm(x, eps=0.1)
            assert np.all(pnn.layer_norm(x) == 0)
        assert len(asked) >= 7
    finally:
        pnn.unregister_kernel("layer_norm", "fussy")


def test_call_arguments_read_as_attributes_without_hiding_its_own():
    a, b = _x(), _x()
    call = pnn.dispatch.Call("layer_norm", {"x": a, "replace": b, "eps": b}, {"eps": 1.0, "dtype": "int8"},
                             xp=np, family="numpy", device="cpu", dtype="float64")
    assert call.x is a and call.eps is b  # arrays over params
    assert call.dtype == "float64" and call.params["dtype"] == "int8"  # the call's own attributes over both
    assert callable(call.replace) and call.arrays["replace"] is b  # and never a method
    copy = call.replace(save=True)
    assert copy.save and not call.save and copy.x is a and copy.dtype == "float64"
    with pytest.raises(AttributeError, match="layer_norm call has no argument 'weight'"):
        call.weight  # noqa: B018


def test_fallback_message_names_only_kernels_made_for_these_arrays():
    """A GPU kernel never targeted NumPy arrays: it did not decline the call, so it is not named."""
    gpu = pnn.Support(families=("cupy",), devices=("cuda",))
    pnn.register_kernel("layer_norm", "gpu_only", forward=lambda call: ((call.x,), None), supports=gpu)
    fussy = pnn.Support(families=("numpy",), check=lambda call: "declines every call")
    pnn.register_kernel("layer_norm", "fussy", forward=lambda call: ((call.x,), None), supports=fussy)
    try:
        pnn.set_fallback("warn")
        with pytest.warns(pnn.FallbackWarning) as caught:
            pnn.layer_norm(_x((3, 4)))
        message = str(caught[0].message)
        assert "fussy declines every call" in message and "gpu_only" not in message
    finally:
        pnn.unregister_kernel("layer_norm", "gpu_only")
        pnn.unregister_kernel("layer_norm", "fussy")


def test_explain_under_a_forced_backend_says_the_others_were_not_requested():
    with pnn.use_backend("reference"):
        report = pnn.explain(pnn.layer_norm, _x())
    assert report.backend == "reference"
    reasons = dict(report.passed_over)
    if pnn.available_backends()["numba"]:
        assert reasons["numba"].startswith("not requested (reference forced by")
    assert not any("lower priority" in r for r in reasons.values())


def test_register_kernel_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown op"):
        pnn.register_kernel("softmax9", "x", forward=lambda c: c)
    with pytest.raises(ValueError, match="auto"):
        pnn.register_kernel("conv", "auto", forward=lambda c: c)
    with pytest.raises(TypeError, match="forward"):
        pnn.register_kernel("conv", "mine", forward=42)
    with pytest.raises(TypeError, match="Support"):
        pnn.register_kernel("conv", "mine", forward=lambda c: c, supports={"dtypes": ("float32",)})


def test_contiguous_kernel_gets_a_copy_and_explain_reports_it():
    seen = {}

    def forward(call):
        seen["contiguous"] = call.x.flags.c_contiguous
        return (call.xp.asarray(call.x, copy=True),), None

    pnn.register_kernel(
        "rms_norm", "needs_c", forward=forward, supports=pnn.Support(contiguous=True), priority=100
    )
    try:
        x = _x((6, 4)).T  # Fortran-ordered view
        with pnn.use_backend("needs_c"):
            report = pnn.explain(pnn.rms_norm, x)
            assert report.copies == ["x"] and "x made C-contiguous" in str(report)
            np.testing.assert_array_equal(pnn.rms_norm(x), x)
        assert seen["contiguous"]
        assert pnn.explain(pnn.rms_norm, np.ascontiguousarray(x)).copies == []
    finally:
        pnn.unregister_kernel("rms_norm", "needs_c")


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_numpy_native_kernel_gets_zero_copy_views_of_torch_tensors():
    seen = {}

    def forward(call):
        seen["type"] = type(call.x)
        seen["shares"] = call.x.ctypes.data
        return (call.x + 1.0,), None

    pnn.register_kernel(
        "rms_norm", "np_kernel", forward=forward,
        supports=pnn.Support(families=("numpy", "torch"), devices=("cpu",), native="numpy"), priority=100,
    )
    try:
        x = torch.randn(3, 4, dtype=torch.float64)
        y = pnn.rms_norm(x)
        assert isinstance(y, torch.Tensor) and torch.equal(y, x + 1)
        assert seen["type"] is np.ndarray and seen["shares"] == x.data_ptr()
    finally:
        pnn.unregister_kernel("rms_norm", "np_kernel")


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_results_are_tensors_without_autograd_history():
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    y = pnn.batch_norm(x, weight=w)
    assert isinstance(y, torch.Tensor) and not y.requires_grad and y.grad_fn is None
    y, pullback = pnn.vjp(pnn.batch_norm, x, weight=w)
    g = pullback(torch.ones_like(y))
    assert isinstance(g.x, torch.Tensor) and not g.x.requires_grad
    assert isinstance(g.weight, torch.Tensor) and g.bias is None


@pytest.mark.skipif(not HAS_STRICT, reason="array_api_strict not installed")
def test_array_api_strict_results_stay_array_api_strict():
    import array_api_strict as xps

    x = xps.asarray(_x((3, 5)))
    y = pnn.layer_norm(x)
    assert type(y) is type(x)
    np.testing.assert_allclose(to_numpy(y), to_numpy(pnn.layer_norm(_x((3, 5)))), rtol=1e-12)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("which", ["weight", "bias"])
def test_mixed_array_libraries_are_an_error(which):
    x = np.ones((2, 3))
    args = {"weight": np.ones(3), "bias": np.zeros(3)}
    args[which] = torch.ones(3, dtype=torch.float64)
    with pytest.raises(TypeError, match=f"different libraries.*{which} is a PyTorch tensor"):
        pnn.layer_norm(x, **args)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_mixed_devices_are_an_error():
    x = torch.ones(2, 3, dtype=torch.float64)
    w = torch.ones(3, dtype=torch.float64, device="meta")
    with pytest.raises(ValueError, match="different devices.*weight on meta"):
        pnn.layer_norm(x, w)


def test_kernel_packages_never_import_each_other():
    """Each backend package stands alone: shared code lives in portable_nn (kernel_plans, kernel_cache)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    packages = {"kernels_cpu": "kernels_cpu", "kernels_aten": "kernels_aten",
                "kernels_gpu/numba_cuda": "kernels_gpu.numba_cuda", "kernels_gpu/cuda_c": "kernels_gpu.cuda_c"}
    offending = []
    for folder, own in packages.items():
        others = [name for name in packages.values() if name != own]
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                offending += [f"{path.relative_to(root)} imports {n}" for n in names
                              if any(n == o or n.startswith(o + ".") for o in others)]
    assert not offending, offending


def test_no_module_imports_the_command_line():
    """``__main__`` is the command line only: what it reports lives in portable_nn.about."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offending = []
    for folder in ("portable_nn", "kernels_cpu", "kernels_aten", "kernels_gpu"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "__main__.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                if any(n == "__main__" or n.endswith(".__main__") for n in names):
                    offending.append(str(path.relative_to(root)))
    assert not offending, offending


def test_kernel_constants_come_from_one_dependency_free_module():
    """Activation codes and keeps_output_only live in portable_nn.kernel_codes, which imports
    nothing of ours; the reference does not import the API at run time; kernels take nothing
    from the reference."""
    import ast
    from pathlib import Path

    import portable_nn
    from portable_nn import kernel_codes

    assert portable_nn.ACTIVATIONS is kernel_codes.ACTIVATION_CODES
    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "portable_nn" / "kernel_codes.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert set(imported) <= {"__future__", "typing"}, imported
    offending = []
    for folder in ("kernels_cpu", "kernels_aten", "kernels_gpu"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offending += [f"{path.relative_to(root)} imports {n}" for n in names
                              if n == "portable_nn.reference" or n.startswith("portable_nn.reference.")]
    assert not offending, offending
    reference = (root / "portable_nn" / "reference" / "activations.py").read_text()
    assert "if TYPE_CHECKING:" in reference and "\nfrom ..api" not in reference


def test_byte_swapped_numpy_arrays_are_copied_to_native_order_visibly():
    """Numba cannot type a '>f4' array: a kernel needing C order gets a native copy, and explain says so."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((4, 8)), rng.standard_normal(8)
    swapped = x.astype(x.dtype.newbyteorder()), w.astype(w.dtype.newbyteorder())
    assert not swapped[0].dtype.isnative
    before = [a.copy() for a in swapped]
    with pnn.use_backend("numba"):
        report = pnn.explain(pnn.layer_norm, *swapped)
        assert report.copies == ["x", "weight"]
        y, pullback = pnn.vjp(pnn.layer_norm, *swapped)
        grads = pullback(np.ones_like(y))
    expected, ref_pullback = pnn.vjp(pnn.layer_norm, x, w)
    assert np.array_equal(y, expected)
    assert np.allclose(grads.weight, ref_pullback(np.ones_like(y)).weight, rtol=1e-12)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(swapped, before))  # inputs untouched
