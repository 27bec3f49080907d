"""INT4/INT8 weight matmuls for the GPTQ and AWQ layouts on CUDA (Triton).

Three kernels, one chosen per call by ``select.choose_config``: ``gemv`` (one row),
``tiled`` (tl.dot, any case), ``dequant`` (dequantize, then cuBLAS, for large M).
Layouts: ``common``; packing and plain-torch references: ``kernels.packing``.
"""

from qpage.kernels.int_matmul.dequant import dequantize_int
from qpage.kernels.int_matmul.select import choose_config, int_matmul

__all__ = ["choose_config", "dequantize_int", "int_matmul"]
