"""A quantization scheme: what a quantized linear layer is, saved with the checkpoint.

The job's settings (calibration samples, sequence length, seed, device) are not part of it:
two runs with different settings produce checkpoints of the same scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("int4-rtn", "int8-rtn", "int4-imatrix", "int8-imatrix", "int4-gptq", "int8-gptq", "int4-awq", "int8-awq",
           "int4-signround", "int8-signround", "fp8", "fp8-block", "nf4")
"""What ``qpage quantize --scheme`` accepts. ``imatrix``: round to nearest on scales searched
for the least error weighted by the calibration inputs' E[x^2] (llama.cpp's importance
matrix); ``signround``: imatrix's grid, then rounding and scales learnt layer by layer by
signed gradient steps on the layer's output (AutoRound's method); ``fp8``: E4M3 with
per-channel scales; ``fp8-block``: 128x128 block scales; ``nf4``: bitsandbytes' 4-bit
NormalFloat, blocks of 64."""
CALIBRATED = ("imatrix", "gptq", "awq", "signround")
"""Methods that need calibration text."""


def default_sym(bits: int) -> bool:
    """The integer grid when none is asked for: asymmetric (a zero point per group) at 4 and 8
    bits, where it measures better on both texts and every kernel takes one (on CPU, Q4_1 and
    Q8_M blocks; docs/quantization.md has the figures)."""
    return bits not in (4, 8)


@dataclass(frozen=True)
class QuantScheme:
    bits: int
    """Integer weight bits: 4 or 8."""
    group_size: int | None
    """Input features per scale/zero group; None = one group per output channel."""
    sym: bool
    """Symmetric (zero fixed at 2**(bits-1)) or asymmetric (a zero per group)."""
    method: str = "rtn"
    """The algorithm that chose the integers (recorded, not needed to run the model)."""
    act_order: bool = False
    static_groups: bool = False
    """GPTQ act-order only: groups keep the original column order (no g_idx permutation),
    as compressed-tensors' ``actorder: weight`` and GPTQ's ``static_groups``."""
    block: int | None = None
    """FP8 only: scale block edge (128), or None for per-channel scales."""

    @property
    def is_fp8(self) -> bool:
        return self.method == "fp8"

    @property
    def is_nf4(self) -> bool:
        return self.method == "nf4"

    def __post_init__(self) -> None:
        if self.is_nf4:
            if self.bits != 4 or self.group_size != 64 or self.act_order or not self.sym:
                raise ValueError("nf4 is 4-bit with one absmax per 64 weights; it takes no group size or act-order")
            return
        if self.is_fp8:
            if self.bits != 8 or self.group_size is not None or self.act_order or self.block not in (None, 128):
                raise ValueError("fp8 takes no group size or act-order: per-channel or 128x128 block scales")
            return
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} is not supported; use 4 or 8")
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size={self.group_size} is not supported; use 32, 64, 128 or per-channel")
        if self.act_order and self.method != "gptq":
            raise ValueError(f"act_order needs GPTQ ({self.method.upper()} has no column order); drop --act-order")
        if self.static_groups and not self.act_order:
            raise ValueError("static groups only apply with act-order; add --act-order or drop --static-groups")

    @classmethod
    def parse(cls, name: str, group_size: int | None = 128, sym: bool | None = None, act_order: bool = False,
              static_groups: bool = False) -> QuantScheme:
        """``int4-rtn`` style names (see SCHEMES); ``sym`` None: ``default_sym``."""
        if name not in SCHEMES:
            raise ValueError(f"scheme {name!r} is not supported yet; choose one of {', '.join(SCHEMES)}")
        if name == "nf4":
            if act_order or static_groups or sym is False:
                raise ValueError("nf4 is symmetric, with no act-order or static groups; drop --act-order, "
                                 "--static-groups and --no-sym")
            return cls(bits=4, group_size=64, sym=True, method="nf4")
        if name.startswith("fp8"):
            if act_order:
                raise ValueError("fp8 has no act-order; drop --act-order")
            return cls(bits=8, group_size=None, sym=True, method="fp8", block=128 if name == "fp8-block" else None)
        kind, method = name.split("-")
        bits = int(kind[3:])
        return cls(bits=bits, group_size=group_size, sym=default_sym(bits) if sym is None else sym, method=method,
                   act_order=act_order, static_groups=static_groups)

    def bits_per_weight(self, in_features: int) -> float:
        """Average stored bits per weight: the integer plus its group's fp16 scale and packed zero."""
        if self.is_fp8:
            return 8 + 32 / (self.block * self.block if self.block else in_features)
        if self.is_nf4:
            return 4 + 32 / 64
        g = self.group_size or in_features
        return self.bits + (16 + (0 if self.sym else self.bits)) / g

    def describe(self) -> str:
        if self.is_nf4:
            return "nf4 (bitsandbytes 4-bit NormalFloat, blocks of 64)"
        if self.is_fp8:
            return f"fp8 e4m3 {'128x128 block' if self.block else 'per-channel'}"
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        order = (" act-order static-groups" if self.static_groups else " act-order") if self.act_order else ""
        return f"int{self.bits} {self.method} {group} {'sym' if self.sym else 'asym'}{order}"
