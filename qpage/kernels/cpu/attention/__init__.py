"""CPU attention over the paged cache: NumPy-BLAS, and C for the fp32, FP8 and integer caches."""
