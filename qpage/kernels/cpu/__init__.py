"""CPU kernels: dense fp32 matmul and attention on NumPy's BLAS (``blas``, ``blas_attention``),
the C kernels of the fp32 path built on first use (``native``, ``native_fp8``, sources in
``csrc/``), and torch's packed INT4/INT8 matmuls for bf16 (``packed``)."""
