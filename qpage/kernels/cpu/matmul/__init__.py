"""CPU matmuls: dense fp32 on packed panels in C (NumPy-BLAS without the C kernels), C on
llama.cpp's block formats (and integer weights written as them), torch's packed int4/int8."""
