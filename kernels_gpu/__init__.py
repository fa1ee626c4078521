"""GPU kernels: Numba-CUDA (backend ``"numba_cuda"``) and CUDA C through CuPy
RawModule (backend ``"cupy"``), one module per op family in each flavour:

* ``kernels_gpu/numba_cuda/<family>.py`` — ``@cuda.jit`` kernels and their host launchers;
* ``kernels_gpu/cuda_c/<family>.cu`` — CUDA C sources, launched by ``kernels_gpu/cuda_c/<family>.py``.

Both take CuPy arrays (``Support(native="cupy")``): dispatch hands them zero-copy CuPy views
of PyTorch CUDA tensors and runs them on the tensors' current stream.  Importing this
package only declares the kernels; numba.cuda and cupy are imported, and kernels
compiled, on first use.
"""

from __future__ import annotations

from . import cuda_c, numba_cuda  # noqa: F401  (each declares its kernels on import)
