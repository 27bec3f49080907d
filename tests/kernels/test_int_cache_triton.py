"""The Triton kernels of the int8/int4 cache (``kernels.attention.int_cache``) against their
torch references, under the interpreter: the write bit for bit (codes and fp16 parameters),
decode attention within 2e-5 relative of ``TorchPagedAttention._decode`` on the dequantized
cache (summation order, where the parameters apply, exp2), and the block dequantizer within
1e-6 (a fused multiply-add may round once instead of twice)."""

from __future__ import annotations

import pytest
import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.attention.int_cache import dequantize_blocks, paged_decode_int, write_int_cache
from qpage.kernels.kv_int import dequantize_ref, write_int_cache_ref
from qpage.layers.attention.backends import TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, make_layer_kv
from qpage.layers.attention.metadata import DecodeGroup
from tests.kernels.conftest import rel_err


def _rows(t: int, kvh: int, hd: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, kvh, hd, generator=g) * torch.logspace(-7, 2.5, t * kvh).view(t, kvh, 1)
    x[:, :, :2] *= 30
    x[0, 0] = 0
    x[1, 0, :6] = torch.tensor([0.5, 1.5, 2.5, -3.5, 127, -127])
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("kvh", "hd"), [(3, 64), (2, 80)])
def test_write_is_bit_exact(bits: int, kvh: int, hd: int) -> None:
    nb = 4
    spec = KVCacheSpec(torch.float32, int_bits=bits)
    mine, ref = (make_layer_kv(spec, nb, kvh, hd, torch.device("cpu")) for _ in range(2))
    x = _rows(20, kvh, hd, 1)
    slots = torch.randperm(nb * BLOCK_SIZE)[:20]
    slots[3] = -1
    write_int_cache(x, mine.k, mine.k_scale, slots, bits)
    write_int_cache_ref(x, ref.k, ref.k_scale, slots, bits)
    assert torch.equal(mine.k, ref.k) and torch.equal(mine.k_scale, ref.k_scale)


@pytest.mark.parametrize("kv_bits", [(8, 8), (4, 4), (8, 4)], ids=["int8", "int4", "k8v4"])
@pytest.mark.parametrize(("kvh", "group", "hd"), [(3, 3, 64), (1, 4, 32)])
def test_decode_and_block_reader_match_torch(kv_bits: tuple[int, int], kvh: int, group: int, hd: int) -> None:
    lens = [70, 1, 16]
    g = torch.Generator().manual_seed(4)
    width = 6
    nb = len(lens) * width
    kb, vb = kv_bits
    cache = make_layer_kv(KVCacheSpec(torch.float32, int_bits=kb, v_bits=vb if vb != kb else None), nb, kvh, hd,
                          torch.device("cpu"))
    table = torch.randperm(nb, generator=g).view(len(lens), width)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[i][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        write_int_cache_ref(torch.randn(n, kvh, hd, generator=g) * 2 + 0.3, cache.k, cache.k_scale, slots, kb)
        write_int_cache_ref(torch.randn(n, kvh, hd, generator=g), cache.v, cache.v_scale, slots, vb)
    seq_lens = torch.tensor(lens)
    mask = (torch.arange(width * BLOCK_SIZE)[None, :] < seq_lens[:, None])[:, None, None, :]
    q = torch.randn(len(lens), kvh * group, hd, generator=g)
    ref = TorchPagedAttention._decode(q, cache, DecodeGroup(0, len(lens), table, mask, max(lens), seq_lens),
                                      hd**-0.5)
    out = paged_decode_int(q, cache.k, cache.v, cache.k_scale, cache.v_scale, kb, vb, table.to(torch.int32),
                           seq_lens.to(torch.int32), hd**-0.5, block_n=16)
    assert rel_err(out, ref) < 2e-5
    ids = table[0, :3].contiguous()
    got = dequantize_blocks(cache.v, cache.v_scale, vb, ids, hd, torch.float32)
    assert rel_err(got, dequantize_ref(cache.v[ids], cache.v_scale[ids], vb)) < 1e-6
