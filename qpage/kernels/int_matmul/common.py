"""Triton helpers shared by the integer matmul kernels: unpacking words and reading a tile's
zero points and scales.

Layouts (K = in features, N = out features, g = group size, G = ceil(K / g) groups,
P = 32 // bits values per int32, least significant first):
- GPTQ: ``qweight`` int32 [K / P, N], packed along K (row r*P + j at bits bits*j);
  ``qzeros`` int32 [G, N / P], packed along N in plain order; ``scales`` [G, N];
  ``g_idx`` int32 [K] (row -> group; act-order permutes it). The kernels read *v2* zeros
  (the stored value is the zero); loaders add 1 to v1 checkpoints' zeros before this.
- AWQ (GEMM): ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [G, N / 8], both packed
  along N in the interleaved order 0,2,4,6,1,3,5,7 (nibble i holds column ORDER[i]; column
  c sits in nibble (c % 2) * 4 + (c % 8) // 2); ``scales`` [G, N]; 4-bit only.

``W[k, n] = scales[grp(k), n] * (q[k, n] - zero[grp(k), n])``; symmetric checkpoints may
omit zeros (zero = 2**(bits-1)). INT8 weight-only per-channel is the GPTQ layout with
bits=8 and one group spanning K. Packing and the torch references: ``kernels.packing``.
"""

from qpage.kernels.triton_utils import tl, triton


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
