"""The BPU simulator: the executor, the reference kernels and the fast kernels, one module per family."""
