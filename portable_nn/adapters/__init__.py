"""Framework adapters, optional: import the public modules to use them.

* :mod:`portable_nn.torch` — every op as a ``torch.library`` custom op with an autograd
  formula through our pullbacks (``torch.compile`` keeps them in its graphs), and drop-in
  ``torch.nn`` modules (``LayerNorm``, ``BatchNorm2d``, ``LSTM``, ``Conv2d`` …).
* :mod:`portable_nn.jax` — every op as a ``jax.custom_vjp`` function usable under
  ``jax.jit`` and ``jax.grad``.

Importing ``portable_nn`` imports neither framework; each adapter imports its framework
when ``portable_nn.torch`` or ``portable_nn.jax`` is imported.
"""
