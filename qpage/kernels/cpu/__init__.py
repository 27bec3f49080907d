"""CPU kernels, by operation: ``matmul`` (NumPy-BLAS on dense weights, C on llama.cpp's
block formats, torch's packed INT4/INT8), ``attention`` (NumPy-BLAS, C for the fp32, FP8 and
integer caches), ``native_ops`` (norms, activation, rotary in C) and ``native_decode`` (a
whole decode step in one C call); ``native`` builds and loads the C library (``csrc/``)."""
