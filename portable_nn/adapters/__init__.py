"""Framework adapters (torch autograd functions and modules, jax.custom_vjp wrappers).

They import their framework lazily and are optional; they arrive with issue 6.
"""
