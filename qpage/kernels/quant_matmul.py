"""Fused INT4/INT8 dequant-matmul for the GPTQ and AWQ layouts: ``y = x @ W``.

Layouts (DESIGN section 7b), with K = in features, N = out features, g = group size,
G = ceil(K / g) groups, P = 32 // bits values per int32, least significant first:
- GPTQ: ``qweight`` int32 [K / P, N], packed along K (row r*P + j at bits bits*j);
  ``qzeros`` int32 [G, N / P], packed along N in plain order; ``scales`` [G, N];
  ``g_idx`` int32 [K] (row -> group; act-order permutes it). The kernel reads *v2* zeros
  (the stored value is the zero); loaders add 1 to v1 checkpoints' zeros before this.
- AWQ (GEMM): ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [G, N / 8], both packed
  along N in the interleaved order 0,2,4,6,1,3,5,7 (nibble i holds column ORDER[i]; column
  c sits in nibble (c % 2) * 4 + (c % 8) // 2); ``scales`` [G, N]; 4-bit only.

``W[k, n] = scales[grp(k), n] * (q[k, n] - zero[grp(k), n])``; symmetric checkpoints may
omit zeros (zero = 2**(bits-1)). INT8 weight-only per-channel is the GPTQ layout with
bits=8 and one group spanning K. Packing and the torch references: ``int_packing``.

Four paths, chosen by ``MatmulConfig``:
- **GEMV** (``quant_gemv``): M = 1, multiply-add without tensor cores; for GPTQ-layout
  weights with fp16/bf16 activations optionally in packed fp16 pairs (``quant_gemv_h2``:
  ``MatmulConfig.half2``, from a GPU's tuned table or ``QPAGE_GEMV_HALF2=1``).
- **pairs** (``quant_pairs``): decode batches of GPTQ (4 and 8 bits) and AWQ weights,
  tl.dot fed without a reshape, two values dequantized per 32-bit operation.
- **tl.dot** (here): a [BLOCK_M, BLOCK_N] tile of y per program, K split over SPLIT_K
  programs when the output tiles alone do not fill the GPU (``split_k``); weights are
  dequantized in registers and fed to ``tl.dot`` in the activation dtype (fp32 under the
  interpreter), accumulating in fp32. The unpacked tile is formed either by splitting
  each loaded word into its P values and reshaping (each word loaded once), or by a
  gather that loads a word once per value it holds (``gather``: no reshape, the repeats
  hit L1).
- **dequantize then cuBLAS** (``quant_dequant``): large M (prefill), where the matmul is
  compute-bound and the weight is read once per chunk of columns anyway.
"""

import functools
import os
from dataclasses import dataclass, replace

import torch

from qpage.kernels.int_packing import (  # noqa: F401  (re-exported: loaders and tests import them here)
    AWQ_ORDER,
    dequantize_ref,
    int_matmul_ref,
    pack_cols,
    pack_rows,
    unpack_cols,
    unpack_rows,
)
from qpage.kernels.split_k import finish_tile, split_k_output, split_k_range
from qpage.kernels.triton_utils import INTERPRET, tl, triton
from qpage.kernels.tuned import matmul_kind, table_for, tuned_matmul

DEQUANT_MIN_M = 256
"""From this many rows on CUDA, dequantize to fp16 and use cuBLAS (H200 arithmetic: the
fused kernel ran at 0.2-0.3x cuBLAS from M = 64, benchmarks/reference/h200-2026-11-30)."""


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    """Software-pipeline stages of the K loop. The kernel argument pipelines only loads that
    feed ``tl.dot``; the GEMVs pass it to ``tl.range`` instead, so their loads are pipelined too
    (``quant_gemv``), and 1 leaves each tile's load waiting in turn."""
    gemv: bool = False
    """M = 1 with one group per K tile: ``quant_gemv`` (multiply-add, no tensor cores)."""
    lean: bool = True
    """GEMV on the GPTQ layout: values taken in place (``_gptq_gemv_kernel``) rather than by
    shifts (``_int_gemv_kernel``); see ``quant_gemv``. AWQ always uses the latter."""
    serial: bool = True
    """Split-K partials summed by the last program (one launch) rather than atomically."""
    gather: bool = False
    """tl.dot path: unpack by gathering words (see the module docstring)."""
    dequant: bool = False
    """Dequantize to the activation dtype, then a dense matmul (``quant_dequant``)."""
    pairs: bool = False
    """tl.dot path, GPTQ (4 or 8 bits) or AWQ layout: values dequantized two per 32-bit
    operation and fed to one tl.dot per value position (``quant_pairs``); where it does not
    apply (``g_idx``, a tile across groups, GPTQ K tiles under 16 words, AWQ column tiles not
    a multiple of 128) the kernel here runs instead."""
    half2: bool = False
    """GEMV (M = 1) of 4- and 8-bit GPTQ weights with fp16/bf16 activations: products and each
    word's sum in packed fp16 pairs (``quant_gemv_h2``); elsewhere the GEMV above."""


@triton.jit
def _unpack_tile(packed, SHIFTS_ALONG_K: tl.constexpr, AWQ: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A packed int32 tile -> unsigned values [BLOCK_K, BLOCK_N] (each word loaded once)."""
    PACK: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    j = tl.arange(0, PACK)
    if SHIFTS_ALONG_K:  # GPTQ qweight [BLOCK_K / PACK, BLOCK_N]: word row r holds k = r * PACK + j
        vals = (packed[:, None, :] >> (j * BITS)[None, :, None]) & QMASK
        return tl.reshape(vals, (BLOCK_K, BLOCK_N))
    else:  # packed along N [rows, BLOCK_N / PACK]: word c holds n = c * PACK + j
        vals = (packed[:, :, None] >> col_shift(j, AWQ, BITS)[None, None, :]) & QMASK
        return tl.reshape(vals, (BLOCK_K, BLOCK_N))


@triton.jit
def col_shift(offs_n, AWQ: tl.constexpr, BITS: tl.constexpr):
    """Bit offset of column ``offs_n`` inside a word packed along N (GPTQ zeros, AWQ)."""
    PACK: tl.constexpr = 32 // BITS
    col = offs_n % PACK
    if AWQ:
        return ((col % 2) * 4 + col // 2) * 4
    else:
        return col * BITS


@triton.jit
def gather_q(qw_ptr, offs_k, offs_n, k_mask, n_mask, stride_qk, stride_qn, AWQ: tl.constexpr, BITS: tl.constexpr):
    """Unsigned values [BLOCK_K, BLOCK_N] of the weight, each word loaded once per value."""
    PACK: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    mask = k_mask[:, None] & n_mask[None, :]
    if AWQ:
        w = tl.load(qw_ptr + offs_k[:, None] * stride_qk + (offs_n // PACK)[None, :] * stride_qn, mask=mask, other=0)
        return (w >> col_shift(offs_n, True, BITS)[None, :]) & QMASK
    else:
        w = tl.load(qw_ptr + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask, other=0)
        return (w >> ((offs_k % PACK) * BITS)[:, None]) & QMASK


@triton.jit
def col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                   AWQ: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """(int32 zero, fp32 scale) of columns ``offs_n`` in group ``grp``: a tile inside one group."""
    PACK: tl.constexpr = 32 // BITS
    s = tl.load(s_ptr + grp * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zp = tl.load(z_ptr + grp * stride_zg + (offs_n // PACK) * stride_zn, mask=n_mask, other=0)
        z = (zp >> col_shift(offs_n, AWQ, BITS)) & ((1 << BITS) - 1)
    else:
        z = tl.full(offs_n.shape, 1 << (BITS - 1), dtype=tl.int32)
    return z, s


@triton.jit
def group_zero_scale(s_ptr, z_ptr, g_ptr, offs_k, offs_n, k_mask, n_mask, group_size,
                     stride_sg, stride_sn, stride_zg, stride_zn,
                     AWQ: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr):
    """(zero, fp32 scale) of every element of a [BLOCK_K, BLOCK_N] tile (groups vary by row)."""
    PACK: tl.constexpr = 32 // BITS
    if HAS_GIDX:
        grp = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]
    else:
        grp = (offs_k // group_size)[:, None]
    kn_mask = k_mask[:, None] & n_mask[None, :]
    s = tl.load(s_ptr + grp * stride_sg + offs_n[None, :] * stride_sn, mask=kn_mask, other=0.0)
    if HAS_ZEROS:
        zp = tl.load(z_ptr + grp * stride_zg + (offs_n // PACK)[None, :] * stride_zn, mask=kn_mask, other=0)
        z = (zp >> col_shift(offs_n, AWQ, BITS)[None, :]) & ((1 << BITS) - 1)
    else:
        z = tl.full((1, 1), 1 << (BITS - 1), dtype=tl.int32)
    return z, s.to(tl.float32)


@triton.jit
def _load_q_tile(qw_ptr, t, offs_k, offs_n, offs_np, k_mask, n_mask, np_mask, K, stride_qk, stride_qn,
                 BITS: tl.constexpr, AWQ: tl.constexpr, GATHER: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    if GATHER:
        return gather_q(qw_ptr, offs_k, offs_n, k_mask, n_mask, stride_qk, stride_qn, AWQ, BITS)
    elif AWQ:
        packed = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_np[None, :] * stride_qn,
                         mask=k_mask[:, None] & np_mask[None, :], other=0)
        return _unpack_tile(packed, False, True, BITS, BLOCK_K, BLOCK_N)
    else:
        offs_kp = t * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
        packed = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=(offs_kp < tl.cdiv(K, PACK))[:, None] & n_mask[None, :], other=0)
        return _unpack_tile(packed, True, False, BITS, BLOCK_K, BLOCK_N)


@triton.jit
def _int_matmul_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_ym, stride_yn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr, GATHER: tl.constexpr,
    DOT_F32: tl.constexpr, MAGIC_F16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_np = pid_n * (BLOCK_N // PACK) + tl.arange(0, BLOCK_N // PACK)  # packed columns
    m_mask = offs_m < M
    n_mask = offs_n < N
    np_mask = offs_np < tl.cdiv(N, PACK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    for t in range(t_start, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        q = _load_q_tile(qw_ptr, t, offs_k, offs_n, offs_np, k_mask, n_mask, np_mask, K, stride_qk, stride_qn,
                         BITS, AWQ, GATHER, BLOCK_K, BLOCK_N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if ONE_GROUP_PER_TILE:
            grp = (t * BLOCK_K) // group_size
            z, s = col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                                  AWQ, BITS, HAS_ZEROS)
            z = z[None, :]
            # The group's scale factors out of the tile: y += s * (x @ (q - z)). With fp16
            # activations q - z is formed without an int->float conversion per element: OR q
            # into the mantissa of 1024.0 (0x6400) and subtract 1024 + z.
            if MAGIC_F16:
                w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (z + 1024).to(tl.float16)
                if DOT_F32:
                    part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(x, w)
            elif DOT_F32:
                part = tl.dot(x.to(tl.float32), (q - z).to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, (q - z).to(x.dtype))
            acc += part * s[None, :]
        else:
            z, s = group_zero_scale(s_ptr, z_ptr, g_ptr, offs_k, offs_n, k_mask, n_mask, group_size,
                                    stride_sg, stride_sn, stride_zg, stride_zn, AWQ, BITS, HAS_ZEROS, HAS_GIDX)
            w = (q - z).to(tl.float32) * s
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    finish_tile(acc, y_ptr, offs_m, offs_n, m_mask[:, None] & n_mask[None, :], stride_ym, stride_yn, ws_ptr, lock_ptr,
                pid_m, pid_n, pid_k, BLOCK_M, BLOCK_N, SPLIT_K, SERIAL)


def _split_for(tiles: int, k_tiles: int, sms: int, m: int, k: int) -> int:
    """Split K (a power of two, at most 8) until there are ~6 tiles per SM, while the split's
    own traffic stays small: each split writes and reads back (or adds atomically) an fp32
    [m, N] partial, 8 * m * N bytes, against the K * N / 2 bytes of an INT4 weight, so
    split * m is kept to K / 32 (at most half the weight's bytes)."""
    split = 1
    while (tiles * split < 6 * sms and split * 2 <= k_tiles and split < 8
           and 2 * split * m <= max(1, k // 32)):
        split *= 2
    return split


PAIRS_MIN_WORDS = 16
"""GPTQ pairs kernel: a K tile gives each of its 32 / bits slices one row per word, and tl.dot
needs 16 (K tiles of 128 rows at 4 bits, 64 at 8)."""


def _gptq_pairs(layout: str | None, block_k: int) -> bool:
    """A GPTQ-layout weight ("gptq4"/"gptq8") whose K tile holds the words the pairs kernel needs."""
    bits = {"gptq4": 4, "gptq8": 8}.get(layout or "")
    return bits is not None and block_k * bits >= PAIRS_MIN_WORDS * 32


def default_config(m: int, n: int, k: int, device: torch.device, gemv: bool | None = None,
                   group_size: int | None = None, pairs_layout: str | None = None) -> MatmulConfig:
    """Tile sizes by regime: M <= 16 streams the weight, up to M < DEQUANT_MIN_M GEMM tiles,
    both with K split when the output tiles alone leave SMs idle; from DEQUANT_MIN_M the
    dequantize-then-cuBLAS path. ``block_k`` stays within one quantization group where it
    can, so the group's scale factors out of the tile. ``pairs_layout``: "gptq4", "gptq8" or
    "awq" for a weight without act-order, which takes the ``pairs`` kernel at decode batches
    (GPTQ: 2 <= M <= 32 where the K tile can hold 16 words; AWQ: 2 <= M <= 16); other weights
    keep the tiles they were measured with."""
    block_k = 128
    if group_size and group_size < block_k and group_size >= 16 and group_size & (group_size - 1) == 0:
        block_k = group_size
    if INTERPRET or device.type != "cuda":
        return MatmulConfig(block_m=16 if m <= 16 else 32, block_n=64, block_k=min(block_k, 64),
                            gemv=bool(gemv) and m == 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if m <= 16:
        # Measured on an H200 (benchmarks/kernels.py, 4096x14336, M=1): the GEMV kernel with
        # 64-128-column tiles, 2-4 warps and K split in 8 was fastest (22.8 us; tl.dot: 36 us).
        gemv = m == 1 if gemv is None else gemv and m == 1
        pairs = not gemv and (pairs_layout == "awq" or _gptq_pairs(pairs_layout, block_k))
        # AWQ pairs: 256 columns give each of 4 warps 8 of every slice's 32 (128: duplicated MMAs).
        block_n = 256 if pairs and pairs_layout == "awq" else 128 if gemv or pairs else 64
        split = _split_for(triton.cdiv(n, block_n), triton.cdiv(k, block_k), sms, m, k)
        # The GEMV's K loop in 2 stages (quant_gemv): one tile's arithmetic (~500 instructions
        # a warp, 4-5 warps a scheduler) outlasts a load's latency, so one tile ahead covers it.
        return MatmulConfig(block_m=16, block_n=block_n, block_k=block_k, split_k=split, num_warps=4,
                            num_stages=2 if gemv else 3, gemv=gemv, pairs=pairs)
    if m <= 32 and _gptq_pairs(pairs_layout, block_k):
        # Static counts (quant_pairs): 32x128x128 pairs tiles take 5.3-5.5 SASS instructions
        # per weight on sm_89/90, the 32x64x64 tiles below 9.9-10.2. Not yet timed on a GPU.
        tiles = triton.cdiv(n, 128)
        return MatmulConfig(block_m=32, block_n=128, block_k=block_k, num_warps=4, num_stages=3, pairs=True,
                            split_k=_split_for(tiles, triton.cdiv(k, block_k), sms, m, k))
    if m < DEQUANT_MIN_M:
        # The H200 run had 32-112 programs here (no split): too few for 132 SMs.
        block_m = 32 if m <= 32 else 64
        block_k = min(block_k, 64)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 64)
        return MatmulConfig(block_m=block_m, block_n=64, block_k=block_k, num_warps=4, num_stages=3,
                            split_k=_split_for(tiles, triton.cdiv(k, block_k), sms, m, k))
    return MatmulConfig(block_m=128, block_n=128, block_k=min(block_k, 64), num_warps=8, num_stages=3, dequant=True)


@functools.lru_cache(maxsize=4096)
def choose_config(device: torch.device, kind: str | None, m: int, n: int, k: int, group_size: int | None
                  ) -> MatmulConfig:
    """The shipped tuned config of this GPU for the problem (``tuned``), else the heuristic;
    ``QPAGE_GEMV_HALF2=1`` (or ``0``) turns the half2 GEMV on (or off) wherever the GEMV runs."""
    fields = tuned_matmul(table_for(device), kind, m, n, k)
    if fields:
        cfg = MatmulConfig(**fields)
    else:
        layout = {"int4": "gptq4", "int8": "gptq8", "awq": "awq"}.get((kind or "").split("-")[0])
        cfg = default_config(m, n, k, device, group_size=group_size, pairs_layout=layout)
    half2 = os.environ.get("QPAGE_GEMV_HALF2", "")
    if cfg.gemv and half2 in ("0", "1"):  # the half2 GEMV forced on or off (quant_gemv_h2)
        cfg = replace(cfg, half2=half2 == "1")
    return cfg


def int_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    awq: bool = False,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W [K, N]`` with W packed as described in the module docstring.

    ``group_size`` is the group length along K (K itself for per-channel); ``qzeros=None``
    means symmetric (zero = 2**(bits-1)). Inputs are assumed validated at load time.
    """
    if bits not in (4, 8) or (awq and bits != 4):
        raise ValueError(f"bits={bits} is not supported (GPTQ layout: 4 or 8; AWQ: 4)")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    n = scales.shape[1]
    kind = matmul_kind(bits, group_size, k, awq, g_idx is not None)
    cfg = config or choose_config(x.device, kind, m, n, k, group_size)
    if cfg.dequant:
        from qpage.kernels.quant_dequant import dequant_matmul

        return dequant_matmul(x2, qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size, awq=awq
                              ).view(*lead, n)
    if awq and cfg.block_n % 8:
        raise ValueError("AWQ needs block_n to be a multiple of 8")
    pack = 32 // bits
    if cfg.block_k % pack or cfg.block_n % pack:
        raise ValueError(f"block_k and block_n must be multiples of {pack} for {bits}-bit weights")
    one_group = g_idx is None and group_size % cfg.block_k == 0
    if cfg.gemv and m == 1 and one_group:
        from qpage.kernels.quant_gemv import int_gemv

        return int_gemv(x2, qweight, scales, qzeros, bits=bits, group_size=group_size, awq=awq, config=cfg
                        ).view(*lead, n)
    if cfg.gemv:
        layout = ("awq" if awq else f"gptq{bits}") if g_idx is None else None
        cfg = default_config(m, n, k, x.device, gemv=False, group_size=group_size, pairs_layout=layout)
        one_group = g_idx is None and group_size % cfg.block_k == 0
    if cfg.pairs:
        from qpage.kernels.quant_pairs import pairs_apply, pairs_matmul

        if pairs_apply(x2, bits, awq, g_idx is not None, group_size, cfg):
            return pairs_matmul(x2, qweight, scales, qzeros, bits=bits, group_size=group_size, awq=awq, config=cfg
                                ).view(*lead, n)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    y, ws, locks, serial = split_k_output(m, n, x.dtype, x.device, cfg.split_k, cfg.serial, grid[0] * grid[1],
                                  cfg.block_m * cfg.block_n)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    gidx = g_idx if g_idx is not None else qweight
    _int_matmul_kernel[grid](
        x2, qweight, scales, zeros, gidx, y, ws, locks,
        m, n, k, group_size,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1) if zeros.dim() > 1 else 0, y.stride(0), y.stride(1),
        BITS=bits, AWQ=awq, HAS_ZEROS=qzeros is not None, HAS_GIDX=g_idx is not None,
        ONE_GROUP_PER_TILE=one_group, SPLIT_K=cfg.split_k, SERIAL=serial, GATHER=cfg.gather,
        DOT_F32=INTERPRET or x.dtype == torch.float32, MAGIC_F16=x.dtype == torch.float16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.to(x.dtype).view(*lead, n)
