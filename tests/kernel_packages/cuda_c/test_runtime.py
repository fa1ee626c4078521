"""The CUDA C runtime: every kernel compiles (NVRTC) for sm_80 and sm_90, launches match the kernels'
signatures, the package imports no CuPy, codes shared with Python agree, torch tensors run zero-copy."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

import portable_nn as pnn
from kernels_gpu.cuda_c import _runtime as rt

FAMILIES = ("norm", "pool", "loss", "dense", "conv", "rnn")

ARCHS = ("sm_80", "sm_90")


from kernels_gpu.cuda_c import norm as cnorm  # noqa: E402

from .cuda_c_testing import HAS_NVRTC, _call, _family, _rng, compiled, recording  # noqa: E402


def _needs_compiler():
    if not HAS_NVRTC:
        pytest.skip("cuda-bindings (NVRTC) not installed")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_instantiation_compiles(family, arch):
    _needs_compiler()
    entries, lowered = compiled(family, arch)
    sigs = rt.kernel_signatures(family)
    names = rt.declared(family)
    assert names, "the launcher declares no kernels"
    for name in names:
        base, _ = rt.split_name(name)
        assert base in sigs, f"{name}: no __global__ {base} in {family}.cu"
        low = lowered[name]
        assert low in entries, f"{name} ({low}) is not an entry of the PTX"
        assert len(entries[low]) == len(sigs[base][1]), f"{name}: PTX and source disagree on the parameters"
    # Every kernel of the source is used by the launcher (no dead kernels).
    assert set(sigs) == {rt.split_name(n)[0] for n in names}


def test_a_syntax_error_fails_the_compile(monkeypatch):
    _needs_compiler()
    _family("norm")
    good = rt.source
    broken = "\n__global__ void broken(int* p) { p[0] = q; }\n"
    monkeypatch.setattr(rt, "source", lambda family: good(family) + broken)
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        rt.compile_ptx("norm", "sm_80")


def test_source_is_self_contained():
    text = rt.source("norm")
    # No #include left: it compiles with a bare NVRTC (no CUDA headers needed).
    assert not re.search(r"^\s*#\s*include", text, re.M) and "block_sum2" in text


def test_importing_the_package_does_not_import_cupy():
    code = "import sys, kernels_gpu.cuda_c, kernels_gpu.cuda_c.norm; print('cupy' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_backend_is_declared_and_unavailable_without_a_device():
    ops = {row["op"] for row in pnn.capabilities() if row["backend"] == "cupy"}
    assert {"layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm"} <= ops
    status = pnn.available_backends()["cupy"]
    if not status:
        x = np.zeros((2, 3), np.float32)
        with pnn.use_backend("cupy"), pytest.raises(pnn.BackendUnavailableError, match="cupy"):
            pnn.layer_norm(x)


def rounded(a, dtype: str):
    """Float64 data rounded to the values ``dtype`` can hold (what kernel and reference both see)."""
    if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
        return a
    if dtype == "bfloat16":
        return rt.bf16_bits_to_float(np, rt.float_to_bf16_bits(np, a.astype(np.float32))).astype(np.float64)
    return a.astype(dtype).astype(np.float64)


def test_block_sizes_are_checked(monkeypatch):
    monkeypatch.setattr(cnorm, "BLOCK", 48)
    monkeypatch.setattr(cnorm, "ROWS_PATH", False)  # the contiguous-rows kernels size their own blocks
    call = _call("layer_norm", (_rng().standard_normal((4, 8)),), {})
    with recording(), pytest.raises(ValueError, match="BLOCK must be a power of two"):
        cnorm.norm_forward(call)
    call = _call("moments", (_rng().standard_normal((4, 80)),), {"axis": -1})
    with recording(), pytest.raises(ValueError, match="BLOCK must be a power of two"):
        cnorm.moments_forward(call)


def test_bfloat16_bit_helpers_round_to_nearest_even():
    values = np.array([1.0, -2.5, 1.00390625, 1.01171875, 3.0e38, np.inf, -np.inf, np.nan, 0.0], np.float32)
    bits = rt.float_to_bf16_bits(np, values)
    back = rt.bf16_bits_to_float(np, bits)
    torch = pytest.importorskip("torch")

    expected = torch.tensor(values).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(back, expected)


@pytest.mark.gpu
def test_gpu_torch_tensors_run_zero_copy_on_the_current_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pnn.use_backend("cupy"):
        assert pnn.explain(pnn.layer_norm, x, w).backend == "cupy"
        y = pnn.layer_norm(x, w, activation="gelu")
    stream.synchronize()
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    expected = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x.float(), (16,), w))
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


def test_activation_codes_are_the_python_ones():
    """common.cuh spells the activation codes as PNN_ACT_* macros: the same numbers as
    portable_nn.kernel_codes (which the API and the Numba kernels use), one macro per name."""
    from pathlib import Path

    from portable_nn.kernel_codes import ACTIVATION_CODES

    header = (Path(rt.__file__).parent / "common.cuh").read_text()
    macros = {name.lower(): int(code) for name, code in re.findall(r"#define PNN_ACT_(\w+) (\d+)", header)}
    assert macros == ACTIVATION_CODES
    assert not re.search(r"case \d+:", header.split("act_fwd", 1)[1].split("block reductions", 1)[0])


def test_cell_family_codes_are_the_python_ones():
    """rnn.cu's KIND_* macros are portable_nn.kernel_codes.CELL_FAMILIES: one numbering of the recurrent cells."""
    from pathlib import Path

    from portable_nn.kernel_codes import CELL_FAMILIES

    source = (Path(rt.__file__).parent / "rnn.cu").read_text()
    macros = {name.lower(): int(code) for name, code in re.findall(r"#define KIND_(\w+) (\d+)", source)}
    assert macros == CELL_FAMILIES

