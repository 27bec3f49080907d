"""The typed settings of the GPU kernels, and their defaults for a problem on a device.

A ``MatmulConfig`` is one weight-streaming matmul launch (integer or FP8 weights): which
kernel (``kind``) and its tiles. A ``DecodeConfig`` is one paged decode-attention launch.
Defaults come from here; a GPU's tuned table (``tuned``) may replace them per problem.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qpage.kernels.triton_utils import INTERPRET

MATMUL_KINDS = ("gemv", "tiled", "dequant")
"""``gemv``: one activation row, multiply-add without tensor cores (``int_matmul.gemv``);
``tiled``: tl.dot over [block_m, block_n] output tiles (``int_matmul.tiled``, ``fp8.matmul``);
``dequant``: dequantize to the activation dtype, then cuBLAS (``int_matmul.dequant``)."""

DEQUANT_MIN_M = 256
"""From this many rows on CUDA, integer weights are dequantized and multiplied by cuBLAS: the
fused kernels are compute-bound there and lose to it (docs/kernels.md)."""


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    """Programs that share one output tile's K loop (``split_k``); 1: no split."""
    num_warps: int = 4
    num_stages: int = 2
    """Software-pipeline stages of the K loop (``tl.range`` in the GEMV, the launch's
    ``num_stages`` for the tl.dot kernels)."""
    kind: str = "tiled"
    """One of ``MATMUL_KINDS``."""

    def __post_init__(self) -> None:
        if self.kind not in MATMUL_KINDS:
            raise ValueError(f"MatmulConfig.kind={self.kind!r} is not one of {', '.join(MATMUL_KINDS)}")


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64
    """Tokens per K/V tile."""
    num_warps: int = 4
    num_stages: int = 2
    partition: int = 512
    """Split-KV: a context longer than two partitions is cut into partitions of this many
    tokens (a multiple of ``block_n``), merged by a second kernel."""
    scales_ahead: bool = True
    """Load a tile's per-token FP8 scales one iteration early (Triton pipelines the codes but
    not these loads)."""
    v_f16: bool = False
    """Convert FP8 V row by row and stage it as fp16 for the P @ V product."""

    def __post_init__(self) -> None:
        if self.partition % self.block_n:
            raise ValueError(f"partition ({self.partition}) must be a multiple of block_n ({self.block_n})")


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=16)
def sm90_plus(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.0 or later (and not the interpreter)."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def split_for(tiles: int, k_tiles: int, sms: int, m: int, k: int) -> int:
    """Split K (a power of two, at most 8) until there are ~6 tiles per SM, while the split's
    own traffic stays small: each split writes and reads back an fp32 [m, N] partial, 8 * m * N
    bytes, against the K * N / 2 bytes of an INT4 weight, so split * m is kept to K / 32."""
    split = 1
    while tiles * split < 6 * sms and split * 2 <= k_tiles and split < 8 and 2 * split * m <= max(1, k // 32):
        split *= 2
    return split


@functools.lru_cache(maxsize=4096)
def default_matmul_config(m: int, n: int, k: int, device: torch.device, group_size: int | None = None,
                          kind: str | None = None) -> MatmulConfig:
    """Tiles by regime: one row streams the weight through the GEMV, up to ``DEQUANT_MIN_M`` rows
    the tiled kernel, both with K split when the output tiles alone leave SMs idle; from
    ``DEQUANT_MIN_M`` the dequantize-then-cuBLAS path. ``block_k`` stays within one quantization
    group where it can, so the group's scale factors out of the tile. ``kind`` forces a kind
    (benchmarks); the interpreter and CPUs get small tiled configs."""
    block_k = 128
    if group_size and 16 <= group_size < block_k and group_size & (group_size - 1) == 0:
        block_k = group_size
    if INTERPRET or device.type != "cuda":
        return MatmulConfig(16 if m <= 16 else 32, 64, min(block_k, 64), kind=kind or "tiled")
    sms = _sm_count(device)
    kind = kind or ("gemv" if m == 1 else "tiled" if m < DEQUANT_MIN_M else "dequant")
    if kind == "dequant":
        return MatmulConfig(128, 128, min(block_k, 64), num_warps=8, num_stages=3, kind=kind)
    if m <= 16:
        block_n = 128 if kind == "gemv" else 64
        split = split_for(-(-n // block_n), -(-k // block_k), sms, m, k)
        return MatmulConfig(16, block_n, block_k, split, num_warps=4, num_stages=2 if kind == "gemv" else 3,
                            kind=kind)
    block_m = 32 if m <= 32 else 64
    block_k = min(block_k, 64)
    tiles = -(-m // block_m) * -(-n // 64)
    return MatmulConfig(block_m, 64, block_k, split_for(tiles, -(-k // block_k), sms, m, k), num_warps=4,
                        num_stages=3, kind=kind)


@functools.lru_cache(maxsize=16)
def default_decode_config(device: torch.device) -> DecodeConfig:
    """Small tiles under the interpreter; FP8 V staged as fp16 on sm_90+, where shared memory
    leaves room for the staging buffer (docs/kernels.md)."""
    if INTERPRET or device.type != "cuda":
        return DecodeConfig(block_n=32)
    return DecodeConfig(v_f16=sm90_plus(device))
