"""The C kernels of the fp32 CPU path (``kernels.cpu.native``) against their torch references.

References: ``TorchPagedAttention._decode`` (SDPA over gathered blocks), ``write_kv_cache_ref``,
``F.rms_norm``, ``F.silu(gate) * up`` and ``apply_rotary``. Tolerances (fp32): the cache
write is bit-exact (a copy); the others differ by summation order and by the C exp
(< 2e-7 relative), so they are held to 2e-6 relative to the reference's norm.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from qpage.config import BLOCK_SIZE
from qpage.kernels.cpu import native as cpu_native
from qpage.kernels.cpu import native_ops
from qpage.kernels.cpu.attention import native_fp32
from qpage.kernels.kv_quant import write_kv_cache_ref
from qpage.layers.attention.backends import TorchPagedAttention
from qpage.layers.attention.kv_format import LayerKV
from qpage.layers.attention.metadata import DecodeGroup
from qpage.layers.rotary import RotaryEmbedding, apply_rotary
from tests.kernels.conftest import rel_err

if cpu_native.no_compiler_or_disabled():  # pragma: no cover
    # Skipped only where they cannot build; a compiler that fails the build fails the tests.
    pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}", allow_module_level=True)

TOL = 2e-6


def test_kernels_build() -> None:
    """A compiler is present (else this module is skipped): the build must succeed."""
    assert cpu_native.unavailable_reason() is None


def paged_case(lens: list[int], kvh: int, group: int, hd: int, seed: int = 0) -> tuple:
    """A cache with random contents, a padded block table of distinct random blocks per
    sequence, and q as a strided view (rows of a fused qkv output, as the model passes it)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK_SIZE) for n in lens) + 1
    nb = len(lens) * width + 3
    shape = (nb, BLOCK_SIZE, kvh, hd)
    cache = LayerKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    ids = torch.randperm(nb, generator=g)
    table = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        used = -(-n // BLOCK_SIZE)
        table[i, :used] = ids[i * width : i * width + used]
    h = kvh * group
    q = torch.randn(len(lens), h + 2 * kvh, hd, generator=g)[:, :h] * 2
    seq_lens = torch.tensor(lens)
    mask = (torch.arange(width * BLOCK_SIZE)[None, :] < seq_lens[:, None])[:, None, None, :]
    return q, cache, DecodeGroup(0, len(lens), table, mask, max(lens), seq_lens)


@pytest.mark.parametrize(("kvh", "group", "hd"), [(3, 3, 64), (2, 4, 128), (4, 1, 64), (1, 7, 80), (2, 2, 24)])
@pytest.mark.parametrize("lens", [[1], [16], [300, 17, 15, 1, 33]])
def test_paged_decode(kvh: int, group: int, hd: int, lens: list[int]) -> None:
    q, cache, d = paged_case(lens, kvh, group, hd)
    out = native_fp32.paged_decode(q, cache.k, cache.v, d.block_table, d.seq_lens, hd**-0.5)
    ref = TorchPagedAttention._decode(q, cache, d, hd**-0.5)
    assert rel_err(out, ref) < TOL


def test_paged_decode_peaked_scores() -> None:
    """Scores hundreds apart: most probabilities underflow to exactly 0 (the C exp's floor)."""
    q, cache, d = paged_case([200], 2, 2, 64, seed=1)
    q = q * 40
    out = native_fp32.paged_decode(q, cache.k, cache.v, d.block_table, d.seq_lens, 0.125)
    assert rel_err(out, TorchPagedAttention._decode(q, cache, d, 0.125)) < TOL


def test_paged_decode_rejects_bad_tables() -> None:
    q, cache, d = paged_case([40], 3, 3, 64)
    bad = d.block_table.clone()
    bad[0, 1] = cache.k.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="block id outside"):
        native_fp32.paged_decode(q, cache.k, cache.v, bad, d.seq_lens, 0.125)
    narrow = d.block_table[:, :2]  # a view whose rows are further apart than its 2 columns
    with pytest.raises(ValueError, match="block id outside"):
        native_fp32.paged_decode(q, cache.k, cache.v, narrow, torch.tensor([40]), 0.125)  # needs 3 blocks
    with pytest.raises(ValueError, match="seq_len < 1"):
        native_fp32.paged_decode(q, cache.k, cache.v, d.block_table, torch.tensor([0]), 0.125)
    with pytest.raises(ValueError, match="unsupported layout"):
        native_fp32.paged_decode(q.double(), cache.k, cache.v, d.block_table, d.seq_lens, 0.125)


def test_write_kv_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(5, 2 + 2 + 4, 16, generator=g)  # fused rows: k heads at 4:6, v heads at 6:8
    k, v = kv[:, 4:6], kv[:, 6:8]
    slots = torch.tensor([3, 40, -1, 17, 0])
    caches = [torch.zeros(4, BLOCK_SIZE, 2, 16) for _ in range(4)]
    native_fp32.write_kv(k, v, caches[0], caches[1], slots)
    write_kv_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="slot outside"):
        native_fp32.write_kv(k, v, caches[0], caches[1], torch.tensor([3, 40, 64, 17, 0]))


@pytest.mark.parametrize("dim", [576, 100])
def test_rms_norms(dim: int) -> None:
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(7, dim, generator=g), torch.randn(7, dim, generator=g)
    w = torch.randn(dim, generator=g)
    assert rel_err(native_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (dim,), w, 1e-5)) < TOL
    wide = torch.randn(7, dim + 9, generator=g)  # a strided view: rows dim + 9 apart
    assert rel_err(native_ops.rms_norm(wide[:, :dim], w, 1e-5), F.rms_norm(wide[:, :dim], (dim,), w, 1e-5)) < TOL
    x2, res2 = x.clone(), res.clone()
    native_ops.add_rms_norm_(x2, res2, w, 1e-5)
    assert torch.equal(res2, x + res)
    assert rel_err(x2, F.rms_norm(x + res, (dim,), w, 1e-5)) < TOL


def test_rms_norm_heads_in_place_on_a_projection_view() -> None:
    """q/k norms: each head of a [T, heads, hd] view of a fused qkv output, in place; the other
    heads untouched."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 10, 64, generator=g)
    w = torch.randn(64, generator=g)
    want = qkv.clone()
    want[:, 2:6] = F.rms_norm(qkv[:, 2:6], (64,), w, 1e-6)
    native_ops.rms_norm_heads_(qkv[:, 2:6], w, 1e-6)
    assert rel_err(qkv, want) < TOL
    assert torch.equal(qkv[:, :2], want[:, :2]) and torch.equal(qkv[:, 6:], want[:, 6:])


def test_silu_mul() -> None:
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 2 * 1536, generator=g) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 1e-8, -1e-8])  # saturation, underflow
    gate, up = gate_up.split(1536, dim=-1)
    out = native_ops.silu_mul(gate_up)
    assert rel_err(out, F.silu(gate) * up) < TOL
    assert torch.allclose(out[0, :8], (F.silu(gate) * up)[0, :8], rtol=1e-6, atol=0)


def test_gelu_tanh_mul() -> None:
    """GeGLU in C (as g * sigmoid(2y)): the torch reference's values; where tanh(y) is near -1
    the reference's 1 + tanh(y) cancels, so element by element the bound is absolute there."""
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 2 * 1536, generator=g) * 4
    gate_up[0, :10] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 1e-8, -1e-8, 0.31, -0.31])
    gate_up[1, :256] = torch.linspace(-0.5, 0.5, 256)  # both sides of the polynomial's edge
    gate, up = gate_up.split(1536, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    out = native_ops.gelu_tanh_mul(gate_up)
    assert rel_err(out, want) < TOL
    assert torch.allclose(out[:2], want[:2], rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("hd", [64, 128])
def test_rope_in_place(hd: int) -> None:
    rot = RotaryEmbedding(hd, 4096, 10000.0, None, torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9 + 2 * 3, hd, generator=g)
    pos = torch.tensor([0, 1, 77, 4000, 2])
    cos, sin = rot.lookup(pos)
    ref = apply_rotary(x[:, :12], cos, sin)
    out = x.clone()
    native_ops.rope_(out, cos.view(5, hd), sin.view(5, hd), 12)
    assert rel_err(out[:, :12], ref) < TOL
    assert torch.equal(out[:, 12:], x[:, 12:])  # the v heads are left alone


@pytest.mark.slow
def test_unavailable_compiler_falls_back() -> None:
    """No compiler: a clear reason, and the engine's CPU backend falls back to BLAS."""
    code = ("import os; from qpage.kernels.cpu import native as c; from qpage.layers.attention.selector import "
            "select_attention_backend as s; from qpage.layers.attention.kv_format import KVCacheSpec; import torch;"
            "print(c.unavailable_reason()); print(s(torch.device('cpu'), KVCacheSpec(torch.float32), 64).name)")
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/cc", "QPAGE_CACHE": "/nonexistent-cache"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)
    reason, backend = proc.stdout.strip().splitlines()
    assert "no C compiler" in reason and backend == "cpu-blas"


@pytest.mark.skipif(cpu_native.no_compiler_or_disabled(), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("hd", [64, 96])
def test_prompt_rows_equal_single_rows_bit_for_bit(hd: int) -> None:
    """A prompt chunk's rows attended together (one shared table: the 8-row tiles, several
    threads) give each row the bits of that row attended alone (the one-row decode path)."""
    from qpage.kernels.cpu.attention.native_fp32 import paged_decode

    g = torch.Generator().manual_seed(0)
    kvh, h, n, start = 2, 6, 45, 30
    k, v = (torch.randn(9, BLOCK_SIZE, kvh, hd, generator=g) for _ in range(2))
    table = torch.randperm(9, generator=g)[None]
    q = torch.randn(n, h, hd, generator=g)
    lens = torch.arange(start + 1, start + n + 1)
    together = paged_decode(q, k, v, table, lens, 0.125)
    for i in range(n):
        assert torch.equal(together[i : i + 1], paged_decode(q[i : i + 1], k, v, table, lens[i : i + 1], 0.125)), i
