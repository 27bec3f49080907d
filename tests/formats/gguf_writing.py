"""Writing a transformers model's tensors as a GGUF file under llama.cpp's names, for the
architecture tests that make their files with the ``gguf`` package (Phi-3, Gemma, MoE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from qpage.formats.gguf_write import tokenizer_keys

TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def write_tensors_and_close(w: Any, state: dict[str, torch.Tensor], layer_names: dict[str, str], qtype: int,
                            norm_shift: float = 0.0, skip: tuple[str, ...] = ()) -> None:
    """Every tensor of ``state`` but ``skip`` into the writer ``w`` (a ``gguf.GGUFWriter`` with its
    keys added): top-level names by ``TOP``, layer tensors ``blk.N.<layer_names[module]>``; 2-d
    weights in ``qtype``, the rest F32; ``norm_shift`` added to every norm weight (Gemma's
    ``1 + w``). Then the file is written and closed."""
    import gguf

    for name, t in state.items():
        if name in skip:
            continue
        x = t.float().numpy()
        if name.endswith("norm.weight"):
            x = x + norm_shift
        if name in TOP:
            gname = TOP[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.{parts[-1]}"
        if x.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_model(cfg: Any, folder: Path, tokenizer_dir: Path) -> transformers.PreTrainedModel:
    """A seeded random model of config ``cfg`` (eager attention, weights larger than the default
    init so errors show in the logits), with the default model's tokenizer files in ``folder``."""
    torch.manual_seed(0)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return model


def start_file(dest: Path, arch: str, c: Any, tokenizer_dir: Path, q8: bool, head_dim: int | None = None) -> Any:
    """A ``gguf.GGUFWriter`` for ``arch`` with the keys every llama.cpp file has (shape, norm
    epsilon, file type, the tokenizer); ``head_dim`` adds the key and value lengths."""
    import gguf

    w = gguf.GGUFWriter(str(dest), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(7 if q8 else 0)
    for key, value, vtype, sub in tokenizer_keys(tokenizer_dir, c.vocab_size):
        w.add_key_value(key, value, vtype, sub_type=sub)
    return w


def assert_matches_reference(h: Any, model: Any, ids: list[int], qtype: str) -> None:
    """The file ``h`` runs against ``model`` (transformers, the same weights) over a prefill of
    ``ids`` and three decode steps: F32 within 2e-4 of its logits; a block format (Q8_0 weights,
    int8 activations, as tests/formats/test_gguf_fixtures.py holds them) within a mean KL of 0.01."""
    req = h.request("a", ids)
    got = [h.step([(req, len(ids))])["a"]]
    for t in (3, 5, 7):
        req.append_token(t)
        got.append(h.step([(req, 1)])["a"])
    with torch.no_grad():
        want = model(torch.tensor([req.all_token_ids])).logits[0]
    got_all = torch.cat(got)
    if qtype == "F32":
        torch.testing.assert_close(got_all, want, atol=2e-4, rtol=0)
        return
    kl = torch.nn.functional.kl_div(got_all.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert float(kl.mean()) < 0.01
