"""NF4 weight quantization as bitsandbytes does it: W [out, in] flattened row-major in blocks
of 64, each block's largest magnitude (absmax) scales it into [-1, 1], and each weight takes
the nearest of the 16 NF4 values (``formats.bnb.CODEBOOKS``; a weight exactly between two
goes to the upper one). No calibration."""

from __future__ import annotations

import torch

from qpage.formats.bnb import BLOCKSIZE, CODEBOOKS


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (codes uint8 [out, in] in 0..15, absmax fp32 [ceil(out * in / 64)]);
    w ~= codebook[codes] * absmax of the weight's block. A partial last block is padded with
    zeros, as bitsandbytes does."""
    out_f, in_f = w.shape
    flat = w.float().reshape(-1)
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, -n % BLOCKSIZE)).view(-1, BLOCKSIZE)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    book = torch.from_numpy(CODEBOOKS["nf4"])
    # The nearest value: the midpoints between neighbours split [-1, 1] (a tie goes up).
    codes = torch.bucketize(scaled, (book[1:] + book[:-1]) / 2, right=True)
    return codes.reshape(-1)[:n].reshape(out_f, in_f).to(torch.uint8), absmax
