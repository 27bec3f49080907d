"""Tests of the packed PTX FP8 decoder, as they stood before it left the package (see
../README.md); they need ``experimental/kernels/fp8_ptx_decoder.py`` wired into the codec."""
# ruff: noqa

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
