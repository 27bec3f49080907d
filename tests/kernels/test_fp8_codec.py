"""FP8 encode/decode in Triton (integer arithmetic) against torch's float8 conversions, bit for bit."""

from __future__ import annotations

import pytest
import torch

from qpage.kernels.fp8 import codec as fp8_codec
from qpage.kernels.fp8.codec import (
    CVT_BITS,
    CVT_HW,
    FP8_FORMATS,
    encode_fp8_ref,
    f32_to_fp8,
    fp8_to_f16,
    fp8_to_f32,
    fp8_unit,
)
from qpage.kernels.triton_utils import tl, triton


@triton.jit
def _roundtrip_kernel(x_ptr, codes_ptr, f32_ptr, f16_ptr, n, IS_E5M2: tl.constexpr, CVT: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(codes_ptr + offs, f32_to_fp8(x, IS_E5M2), mask=mask)
    c = tl.load(codes_ptr + offs, mask=mask, other=0)
    tl.store(f32_ptr + offs, fp8_to_f32(c, IS_E5M2), mask=mask)
    tl.store(f16_ptr + offs, fp8_to_f16(c, IS_E5M2, CVT), mask=mask)


def _run(x: torch.Tensor, fmt: str, cvt: int = CVT_BITS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.empty(x.shape, dtype=torch.uint8)
    f32 = torch.empty(x.shape, dtype=torch.float32)
    f16 = torch.empty(x.shape, dtype=torch.float16)
    _roundtrip_kernel[(triton.cdiv(x.numel(), 1024),)](x, codes, f32, f16, x.numel(), IS_E5M2=fmt == "e5m2", CVT=cvt,
                                                         BLOCK=1024)
    return codes, f32, f16


def _hard_values(fmt: str) -> torch.Tensor:
    """Every finite code's value, the midpoints between neighbours (ties), values just either
    side of them, both zeros, subnormals, the largest finite value and beyond (saturation)."""
    dtype, fmax = FP8_FORMATS[fmt]
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    eps = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    extra = torch.tensor([0.0, -0.0, fmax, -fmax, fmax * 1.03, -fmax * 1.5, 1e30, -1e30, 1e-30, 2.0**-12])
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * torch.logspace(-8, 6, 20000).sqrt()
    return torch.cat([vals, -vals, mids, -mids, eps, -eps, extra, rand]).contiguous()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_matches_torch_bit_for_bit(fmt: str) -> None:
    x = _hard_values(fmt)
    codes, _, _ = _run(x, fmt)
    want = encode_fp8_ref(x, fmt)
    bad = (codes != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. x={x[bad[:5]].tolist()} got {codes[bad[:5]].tolist()} " \
                             f"want {want[bad[:5]].tolist()}"


@pytest.mark.parametrize(("fmt", "cvt"), [("e4m3", CVT_BITS), ("e4m3", CVT_HW), ("e5m2", CVT_BITS)],
                         ids=["e4m3-bits", "e4m3-hw", "e5m2"])
def test_decode_every_code(fmt: str, cvt: int) -> None:
    """All 256 codes (NaNs aside: the encoder saturates and never writes them)."""
    dtype, _ = FP8_FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(dtype).float()
    finite = torch.isfinite(want)
    got32 = torch.empty(256)
    got16 = torch.empty(256, dtype=torch.float16)
    _decode_only[(1,)](codes, got32, got16, IS_E5M2=fmt == "e5m2", CVT=cvt)
    assert torch.equal(got32[finite], want[finite])
    assert torch.equal(got16[finite].float() * fp8_unit(fmt, cvt), want[finite])


@triton.jit
def _decode_only(c_ptr, f32_ptr, f16_ptr, IS_E5M2: tl.constexpr, CVT: tl.constexpr):
    offs = tl.arange(0, 256)
    c = tl.load(c_ptr + offs)
    tl.store(f32_ptr + offs, fp8_to_f32(c, IS_E5M2))
    tl.store(f16_ptr + offs, fp8_to_f16(c, IS_E5M2, CVT))


def test_decoder_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per device (CUDA faked by its compute capability): the hardware conversion for e4m3 on
    sm_89+, the integer bit trick below it, for e5m2, on CPUs and under the interpreter."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(fp8_codec, "INTERPRET", False)
    try:
        for cc, e4m3 in (((8, 6), CVT_BITS), ((8, 9), CVT_HW), ((9, 0), CVT_HW)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None, cc=cc: cc)
            fp8_codec._capability.cache_clear()
            assert (fp8_codec.fp8_decoder(cuda, "e4m3"), fp8_codec.fp8_decoder(cuda, "e5m2")) == (e4m3, CVT_BITS), cc
        assert fp8_codec.fp8_decoder(cpu, "e4m3") == CVT_BITS
    finally:
        fp8_codec._capability.cache_clear()
