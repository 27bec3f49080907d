"""Attention over the paged KV cache: the backends and their selector, the step metadata,
the KV cache formats and their calibration."""
