"""The numba-compiled CPU paths of the kernels (``backend="auto"`` on CPU float32 tensors), tested against the same float64 definitions as the Triton kernels."""
