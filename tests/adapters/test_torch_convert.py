"""``portable_nn.torch.convert``: a whole model's torch.nn layers on our kernels, in place, with the same
parameters (ties kept, an optimizer still valid), equal results, and the activations of
``nn.Sequential`` fused."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import portable_nn.torch as pnt  # noqa: E402


def _close(a, b, what):
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), f"{what}: {(a - b).abs().max().item():.2e}"


def _every_layer():
    """A float64 model with one of each kind of layer convert takes, and activations to fuse."""
    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.GroupNorm(2, 8), nn.SiLU(),
        nn.MaxPool2d(2), nn.InstanceNorm2d(8, affine=True), nn.Hardswish(), nn.AvgPool2d(2),
        nn.ConvTranspose2d(8, 4, 2, stride=2), nn.LeakyReLU(0.2),
    )
    head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 16), nn.GELU(approximate="tanh"), nn.LayerNorm(16),
                         nn.ELU(0.5), nn.RMSNorm(16), nn.Linear(16, 5), nn.Mish())
    return nn.ModuleDict({"features": features, "head": head, "rnn": nn.LSTM(5, 6, num_layers=2, bidirectional=True),
                          "gru": nn.GRU(5, 3)}).double()


def _run(model, x):
    y = model["head"](model["features"](x))
    out, _ = model["rnn"](y[:, None, :].expand(-1, 2, -1).contiguous())
    out2, _ = model["gru"](y[:, None, :])
    return y, out, out2


def test_every_layer_becomes_ours_with_the_same_parameters_and_results():
    model = _every_layer()
    reference = copy.deepcopy(model)
    params = list(model.parameters())
    buffers = list(model.buffers())
    assert pnt.convert(model) is model
    assert all(a is b for a, b in zip(model.parameters(), params)) and len(list(model.parameters())) == len(params)
    assert all(a is b for a, b in zip(model.buffers(), buffers))
    for name, module in model.named_modules():
        twin = getattr(pnt, type(module).__name__, None)
        if isinstance(twin, type) and getattr(nn, type(module).__name__, None) is not None \
                and isinstance(module, nn.Module) and not isinstance(module, nn.Sequential | nn.ModuleDict):
            assert type(module) is twin, name
    features, head = model["features"], model["head"]
    assert [str(features[k].activation) for k in (1, 4, 7, 10)] == ["relu", "silu", "hardswish", "leaky_relu(0.2)"]
    assert [str(head[k].activation) for k in (1, 3, 6)] == ["gelu_tanh", "elu(0.5)", "mish"]
    assert str(features[0].activation) == "identity" and type(features[2]) is nn.Identity
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    got, want = _run(model, x), _run(reference, x)
    for name, a, b in zip(("y", "lstm", "gru"), got, want):
        _close(a, b, name)
    loss = sum((t * t).sum() for t in got)
    loss_ref = sum((t * t).sum() for t in want)
    loss.backward()
    loss_ref.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        _close(p.grad, q.grad, f"d{name}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c) or torch.allclose(b.double(), c.double(), rtol=1e-12), name


def test_an_optimizer_built_before_the_conversion_keeps_training_the_model():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 1)).double()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    pnt.convert(model)
    x = torch.randn(16, 4, dtype=torch.float64)
    for _ in range(3):
        for m, opt in ((model, optimizer), (reference, optimizer_ref)):
            opt.zero_grad()
            (m(x) ** 2).mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        _close(p, q, "parameter after three steps")


def test_tied_weights_stay_tied():
    """GPT-2's lm_head is its token embedding: rebuilding layers with fresh parameters would untie them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    reference = copy.deepcopy(model)
    count = len(list(model.parameters()))
    pnt.convert(model)
    assert model.lm_head.weight is model.transformer.wte.weight and len(list(model.parameters())) == count
    assert sum(type(m) is pnt.LayerNorm for m in model.modules()) == 3  # ln_1, ln_2, ln_f
    tokens = torch.randint(0, 40, (2, 8))
    got = model(tokens, labels=tokens)
    want = reference(tokens, labels=tokens)
    _close(got.logits, want.logits, "logits")
    got.loss.backward()
    want.loss.backward()
    _close(model.transformer.wte.weight.grad, reference.transformer.wte.weight.grad, "tied embedding's gradient")


def test_subclasses_shared_layers_and_fuse_false_are_left_alone():
    class Scaled(nn.LayerNorm):  # a subclass's forward is its own
        def forward(self, x):
            return 2 * super().forward(x)

    shared = nn.Linear(4, 4)
    model = nn.Sequential(Scaled(4), nn.Sequential(shared, nn.ReLU()), shared, nn.Linear(4, 4), nn.ReLU())
    pnt.convert(model)
    assert type(model[0]) is Scaled
    assert type(shared) is pnt.Linear and shared.activation.is_identity and type(model[1][1]) is nn.ReLU
    assert str(model[3].activation) == "relu" and type(model[4]) is nn.Identity
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    pnt.convert(plain, fuse=False)
    assert type(plain[0]) is pnt.Linear and plain[0].activation.is_identity and type(plain[1]) is nn.ReLU


def test_bad_input_is_refused_before_anything_changes():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        pnt.convert([nn.Linear(2, 2)])


def _tiny(transformers, name):
    if name == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                          max_position_embeddings=32)
        return transformers.LlamaForCausalLM(config), 5
    if name == "t5":
        config = transformers.T5Config(d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2, vocab_size=50,
                                       dropout_rate=0.0)
        return transformers.T5ForConditionalGeneration(config), 7  # encoder 2 + final, decoder 3 + final
    config = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=50, head_dim=8)
    return transformers.GemmaForCausalLM(config), 0  # Gemma's RMS norm scales by 1 + weight: not ours


@pytest.mark.parametrize("name", ["llama", "t5", "gemma"])
def test_transformers_rms_norms_that_are_llama_s_or_t5_s_become_ours(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, expected = _tiny(transformers, name)
    model.eval()
    reference = copy.deepcopy(model)
    norms = [type(m).__name__ for m in model.modules() if "RMSNorm" in type(m).__name__ or "LayerNorm" in
             type(m).__name__]
    pnt.convert(model)
    assert sum(type(m) is pnt.RMSNorm for m in model.modules()) == expected, norms
    tokens = torch.randint(0, 50, (2, 8))
    extra = {"decoder_input_ids": tokens} if name == "t5" else {}
    got, want = model(tokens, labels=tokens, **extra), reference(tokens, labels=tokens, **extra)
    assert torch.allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    got.loss.backward()
    want.loss.backward()
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * float(q.grad.abs().max())), pname
