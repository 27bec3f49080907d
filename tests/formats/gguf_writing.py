"""Writing a transformers model's tensors as a GGUF file under llama.cpp's names, for the
architecture tests that make their files with the ``gguf`` package (Phi-3, Gemma)."""

from __future__ import annotations

from typing import Any

import torch

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
