"""Framework adapters, optional: import the public modules to use them.

* :mod:`portable_nn.torch` — every op as a ``torch.library`` custom op with an autograd
  formula through our pullbacks (``torch.compile`` keeps them in its graphs), and drop-in
  ``torch.nn`` modules (``LayerNorm``, ``BatchNorm2d``, ``LSTM``, ``Conv2d`` …).
* :mod:`portable_nn.jax` — every op as a ``jax.custom_vjp`` function usable under
  ``jax.jit`` and ``jax.grad``.

Importing ``portable_nn`` imports neither framework; each adapter imports its framework
when ``portable_nn.torch`` or ``portable_nn.jax`` is imported.
"""

from __future__ import annotations

from typing import Any


def keep_public_path(namespace: dict[str, Any]) -> None:
    """Give every class an adapter package exports (its ``__all__``) the package's module path.

    The adapters are packages whose classes are defined in submodules; pickled models refer to
    classes by module path, and reprs and docs show it, so it stays the path users import from
    (the one the adapters had as single modules).
    """
    for name in namespace["__all__"]:
        obj = namespace[name]
        if isinstance(obj, type):
            obj.__module__ = namespace["__name__"]
