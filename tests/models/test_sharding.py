"""How a model splits over ranks (``models.sharding``): head groups, replication, refusals, and
GPTQ row-parallel parts that equal the matching slice of the whole weight."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from qpage.formats import bnb
from qpage.formats.fp8 import Fp8Config
from qpage.formats.gguf_model import GgufTensor
from qpage.formats.gptq import GptqConfig
from qpage.formats.safetensors_io import lazy_tensors, write_file
from qpage.kernels.packing import dequantize_ref, pack_cols, pack_rows
from qpage.layers.linear.fp8_linear import Fp8Linear
from qpage.models.arch import ArchConfig
from qpage.models.sharding import check_parallel, plan_shards, shard_fp8, shard_gptq, shard_weight

ARCH = ArchConfig("LlamaForCausalLM", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=8, num_kv_heads=4, head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                  max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=False, o_bias=False,
                  mlp_bias=False, qk_norm=False, sliding_window=None, torch_dtype="float32")


def test_even_split_covers_everything_once() -> None:
    plans = plan_shards(ARCH, 2)
    assert [p.heads for p in plans] == [(0, 4), (4, 8)]
    assert [p.kv_heads for p in plans] == [(0, 2), (2, 4)]
    assert [p.intermediate for p in plans] == [(0, 256), (256, 512)]
    assert [p.vocab for p in plans] == [(0, 500), (500, 1000)]
    local = plans[1].local_arch(ARCH)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (4, 2, 256, 500)


def test_uneven_kv_heads_split_in_whole_groups() -> None:
    arch = dataclasses.replace(ARCH, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)  # SmolLM2-135M
    plans = plan_shards(arch, 2)
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 3)]
    assert [p.heads for p in plans] == [(0, 3), (3, 9)], "each rank's query heads are its KV heads' groups"


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    arch = dataclasses.replace(ARCH, num_heads=8, num_kv_heads=2)
    plans = plan_shards(arch, 4)
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_refuses_what_cannot_split() -> None:
    arch = dataclasses.replace(ARCH, num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match="does not fit 6 query heads over 2 KV heads"):
        check_parallel(arch, 4, "m")  # 2 ranks per KV head, but 3 query heads per group
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="holds 2 quantization groups of 128, fewer than tensor_parallel_size=4"):
        check_parallel(dataclasses.replace(ARCH, quantization=fp8), 4, "m")  # 256 attention columns: 2 blocks
    check_parallel(dataclasses.replace(ARCH, quantization=fp8), 2, "m")
    check_parallel(arch, 1, "m")  # one rank always fits


def test_dense_slices() -> None:
    p = plan_shards(ARCH, 2)[1]
    w = torch.arange(256 * 256, dtype=torch.float32).view(256, 256)
    assert torch.equal(shard_weight("model.layers.0.self_attn.q_proj.weight", w, p, ARCH), w[128:256])
    assert torch.equal(shard_weight("model.layers.0.self_attn.k_proj.weight", w[:128], p, ARCH), w[64:128])
    assert torch.equal(shard_weight("model.layers.0.self_attn.o_proj.weight", w, p, ARCH), w[:, 128:256])
    assert torch.equal(shard_weight("model.layers.0.mlp.down_proj.bias", w[0], p, ARCH), torch.zeros(256)), \
        "a row-parallel bias is added by rank 0 only"
    assert torch.equal(shard_weight("model.norm.weight", w[0], p, ARCH), w[0])


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_row_parallel_parts_sum_to_the_whole(act_order: bool, tmp_path: Path) -> None:
    """Each rank's down_proj part, fed the input columns it names, sums to the whole layer;
    qweight is read from a file as a rank reads it (``LazyTensor``: in order, only its rows)."""
    torch.manual_seed(0)
    k, n, g = 512, 256, 128
    cfg = GptqConfig(4, g, False, act_order, False)
    q = torch.randint(0, 16, (k, n))
    scales = torch.rand(k // g, n, dtype=torch.float16) / 10
    zeros = torch.randint(0, 16, (k // g, n))
    g_idx = (torch.randperm(k) // g if act_order else torch.arange(k) // g).to(torch.int32)
    parts = {"qweight": pack_rows(q, 4), "scales": scales, "qzeros": pack_cols(zeros, 4), "g_idx": g_idx}
    whole = dequantize_ref(parts["qweight"], scales, parts["qzeros"], g_idx, bits=4, group_size=g, in_features=k)
    write_file(tmp_path / "w.safetensors", {"qweight": parts["qweight"]})
    parts["qweight"] = dict(lazy_tensors(tmp_path / "w.safetensors"))["qweight"]
    x = torch.randn(3, k)
    total = torch.zeros(3, n)
    plans = plan_shards(ARCH, 2)
    for plan in plans:
        part, cols = shard_gptq("model.layers.0.mlp.down_proj", parts, plans, plan.rank, ARCH, cfg)
        assert isinstance(part["qweight"], torch.Tensor)
        own = torch.arange(*plan.intermediate)
        if act_order:
            assert cols is not None, "act-order columns are scattered: the input is gathered"
        else:
            assert cols is None, "in-order groups on the rank's own columns need no gather"
            cols = own
        w = dequantize_ref(part["qweight"], part["scales"], part["qzeros"], part["g_idx"], bits=4, group_size=g,
                           in_features=len(cols))
        total += x[:, cols] @ w
    torch.testing.assert_close(total, x @ whole, rtol=1e-5, atol=1e-4)


def test_gguf_blocks_slice_on_block_boundaries() -> None:
    """A row-parallel GGUF weight is cut between blocks: each rank's part dequantizes to its
    columns of the whole; a cut inside a 256-weight K-quant block is refused by name."""
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(0)
    w = torch.randn(256, 256).numpy()
    q = quants.quantize(w, GGMLQuantizationType.Q4_0)
    t = GgufTensor(q, int(GGMLQuantizationType.Q4_0), (256, 256), "blk.0.attn_output.weight")
    whole = quants.dequantize(q, GGMLQuantizationType.Q4_0)
    for plan in plan_shards(ARCH, 2):
        part = shard_weight("model.layers.0.self_attn.o_proj.weight", t, plan, ARCH)
        a, b = plan.own_inputs("o_proj", ARCH)
        assert isinstance(part, GgufTensor) and part.shape == (256, b - a)
        assert (part.dequantize().numpy() == whole[:, a:b]).all()
    kq = np.zeros((256, 144), dtype=np.uint8)  # one 256-weight Q4_K block (144 bytes) per row
    k = GgufTensor(kq, int(GGMLQuantizationType.Q4_K), (256, 256), "blk.0.x")
    with pytest.raises(ValueError, match=r"blk.0.x: input columns \[0, 128\) do not fall on the weight's 256"):
        shard_weight("model.layers.0.self_attn.o_proj.weight", k, plan_shards(ARCH, 2)[0], ARCH)


def test_ranks_agree_on_gathering() -> None:
    """15 heads over 5 KV heads, groups of 64, 4 ranks: rank 0's o_proj columns happen to be
    its own, the others' are not; a gather is a collective, so every rank gathers."""
    arch = dataclasses.replace(ARCH, num_heads=15, num_kv_heads=5, head_dim=64, hidden_size=960)
    cfg = GptqConfig(4, 64, True, False, False)
    k, n = arch.q_size, 64
    parts = {"qweight": pack_rows(torch.randint(0, 16, (k, n)), 4), "scales": torch.ones(k // 64, n),
             "qzeros": pack_cols(torch.full((k // 64, n), 8), 4), "g_idx": None}
    plans = plan_shards(arch, 4)
    cols = [shard_gptq("model.layers.0.self_attn.o_proj", parts, plans, r, arch, cfg)[1] for r in range(4)]
    assert all(c is not None for c in cols)
    assert torch.equal(torch.cat(cols), torch.arange(k)), "the ranks' columns cover the input once"


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_parts_sum_to_the_whole(block: int | None, tmp_path: Path) -> None:
    """FP8 per channel and in 128x128 blocks (``formats.fp8.check_linear``'s layout): the
    column-parallel parts are the whole's rows, and the row-parallel parts, fed the input
    columns they name (whole scale blocks, gathered where they straddle a head boundary), sum
    to the whole layer. 9 heads of 64 over 3 KV heads: rank 0's o_proj columns are [0, 192)."""
    arch = dataclasses.replace(ARCH, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536)
    torch.manual_seed(0)
    k, n = arch.q_size, arch.hidden_size
    codes = torch.randn(n, k).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = torch.rand(n, -(-k // block)) if block else torch.rand(n)
    w = Fp8Linear(k, n, False, Fp8Config(block, "fp8"))
    w.store_part(codes, scale, 0, n)
    whole = w.dequantized()
    x = torch.randn(3, k)
    total = torch.zeros(3, n)
    plans = plan_shards(arch, 2)
    write_file(tmp_path / "w.safetensors", {"w": codes.view(torch.float8_e4m3fn)})
    lazy = dict(lazy_tensors(tmp_path / "w.safetensors"))["w"]  # read as a rank reads it: only its part
    for plan in plans:
        c, s, cols = shard_fp8("model.layers.0.self_attn.o_proj", lazy, scale, plans, plan.rank, arch, block)
        if block is None:
            assert cols is None, "per-channel scales split anywhere: each rank reads its own columns"
            cols = torch.arange(*plan.own_inputs("o_proj", arch))
        else:
            assert cols is not None and int(cols[0]) % block == 0, "whole blocks, the input gathered"
        part = Fp8Linear(len(cols), n, False, Fp8Config(block, "fp8"))
        part.store_part(c, s, 0, n)
        total += x[:, cols] @ part.dequantized().t()
        q, qs, none = shard_fp8("model.layers.0.mlp.up_proj", lazy, scale, plans, plan.rank, arch, block)
        a, b = plan.intermediate
        assert none is None and torch.equal(q, codes[a:b]) and torch.equal(qs, scale[a:b])
    torch.testing.assert_close(total, x @ whole.t(), rtol=1e-5, atol=1e-3)


def test_bitsandbytes_blocks_slice_with_their_absmax() -> None:
    """An NF4 weight's 32-weight kernel blocks split between columns; each part keeps the
    exact absmax of its weights (a bitsandbytes block of 64 may be cut in half)."""
    torch.manual_seed(0)
    out_f, in_f = 64, 256
    codes = torch.randint(0, 16, (out_f, in_f))
    absmax = torch.rand(out_f * in_f // 64) + 0.5
    parts = {k.removeprefix("p."): v for k, v in bnb.pack_linear("p", codes, absmax).items()}
    t = bnb.check_linear("p", parts, bnb.BnbConfig("nf4", False), in_f, out_f, "f")
    assert isinstance(t, bnb.Bnb4Tensor)
    whole = t.dequantize()
    for a, b in ((0, 96), (96, 256)):
        part = t.take_cols(a, b)
        assert isinstance(part, bnb.Bnb4Tensor) and part.shape == (out_f, b - a)
        assert torch.equal(part.dequantize(), whole[:, a:b])
    assert torch.equal(t.take_rows(16, 48).dequantize(), whole[16:48])
    with pytest.raises(ValueError, match="do not fall on the weight's 32-weight blocks"):
        t.take_cols(0, 48)


def test_lazy_tensors_read_only_their_slice(tmp_path: Path) -> None:
    """What a rank reads of a safetensors file: rows, columns, or all, equal to the tensor's."""
    torch.manual_seed(0)
    tensors = {"w": torch.randn(7, 5), "b": torch.randn(9).to(torch.bfloat16), "s": torch.tensor(2.5),
               "c": torch.randn(4, 6).to(torch.float8_e4m3fn).view(torch.uint8), "t": torch.randn(4, 3, 2)}
    write_file(tmp_path / "m.safetensors", tensors)
    lazy = dict(lazy_tensors(tmp_path / "m.safetensors"))
    for name, t in tensors.items():
        assert torch.equal(lazy[name].read(), t), name
    w = lazy["w"]
    assert torch.equal(w[2:5], tensors["w"][2:5]) and torch.equal(w[:, 1:4], tensors["w"][:, 1:4])
    assert torch.equal(lazy["t"][1:3], tensors["t"][1:3]) and torch.equal(lazy["b"][3:7], tensors["b"][3:7])
    plan = plan_shards(ARCH, 2)[1]
    assert shard_weight("model.norm.weight", w, plan, ARCH) is w, "kept whole, still unread: the loader reads it"
    with pytest.raises(TypeError, match="reads"):
        lazy["t"][:, 1:2]
