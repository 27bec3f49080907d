"""FP8 on CUDA (Triton): the codec that encodes and decodes E4M3/E5M2 codes held as uint8
(``codec``), and the E4M3 weight-only matmul (``matmul``)."""
