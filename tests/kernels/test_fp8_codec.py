"""FP8 encode/decode in Triton (integer arithmetic) against torch's float8 conversions, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qpage.kernels import fp8_codec
from qpage.kernels.fp8_codec import (
    CVT_BITS,
    CVT_HW,
    CVT_PTX,
    E4M3_PTX,
    E5M2_PTX,
    FP8_FORMATS,
    decode_fp8_ref,
    encode_fp8_ref,
    f32_to_fp8,
    fp8_to_f16,
    fp8_to_f32,
    fp8_unit,
)
from qpage.kernels.triton_utils import tl, triton
from tests.kernels.ptx_model import run_ptx


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


def test_ptx_model_prmt_and() -> None:
    """The model's byte permute (result byte i = byte ``selector nibble i`` of {b, a}) and AND,
    on values worked by hand."""
    got = run_ptx("prmt.b32 $0, $1, 0, 0x1404; prmt.b32 $2, $1, $3, 0x0765; and.b32 $4, $1, 0x7F007F00;",
                  {1: np.uint32(0xDDCCBBAA), 3: np.uint32(0x44332211)})
    assert got[0] == 0xBB00AA00 and got[2] == 0xAA443322 and got[4] == 0x5D003B00


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_decode_ptx_bit_for_bit(fmt: str) -> None:
    """``E4M3_PTX``/``E5M2_PTX`` (``CVT_PTX``, GPUs only: the interpreter cannot run assembly),
    executed by the PTX model: every code in every byte position and 20k random words give
    the fp16 bits of the Triton decode, in Triton's packing order (code i of the 32-bit input
    in byte i; output register 0 holds codes 0 and 1, the lower in its low half), and those
    times the unit are torch's values for every finite code."""
    ptx = (E4M3_PTX if fmt == "e4m3" else E5M2_PTX).value
    codes = np.arange(256, dtype=np.uint32)
    rng = np.random.default_rng(0)
    filler = rng.integers(0, 256, size=(256, 4), dtype=np.uint32)
    words = [rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)]
    for pos in range(4):  # code c at byte ``pos``, random bytes elsewhere
        b = filler.copy()
        b[:, pos] = codes
        words.append(b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24))
    words.append(np.zeros((-sum(map(len, words))) % 256, dtype=np.uint32))  # whole blocks of 1024 codes
    w = np.concatenate(words)
    out = run_ptx(ptx, {2: w})
    got = np.stack([out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16], axis=1).astype(np.uint16)
    c = np.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=1).astype(np.uint8)
    # The Triton decode (fp8_to_f16, CVT_BITS) on the same codes, run by the interpreter.
    flat = torch.from_numpy(c.reshape(-1).copy())
    triton_f16 = fp8_codec._decode_all(flat, torch.device("cpu"), fmt, CVT_BITS)
    want = triton_f16.view(torch.int16).numpy().view(np.uint16).reshape(c.shape)
    assert np.array_equal(got, want)
    value = decode_fp8_ref(flat, fmt).numpy().reshape(c.shape)
    finite = np.isfinite(value)
    decoded = got.view(np.float16)[finite].astype(np.float32) * fp8_unit(fmt, CVT_PTX)
    assert np.array_equal(decoded, value[finite])


def test_decoder_choice_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per device (CUDA faked by its compute capability): hardware e4m3 on sm_89+, PTX below it
    and for e5m2, the Triton bit trick under the interpreter; ``QPAGE_FP8_DECODER`` forces a
    decoder the device can run and names the fix for one it cannot."""
    from qpage.kernels import fp8_codec

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("QPAGE_FP8_DECODER", raising=False)
    monkeypatch.setattr(fp8_codec, "INTERPRET", False)
    monkeypatch.setattr(fp8_codec, "ptx_decoder_ok", lambda device, fmt: True)
    try:
        for cc, e4m3, e5m2 in (((8, 6), CVT_PTX, CVT_PTX), ((8, 9), CVT_HW, CVT_PTX), ((9, 0), CVT_HW, CVT_PTX)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None, cc=cc: cc)
            fp8_codec._capability.cache_clear()
            assert (fp8_codec.fp8_decoder(cuda, "e4m3"), fp8_codec.fp8_decoder(cuda, "e5m2")) == (e4m3, e5m2), cc
        assert fp8_codec.fp8_decoder(cpu, "e4m3") == CVT_BITS
        monkeypatch.setenv("QPAGE_FP8_DECODER", "ptx")  # on sm_90: the PTX instead of the hardware
        assert fp8_codec.fp8_decoder(cuda, "e4m3") == CVT_PTX
        monkeypatch.setenv("QPAGE_FP8_DECODER", "bits")
        assert fp8_codec.fp8_decoder(cuda, "e4m3") == CVT_BITS
        monkeypatch.setenv("QPAGE_FP8_DECODER", "hw")
        with pytest.raises(ValueError, match="needs e4m3 codes on sm_89"):
            fp8_codec.fp8_decoder(cuda, "e5m2")
        with pytest.raises(ValueError, match="run no PTX"):
            fp8_codec.fp8_decoder(cpu, "e4m3")
        monkeypatch.setenv("QPAGE_FP8_DECODER", "fast")
        with pytest.raises(ValueError, match="expected one of"):
            fp8_codec.fp8_decoder(cuda, "e4m3")
    finally:
        fp8_codec._capability.cache_clear()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_ptx_decoder_checked_on_first_use(fmt: str, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU without e4m3 conversion (faked sm_86) the PTX decoder is used only after it
    has decoded every code exactly as torch does; a decoder that gets one code wrong (here a
    simulated one) is replaced by the element-wise bit trick, with a warning, and forcing it
    then raises naming the failed check. The "GPU" decode runs the Triton bit trick under the
    interpreter, so the passing case is the check's own logic against real decoded values."""
    from qpage.kernels import fp8_codec

    cuda = torch.device("cuda")
    monkeypatch.delenv("QPAGE_FP8_DECODER", raising=False)
    monkeypatch.setattr(fp8_codec, "INTERPRET", False)
    monkeypatch.setattr(fp8_codec, "_PTX_CHECKED", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    real = fp8_codec._decode_all
    monkeypatch.setattr(fp8_codec, "_decode_all", lambda codes, device, f, cvt: real(codes, torch.device("cpu"), f,
                                                                                         CVT_BITS))
    try:
        fp8_codec._capability.cache_clear()
        assert fp8_codec.fp8_decoder(cuda, fmt) == CVT_PTX
        assert not caplog.records

        def off_by_one(codes: torch.Tensor, device: torch.device, f: str, cvt: int) -> torch.Tensor:
            out = real(codes, torch.device("cpu"), f, CVT_BITS)
            out[57] = out[57] * 2
            return out

        monkeypatch.setattr(fp8_codec, "_PTX_CHECKED", {})
        monkeypatch.setattr(fp8_codec, "_decode_all", off_by_one)
        assert fp8_codec.fp8_decoder(cuda, fmt) == CVT_BITS
        assert "disagreed with torch on 1 of" in caplog.text
        monkeypatch.setenv("QPAGE_FP8_DECODER", "ptx")
        with pytest.raises(ValueError, match="failed its check"):
            fp8_codec.fp8_decoder(cuda, fmt)
    finally:
        fp8_codec._capability.cache_clear()
