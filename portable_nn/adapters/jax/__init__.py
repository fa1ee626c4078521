"""JAX adapter: every portable_nn op as a JAX function with custom derivatives.

``import portable_nn.jax as pnj`` gives the ops of :mod:`portable_nn` with the same
signatures and semantics (``pnj.layer_norm(x, w, b, activation="gelu")``), as
functions JAX can transform: ``jax.grad``, ``jax.vjp``, ``jax.jit``, ``jax.vmap``,
forward mode (``jax.jvp``, ``jax.jacfwd``) and higher orders (``jax.hessian``) all
work, and the gradients are portable_nn's own fused backward kernels, not JAX's
differentiation of the forward.

Which kernels run
-----------------
Each call takes one of two routes, chosen when the call is traced (once per
compilation under ``jit``; ``explain`` tells which one a call gets):

* **Numba kernels through a host callback** (``"callback"``).  On the CPU the
  array data is handed to portable_nn's Numba kernels as NumPy arrays: under
  ``jit`` (and any other transformation) through ``jax.pure_callback`` — an
  XLA custom call that gives the kernel the buffers (zero-copy on the CPU) and
  returns its results — and eagerly through a plain call on ``np.asarray``
  views.  Gradients run the fused backward kernel in a second callback.  A
  kernel's saved intermediates are NumPy objects that cannot live inside a
  JAX program, so the backward callback re-runs the forward kernel to rebuild
  them: a gradient costs one extra forward (the price JAX's ``checkpoint``
  pays), and the gradients nobody differentiates (``jax.grad`` of the weights
  only, a running statistic…) are neither computed nor allocated.  XLA cannot
  fuse across a callback, and a callback runs each vmapped example in turn
  (``vmap_method="sequential"``).
* **The reference traced with jax.numpy** (``"traced"``).  portable_nn's
  array-API reference implementation, forward and hand-written backward, is
  traced with ``jax.numpy`` as its namespace, so XLA compiles it for whatever
  device the program runs on (CPU, GPU, TPU), fuses it with its neighbours and
  vmaps it natively.  Its backward re-traces the forward to rebuild the
  intermediates; under ``jit`` XLA merges that with the forward pass, so it
  costs nothing.  Outside ``jit`` it runs operation by operation, each JAX
  primitive compiled on first use: put models under ``jit``.

The route follows portable_nn's backend configuration for the op
(``pnn.use_backend``, ``pnn.set_backend``, ``PORTABLE_NN_BACKEND``), read at
trace time:

* ``"auto"`` (the default): on the CPU, the recurrent sequences (``rnn``,
  ``lstm``, ``gru``) take the callback route when dispatch would run a kernel
  on NumPy arrays of the call's shapes, dtype and layout (the Numba kernels
  take float32 and float64); every other op, and every op when JAX runs on a
  GPU or TPU, takes the traced reference.  The reason is measured: XLA fuses
  the elementwise and reduction work of norms, dense, pooling, losses and
  cells as well as portable_nn's kernels do, and without a host round trip or
  a recomputed forward, so the traced reference was as fast or faster in
  ``jit(grad(...))`` for those ops (up to ~4x); the time loop of a recurrent
  layer is where XLA, given a trace unrolled over every time step, falls
  behind: the Numba sequence kernels ran the gradient 2-7x faster, and the
  unrolled trace can take minutes to compile for long sequences.
* ``"reference"``: always the traced reference.
* any other backend (``"numba"``, or one added with ``pnn.register_kernel``):
  the callback route on that backend, or ``BackendUnavailableError`` at trace
  time when it cannot take the call (a float16 call forced to ``"numba"``).

``jit`` compiles the route in: changing the configuration later does not
change an already compiled function (``jax.clear_caches()`` or a new ``jit``
does).

Transformations
---------------
Each op is a ``jax.custom_jvp`` whose tangent ẏ = J ẋ is a primitive linear in
ẋ (:mod:`portable_nn.adapters.jax._ops`, the derivatives section): evaluated —
forward mode, ``jax.jvp``/``jax.jacfwd`` — it is JAX's forward mode through the
traced reference; transposed — reverse mode, ``jax.grad``/``jax.vjp``/
``jax.value_and_grad`` — it is the route's backward (the fused kernels on the
callback route, the reference's hand-written backward on the traced one), so a
first-order gradient runs exactly what a plain ``custom_vjp`` would, and
measured the same.  That backward is in turn a ``custom_jvp`` whose derivative is
JAX's through the reference, so every composition works to any order, on both
routes (``jax.hessian``, ``grad`` of ``grad``, ``jacrev`` of ``jacfwd``), and a
callback is never differentiated.  The cost: forward mode runs the reference's
forward and JVP besides the op's forward; each order beyond the first reverse-mode
one differentiates the reference, which for the sequences is unrolled over time
(second derivatives of an LSTM over 32 steps took minutes to compile).  Under
``jax.shard_map`` the ops run but are not differentiable (JAX checks the varying
mapped axes of custom derivative rules, which the ops do not track); the
``axis_name`` batch norm, plain ``jax.numpy``, is.  ``jax.jit`` compiles either
route; ``jax.vmap`` batches the traced reference natively and loops a callback
over the examples.  float64 needs ``jax.config.update("jax_enable_x64", True)``,
as everywhere in JAX.

Arguments
---------
Array arguments are JAX arrays (NumPy arrays are accepted and converted).
Every other argument — shapes, axes, activation names, stride, padding, eps,
momentum, flags — is static: a Python value fixed at trace time, never a
traced value.  Arguments are validated when the call is traced, with
portable_nn's messages (``ValueError``/``TypeError`` naming the argument).

Gradients flow to the arguments of each op's ``vjp`` fields (``x``,
``weight``, ``bias``, the RNN ``params``, states, ``logits``, a probability
``target``).  Integer ``target`` of ``cross_entropy`` and the ``lengths`` of
sequences get none; neither do running statistics, and class ``weight`` of
``cross_entropy``: differentiating with respect to one of those raises
``ValueError`` (wrap it in ``jax.lax.stop_gradient``).  The updated running
statistics are returned functionally — JAX arrays are immutable, so
``batch_norm``/``instance_norm`` need ``return_stats=True`` whenever they
update running statistics, and return ``(y, new_running_mean,
new_running_var)``; the new statistics carry no gradient.

Values are checked where they can be read: integer class targets and
``lengths`` given as concrete arrays are checked at trace time.  Under ``jit``
a traced ``lengths`` works on the callback route only (it is read by the
kernel at run time, and checked there); the traced reference needs concrete
``lengths`` (close over a NumPy array or a tuple).  A traced integer target is
range-checked inside the callback on the callback route and not at all on the
traced route.
"""

from __future__ import annotations

from ...api import merge_moments
from .. import keep_public_path
from . import functional
from ._ops import Route, explain, reference_autodiff
from .functional import *  # noqa: F403  (one function per portable_nn op, generated from its description)

__all__ = ["Route", "explain", "merge_moments", "reference_autodiff"]
__all__ += functional.__all__

keep_public_path(globals())
