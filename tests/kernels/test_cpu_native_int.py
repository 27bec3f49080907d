"""The int8/int4 cache kernels in C (``kernels.cpu.attention.native_int``) against their torch references,
and the references themselves (``kernels.kv_int``).

The cache write must equal ``write_int_cache_ref`` bit for bit (codes and fp16 parameters).
Decode attention is held to 2e-6 relative against ``TorchPagedAttention._decode`` on the same
cache (which dequantizes it first): they differ by summation order, by where the scale and
zero are applied, and by the C exp. The block reader (prefill's context) is held to 1 ulp-ish
(1e-6 relative) against ``dequantize_ref``: C may fuse its multiply-add.
"""

from __future__ import annotations

import pytest
import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.cpu import native as cpu_native
from qpage.kernels.kv_int import dequantize_ref, hadamard, quantize_ref, unpack_int4, write_int_cache_ref
from qpage.layers.attention.backends import TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, make_layer_kv
from qpage.layers.attention.metadata import DecodeGroup
from tests.kernels.conftest import rel_err

BITS = [8, 4]


def kv_rows(t: int, kvh: int, hd: int, seed: int) -> torch.Tensor:
    """Rows across many magnitudes within fp16's range (1e-7..3e2 times outliers of 40x:
    subnormal fp16 scales at the low end), an all-zero head, a constant head and exact ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, kvh, hd, generator=g) * torch.logspace(-7, 2.5, t * kvh).view(t, kvh, 1)
    x[:, :, :3] *= 40
    x[0, 0] = 0
    x[2, 1] = 3.25
    x[1, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -3.5, 127, -127, 6e4, -1e-12])
    return x


def test_reference_layout_and_error() -> None:
    x = kv_rows(50, 3, 64, 0)[4:]
    c8, p8 = quantize_ref(x, 8)
    assert c8.dtype == torch.int8 and p8.shape == (46, 3, 1) and int(c8.abs().max()) <= 127
    err8 = (dequantize_ref(c8, p8, 8) - x).abs()
    assert (err8 <= 0.5 * p8.float() * (1 + 1e-3)).all()  # half a step (the scale is rounded to fp16)
    c4, p4 = quantize_ref(x, 4)
    assert c4.dtype == torch.uint8 and c4.shape == (46, 3, 32) and p4.shape == (46, 3, 2)
    codes = unpack_int4(c4)
    assert int(codes.max()) <= 15
    step, lo = p4[..., :1].float(), p4[..., 1:].float()
    assert torch.equal(codes[..., 0], torch.round((x[..., 0] - lo[..., 0]) / step[..., 0]).clamp(0, 15).byte())
    err4 = (dequantize_ref(c4, p4, 4) - x).abs()
    span = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
    assert (err4 <= 0.5 * step + 1e-3 * span + 1e-30).all()


@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])
def test_hadamard_is_orthonormal_and_symmetric(head_dim: int) -> None:
    h, block = hadamard(head_dim)
    assert block == head_dim & -head_dim
    torch.testing.assert_close(h @ h, torch.eye(head_dim), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T)
    assert (h.abs()[h != 0] == block**-0.5).all()


native = pytest.mark.skipif(cpu_native.no_compiler_or_disabled(), reason="native CPU kernels unavailable")


KV_BITS = [(8, 8), (4, 4), (8, 4)]
KV_IDS = ["int8", "int4", "k8v4"]


def _spec(kv_bits: tuple[int, int]) -> KVCacheSpec:
    return KVCacheSpec(torch.float32, int_bits=kv_bits[0], v_bits=kv_bits[1] if kv_bits[1] != kv_bits[0] else None)


def _write_ref(cache: object, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    write_int_cache_ref(k, cache.k, cache.k_scale, slots, cache.k_bits)  # type: ignore[attr-defined]
    write_int_cache_ref(v, cache.v, cache.v_scale, slots, cache.v_bits)  # type: ignore[attr-defined]


@native
@pytest.mark.parametrize("kv_bits", KV_BITS, ids=KV_IDS)
def test_write_is_bit_exact(kv_bits: tuple[int, int]) -> None:
    from qpage.kernels.cpu.attention.native_int import write_int

    kvh, hd, nb = 3, 64, 12
    mine, ref = (make_layer_kv(_spec(kv_bits), nb, kvh, hd, torch.device("cpu")) for _ in range(2))
    k, v = kv_rows(40, kvh, hd, 1), kv_rows(40, kvh, hd, 2)
    slots = torch.randperm(nb * BLOCK_SIZE)[:40]
    slots[5] = -1
    write_int(k, mine.k, mine.k_scale, slots, kv_bits[0])
    write_int(v, mine.v, mine.v_scale, slots, kv_bits[1])
    _write_ref(ref, k, v, slots)
    assert torch.equal(mine.k, ref.k) and torch.equal(mine.v, ref.v)
    assert torch.equal(mine.k_scale, ref.k_scale) and torch.equal(mine.v_scale, ref.v_scale)
    assert int((mine.k_scale != 0).sum()) >= 39 * kvh * (1 if kv_bits[0] == 8 else 2) - 2


def _filled_cache(kv_bits: tuple[int, int], kvh: int, hd: int, lens: list[int], seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK_SIZE) for n in lens) + 1
    nb = len(lens) * width + 2
    cache = make_layer_kv(_spec(kv_bits), nb, kvh, hd, torch.device("cpu"))
    ids = torch.randperm(nb, generator=g)
    table = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        used = -(-n // BLOCK_SIZE)
        table[i, :used] = ids[i * width : i * width + used]
        pos = torch.arange(n)
        slots = table[i][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(n, kvh, hd, generator=g) * (1 + 3 * torch.rand(n, kvh, 1, generator=g)) + 0.5
        _write_ref(cache, k, torch.randn(n, kvh, hd, generator=g) - 0.3, slots)
    return cache, table, g


@native
@pytest.mark.parametrize("kv_bits", KV_BITS, ids=KV_IDS)
@pytest.mark.parametrize(("kvh", "group", "hd"), [(3, 3, 64), (2, 4, 128), (1, 7, 80), (2, 2, 6), (1, 2, 320)])
def test_decode_matches_torch(kv_bits: tuple[int, int], kvh: int, group: int, hd: int) -> None:
    from qpage.kernels.cpu.attention.native_int import paged_decode_int

    lens = [300, 17, 1, 16]
    cache, table, g = _filled_cache(kv_bits, kvh, hd, lens, 3)
    seq_lens = torch.tensor(lens)
    mask = (torch.arange(table.shape[1] * BLOCK_SIZE)[None, :] < seq_lens[:, None])[:, None, None, :]
    d = DecodeGroup(0, len(lens), table, mask, max(lens), seq_lens)
    q = torch.randn(len(lens), kvh * group, hd, generator=g) * 2
    ref = TorchPagedAttention._decode(q, cache, d, hd**-0.5)
    out = paged_decode_int(q, cache.k, cache.v, cache.k_scale, cache.v_scale, *kv_bits, table, seq_lens, hd**-0.5)
    assert rel_err(out, ref) < 2e-6


@native
def test_bad_tables_and_slots_raise() -> None:
    from qpage.kernels.cpu.attention.native_int import paged_decode_int, write_int

    cache = make_layer_kv(KVCacheSpec(torch.float32, int_bits=4), 4, 2, 64, torch.device("cpu"))
    q = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="block id outside"):
        paged_decode_int(q, cache.k, cache.v, cache.k_scale, cache.v_scale, 4, 4, torch.tensor([[9]]),
                         torch.tensor([3]), 0.125)
    k = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="slot outside"):
        write_int(k, cache.k, cache.k_scale, torch.tensor([64]), 4)
    with pytest.raises(ValueError, match="fp16 parameters"):
        write_int(k, cache.k, cache.k_scale.float(), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match=r"int8 cache: expected contiguous torch\.int8 codes"):
        write_int(k, cache.k, cache.k_scale, torch.tensor([0]), 8)
