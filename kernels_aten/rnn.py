"""PyTorch's own fused recurrent layers (backend ``"aten"``): ``rnn``, ``lstm``, ``gru`` over whole
sequences, for torch tensors.

Forward: one call of ``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` — what
``nn.LSTM``/``nn.GRU``/``nn.RNN`` run: oneDNN's fused LSTM for float32/bfloat16 on the CPU,
ATen's layer loop (one input-projection product per layer, then the fused cell per step)
otherwise, cuDNN on CUDA — with the call's weights as the flat weight list, stacked layers,
``bidirectional`` and ``batch_first`` passed through.  Variable ``lengths`` go through packed
sequences exactly as ``nn.LSTM`` takes them (``pack_padded_sequence(enforce_sorted=False)``,
the packed overload of the same function, ``pad_packed_sequence``): outputs past a sequence's
end are zero and its final state is the one at its last step.

Backward: when a backward will follow (``call.save``), the forward runs with autograd
recording on detached aliases of the inputs (no copies), of which only the fields in
``call.needs`` (``vjp``'s ``wrt``) require grad; the recorded graph is the residual, and the
backward is ``torch.autograd.grad`` of the outputs with the cotangents, for the wanted inputs
only (``retain_graph``: a pullback may be called again).

Arguments PyTorch's layers cannot express are declined before this module runs (see
``kernels_aten/__init__.py``): GRU ``reset_after=False``, half data with float32 weights.
LSTM projections (5-tuple params) pass through: ``w_hr`` ends each layer's weight group.
Biases: PyTorch wants all of them or none; where some are ``None`` and others not, the
missing ones are passed as zeros (which do not require grad, so their gradient stays
``None``) — the same function.  ``T = 0`` (which PyTorch's layers reject) returns empty
outputs and the initial states, through the same recorded-graph backward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

_KEYS = torch._C.DispatchKey
#: The dispatch keys autograd records through (excluded below a ``torch.library`` custom op).
_AUTOGRAD_KEYS = (
    torch._C.DispatchKeySet(_KEYS.AutogradFunctionality)
    | torch._C.DispatchKeySet(_KEYS.AutogradOther)
    | torch._C.DispatchKeySet(_KEYS.AutogradNestedTensor)
)
#: cuDNN's complaint about weights that are not one flat buffer: true, and the price of taking
#: the caller's weight tensors as they are.
_NOT_FLAT = "RNN module weights are not part of single contiguous chunk of memory"


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """Autograd records here, whatever the caller's context.

    Dispatch runs kernels under ``torch.no_grad()``; the ``portable_nn.torch`` adapter runs them
    inside a custom op, below PyTorch's autograd dispatch keys (where ``enable_grad`` alone
    records nothing); and a caller may be in inference mode.  All three are lifted for the
    duration of the forward only.  ``_ForceDispatchKeyGuard`` is private PyTorch API: the
    adapter test in tests/kernel_packages/aten/test_rnn.py says when a PyTorch release changes it.
    """
    with torch.inference_mode(False), torch.enable_grad():
        # read after leaving inference mode, which excludes more than autograd's keys
        include = torch._C._dispatch_tls_local_include_set()
        exclude = torch._C._dispatch_tls_local_exclude_set()
        with torch._C._ForceDispatchKeyGuard(include, exclude - _AUTOGRAD_KEYS):
            yield


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """A detached alias of ``t`` that requires grad when ``grad`` (a copy only for inference tensors)."""
    t = t.detach()
    if grad:
        if t.is_inference():  # inference tensors cannot join a graph
            t = t.clone()
        t.requires_grad_(True)
    return t


def _function(call: Any) -> Any:
    if call.kind == "lstm":
        return torch._VF.lstm
    if call.kind == "gru":
        return torch._VF.gru
    return torch._VF.rnn_relu if call.activation.name == "relu" else torch._VF.rnn_tanh


def _inputs(call: Any, record: frozenset[str]) -> tuple[torch.Tensor, list[list[Any]], list[torch.Tensor]]:
    """(x, per layer and direction the four weights (None where absent), initial states), as leaves."""
    x = call.x
    batch = int(x.shape[0 if call.batch_first else 1])
    names = ("h0", "c0") if call.kind == "lstm" else ("h0",)
    states = []
    for name in names:
        given = call.arrays.get(name)
        size = _output_size(call) if name == "h0" else call.hidden_size
        shape = (call.num_layers * call.num_directions, batch, size)
        states.append(x.new_zeros(shape) if given is None else _leaf(given, name in record))
    weights = [
        [None if call.arrays[name] is None else _leaf(call.arrays[name], "params" in record) for name in row]
        for row in call.param_names
    ]
    return _leaf(x, "x" in record), weights, states


def _output_size(call: Any) -> int:
    """The size of h and of each direction's outputs: proj_size with LSTM projections, else hidden_size."""
    return call.params.get("proj_size") or call.hidden_size


def _flat_weights(weights: list[list[Any]]) -> tuple[list[torch.Tensor], bool]:
    """PyTorch's flat weight list and ``has_biases``: zeros stand in for ``None`` biases when
    other biases are given (PyTorch takes all or none); an LSTM projection ``w_hr`` comes last in
    each layer's group, as in ``nn.LSTM._flat_weights`` (PyTorch tells projections by the count)."""
    has_biases = any(b is not None for row in weights for b in row[2:4])
    flat = []
    for w_ih, w_hh, b_ih, b_hh, *projection in weights:
        flat += [w_ih, w_hh]
        if has_biases:
            flat += [w_hh.new_zeros(w_hh.shape[0]) if b is None else b for b in (b_ih, b_hh)]
        flat += projection
    return flat, has_biases


def _run(call: Any, x: torch.Tensor, weights: list[list[Any]], states: list[torch.Tensor],
         train: bool) -> tuple[torch.Tensor, ...]:
    """(outputs, h_n[, c_n]) in the caller's layout."""
    steps = int(x.shape[1 if call.batch_first else 0])
    if steps == 0:  # PyTorch's layers reject empty sequences: nothing runs, the states pass through
        out_shape = (*x.shape[:2], call.num_directions * _output_size(call))
        return (x.new_zeros(out_shape), *(s.clone() for s in states))
    fn = _function(call)
    flat, has_biases = _flat_weights(weights)
    hx = tuple(states) if call.kind == "lstm" else states[0]
    layers, bidirectional = call.num_layers, call.num_directions == 2
    if call.lengths is None:
        return tuple(fn(x, hx, flat, has_biases, layers, 0.0, train, bidirectional, call.batch_first))
    lengths = torch.tensor(call.lengths, dtype=torch.int64)
    packed = pack_padded_sequence(x, lengths, batch_first=call.batch_first, enforce_sorted=False)
    order, inverse = packed.sorted_indices, packed.unsorted_indices
    hx = tuple(s.index_select(1, order) for s in states) if call.kind == "lstm" else states[0].index_select(1, order)
    result = fn(packed.data, packed.batch_sizes, hx, flat, has_biases, layers, 0.0, train, bidirectional)
    data = PackedSequence(result[0], packed.batch_sizes, order, inverse)
    y, _ = pad_packed_sequence(data, batch_first=call.batch_first, total_length=steps)
    return (y, *(s.index_select(1, inverse) for s in result[1:]))


def sequence_forward(call: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``rnn``/``gru``: ``(outputs, h_n)``; ``lstm``: ``(outputs, h_n, c_n)``; residuals: the
    recorded graph and its leaves (see the module docstring)."""
    record = frozenset(("x", "params", "h0", "c0") if call.needs is None else call.needs) if call.save else frozenset()
    with contextlib.ExitStack() as stack:
        if call.save:
            stack.enter_context(_recording())
        if call.x.is_cuda:
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=_NOT_FLAT)
        x, weights, states = _inputs(call, record)
        outputs = _run(call, x, weights, states, train=bool(call.save))
    residuals = (outputs, x, weights, states, record) if call.save else None
    return tuple(o.detach() for o in outputs), residuals


def _autograd_grads(outputs: tuple[torch.Tensor, ...], cotangents: Any, wanted: list[torch.Tensor]) -> list[Any]:
    """The gradients of the recorded ``outputs`` (seeded with ``cotangents``) at each ``wanted`` leaf.

    An input no output depends on (every weight when T = 0) gets a zero gradient.
    """
    pairs = [(o, ct) for o, ct in zip(outputs, cotangents) if o.requires_grad]
    found: tuple[Any, ...] = (None,) * len(wanted)
    if pairs and wanted:
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [ct for _, ct in pairs], retain_graph=True, allow_unused=True
        )
    return [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, found)]


def _check_recorded(needs: frozenset[str], record: frozenset[str]) -> None:
    missing = needs - record
    if missing:
        raise RuntimeError(f"aten: gradients {sorted(missing)} were not recorded by the forward (call.needs)")


def sequence_backward(residuals: Any, cotangents: Any, needs: frozenset[str]) -> dict[str, Any]:
    """``x``, ``params`` (a list of 4-tuples, ``None`` for absent biases), ``h0``, ``c0``: the
    gradients in ``needs``, by ``torch.autograd.grad`` through the recorded forward."""
    outputs, x, weights, states, record = residuals
    _check_recorded(needs, record)
    wanted: list[torch.Tensor] = []
    if "x" in needs:
        wanted.append(x)
    if "params" in needs:
        wanted += [w for row in weights for w in row if w is not None]
    for name, state in zip(("h0", "c0"), states):
        if name in needs:
            wanted.append(state)
    grads = iter(_autograd_grads(outputs, cotangents, wanted))
    result: dict[str, Any] = {}
    if "x" in needs:
        result["x"] = next(grads)
    if "params" in needs:
        result["params"] = [tuple(None if w is None else next(grads) for w in row) for row in weights]
    for name in ("h0", "c0")[: len(states)]:
        if name in needs:
            result[name] = next(grads)
    return result
