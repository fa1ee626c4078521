"""Numba-CUDA and CuPy RawKernel GPU kernels (backends ``"numba_cuda"`` and ``"cupy"``).

Importing this package declares the kernels to dispatch; it must not import
numba.cuda or cupy.  No GPU kernel is declared yet (issue 5).
"""
