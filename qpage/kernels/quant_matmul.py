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
bits=8 and one group spanning K.

One kernel serves decode and prefill: a [BLOCK_M, BLOCK_N] tile of y per program; for
small M the K loop is split over SPLIT_K programs that add into an fp32 output (the GEMV
regime is bound by reading the weight, so it needs many programs in flight); for large M
it is a plain tiled GEMM. Weights are dequantized to fp32 in registers and fed to
``tl.dot`` in the activation dtype (fp32 under the interpreter), accumulating in fp32.
"""

from dataclasses import dataclass

import torch

from qpage.kernels.triton_utils import INTERPRET, tl, triton

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ packs column ``AWQ_ORDER[i]`` of each group of 8 into nibble i."""


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    gemv: bool = False
    """M = 1 with one group per K tile: ``quant_gemv`` (multiply-add, no tensor cores)."""


@triton.jit
def split_k_range(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [start, end) that split ``pid_k`` of SPLIT_K reduces (the last may be short)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_start = pid_k * per_split
    t_end = t_start + per_split
    if t_end > k_tiles:
        t_end = k_tiles
    return t_start, t_end


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
        if AWQ:
            shifts = ((j % 2) * 4 + j // 2) * 4
        else:
            shifts = j * BITS
        vals = (packed[:, :, None] >> shifts[None, None, :]) & QMASK
        return tl.reshape(vals, (BLOCK_K, BLOCK_N))


@triton.jit
def _int_matmul_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_ym, stride_yn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, MAGIC_F16: tl.constexpr,
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
        if AWQ:
            packed = tl.load(qw_ptr + offs_k[:, None] * stride_qk + offs_np[None, :] * stride_qn,
                             mask=k_mask[:, None] & np_mask[None, :], other=0)
            q = _unpack_tile(packed, False, True, BITS, BLOCK_K, BLOCK_N)
        else:
            offs_kp = t * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
            packed = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                             mask=(offs_kp < tl.cdiv(K, PACK))[:, None] & n_mask[None, :], other=0)
            q = _unpack_tile(packed, True, False, BITS, BLOCK_K, BLOCK_N)
        if ONE_GROUP_PER_TILE:
            grp = (t * BLOCK_K) // group_size
            s = tl.load(s_ptr + grp * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zp = tl.load(z_ptr + grp * stride_zg + offs_np * stride_zn, mask=np_mask, other=0)
                z = _unpack_tile(zp[None, :], False, AWQ, BITS, 1, BLOCK_N)
            else:
                z = tl.full((1, BLOCK_N), 1 << (BITS - 1), dtype=tl.int32)
            # The group's scale factors out of the tile: y += s * (x @ (q - z)). With fp16
            # activations q - z is formed without an int->float conversion per element: OR q
            # into the mantissa of 1024.0 (0x6400) and subtract 1024 + z.
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
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
            if HAS_GIDX:
                grp = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]
            else:
                grp = (offs_k // group_size)[:, None]
            kn_mask = k_mask[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + grp * stride_sg + offs_n[None, :] * stride_sn, mask=kn_mask, other=0.0)
            if HAS_ZEROS:
                zp = tl.load(z_ptr + grp * stride_zg + (offs_n // PACK)[None, :] * stride_zn, mask=kn_mask, other=0)
                col = offs_n % PACK
                if AWQ:
                    zshift = ((col % 2) * 4 + col // 2) * 4
                else:
                    zshift = col * BITS
                z = (zp >> zshift[None, :]) & ((1 << BITS) - 1)
            else:
                z = 1 << (BITS - 1)
            w = (q - z).to(tl.float32) * s.to(tl.float32)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptrs, acc, mask=out_mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def default_config(m: int, n: int, k: int, device: torch.device, gemv: bool | None = None,
                   group_size: int | None = None) -> MatmulConfig:
    """Tile sizes by regime: M <= 16 streams the weight (split K only when N alone gives fewer
    tiles than the GPU has SMs); larger M uses GEMM tiles. ``block_k`` stays within one
    quantization group where it can, so the group's scale factors out of the tile."""
    block_k = 128
    if group_size and group_size < block_k and group_size >= 16 and group_size & (group_size - 1) == 0:
        block_k = group_size
    if INTERPRET or device.type != "cuda":
        return MatmulConfig(block_m=16 if m <= 16 else 32, block_n=64, block_k=min(block_k, 64),
                            gemv=bool(gemv) and m == 1)
    if m <= 16:
        # Measured on an H200 (benchmarks/kernels.py, 4096x14336, M=1): the GEMV kernel with
        # 128-column tiles, 4 warps and K split in 8 was fastest (22.6 us; tl.dot: 37-40 us);
        # 32-column GEMV tiles were 10x slower. Split K until there are ~6 tiles per SM.
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        gemv = m == 1 if gemv is None else gemv and m == 1
        block_n = 128 if gemv else 64
        tiles = triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block_k)
        split = 1
        while tiles * split < 6 * sms and split * 2 <= k_tiles and split < 8:
            split *= 2
        return MatmulConfig(block_m=16, block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=3,
                            gemv=gemv)
    if m <= 64:
        return MatmulConfig(block_m=64, block_n=128, block_k=min(block_k, 64), num_warps=4, num_stages=3)
    return MatmulConfig(block_m=128, block_n=128, block_k=min(block_k, 64), num_warps=8, num_stages=3)


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
    cfg = config or default_config(m, n, k, x.device, group_size=group_size)
    if awq and cfg.block_n % 8:
        raise ValueError("AWQ needs block_n to be a multiple of 8")
    pack = 32 // bits
    if cfg.block_k % pack or cfg.block_n % pack:
        raise ValueError(f"block_k and block_n must be multiples of {pack} for {bits}-bit weights")
    one_group = g_idx is None and group_size % cfg.block_k == 0
    if cfg.gemv and m == 1 and one_group:
        from qpage.kernels.quant_gemv import int_gemv

        return int_gemv(x2, qweight, scales, qzeros, bits=bits, group_size=group_size, awq=awq, config=cfg
                        ).to(x.dtype).view(*lead, n)
    if cfg.gemv:
        cfg = default_config(m, n, k, x.device, gemv=False, group_size=group_size)
        one_group = g_idx is None and group_size % cfg.block_k == 0
    out_dtype = torch.float32 if cfg.split_k > 1 else x.dtype
    alloc = torch.zeros if cfg.split_k > 1 else torch.empty
    y = alloc((m, n), dtype=out_dtype, device=x.device)
    zeros = qzeros if qzeros is not None else qweight  # placeholder pointer, never read
    gidx = g_idx if g_idx is not None else qweight
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _int_matmul_kernel[grid](
        x2, qweight, scales, zeros, gidx, y,
        m, n, k, group_size,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1) if zeros.dim() > 1 else 0, y.stride(0), y.stride(1),
        BITS=bits, AWQ=awq, HAS_ZEROS=qzeros is not None, HAS_GIDX=g_idx is not None,
        ONE_GROUP_PER_TILE=one_group, SPLIT_K=cfg.split_k, DOT_F32=INTERPRET or x.dtype == torch.float32,
        MAGIC_F16=x.dtype == torch.float16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.to(x.dtype).view(*lead, n)


# ---------------------------------------------------------------- references and packing


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [R / P, C] packed along rows -> int32 [rows, C] (GPTQ qweight)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
    return vals.reshape(-1, packed.shape[1])[:rows]


def unpack_cols(packed: torch.Tensor, bits: int, cols: int, awq: bool = False) -> torch.Tensor:
    """int32 [R, C / P] packed along columns -> int32 [R, cols] (GPTQ qzeros; AWQ both)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(2) >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C/P, nibble]
    if awq:
        inverse = [AWQ_ORDER.index(c) for c in range(8)]
        vals = vals[:, :, inverse]
    return vals.reshape(packed.shape[0], -1)[:, :cols]


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] values in 0..2**bits-1 -> int32 [ceil(R / P), C], packed along rows."""
    pack = 32 // bits
    r = q.shape[0]
    q = torch.nn.functional.pad(q.to(torch.int64), (0, 0, 0, (-r) % pack))
    q = q.view(-1, pack, q.shape[1])
    shifts = torch.arange(pack, dtype=torch.int64, device=q.device) * bits
    return _to_int32((q << shifts[None, :, None]).sum(1))


def pack_cols(q: torch.Tensor, bits: int, awq: bool = False) -> torch.Tensor:
    """int [R, C] values -> int32 [R, ceil(C / P)], packed along columns (AWQ order if asked)."""
    pack = 32 // bits
    c = q.shape[1]
    q = torch.nn.functional.pad(q.to(torch.int64), (0, (-c) % pack))
    q = q.view(q.shape[0], -1, pack)
    if awq:
        q = q[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(pack, dtype=torch.int64, device=q.device) * bits
    return _to_int32((q << shifts[None, None, :]).sum(2))


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def dequantize_ref(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, g_idx: torch.Tensor | None,
    *, bits: int, group_size: int, in_features: int, awq: bool = False,
) -> torch.Tensor:
    """The fp32 weight [K, N] the packed tensors encode."""
    n = scales.shape[1]
    q = unpack_cols(qweight, bits, n, awq=True) if awq else unpack_rows(qweight, bits, in_features)
    grp = g_idx.long() if g_idx is not None else torch.arange(in_features, device=q.device) // group_size
    if qzeros is None:
        z = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    else:
        z = unpack_cols(qzeros, bits, n, awq=awq)
    return (q - z[grp]).float() * scales.float()[grp]


def int_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None, *, bits: int, group_size: int, awq: bool = False,
) -> torch.Tensor:
    w = dequantize_ref(qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size,
                       in_features=x.shape[-1], awq=awq)
    return (x.float() @ w).to(x.dtype)
