"""The array-API reference implementations (every array library; the test oracle).

Every op has one, found by one naming rule: ``portable_nn.reference.<family>:<op>_forward`` and
``<op>_backward``, where ``<family>`` is the api module that declares the op (``norm``, ``rnn`` …).
Registering them imports nothing heavy: dispatch resolves the ``"module:function"`` strings on
first use.
"""

from __future__ import annotations

from ..backends import Backend
from ..dispatch import Support, op_family, op_names, register_builtin

REFERENCE_PRIORITY = -1
BACKEND = Backend(
    "reference",
    probe=lambda: (True, "array-API implementation, always available"),
    priority=REFERENCE_PRIORITY,
    arrays="any",
    description="the array-API reference: every array library, device and floating dtype; the oracle",
)
_ANY = Support(description="array-API standard only")

for _op in op_names():
    _module = f"portable_nn.reference.{op_family(_op)}"
    register_builtin(
        _op, BACKEND.name, forward=f"{_module}:{_op}_forward", backward=f"{_module}:{_op}_backward",
        supports=_ANY, priority=REFERENCE_PRIORITY,
    )
