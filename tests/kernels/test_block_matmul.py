"""The CUDA block-format path (``kernels.block_matmul``) under Triton's interpreter, against
the ``gguf`` package: Q4_1, Q4_K and Q6_K decoded from the file's bytes equal
``gguf.quants.dequantize`` exactly (fp32 out); Q4_0 and Q8_0 written as GPTQ integers run on
the INT kernels within 1e-5 of the dequantized weight times x (fp32, order of additions).
Random blocks as in test_cpu_gguf.py; shapes small (the interpreter is slow).
"""

from __future__ import annotations

import pytest
import torch

from qpage.formats.gguf_model import GgufConfig, GgufTensor
from qpage.kernels import block_matmul as bm
from qpage.kernels.triton_utils import HAS_TRITON, INTERPRET
from qpage.layers.linear.block_linear import BlockLinear
from qpage.layers.linear.linear_kernels import TritonBlocks
from tests.kernels.conftest import rel_err
from tests.kernels.gguf_weights import quantized_weight

pytestmark = pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="needs Triton's interpreter")

CPU = torch.device("cpu")


@pytest.mark.parametrize(("name", "n", "k"), [("Q4_1", 20, 96), ("Q4_K", 18, 512), ("Q6_K", 9, 256)])
def test_decoded_weights_equal_gguf(name: str, n: int, k: int) -> None:
    rows, w = quantized_weight(name, n, k, seed=n)
    got = bm.dequantize(torch.from_numpy(rows), getattr(bm, name), k, torch.float32)
    assert torch.equal(got, w.t())
    part = bm.dequantize(torch.from_numpy(rows), getattr(bm, name), k, torch.float32, columns=(4, 9))
    assert torch.equal(part, w.t()[:, 4:9])


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_dequant_matmul_in_column_chunks(name: str) -> None:
    k = 256
    rows, w = quantized_weight(name, 140, k, seed=1)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    mm = bm.DequantWeight(torch.from_numpy(rows), getattr(bm, name), k, max_chunk_bytes=1)  # 128 columns a chunk
    assert rel_err(mm(x), x.double() @ w.double().t()) < 1e-5


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
def test_gptq_form_runs_on_the_int_kernels(name: str) -> None:
    n, k = 24, 128
    rows, w = quantized_weight(name, n, k, seed=2)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1))
    mm = bm.to_gptq(rows, getattr(bm, name), k, CPU)
    assert rel_err(mm(x), x.double() @ w.double().t()) < 1e-5
    chunked = bm.to_gptq(rows, getattr(bm, name), k, CPU, step=7)  # rows packed 7 at a time
    assert torch.equal(chunked.qweight, mm.qweight) and torch.equal(chunked.scales, mm.scales)


def test_unsupported_formats_are_named() -> None:
    assert "no CUDA kernel" in (bm.unsupported_reason(13, 256) or "")  # Q5_K
    assert "256-weight blocks" in (bm.unsupported_reason(bm.Q6_K, 96) or "")
    assert bm.unsupported_reason(bm.Q4_0, 64) is None


def test_fused_projection_of_mixed_parts() -> None:
    """A fused linear whose parts are Q4_0 (GPTQ form), Q4_K (decoded) and fp32: each part's
    output in its columns; on a CPU tensor the selector itself passes it over, by name."""
    k, parts = 256, [("Q4_0", 48), ("Q4_K", 16), ("F32", 8)]
    layer = BlockLinear(k, sum(n for _, n in parts), False, GgufConfig())
    offset = 0
    for i, (name, n) in enumerate(parts):
        if name == "F32":
            value = torch.randn(n, k, generator=torch.Generator().manual_seed(i))
        else:
            rows, _ = quantized_weight(name, n, k, seed=i)
            value = GgufTensor(rows, getattr(bm, name), (n, k), name)
        layer.load_part(f"p{i}", {"weight": value}, offset, n, "f")
        offset += n
    spec = layer.spec(torch.float32)
    assert "runs on cuda, not cpu" in (TritonBlocks().can_implement(spec) or "")
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    got = TritonBlocks().build(layer, spec).mm(x)
    assert rel_err(got, x.double() @ layer.dequantized_in_out().double()) < 1e-5
