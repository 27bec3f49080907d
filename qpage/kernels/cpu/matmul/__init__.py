"""CPU matmuls: NumPy-BLAS on dense weights, C on llama.cpp's block formats (and integer
weights written as them), torch's packed int4/int8."""
