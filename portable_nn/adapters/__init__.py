"""Framework adapters, optional: import the public modules to use them.

* :mod:`portable_nn.torch` — every op as a ``torch.library`` custom op with an autograd
  formula through our pullbacks (``torch.compile`` keeps them in its graphs), and drop-in
  ``torch.nn`` modules (``LayerNorm``, ``BatchNorm2d``, ``LSTM``, ``Conv2d`` …).
* :mod:`portable_nn.jax` — every op as a ``jax.custom_jvp`` function whose reverse mode is our
  fused backward, usable under ``jax.jit``, ``jax.grad``, ``jax.jvp`` and to any order.

Importing ``portable_nn`` imports neither framework; each adapter imports its framework
when ``portable_nn.torch`` or ``portable_nn.jax`` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
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


def op_function(spec: Any, module: str, doc: str, run: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
    """An adapter's function for the op described by ``spec``: the op's own signature and defaults,
    ``doc`` as docstring, and a body that hands ``run`` the arguments by name.

    The function is compiled from the signature (as :mod:`dataclasses` writes ``__init__``), so
    Python itself binds the arguments: ``inspect.Signature.bind`` cost ~10 µs a call, a fifth of a
    small op's whole overhead.
    """
    defaults: dict[str, Any] = {}
    params, names, keyword_only = [], [], False
    for name, p in spec.signature.parameters.items():
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            params.append("*")
            keyword_only = True
        text = name
        if p.default is not p.empty:
            defaults[f"_default_{name}"] = p.default
            text += f"=_default_{name}"
        params.append(text)
        names.append(name)
    body = ", ".join(f"{n!r}: {n}" for n in names)
    source = f"def {spec.name}({', '.join(params)}):\n    return _run({{{body}}})\n"
    namespace: dict[str, Any] = {"_run": run, **defaults}
    exec(source, namespace)
    fn = namespace[spec.name]
    fn.__module__ = module
    fn.__qualname__ = spec.name
    fn.__doc__ = doc
    fn.__signature__ = spec.signature
    return fn
