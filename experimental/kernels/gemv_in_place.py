"""The in-place INT4/INT8 GEMV for the GPTQ layout, as it stood before it left the package
(see ../README.md). Value j of a word is taken in place, without shifting it down:
``(word | M) & (M | 0xF << 4j)`` with M the bits of 2.0**23 is the float 2**23 + q * 16**j,
so one AND and one subtraction of 2**23 give ``q * 16**j`` exactly; the 16**-j goes into the
activation, and the zero point is applied once per word and column. Static SASS counts:
4.3-4.5 instructions per weight in the loop against 6.1-6.2 for the shift kernel (sm_80-90).
Never timed on a GPU.
"""

from qpage.kernels.int_matmul.common import col_zero_scale
from qpage.kernels.split_k import finish_split_k, split_k_range
from qpage.kernels.triton_utils import tl, triton

MAGIC = 0x4B000000


@triton.jit
def _split8(x):
    """Columns 0..7 of ``x`` [rows, 8] as 8 vectors [rows]."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 4, 2)))  # columns 0,2,4,6 / 1,3,5,7
    e04, e26 = tl.split(tl.reshape(even, (x.shape[0], 2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, (x.shape[0], 2, 2)))
    c0, c4 = tl.split(e04)
    c2, c6 = tl.split(e26)
    c1, c5 = tl.split(o15)
    c3, c7 = tl.split(o37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _split4(x):
    """Columns 0..3 of ``x`` [rows, 4] as 4 vectors [rows]."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # columns 0,2 / 1,3
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _value(word, mask):
    """``q * 2**shift`` (exact, fp32) of the value under ``mask = M | QMASK << shift``."""
    return ((word | 0x4B000000) & mask).to(tl.float32, bitcast=True) - 8388608.0  # M = MAGIC


@triton.jit
def _gptq_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, lock_ptr,
    N, K, group_size, magic,
    stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    QMASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t_start, t_end = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    j = tl.arange(0, PACK)
    x_shift = 1.0 / (1 << ((j % (PACK // 2)) * BITS)).to(tl.float32)  # undoes value j's 16**j
    # The masks of the values in each half-word, as runtime values (see the module docstring).
    m0 = magic | QMASK
    m1 = magic | (QMASK << BITS)
    m2 = magic | ((QMASK << (2 * BITS)) & 0xFFFF)  # 4-bit only (0 for 8 bits: unused)
    m3 = magic | ((QMASK << (3 * BITS)) & 0xFFFF)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):  # see the module docstring
        grp = (t * BLOCK_K) // group_size
        offs_kp = t * WORDS + tl.arange(0, WORDS)
        kp_mask = offs_kp < tl.cdiv(K, PACK)
        lo = tl.load(qw_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                     mask=kp_mask[:, None] & n_mask[None, :], other=0)
        hi = (lo.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
        ks = offs_kp[:, None] * PACK + j[None, :]
        xt = tl.load(x_ptr + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)  # [WORDS, PACK]
        x_sum = tl.sum(xt, axis=1)
        xt = xt * x_shift[None, :]
        if BITS == 4:
            x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xt)
            part = x0[:, None] * _value(lo, m0)
            part += x1[:, None] * _value(lo, m1)
            part += x2[:, None] * _value(lo, m2)
            part += x3[:, None] * _value(lo, m3)
            part += x4[:, None] * _value(hi, m0)
            part += x5[:, None] * _value(hi, m1)
            part += x6[:, None] * _value(hi, m2)
            part += x7[:, None] * _value(hi, m3)
        else:
            x0, x1, x2, x3 = _split4(xt)
            part = x0[:, None] * _value(lo, m0)
            part += x1[:, None] * _value(lo, m1)
            part += x2[:, None] * _value(hi, m0)
            part += x3[:, None] * _value(hi, m1)
        z, s = col_zero_scale(s_ptr, z_ptr, grp, offs_n, n_mask, stride_sg, stride_sn, stride_zg, stride_zn,
                              False, BITS, HAS_ZEROS)
        acc += (part - x_sum[:, None] * z.to(tl.float32)[None, :]) * s[None, :]
    finish_split_k(tl.sum(acc, axis=0), y_ptr + offs_n, n_mask, tl.arange(0, BLOCK_N), ws_ptr, lock_ptr, pid_n,
                   tl.num_programs(0), pid_k, BLOCK_N, SPLIT_K)
