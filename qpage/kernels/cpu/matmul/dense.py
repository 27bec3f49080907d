"""Dense fp32 matmul on CPU in C (``csrc/cpu_dense.c``), batch-invariant.

The weight is packed once into panels of 16 output columns (``[ceil(n / 16), k, 16]``, zero
padded), read as one sequential stream. Each output is one multiply-add chain over the input
in a fixed order, so a row's result is the same bits whatever the row count of the call,
where the row sits in it, or the thread count; NumPy's BLAS (``blas``) changes kernels with the
shape and cannot promise that. Reference: ``torch.nn.functional.linear`` up to float rounding
(tests/kernels/test_cpu_dense.py).
"""

from __future__ import annotations

import torch

from qpage.kernels.cpu.native import load, num_threads, unavailable_reason

PANEL = 16


def unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the C dense matmul cannot run activations of ``dtype`` on ``device`` (None: it can)."""
    if device.type != "cpu":
        return f"runs on cpu, not {device.type}"
    if dtype != torch.float32:
        return f"needs fp32 activations, not {dtype}"
    return None if load() is not None else f"the C kernels are unavailable ({unavailable_reason()})"


class DensePanels:
    """A weight [n, k] (any strides: a transposed ``[k, n]`` view packs without a copy) held as
    panels; calling it on x [..., k] gives x W^T [..., n] in fp32."""

    def __init__(self, weight: torch.Tensor, threads: int | None = None) -> None:
        lib = load()
        assert lib is not None, "DensePanels needs the C kernels; check unsupported_reason() first"
        if weight.dim() != 2:
            raise ValueError(f"a dense weight is 2-D [out, in], got shape {tuple(weight.shape)}")
        w = weight.detach().to("cpu", torch.float32)
        self.n, self.k = w.shape
        self.panels = torch.empty((self.n + PANEL - 1) // PANEL, self.k, PANEL)
        lib.qp_dense_pack(w.data_ptr(), w.stride(0), w.stride(1), self.n, self.k, self.panels.data_ptr())
        self._lib, self.threads, self._w = lib, threads or num_threads(), self.panels.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * 4

    def into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out = x W^T`` for x fp32 [m, k] and out fp32 [m, >= n] (a column slice of a wider
        output is fine), both with unit column stride."""
        m = x.shape[0]
        if x.stride(1) != 1 or out.stride(1) != 1 or out.shape[0] != m or x.shape[1] != self.k:
            raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a [{self.n}, {self.k}] "
                             "weight with unit column strides")
        self._lib.qp_dense_matmul(x.data_ptr(), x.stride(0), m, self._w, self.n, self.k,
                                  out.data_ptr(), out.stride(0), self.threads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The hot path (a 2-D fp32 input with unit column stride) makes one C call and no checks
        # beyond these: a decode step runs about four of these per layer.
        if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] != self.k:
            shape = x.shape
            return self(x.reshape(-1, self.k).float().contiguous()).view(*shape[:-1], self.n)
        m = x.shape[0]
        out = torch.empty(m, self.n)
        if m:
            self._lib.qp_dense_matmul(x.data_ptr(), x.stride(0), m, self._w, self.n, self.k, out.data_ptr(), self.n,
                                      self.threads)
        return out
