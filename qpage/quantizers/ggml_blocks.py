"""Weights into llama.cpp's block formats (what ``qpage quantize --format gguf`` writes), each
sub-block's scale chosen for the least weighted squared error.

Every format is an affine grid per sub-block, w ~= s q + m with integer codes q in a fixed
range; the formats differ in sub-block size, code range, whether m exists and how s and m
are stored (byte layouts are ggml's; tests decode them with ``gguf.quants.dequantize``):

====================  =====  =========  ============  ============================================
type                  block  sub-block  codes         stored
====================  =====  =========  ============  ============================================
Q4_0, Q5_0, Q8_0      32     32         -8..7, -16..15, -128..127   fp16 d (s = d, m = 0)
Q4_1, Q5_1            32     32         0..15, 0..31  fp16 d and m
Q4_K, Q5_K            256    32         0..15, 0..31  fp16 d, dmin; 6-bit sc, mc: s = d sc, m = -dmin mc
Q6_K                  256    16         -32..31       fp16 d; int8 sc: s = d sc
====================  =====  =========  ============  ============================================

Each sub-block's (s, m) comes from a search (``fit``): candidate grids a little narrower and
wider than the sub-block's range, each refitted by weighted least squares, keeping the one
with the least weighted error; the plain grid (llama.cpp's reference rounding) is a
candidate, so the search never does worse on that error. The weight of a weight is its input
channel's importance (E[x^2] of the calibration inputs: llama.cpp's importance matrix), or,
without one, |x| plus the block's RMS (large weights matter more, none is ignored; on the
default model at Q4_0 this measured a lower KL on both texts than unit or x^2 weights).
K-quants then store their sub-block scales in 6 or 8 bits; the super-block's d (and dmin)
are refitted by least squares to the codes that result, and the codes rounded once more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from qpage.formats.gguf_reader import type_name

_T = GGMLQuantizationType
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (int(t) for t in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K,
                                                                   _T.Q5_K, _T.Q6_K))
SEARCH_STEPS = 16
"""Candidate grids per sub-block besides the plain one."""
_CHUNK = 1 << 20
"""Weights searched at once, bounding the search's temporaries."""


@dataclass(frozen=True)
class Grid:
    block: int
    """Weights per block (one fp16 d)."""
    sub: int
    """Weights per sub-block (one s, m)."""
    lo: int
    hi: int
    """Code range."""
    offset: bool
    """Whether the grid has an offset m (codes are then 0..hi)."""

    @property
    def nbytes(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(_TYPE_OF[self])][1]


GRIDS = {Q4_0: Grid(32, 32, -8, 7, False), Q4_1: Grid(32, 32, 0, 15, True), Q5_0: Grid(32, 32, -16, 15, False),
         Q5_1: Grid(32, 32, 0, 31, True), Q8_0: Grid(32, 32, -128, 127, False), Q4_K: Grid(256, 32, 0, 15, True),
         Q5_K: Grid(256, 32, 0, 31, True), Q6_K: Grid(256, 16, -32, 31, False)}
"""The formats written, by ggml type id."""
_TYPE_OF = {g: t for t, g in GRIDS.items()}


def unsupported_reason(ggml_type: int, k: int) -> str | None:
    """Why rows of k weights cannot be written in this format (None: they can)."""
    if ggml_type not in GRIDS:
        names = ", ".join(type_name(t) for t in GRIDS)
        return f"{type_name(ggml_type)} is not written by qpage (these are: {names})"
    if k % GRIDS[ggml_type].block:
        return f"rows of {k} weights are not whole {GRIDS[ggml_type].block}-weight {type_name(ggml_type)} blocks"
    return None


def quantize_rows(w: torch.Tensor, ggml_type: int, importance: torch.Tensor | None = None) -> np.ndarray:
    """w [rows, k] -> the format's bytes, uint8 [rows, k / block * block bytes];
    ``importance`` [k]: the weight of each input channel in the error (None: by magnitude)."""
    rows, k = w.shape
    reason = unsupported_reason(ggml_type, k)
    if reason is not None:
        raise ValueError(reason)
    g = GRIDS[ggml_type]
    out = np.empty((rows, k // g.block * g.nbytes), dtype=np.uint8)
    imp = None if importance is None else importance.float().clamp_min(0).reshape(1, k)
    step = max(1, _CHUNK // k)
    for r in range(0, rows, step):
        x = w[r : r + step].float()
        wt = _weights(x, g, imp)
        out[r : r + step] = _encode(x, wt, ggml_type, g).reshape(x.shape[0], -1)
    return out


def _weights(x: torch.Tensor, g: Grid, imp: torch.Tensor | None) -> torch.Tensor:
    if imp is not None:
        return imp.expand_as(x).reshape(-1, g.sub) + 1e-12  # an unseen channel still counts a little
    xb = x.reshape(-1, g.block)
    return (xb.abs() + xb.square().mean(1, keepdim=True).sqrt()).reshape(-1, g.sub) + 1e-30


@dataclass
class BlockGrid:
    """The grids of n blocks: each sub-block's scale ``s`` and offset ``m`` [n, sub-blocks]
    as the format stores them, and the stored fields (``stored``: what the byte packer takes
    besides the codes: fp16 d (and m) for 32-weight types; d, dmin, sc, mc for Q4_K/Q5_K;
    d, sc for Q6_K)."""

    s: torch.Tensor
    m: torch.Tensor
    stored: tuple[torch.Tensor, ...]


def block_grid(x: torch.Tensor, wt: torch.Tensor, ggml_type: int) -> BlockGrid:
    """The searched grid of each block, x and wt [n, block]."""
    g = GRIDS[ggml_type]
    per = g.block // g.sub
    s, m = fit(x.reshape(-1, g.sub), wt.reshape(-1, g.sub), g)
    if per == 1:  # one fp16 scale (and offset) per block
        s, m = s.half().float(), m.half().float()
        return BlockGrid(s[:, None], m[:, None], (s, m))
    if g.offset:
        d, sc, dmin, mc = _k_scales(s.view(-1, per), -m.view(-1, per), 63)
        assert dmin is not None and mc is not None
        return BlockGrid(d[:, None] * sc, -dmin[:, None] * mc, (d, dmin, sc, mc))
    d, sc, _, _ = _k_scales(s.view(-1, per), None, 127)
    return BlockGrid(d[:, None] * sc, torch.zeros_like(sc), (d, sc))


def grid_codes(x: torch.Tensor, grid: BlockGrid, ggml_type: int) -> torch.Tensor:
    """Integer codes (fp32) of x [n, block] on each block's grid."""
    g = GRIDS[ggml_type]
    return codes(x.reshape(-1, g.sub), grid.s.reshape(-1), grid.m.reshape(-1), g).view(x.shape)


def pack(q: torch.Tensor, grid: BlockGrid, ggml_type: int) -> np.ndarray:
    """Codes [n, block] on ``grid`` -> the format's bytes, uint8 [n, block bytes]."""
    return _PACK[ggml_type](q, *grid.stored)


def _encode(x: torch.Tensor, wt: torch.Tensor, ggml_type: int, g: Grid) -> np.ndarray:
    """Blocks of x (rows of whole blocks) -> uint8 [blocks, block bytes]."""
    xb, wb = x.reshape(-1, g.block), wt.reshape(-1, g.block)
    grid = block_grid(xb, wb, ggml_type)
    q = grid_codes(xb, grid, ggml_type)
    if g.block > g.sub:  # K-quants: the super-block scales refitted to the codes, then the codes again
        grid = _refit_super(xb, wb, q, grid, g)
        q = grid_codes(xb, grid, ggml_type)
    return pack(q, grid, ggml_type)


def fit(x: torch.Tensor, wt: torch.Tensor, g: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, m) of each row of x [n, sub] (m = 0 without an offset) minimising the weighted error."""
    if g.offset:
        lo_v = x.amin(1)
        if g.block > g.sub:  # K-quants store -m >= 0
            lo_v = lo_v.clamp_max(0)
        rng = (x.amax(1) - lo_v).clamp_min(1e-30)
        best_s, best_m = rng / g.hi, lo_v
    else:
        mx = x.gather(1, x.abs().argmax(1, keepdim=True))[:, 0]  # the signed largest magnitude
        best_s, best_m = _nonzero(mx / g.lo), torch.zeros_like(mx)
    best_e = _error(x, wt, best_s, best_m, g)
    sw, sx = wt.sum(1), (wt * x).sum(1)
    for i in range(SEARCH_STEPS + 1):
        t = 2 * i / SEARCH_STEPS - 1
        if g.offset:  # codes on a grid of (hi + t) steps over the range, then the best (s, m) for them
            lvl = ((x - lo_v[:, None]) * ((g.hi + t) / rng)[:, None]).round_().clamp_(0, g.hi)
            sl, sll, slx = (wt * lvl).sum(1), (wt * lvl * lvl).sum(1), (wt * lvl * x).sum(1)
            det = (sw * sll - sl * sl).clamp_min(1e-30)
            s, m = (sw * slx - sx * sl) / det, (sll * sx - sl * slx) / det
            if g.block > g.sub:
                s = torch.where(m > 0, slx / sll.clamp_min(1e-30), s)
                m = m.clamp_max(0)
            s = s.clamp_min(1e-30)
        else:  # the largest magnitude at (lo + t), then the best s for those codes
            q = torch.div(x, _nonzero(mx / (g.lo + t))[:, None]).round_().clamp_(g.lo, g.hi)
            s, m = _nonzero((wt * q * x).sum(1) / (wt * q * q).sum(1).clamp_min(1e-30)), best_m
        e = _error(x, wt, s, m, g)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
    return best_s, best_m


def codes(x: torch.Tensor, s: torch.Tensor, m: torch.Tensor, g: Grid) -> torch.Tensor:
    """Integer codes (fp32) of x [n, sub] on each row's grid; a zero scale gives code 0 (or lo)."""
    return torch.div(x - m[:, None], _nonzero(s)[:, None]).round_().clamp_(g.lo, g.hi)


def _error(x: torch.Tensor, wt: torch.Tensor, s: torch.Tensor, m: torch.Tensor, g: Grid) -> torch.Tensor:
    return (wt * codes(x, s, m, g).mul_(s[:, None]).add_(m[:, None]).sub_(x).square_()).sum(1)


def _nonzero(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s.abs() < 1e-30, torch.full_like(s, 1e-30), s)


def _k_scales(s: torch.Tensor, neg_m: torch.Tensor | None, top: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sub-block scales [n, per] as fp16 d times integers (0..top, or -top..top when signed),
    and the offsets' the same way: (d, sc, dmin, mc)."""
    amax = s.abs().amax(1)
    d = (amax / top).half().float()
    sc = torch.div(s, _nonzero(d)[:, None]).round_().clamp_(-top if neg_m is None else 0, top)
    if neg_m is None:
        return d, sc, None, None
    dmin = (neg_m.amax(1) / top).half().float()
    mc = torch.div(neg_m, _nonzero(dmin)[:, None]).round_().clamp_(0, top)
    return d, sc, dmin, mc


def _refit_super(x: torch.Tensor, wt: torch.Tensor, q: torch.Tensor, grid: BlockGrid, g: Grid) -> BlockGrid:
    """Least-squares d (and dmin) of each super-block x [n, 256] for fixed codes and sub-block
    integers: x ~= d (sc q) - dmin mc. Keeps the old values where the fit is degenerate or worse."""
    n, per = x.shape[0], g.block // g.sub
    d, sc = grid.stored[0], grid.stored[-2 if g.offset else -1]
    a = (sc[:, :, None] * q.view(n, per, g.sub)).reshape(n, -1)
    saa, sax = (wt * a * a).sum(1), (wt * a * x).sum(1)
    if not g.offset:
        new_d = (sax / saa.clamp_min(1e-30)).half().float()
        old = (wt * (d[:, None] * a - x).square()).sum(1)
        new = (wt * (new_d[:, None] * a - x).square()).sum(1)
        d = torch.where((new < old) & (saa > 0), new_d, d)
        return BlockGrid(d[:, None] * sc, grid.m, (d, sc))
    dmin, mc = grid.stored[1], grid.stored[3]
    b = mc[:, :, None].expand(n, per, g.sub).reshape(n, -1)
    sbb, sab, sbx = (wt * b * b).sum(1), (wt * a * b).sum(1), (wt * b * x).sum(1)
    det = saa * sbb - sab * sab
    ok = det.abs() > 1e-12 * (saa * sbb).clamp_min(1e-30)
    safe = torch.where(ok, det, torch.ones_like(det))
    new_d = ((sax * sbb - sbx * sab) / safe).half().float()
    new_dmin = (-(saa * sbx - sab * sax) / safe).half().float()
    old = (wt * (d[:, None] * a - dmin[:, None] * b - x).square()).sum(1)
    new = (wt * (new_d[:, None] * a - new_dmin[:, None] * b - x).square()).sum(1)
    take = ok & (new < old) & (new_d >= 0) & (new_dmin >= 0)
    d, dmin = torch.where(take, new_d, d), torch.where(take, new_dmin, dmin)
    return BlockGrid(d[:, None] * sc, -dmin[:, None] * mc, (d, dmin, sc, mc))


# --- byte layouts (ggml-common.h) ---------------------------------------------------------

def _u8(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.int16).numpy().astype(np.uint8)


def _f16(t: torch.Tensor) -> np.ndarray:
    return t.half().numpy().view(np.uint8).reshape(-1, 2)


def _nibbles(c: np.ndarray) -> np.ndarray:
    """Codes [n, 32] (low 4 bits used) -> 16 bytes: byte j = c[j] | c[j + 16] << 4."""
    return (c[:, :16] & 15) | ((c[:, 16:] & 15) << 4)


def _high_bits32(c: np.ndarray) -> np.ndarray:
    """Bit 4 of codes [n, 32] as a little-endian uint32: bit j from c[j]."""
    bits = ((c >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return bits.sum(1, dtype=np.uint32).view(np.uint8).reshape(-1, 4)


def _pack_q4_0(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    return np.concatenate([_f16(s), _nibbles(_u8(q + 8))], 1)


def _pack_q4_1(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    return np.concatenate([_f16(s), _f16(m), _nibbles(_u8(q))], 1)


def _pack_q5_0(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    c = _u8(q + 16)
    return np.concatenate([_f16(s), _high_bits32(c), _nibbles(c)], 1)


def _pack_q5_1(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    c = _u8(q)
    return np.concatenate([_f16(s), _f16(m), _high_bits32(c), _nibbles(c)], 1)


def _pack_q8_0(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    return np.concatenate([_f16(s), q.to(torch.int8).numpy().view(np.uint8)], 1)


def _k_scale_bytes(sc: torch.Tensor, mc: torch.Tensor) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] -> 12 bytes: bytes 0-3 hold sc[0:4] and the top two
    bits of sc[4:8]; bytes 4-7 mc[0:4] and the top bits of mc[4:8]; bytes 8-11 the low four
    bits of sc[4:8] (low nibble) and mc[4:8] (high nibble)."""
    s, m = _u8(sc), _u8(mc)
    return np.concatenate([s[:, :4] | ((s[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                           (s[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], 1)


def _k_nibbles(c: np.ndarray) -> np.ndarray:
    """Codes [n, 256] -> 128 bytes: per 64 weights, byte l = c[l] | c[l + 32] << 4."""
    c = c.reshape(-1, 4, 2, 32)
    return ((c[:, :, 0] & 15) | ((c[:, :, 1] & 15) << 4)).reshape(-1, 128)


def _pack_q4_k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mc: torch.Tensor) -> np.ndarray:
    return np.concatenate([_f16(d), _f16(dmin), _k_scale_bytes(sc, mc), _k_nibbles(_u8(q))], 1)


def _pack_q5_k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mc: torch.Tensor) -> np.ndarray:
    c = _u8(q)
    # qh[l]: bit j = bit 4 of weight l of sub-block j
    hi = ((c.reshape(-1, 8, 32) >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = hi.sum(1, dtype=np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), _k_scale_bytes(sc, mc), qh, _k_nibbles(c)], 1)


def _pack_q6_k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> np.ndarray:
    c = _u8(q + 32).reshape(-1, 2, 4, 32)  # halves of 128, quarters of 32
    ql = np.concatenate([(c[:, :, 0] & 15) | ((c[:, :, 2] & 15) << 4),
                         (c[:, :, 1] & 15) | ((c[:, :, 3] & 15) << 4)], 2).reshape(-1, 128)
    qh = ((c[:, :, 0] >> 4) | ((c[:, :, 1] >> 4) << 2) | ((c[:, :, 2] >> 4) << 4)
          | ((c[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.to(torch.int8).numpy().view(np.uint8), _f16(d)], 1)


_PACK: dict[int, Callable[..., np.ndarray]] = {
         Q4_0: _pack_q4_0, Q4_1: _pack_q4_1, Q5_0: _pack_q5_0, Q5_1: _pack_q5_1, Q8_0: _pack_q8_0,
         Q4_K: _pack_q4_k, Q5_K: _pack_q5_k, Q6_K: _pack_q6_k}
