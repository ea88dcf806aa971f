"""Chapter 7's C kernels for CPUs: the build driver, packed matmuls, paged
attention, steps recorded and replayed from C, and the `cpu` compute backend."""
