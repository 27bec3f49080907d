"""Compute kernels, grouped by operation; each with a plain-torch reference.

- ``int_matmul/``: INT4/INT8 GPTQ/AWQ matmuls on CUDA (GEMV, tiled, dequantize-then-cuBLAS);
- ``fp8/``: the FP8 codec and the FP8 weight matmul on CUDA;
- ``attention/``: paged cache write, decode and prefill on CUDA;
- ``cpu/``: BLAS, C and packed-weight kernels for CPUs.

Helpers below them: ``triton_utils`` (the optional Triton import), ``packing`` (GPTQ/AWQ
packing, no Triton), ``kv_quant`` (FP8 KV scale rules), ``split_k``, ``configs`` (typed kernel
settings and defaults) and ``tuned`` (per-GPU tables). Which kernel runs is decided in one
selector per operation: ``int_matmul.select`` per call, the layers' ``prepare`` per layer
(``qpage.layers.linear.linear_kernels``), ``qpage.layers.attention.selector`` for attention.
"""
