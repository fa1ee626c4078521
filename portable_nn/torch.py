"""``portable_nn.torch``: portable_nn for PyTorch users — autograd-aware functions and drop-in modules.

::

    import portable_nn.torch as pnt

    y = pnt.layer_norm(x, w, b, activation="gelu")    # differentiable, torch.compile-able
    model.norm = pnt.LayerNorm(512)                   # same parameters and state_dict as torch.nn.LayerNorm
    model.norm.load_state_dict(old_norm.state_dict())

The functions are ``torch.library`` custom ops (``torch.ops.portable_nn.*``)
with fake implementations and autograd formulas, so ``torch.compile`` keeps
them in its graphs; forward and backward run through dispatch (CPU tensors
reach the Numba kernels without a copy, CUDA tensors the GPU kernels; conv,
dense, lstm and rnn run PyTorch's own kernels, the ``aten`` backend, which
measured faster there), and a gradient no input needs is never computed.  Higher-order
derivatives (``create_graph=True``) work, by differentiating the array-API reference instead of
the fused backward (see :mod:`portable_nn.adapters.torch` for what that costs).  The modules
subclass their ``torch.nn`` counterparts: same constructor arguments, parameters, buffers,
initialisation, state_dict keys and train/eval behaviour, plus the
keyword-only options our kernels add (``activation=``, ``channel_axis=``,
GRU ``reset_after=``).  See :mod:`portable_nn.adapters.torch` for how the ops
are built.  Needs PyTorch (``pip install torch``).
"""

from __future__ import annotations

# The adapter module defines the public names and their ``__all__``; this module is its public face.
from .adapters.torch import *  # noqa: F403
from .adapters.torch import __all__  # noqa: F401
