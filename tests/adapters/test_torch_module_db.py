"""PyTorch's own module test samples (``torch.testing._internal.common_modules.module_db``) through
our drop-in modules: every sample we accept gives torch.nn's output and input gradient, the ones we
refuse are exactly the documented gaps, and every error input raises torch.nn's exception type."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal needs it

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.testing._internal.common_modules import ModuleErrorEnum, module_db

import portable_nn.torch as pt  # noqa: E402

from .torch_samples_testing import clone  # noqa: E402

#: Every drop-in module with a ModuleInfo in torch 2.13's module_db.
OURS = sorted(info.module_cls.__name__ for info in module_db if info.module_cls.__name__ in pt.__all__)
INFOS = {info.module_cls.__name__: info for info in module_db if info.module_cls.__name__ in OURS}

#: What the drop-ins refuse with NotImplementedError today (and the argument that makes them).
KNOWN_GAPS: dict[str, str] = {}


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    data = getattr(value, "data", None)  # a PackedSequence
    return [data] if isinstance(data, torch.Tensor) else []


def _samples(info, training: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True,
                                       training=training)


def test_every_drop_in_with_module_samples_is_covered():
    assert set(OURS) >= {"LayerNorm", "BatchNorm2d", "GroupNorm", "RMSNorm", "Conv2d", "Linear", "LSTM", "GRU",
                         "RNN", "LSTMCell", "MaxPool2d", "AvgPool2d", "CrossEntropyLoss"}


@pytest.mark.parametrize("name", OURS)
def test_module_samples_match_torch(name):
    info = INFOS[name]
    compared = refused = 0
    for training in (True, False):
        for sample in _samples(info, training):
            ctor, fwd = sample.constructor_input, sample.forward_input
            if fwd is None:
                continue
            torch.manual_seed(0)
            ref = info.module_cls(*ctor.args, **ctor.kwargs).to(torch.float64).train(training)
            try:
                ours = getattr(pt, name)(*ctor.args, **ctor.kwargs)
            except NotImplementedError as exc:
                assert KNOWN_GAPS.get(name, "?") in str(exc), exc
                refused += 1
                continue
            ours = ours.to(torch.float64).train(training)
            ours.load_state_dict(ref.state_dict())
            args, kwargs = clone(fwd.args), clone(fwd.kwargs)
            want = ref(*fwd.args, **fwd.kwargs)
            got = ours(*args, **kwargs)
            want_t, got_t = _tensors(want), _tensors(got)
            assert len(got_t) == len(want_t), sample
            for g, w in zip(got_t, want_t):
                torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-9, equal_nan=True, msg=lambda m: f"{sample}: {m}")
            inputs = [t for t in _tensors(fwd.args) if t.requires_grad]
            if inputs and want_t[0].requires_grad:
                seed = torch.randn_like(want_t[0])
                grad_w = torch.autograd.grad(want_t[0], inputs, seed, allow_unused=True)
                grad_g = torch.autograd.grad(got_t[0], [t for t in _tensors(args) if t.requires_grad], seed,
                                             allow_unused=True)
                for g, w in zip(grad_g, grad_w):
                    if w is not None:
                        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9, msg=lambda m: f"{sample} grad: {m}")
            compared += 1
    assert compared > 0
    assert bool(refused) == (name in KNOWN_GAPS), f"{name}: {refused} samples refused"


@pytest.mark.parametrize("name", [n for n in OURS if INFOS[n].module_error_inputs_func is not None])
def test_module_error_inputs_raise_torchs_exception_type(name):
    """Each error input of module_db raises (an instance of) the exception type torch.nn raises."""
    info = INFOS[name]
    for dtype in (torch.float32, torch.float64):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            errors = info.module_error_inputs_func(info, device="cpu", dtype=dtype, requires_grad=False,
                                                   training=True)
        for error in errors:
            ctor, fwd = error.module_error_input.constructor_input, error.module_error_input.forward_input
            with pytest.raises(error.error_type):
                module = getattr(pt, name)(*ctor.args, **ctor.kwargs).to(dtype)
                if error.error_on == ModuleErrorEnum.FORWARD_ERROR:
                    module(*fwd.args, **fwd.kwargs)
