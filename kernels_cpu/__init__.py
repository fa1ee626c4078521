"""Numba-JIT CPU kernels (backend ``"numba"``), one module per op family.

Importing this package declares the kernels to dispatch; it must not import
numba — kernels compile (with Numba's on-disk cache) on first use.  No CPU
kernel is declared yet: every op runs on the array-API reference until the
kernels land (issue 4), and ``pnn.explain`` says so.
"""
