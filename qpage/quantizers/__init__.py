"""Offline quantization: schemes, algorithms (RTN; GPTQ and AWQ to come) and the pipeline."""
