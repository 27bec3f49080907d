"""Run a quantized checkpoint in transformers with GPTQModel's torch kernel (fp32), in its own
process (GPTQModel sets global state at import), and save its logits and the dequantized
weight of one linear with safetensors:

    python -m tests.formats.peer_logits MODEL_DIR OUT.safetensors ID ID ...
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GPTQConfig

    model_dir, out, ids = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3:]]
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu",
                                             quantization_config=GPTQConfig(bits=4, backend="torch"))
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0].float()
        down = m.model.layers[0].mlp.down_proj.dequantize_weight().float()
    save_file({"logits": logits.contiguous(), "down_proj": down.contiguous()}, out)


if __name__ == "__main__":
    main()
