"""Mixture-of-experts models beyond transformers' logits (which tests/models/test_architectures.py
checks for every family, ``MOE_CASES``): the C block against the torch path on the same packed
experts, the fused decode step, batch invariance with preemption and prefix-cache hits,
checkpoints written by ``qpage quantize`` in each integer format, and the config's fields.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qpage.models.loader import read_arch_config
from tests.helpers import RunnerHarness
from tests.models.test_architectures import MOE_CASES, build


@pytest.fixture(scope="module", params=["qwen2moe", "qwen3moe", "gpt-oss"])
def moe_gguf(request: pytest.FixtureRequest, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Path:
    """A random MoE in Q8_0 as llama.cpp lays it out (``tests.formats.test_gguf_moe``; Qwen2-MoE
    with its shared expert, gpt-oss with its biases, clamped SwiGLU and sinks)."""
    gguf = pytest.importorskip("gguf")
    from tests.formats.test_gguf_moe import moe, write_moe_gguf

    folder = tmp_path_factory.mktemp(request.param)
    model = moe(request.param, folder, default_model_dir, max_position_embeddings=512)
    return write_moe_gguf(request.param, model, folder, folder / "model.gguf", gguf.GGMLQuantizationType.Q8_0)


def test_c_block_equals_the_torch_path_on_the_same_experts(moe_gguf: Path) -> None:
    """The C block against the torch path over the same packed experts (the same int8
    activations): equal up to the order of float additions, for 1 to 33 rows."""
    from qpage.layers.moe import SparseMoe

    h = RunnerHarness(moe_gguf, num_blocks=8)
    blocks = [m for m in h.model.modules() if isinstance(m, SparseMoe)]
    assert blocks and all(b.kernel is not None for b in blocks)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 7, 33):
        x = torch.randn(rows, blocks[0].gate.shape[1], generator=g)
        for b in blocks:
            want = b.reference(x)
            torch.testing.assert_close(b(x), want, atol=1e-5 * float(want.abs().max()), rtol=0)


def test_fused_moe_step_equals_the_python_layers(moe_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import qpage.models.llama as llama_module
    from qpage import LLM
    from tests.models.test_fused_decode import assert_fused_equals_python

    llm = LLM(model=str(moe_gguf), kv_cache_memory="64MiB", max_model_len=512, log_stats=False)
    assert llm.llm_engine.model.decode_stack is not None
    assert_fused_equals_python(llm, llama_module, monkeypatch)


@pytest.mark.slow
def test_moe_batch_invariance_preemption_and_prefix_hits(moe_gguf: Path) -> None:
    """Greedy tokens and logprobs of an MoE model equal a roomy run alone: batched with sampled
    neighbours, chunked, preempted under a tight KV budget, over prefix-cache hits
    (``tests.engine.test_batch_invariance``)."""
    from tests.engine.test_batch_invariance import check_invariance

    check_invariance(str(moe_gguf), "auto")


@pytest.mark.parametrize("case, scheme, fmt, max_kl", [
    ("qwen3-moe", "int4-gptq", "gptq", 0.01), ("mixtral", "int4-gptq", "gptq", 0.01),
    ("qwen2-moe", "int8-rtn", "gptq", 0.001), ("qwen3-moe-step", "int4-rtn", "compressed-tensors", 0.01),
    ("mixtral", "int4-rtn", "awq", 0.01), ("mixtral", "int4-awq", "awq", 0.01),
    ("qwen2-moe", "int8-awq", "gptq", 0.001)])
def test_moe_quantized_by_qpage_runs_packed(tmp_path: Path, case: str, scheme: str, fmt: str, max_kl: float) -> None:
    """``qpage quantize`` on an MoE checkpoint: every expert quantized (GPTQ or AWQ on the rows routed to
    it, RTN for those few rows reached), the routers left in full precision; the checkpoint runs
    its experts on the C block from each integer format (per-expert tensors, as the ecosystem's
    MoE checkpoints store them) within a mean KL of ``max_kl`` of the float model's predictions
    (a KL rather than the largest logit error: a token routed to another expert by the rounding
    moves a few logits by more than rounding alone would)."""
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    cls_name, extra = MOE_CASES[case]
    src, ref = build(tmp_path / "f", cls_name, extra)
    g = torch.Generator().manual_seed(3)
    calib = [torch.randint(0, 256, (64,), generator=g).tolist() for _ in range(4)]
    report = quantize_checkpoint(src, tmp_path / "q", QuantScheme.parse(scheme, group_size=32), progress=False,
                                 calib=calib, fmt=fmt)
    a = read_arch_config(src)
    assert report.linears == sum(4 + (3 * (a.num_experts + bool(a.shared_expert_intermediate_size)) if a.is_sparse(i)
                                      else 3) for i in range(a.num_layers))
    if scheme.endswith(("gptq", "awq")):
        assert 0 < report.rtn_fallbacks < report.linears  # some experts saw few of the 256 rows, most did not
    if scheme.endswith("awq"):
        assert_router_absorbed_the_scale(src, tmp_path / "q")
    h = RunnerHarness(tmp_path / "q", num_blocks=32)
    assert {m.kernel_path for m in h.model.quant_linears()} == {"cpu-blocks"}
    assert {m.experts_path for m in h.model.modules() if hasattr(m, "experts_path")} == {"cpu-native"}
    ids = calib[0][:40]
    got = h.step([(h.request("a", ids), len(ids))])["a"]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).mean()) < max_kl


def assert_router_absorbed_the_scale(src: Path, out: Path) -> None:
    """AWQ divides a sparse layer's post-attention norm by the experts' shared input scale: the
    router (and the shared expert's gate) must take it back exactly, column by column, so the
    routing is the float model's. At least one layer was scaled."""
    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = tensors(src), tensors(out)
    scaled = 0
    for name in a:
        if not name.endswith(("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.gate.weight",
                              "shared_expert_gate.weight")):
            continue
        norm = name.split(".mlp.")[0].split(".block_sparse_moe.")[0] + ".post_attention_layernorm.weight"
        torch.testing.assert_close(b[name] * b[norm], a[name] * a[norm], rtol=1e-5, atol=1e-7)
        scaled += not torch.equal(a[norm], b[norm])
    assert scaled > 0


def test_moe_config_fields_and_refusals() -> None:
    """Qwen's sparse layers (``decoder_sparse_step``, ``mlp_only_layers``), Mixtral's always
    renormalised routing, gpt-oss's sinks, biases and clamp, and architectures refused by name
    with the reason."""
    from qpage.models.arch import parse_arch_config

    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 256, "num_experts_per_tok": 2}
    a = parse_arch_config({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                           "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert a.sparse_layers == (False, True, False, False) and a.qk_norm and not a.norm_topk_prob
    m = parse_arch_config({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8})
    assert m.sparse_layers == (True,) * 4 and m.norm_topk_prob and m.moe_intermediate_size == 96
    with pytest.raises(ValueError, match="router_jitter_noise"):
        parse_arch_config({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                           "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match="num_experts_per_tok <= num_experts"):
        parse_arch_config({**base, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 1,
                           "moe_intermediate_size": 32})
    g = parse_arch_config({**base, "architectures": ["GptOssForCausalLM"], "num_local_experts": 8,
                           "attention_bias": True})
    assert g.attention_sinks and g.expert_bias and g.swiglu_limit == 7.0 and g.qkv_bias and g.o_bias
    from qpage.models.sharding import check_parallel

    with pytest.raises(ValueError, match="mixtures of experts"):
        check_parallel(m, 2, "config.json")
    with pytest.raises(ValueError, match=r"DeepSeek-V3's latent attention is not supported"):
        parse_arch_config({**base, "architectures": ["DeepseekV3ForCausalLM"]})


@pytest.mark.parametrize("scheme", ["int4-gptq", "int4-awq"])
def test_calibration_in_several_passes_writes_the_same_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  scheme: str) -> None:
    """A layer whose statistics exceed the budget is recorded in several passes over the
    calibration windows, each seeing the layer as it was: the checkpoint is the same bytes."""
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers import calibrate
    from qpage.quantizers.pipeline import quantize_checkpoint

    cls_name, extra = MOE_CASES["qwen2-moe"]
    src, _ = build(tmp_path / "f", cls_name, extra)
    calib = [torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(3)).tolist() for _ in range(2)]
    parsed = QuantScheme.parse(scheme, group_size=32)
    quantize_checkpoint(src, tmp_path / "one", parsed, progress=False, calib=calib)
    monkeypatch.setattr(calibrate, "HESSIAN_BUDGET", 8 * 64 * 64)  # one 64-wide linear a pass
    quantize_checkpoint(src, tmp_path / "many", parsed, progress=False, calib=calib)

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    one, many = tensors(tmp_path / "one"), tensors(tmp_path / "many")
    assert one and one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)


def test_awq_folds_keep_the_float_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWQ's scales alone, with its rounding and clipping left out, keep the float model: a
    Qwen2-MoE without GQA (o's scale folds into v's rows and their bias), with its shared
    expert, whose folded weights, norms, router, shared-expert gate and biases are written back
    as a float checkpoint, gives transformers' logits within 2e-4 (summation order only)."""
    from types import SimpleNamespace

    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers import awq_layers

    cls_name, extra = MOE_CASES["qwen2-moe"]
    src, ref = build(tmp_path / "f", cls_name, {**extra, "num_key_value_heads": 4})
    monkeypatch.setattr(awq_layers, "quantize_rtn", lambda w, *a, **k: (w.t().clone(), w[:1], w[:1]))
    monkeypatch.setattr(awq_layers, "dequantize_rtn", lambda q, s, z, g: q.t())  # the weight as it is
    results: dict[str, torch.Tensor] = {}
    sink = SimpleNamespace(rtn_fallbacks=[], put_layer=lambda i, out: results.update(
        {f"{p}.weight": r[0].t().contiguous() for p, r in out.items()}))
    calib = [torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(3)).tolist() for _ in range(4)]
    _, rewritten = awq_layers.awq_calibrate(src, QuantScheme.parse("int4-awq", group_size=32), calib,
                                            sink, clip=False)  # type: ignore[arg-type]
    folded = {**load_file(src / "model.safetensors"), **results, **rewritten}
    assert results.keys() <= load_file(src / "model.safetensors").keys()
    assert any("v_proj.bias" in k for k in rewritten) and any("shared_expert_gate" in k for k in rewritten)
    out = tmp_path / "folded"
    out.mkdir()
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    save_file({k: v.contiguous() for k, v in folded.items()}, str(out / "model.safetensors"))
    h = RunnerHarness(out, num_blocks=32)
    ids = calib[0][:40]
    got = h.step([(h.request("a", ids), len(ids))])["a"]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("scheme", ["int4-rtn", "int4-gptq", "int4-awq"])
def test_gpt_oss_quantized_by_qpage_runs_packed(tmp_path: Path, scheme: str) -> None:
    """gpt-oss's stacked experts are written one tensor per expert (GPTQ layout) and run packed
    (its experts on the C block) within a mean KL of 0.01 of the float model; calibrated
    schemes calibrate each expert on the rows routed to it (the calibration layer splits the
    stacked experts as the loader does)."""
    from qpage.formats.scheme import QuantScheme
    from qpage.quantizers.pipeline import quantize_checkpoint

    src, ref = build(tmp_path / "f", *MOE_CASES["gpt-oss"])
    g = torch.Generator().manual_seed(3)
    calib = [torch.randint(0, 256, (64,), generator=g).tolist() for _ in range(4)]
    report = quantize_checkpoint(src, tmp_path / "q", QuantScheme.parse(scheme, group_size=32), progress=False,
                                 calib=calib, fmt="gptq")
    assert report.linears == 3 * (4 + 3 * 8)
    if scheme.endswith("awq"):
        assert_router_absorbed_the_scale(src, tmp_path / "q")
    h = RunnerHarness(tmp_path / "q", num_blocks=32)
    assert {m.kernel_path for m in h.model.quant_linears()} == {"cpu-blocks"}
    assert {m.experts_path for m in h.model.modules() if hasattr(m, "experts_path")} == {"cpu-native"}
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    got = h.step([(h.request("a", ids), len(ids))])["a"]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).mean()) < 0.01
