"""GPU kernels: Numba-CUDA (backend ``"numba_cuda"``) and CUDA C through CuPy
RawModule (backend ``"cupy"``), one module per op family in each flavour:

* ``kernels_gpu/numba_cuda/<family>.py`` — ``@cuda.jit`` kernels and their host launchers;
* ``kernels_gpu/cuda_c/<family>.cu`` — CUDA C sources, launched by ``kernels_gpu/cuda_c/<family>.py``.

Both take CuPy arrays (``Support(native="cupy")``): dispatch hands them zero-copy CuPy views
of PyTorch CUDA tensors and runs them on the tensors' current stream.  Importing a flavour's
package only declares its kernels; numba.cuda and cupy are imported, and kernels
compiled, on first use.

Each flavour is a backend of its own, published as an entry point (``pyproject.toml``); this
package imports neither.
"""
