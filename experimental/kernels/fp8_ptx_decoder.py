"""The packed PTX FP8 decoder and its first-use check, as they stood before they left the
package (see ../README.md): four codes per 32-bit register decoded by two ``prmt`` and an AND,
a shift and a LOP3 per fp16 pair, for GPUs without e4m3 conversion (sm_80/86) and for e5m2.
Checked on CPU only by a model of its instructions; never timed on a GPU.
"""
# ruff: noqa
CVT_BITS = 0
CVT_PTX = 1
CVT_HW = 2

E4M3_PTX = tl.constexpr(
    "{ .reg .b32 t0, t1, m0, m1; "
    "prmt.b32 t0, $2, 0, 0x1404; "  # [0, c0, 0, c1]: codes 0 and 1 in the high bytes of two halves
    "prmt.b32 t1, $2, 0, 0x3424; "  # [0, c2, 0, c3]
    "and.b32 m0, t0, 0x7F007F00; "
    "and.b32 m1, t1, 0x7F007F00; "
    "shr.u32 m0, m0, 1; "  # (code & 0x7f) << 7 in each half
    "shr.u32 m1, m1, 1; "
    "lop3.b32 $0, t0, 0x80008000, m0, 0xEA; "  # | sign << 15: (a & b) | c
    "lop3.b32 $1, t1, 0x80008000, m1, 0xEA; }"
)
"""Four e4m3 codes (one 32-bit register, code i in byte i) -> four fp16 equal to value / 2**8
(``$0`` = codes 0 and 1, ``$1`` = codes 2 and 3, the lower index in the low half)."""

E5M2_PTX = tl.constexpr("{ prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424; }")
"""Four e5m2 codes -> four fp16 (each code is the high byte of its fp16)."""


DECODERS = {"bits": CVT_BITS, "ptx": CVT_PTX, "hw": CVT_HW}


def fp8_decoder(device: torch.device, fmt: str = "e4m3") -> int:
    """How kernels on ``device`` decode ``fmt`` codes: ``CVT_HW`` for e4m3 on sm_89+,
    ``CVT_PTX`` on other CUDA GPUs (and for e5m2) once it has passed ``ptx_decoder_ok``,
    ``CVT_BITS`` under the interpreter. ``QPAGE_FP8_DECODER=bits|ptx|hw`` forces one (to
    compare them on one GPU); a choice the device cannot run raises."""
    best = _best_decoder(device, fmt)
    forced = os.environ.get("QPAGE_FP8_DECODER", "")
    if not forced:
        return best
    if forced not in DECODERS:
        raise ValueError(f"QPAGE_FP8_DECODER={forced!r}: expected one of {sorted(DECODERS)}")
    cvt = DECODERS[forced]
    if cvt > best:
        if best == CVT_BITS and device.type == "cuda" and not INTERPRET:
            why = "the PTX decoder failed its check on this GPU (see the warning logged)"
        elif best == CVT_BITS:
            why = "the interpreter and CPUs run no PTX"
        else:
            why = "it needs e4m3 codes on sm_89 or later"
        raise ValueError(f"QPAGE_FP8_DECODER={forced} is not available for {fmt} here ({why}); unset it or choose "
                         f"{'bits' if best == CVT_BITS else 'bits or ptx'}")
    return cvt


def _best_decoder(device: torch.device, fmt: str) -> int:
    if INTERPRET or device.type != "cuda":
        return CVT_BITS
    if fmt == "e4m3" and _capability(device) >= (8, 9):
        return CVT_HW
    return CVT_PTX if ptx_decoder_ok(device, fmt) else CVT_BITS


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


_PTX_CHECKED: dict[tuple[str, str], bool] = {}


def ptx_decoder_ok(device: torch.device, fmt: str) -> bool:
    """Whether ``CVT_PTX`` decodes every finite code on ``device`` exactly as torch does, checked
    once per process, device and format, at the first use outside a CUDA graph capture. On
    CPU the PTX is checked only by a model of its instructions (tests); if this GPU, driver
    or Triton disagree, kernels fall back to the element-wise bit trick with a warning
    instead of attending to wrong values."""
    key = (str(device), fmt)
    if key not in _PTX_CHECKED:
        if torch.cuda.is_current_stream_capturing():
            return True  # no launch or sync inside a capture; the check runs at the next use
        codes = torch.arange(1024, dtype=torch.int32).remainder(256).to(torch.uint8)
        got = _decode_all(codes, device, fmt, CVT_PTX).float()
        want = decode_fp8_ref(codes, fmt) / fp8_unit(fmt, CVT_PTX)
        finite = torch.isfinite(want)
        bad = int((got[finite] != want[finite]).sum())
        if bad:
            logger.warning("FP8 %s codes: the packed PTX decoder disagreed with torch on %d of %d codes on %s; "
                           "using the element-wise decoder (slower). Please report this with the GPU, driver and "
                           "Triton versions.", fmt, bad, int(finite.sum()), device)
        _PTX_CHECKED[key] = bad == 0
    return _PTX_CHECKED[key]


def _decode_all(codes: torch.Tensor, device: torch.device, fmt: str, cvt: int) -> torch.Tensor:
    """``codes`` (uint8 on CPU, a multiple of 1024 of them) decoded on ``device`` by
    ``fp8_to_f16`` with decoder ``cvt``; fp16 on CPU."""
    c = codes.reshape(-1).to(device)
    if c.numel() % 1024:
        raise ValueError(f"{c.numel()} codes: a multiple of 1024 expected")
    out = torch.empty(c.shape, dtype=torch.float16, device=device)
    _decode_kernel[(c.numel() // 1024,)](c, out, IS_E5M2=fmt == "e5m2", CVT=cvt, BLOCK=1024, num_warps=4)
    return out.cpu().reshape(codes.shape)


