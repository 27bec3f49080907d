"""Compute kernels: Triton GPU kernels and CPU paths, each with a plain-torch ``*_ref``."""
