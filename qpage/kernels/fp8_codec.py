"""FP8 codes stored as uint8, encoded and decoded with integer arithmetic.

Why not Triton's fp8 types: RTX 3090 (sm_86) has no ``fp8e4nv`` in Triton, and the
interpreter's fp32->fp8 cast mis-rounds and does not saturate (DESIGN section 6). So a
cache or weight holds raw bytes, and kernels decode them with the two helpers below; the
results equal torch's ``float8_e4m3fn`` / ``float8_e5m2`` conversions bit for bit.

Formats (sign, exponent, mantissa bits; bias; largest finite):
- ``e4m3`` (``float8_e4m3fn``): 1-4-3, bias 7, 448; no infinities.
- ``e5m2`` (``float8_e5m2``): 1-5-2, bias 15, 57344.

Decode trick: both formats' exponent and mantissa fit an fp16 bit pattern. e5m2 *is* the
top byte of an fp16. For e4m3, ``(code & 0x7f) << 7`` is an fp16 with the same exponent
field under bias 15 instead of 7, so multiplying by 2**8 gives the value; this also holds
for subnormals, which map onto fp16 subnormals exactly (no fp32 flush-to-zero involved).
"""

import functools

import torch

from qpage.kernels.triton_utils import INTERPRET, tl, triton

FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}


def fp8_max(fmt: str) -> float:
    return FP8_FORMATS[fmt][1]


def encode_fp8_ref(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values -> uint8 codes, saturating at the format's largest finite value."""
    dtype, fmax = FP8_FORMATS[fmt]
    return x.float().clamp(-fmax, fmax).to(dtype).view(torch.uint8)


def decode_fp8_ref(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 codes -> fp32 values."""
    return codes.view(FP8_FORMATS[fmt][0]).float()


@triton.jit
def fp8_to_f32(code, IS_E5M2: tl.constexpr):
    """uint8 codes -> fp32 (see the module docstring for the bit trick)."""
    c = code.to(tl.int32)
    if IS_E5M2:
        h = (c << 8).to(tl.int16).to(tl.float16, bitcast=True)
        return h.to(tl.float32)
    else:
        h = (((c & 0x7F) << 7) | ((c & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        return h.to(tl.float32) * 256.0


@functools.lru_cache(maxsize=16)
def hardware_fp8(device: torch.device) -> bool:
    """Whether Triton can convert e4m3 in hardware here (sm_89+); else the bit trick."""
    return (not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


@functools.lru_cache(maxsize=16)
def sm90_plus(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.0 or later (and not the interpreter)."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_unit(fmt: str, hardware: bool) -> float:
    """What ``fp8_to_f16`` leaves out: its result times this is the code's value."""
    return 256.0 if fmt == "e4m3" and not hardware else 1.0


@triton.jit
def fp8_to_f16(code, IS_E5M2: tl.constexpr, HW: tl.constexpr):
    """uint8 codes -> fp16 equal to value / unit (``fp8_unit``): the bit trick alone for
    e4m3 (value * 2**-8, exact), the hardware conversion when HW (sm_89+)."""
    if IS_E5M2:
        return (code.to(tl.int16) << 8).to(tl.float16, bitcast=True)
    elif HW:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        c = code.to(tl.int16)
        return (((c & 0x7F) << 7) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def f32_to_fp8(x, IS_E5M2: tl.constexpr):
    """fp32 -> uint8 codes, round to nearest even, saturating; integer arithmetic only."""
    if IS_E5M2:
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        FMAX: tl.constexpr = 57344.0
    else:
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        FMAX: tl.constexpr = 448.0
    DROP: tl.constexpr = 23 - MB
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range: round the fp32 mantissa to MB bits (a carry moves into the exponent).
    r = a + ((1 << (DROP - 1)) - 1) + ((a >> DROP) & 1)
    normal = ((((r >> 23) - 127 + BIAS) << MB) | ((r >> DROP) & ((1 << MB) - 1)))
    # Subnormal range: |x| / 2**(1 - BIAS - MB) rounded to an integer, from the mantissa.
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.maximum(tl.minimum((151 - BIAS - MB) - (a >> 23), 31), 1)  # only subnormal lanes use it
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a < ((128 - BIAS) << 23), q, normal)
    return (code | sign).to(tl.uint8)
