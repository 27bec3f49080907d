"""A quantization scheme: what a quantized linear layer is, saved with the checkpoint.

The job's settings (calibration samples, sequence length, seed, device) are not part of it
(CONVENTIONS 8): two runs with different settings produce checkpoints of the same scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("int4-rtn", "int8-rtn", "int4-gptq", "int8-gptq")
"""What ``qpage quantize --scheme`` accepts today (AWQ and FP8 are not built yet)."""


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

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} is not supported; use 4 or 8")
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size={self.group_size} is not supported; use 32, 64, 128 or per-channel")
        if self.act_order and self.method == "rtn":
            raise ValueError("act_order needs GPTQ (RTN has no column order); drop --act-order")

    @classmethod
    def parse(cls, name: str, group_size: int | None = 128, sym: bool = True, act_order: bool = False
              ) -> QuantScheme:
        """``int4-rtn`` style names (see SCHEMES)."""
        if name not in SCHEMES:
            raise ValueError(f"scheme {name!r} is not supported yet; choose one of {', '.join(SCHEMES)}")
        kind, method = name.split("-")
        return cls(bits=int(kind[3:]), group_size=group_size, sym=sym, method=method, act_order=act_order)

    def bits_per_weight(self, in_features: int) -> float:
        """Average stored bits per weight: the integer plus its group's fp16 scale and packed zero."""
        g = self.group_size or in_features
        return self.bits + (16 + (0 if self.sym else self.bits)) / g

    def describe(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"int{self.bits} {self.method} {group} {'sym' if self.sym else 'asym'}"
