"""Paged attention on CUDA (Triton): the cache write (``cache_write``), decode (``decode``) and
prefill (``prefill``) kernels, their shared tile helpers (``tiles``) and plain-torch references
(``reference``)."""
