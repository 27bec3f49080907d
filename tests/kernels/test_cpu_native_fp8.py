"""The FP8 cache kernels in C (``kernels.cpu.attention.native_fp8``) against their torch references.

The cache write must equal ``write_kv_cache_ref`` bit for bit (codes and fp16 scales), in
both formats and both scale modes. Decode attention is held to 2e-6 relative against
``TorchPagedAttention._decode`` on the same cache (which dequantizes it first): the two
differ by summation order, by where the scale is applied, and by the C exp.
"""

from __future__ import annotations

import pytest
import torch

from qpage.config import BLOCK_SIZE
from qpage.kernels.cpu import native as cpu_native
from qpage.kernels.kv_quant import write_kv_cache_ref
from qpage.layers.attention.backends import TorchPagedAttention
from qpage.layers.attention.kv_format import KVCacheSpec, make_layer_kv
from qpage.layers.attention.metadata import DecodeGroup
from tests.kernels.conftest import rel_err

if cpu_native.no_compiler_or_disabled():  # pragma: no cover
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

from qpage.kernels.cpu.attention.native_fp8 import code_values, paged_decode_fp8, write_kv_fp8

MODES = [("e4m3", True), ("e4m3", False), ("e5m2", True), ("e5m2", False)]
IDS = ["e4m3-token", "e4m3-tensor", "e5m2-token", "e5m2-tensor"]


def kv_rows(t: int, kvh: int, hd: int, seed: int) -> torch.Tensor:
    """Rows across many magnitudes: heads scaled 1e-7..1e4 (subnormal codes and half-subnormal
    scales at the low end), a few outliers, an all-zero head, and exact ties of the grid."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, kvh, hd, generator=g) * torch.logspace(-7, 4, t * kvh).view(t, kvh, 1)
    x[:, :, :3] *= 40
    x[0, 0] = 0
    x[1, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -3.5, 448, -448, 1e6, -1e-12])
    return x


@pytest.mark.parametrize(("fmt", "per_token"), MODES, ids=IDS)
def test_write_is_bit_exact(fmt: str, per_token: bool) -> None:
    kvh, hd, nb = 3, 64, 12
    spec = KVCacheSpec(torch.float32, fmt, per_token)
    mine = make_layer_kv(spec, nb, kvh, hd, torch.device("cpu"), static_scales=(0.37, 2.5))
    ref = make_layer_kv(spec, nb, kvh, hd, torch.device("cpu"), static_scales=(0.37, 2.5))
    k, v = kv_rows(40, kvh, hd, 1), kv_rows(40, kvh, hd, 2)
    slots = torch.randperm(nb * BLOCK_SIZE)[:40]
    slots[5] = -1
    write_kv_fp8(k, v, mine.k, mine.v, slots, mine.k_scale, mine.v_scale, fmt)
    write_kv_cache_ref(k, v, ref.k, ref.v, slots, ref.k_scale, ref.v_scale, fmt)
    assert torch.equal(mine.k, ref.k) and torch.equal(mine.v, ref.v)
    assert torch.equal(mine.k_scale, ref.k_scale) and torch.equal(mine.v_scale, ref.v_scale)
    assert int((mine.k != 0).sum()) > 0.5 * mine.k.numel() * 39 / (nb * BLOCK_SIZE)


def test_code_table_matches_torch() -> None:
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        torch.testing.assert_close(code_values(fmt), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("fmt", "per_token"), MODES, ids=IDS)
@pytest.mark.parametrize(("kvh", "group", "hd"), [(3, 3, 64), (2, 4, 128), (1, 7, 80)])
def test_decode_matches_torch(fmt: str, per_token: bool, kvh: int, group: int, hd: int) -> None:
    lens = [300, 17, 1, 16]
    g = torch.Generator().manual_seed(3)
    width = max(-(-n // BLOCK_SIZE) for n in lens) + 1
    nb = len(lens) * width + 2
    cache = make_layer_kv(KVCacheSpec(torch.float32, fmt, per_token), nb, kvh, hd, torch.device("cpu"),
                          static_scales=(0.05, 0.02))
    ids = torch.randperm(nb, generator=g)
    table = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        used = -(-n // BLOCK_SIZE)
        table[i, :used] = ids[i * width : i * width + used]
        pos = torch.arange(n)
        slots = table[i][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(n, kvh, hd, generator=g) * (1 + 3 * torch.rand(n, kvh, 1, generator=g))
        write_kv_cache_ref(k, torch.randn(n, kvh, hd, generator=g), cache.k, cache.v, slots, cache.k_scale,
                           cache.v_scale, fmt)
    seq_lens = torch.tensor(lens)
    mask = (torch.arange(width * BLOCK_SIZE)[None, :] < seq_lens[:, None])[:, None, None, :]
    d = DecodeGroup(0, len(lens), table, mask, max(lens), seq_lens)
    q = torch.randn(len(lens), kvh * group, hd, generator=g) * 2
    ref = TorchPagedAttention._decode(q, cache, d, hd**-0.5)
    out = paged_decode_fp8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, fmt, table, seq_lens, hd**-0.5)
    assert rel_err(out, ref) < 2e-6


def test_bad_tables_and_slots_raise() -> None:
    cache = make_layer_kv(KVCacheSpec(torch.float32, "e4m3", True), 4, 2, 64, torch.device("cpu"))
    q = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="block id outside"):
        paged_decode_fp8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, "e4m3", torch.tensor([[9]]),
                         torch.tensor([3]), 0.125)
    k = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="slot outside"):
        write_kv_fp8(k, k, cache.k, cache.v, torch.tensor([64]), cache.k_scale, cache.v_scale, "e4m3")
    with pytest.raises(ValueError, match="per-token scales must be fp16"):
        write_kv_fp8(k, k, cache.k, cache.v, torch.tensor([0]), cache.k_scale.float(), cache.v_scale, "e4m3")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per-tensor", "per-token"])
@pytest.mark.parametrize("hd", [132, 136], ids=["hd132-tail4", "hd136-tail8"])  # 256+ codes over 2 heads
def test_decode_reads_every_code_exactly(fmt: str, per_token: bool, hd: int) -> None:
    """With one cached token attention returns that token's V row, decoded and scaled: every
    finite code placed in V must come back as torch's value of it times the V scale, to the
    bit. This pins the vector decode (AVX2/F16C bit operations, 16 codes at a time) and the
    table for a head_dim tail of 4 or 8 to torch's float8 conversion, subnormals and signs
    included."""
    kvh, bs = 2, BLOCK_SIZE
    values = code_values(fmt)
    finite = torch.nonzero(torch.isfinite(values)).flatten().to(torch.uint8)  # the codes a cache can hold
    row = torch.zeros(kvh * hd, dtype=torch.uint8)
    row[: finite.numel()] = finite
    k_cache = torch.zeros(2, bs, kvh, hd, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    v_cache[1, 0] = row.view(kvh, hd)
    if per_token:
        k_scale = torch.ones(2, bs, kvh, dtype=torch.float16)
        v_scale = torch.full((2, bs, kvh), 0.25, dtype=torch.float16)
    else:
        k_scale, v_scale = torch.tensor(1.0), torch.tensor(0.25)
    q = torch.randn(1, kvh, hd, generator=torch.Generator().manual_seed(0))
    out = paged_decode_fp8(q, k_cache, v_cache, k_scale, v_scale, fmt, torch.tensor([[1]]), torch.tensor([1]),
                           hd**-0.5)
    want = values[row.long()].view(kvh, hd) * 0.25
    assert torch.equal(out[0], want), (out[0] - want).abs().max()
