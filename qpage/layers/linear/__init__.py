"""Linear layers (dense, INT, FP8, block formats), the token embedding, and the one kernel
selector they share (``linear_kernels``)."""
