"""How one layer's K and V are stored in the paged cache: the model dtype, FP8 codes with
scales, or int8/int4 codes with scales (and zeros).

Per layer: ``k`` and ``v`` of shape [num_blocks, BLOCK_SIZE, kv_heads, head_dim] (int4:
head_dim / 2 bytes, two codes a byte); token slot ``s`` is block ``s // BLOCK_SIZE``, offset
``s % BLOCK_SIZE``.

``kv_cache_dtype``:
- ``auto``: the model's dtype.
- ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``: uint8 codes (``kernels.fp8.codec``) with scales:
  - ``per_token`` (default): fp16 ``k_scale``/``v_scale`` [num_blocks, BLOCK_SIZE,
    kv_heads], one per (token, kv head), chosen when the token is written
    (``kernels.attention.cache_write``). 2 bytes per head per token: 3% of the codes at head_dim 64,
    1.6% at 128. K and V are also centered first: per-channel means measured once at start
    (``kv_calibration``) are subtracted before quantization, which attention undoes exactly
    (``LayerKV.k_shift``): the centered values quantize with less error.
  - ``per_tensor`` (vLLM-compatible): one fp32 scale per layer for K and one for V, read
    from the checkpoint's ``self_attn.k_scale`` / ``v_scale`` tensors, else 1.0 (vLLM's
    default). Cheaper, but one outlier-heavy head sets the precision of all.
- ``int8`` / ``int4`` (vLLM's ``int8_per_token_head`` / ``int4_per_token_head``), and
  ``k8v4`` (int8 keys, int4 values): integer codes with fp16 parameters per (token, kv head)
  in ``k_scale``/``v_scale`` (layout: ``kernels.kv_int``). K and V are centered as above and
  rotated by an orthonormal Hadamard matrix over head_dim (``LayerKV.rotation``) before they
  are quantized, so one outlier channel no longer sets a row's scale; the query is rotated
  the same way (scores are unchanged) and the attention output rotated back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qpage.config import BLOCK_SIZE, INT_BITS, KV_CACHE_FORMATS
from qpage.kernels.fp8.codec import decode_fp8_ref
from qpage.kernels.kv_int import PARAMS, code_width, dequantize_ref, hadamard, head_dim_of, write_int_cache_ref
from qpage.kernels.kv_quant import write_kv_cache_ref

KV_SCALE_MODES = ("per_token", "per_tensor")


@dataclass(frozen=True)
class KVCacheSpec:
    dtype: torch.dtype
    """The model's compute dtype (what attention reads back)."""
    fp8_format: str | None = None
    """None (store ``dtype``), "e4m3" or "e5m2"."""
    per_token: bool = True
    """FP8 scale per (token, kv head); else one static scale per layer and tensor."""
    int_bits: int | None = None
    """8 or 4: K's bits in an integer cache (then ``fp8_format`` is None)."""
    v_bits: int | None = None
    """V's bits when they differ from K's (``k8v4``), else None."""
    rotate: bool = True
    """Integer caches: Hadamard-rotate K and V before quantizing (``LayerKV.rotation``)."""

    @classmethod
    def from_config(cls, kv_cache_dtype: str, scales: str, dtype: torch.dtype, rotate: bool = True) -> KVCacheSpec:
        fmt = KV_CACHE_FORMATS[kv_cache_dtype]
        if fmt in INT_BITS:
            kb, vb = INT_BITS[fmt]
            return cls(dtype, None, True, kb, vb if vb != kb else None, rotate)
        return cls(dtype, fmt, scales == "per_token")

    @property
    def kv_bits(self) -> tuple[int, int] | None:
        """(K bits, V bits) of an integer cache, else None."""
        if self.int_bits is None:
            return None
        return self.int_bits, self.v_bits or self.int_bits

    @property
    def format(self) -> str | None:
        """What the cache stores: None (the model dtype), "e4m3", "e5m2", "int8", "int4" or "k8v4"."""
        if self.kv_bits is None:
            return self.fp8_format
        kb, vb = self.kv_bits
        return f"int{kb}" if kb == vb else f"k{kb}v{vb}"

    @property
    def centered(self) -> bool:
        """Whether K and V are centered by calibrated per-channel means (every per-token quantized cache)."""
        return self.int_bits is not None or (self.fp8_format is not None and self.per_token)

    def bytes_per_token(self, num_layers: int, kv_heads: int, head_dim: int) -> int:
        """K and V bytes of one token over all layers, scales included."""
        if self.kv_bits is not None:
            both = sum(code_width(b, head_dim) + 2 * PARAMS[b] for b in self.kv_bits)
            return num_layers * kv_heads * both
        if self.fp8_format is None:
            per_head = head_dim * torch.empty((), dtype=self.dtype).element_size()
        else:
            per_head = head_dim + (2 if self.per_token else 0)
        return 2 * num_layers * kv_heads * per_head

    def describe(self) -> str:
        if self.kv_bits is not None:
            params = "scales" if self.kv_bits == (8, 8) else "scales and zeros"
            return f"{self.format} (per-token-head {params}{', Hadamard-rotated' if self.rotate else ''})"
        if self.fp8_format is None:
            return f"{str(self.dtype).removeprefix('torch.')}"
        return f"fp8_{self.fp8_format} ({'per-token' if self.per_token else 'per-tensor'} scales)"


@dataclass
class LayerKV:
    """One layer's cache tensors (see the module docstring)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    fp8_format: str | None = None
    dtype: torch.dtype = torch.float32
    """What reads return (the model's dtype)."""
    k_shift: torch.Tensor | None = None
    """Per-channel offsets [kv_heads, head_dim] subtracted from K before it is stored (FP8
    per-token and integer caches). Exact: a query's scores all move by q . k_shift, which softmax ignores."""
    v_shift: torch.Tensor | None = None
    """Likewise for V; attention adds it back to the output (the probabilities sum to 1)."""
    k_bits: int | None = None
    """8 or 4 for an integer cache: codes in ``k``, parameters in ``k_scale``."""
    v_bits: int | None = None
    """Likewise for V (``v``, ``v_scale``); set exactly when ``k_bits`` is."""
    rotation: torch.Tensor | None = None
    """fp32 [head_dim, head_dim], orthonormal and symmetric (``kernels.kv_int.hadamard``),
    integer caches only: K and V are stored times it, the query is multiplied by it before
    attention (q.k unchanged) and the output after (it is its own inverse); see ``rotate``."""

    @property
    def kv_bits(self) -> tuple[int, int] | None:
        """(K bits, V bits) of an integer cache, else None."""
        return (self.k_bits, self.v_bits) if self.k_bits is not None and self.v_bits is not None else None

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.k_bits, self.k.shape[3]) if self.k_bits is not None else self.k.shape[3]

    @property
    def quantized(self) -> bool:
        return self.fp8_format is not None or self.k_bits is not None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] times ``rotation``, in fp32 (1/sqrt(block) is not exact in fp16 or
        bf16: there R.R would be off the identity by about 2e-4), rounded once to x's dtype."""
        assert self.rotation is not None
        return x @ self.rotation if x.dtype == torch.float32 else (x.float() @ self.rotation).to(x.dtype)

    def set_shifts(self, k_shift: torch.Tensor, v_shift: torch.Tensor) -> None:
        self.k_shift = k_shift.to(self.dtype)
        self.v_shift = v_shift.to(self.dtype)

    def write_ref(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's K and V (quantizing when FP8 or integer) in plain torch."""
        if (bits := self.kv_bits) is not None:
            assert self.k_scale is not None and self.v_scale is not None
            write_int_cache_ref(k, self.k, self.k_scale, slot_mapping, bits[0])
            write_int_cache_ref(v, self.v, self.v_scale, slot_mapping, bits[1])
            return
        write_kv_cache_ref(k, v, self.k, self.v, slot_mapping, self.k_scale, self.v_scale, self.fp8_format)

    def read_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, [len(block_ids), BLOCK, kvh, hd] in ``dtype``."""
        keys, values = gather_blocks(self.k, block_ids), gather_blocks(self.v, block_ids)
        if not self.quantized:
            return keys, values
        ks = vs = None
        if self.k_scale is not None and self.k_scale.dim() >= 3:
            ks, vs = gather_blocks(self.k_scale, block_ids), gather_blocks(self.v_scale, block_ids)  # type: ignore[arg-type]
        return self._decode(keys, ks if ks is not None else self.k_scale, self.k_bits), self._decode(
            values, vs if vs is not None else self.v_scale, self.v_bits)

    def read_span(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``count`` consecutive blocks from ``first`` (a view when not quantized)."""
        span = slice(first, first + count)
        if not self.quantized:
            return self.k[span], self.v[span]
        per_token = self.k_scale is not None and self.k_scale.dim() >= 3
        ks = self.k_scale[span] if per_token else self.k_scale  # type: ignore[index]
        vs = self.v_scale[span] if per_token else self.v_scale  # type: ignore[index]
        return self._decode(self.k[span], ks, self.k_bits), self._decode(self.v[span], vs, self.v_bits)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor | None, bits: int | None) -> torch.Tensor:
        assert scale is not None
        if bits is not None:
            return dequantize_ref(codes, scale, bits).to(self.dtype)
        assert self.fp8_format is not None
        x = decode_fp8_ref(codes, self.fp8_format)
        x = x * (scale.float()[..., None] if scale.dim() == codes.dim() - 1 else scale.float())
        return x.to(self.dtype)


def make_layer_kv(
    spec: KVCacheSpec, num_blocks: int, kv_heads: int, head_dim: int, device: torch.device,
    static_scales: tuple[float, float] | None = None,
) -> LayerKV:
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    if spec.kv_bits is not None:
        (k, ks), (v, vs) = (_int_tensors(shape, bits, device) for bits in spec.kv_bits)
        return LayerKV(k, v, ks, vs, dtype=spec.dtype, k_bits=spec.kv_bits[0], v_bits=spec.kv_bits[1],
                       rotation=hadamard(head_dim)[0].to(device) if spec.rotate else None)
    if spec.fp8_format is None:
        return LayerKV(torch.zeros(shape, dtype=spec.dtype, device=device),
                       torch.zeros(shape, dtype=spec.dtype, device=device), dtype=spec.dtype)
    k = torch.zeros(shape, dtype=torch.uint8, device=device)
    v = torch.zeros(shape, dtype=torch.uint8, device=device)
    if spec.per_token:
        ks = torch.zeros(shape[:3], dtype=torch.float16, device=device)
        vs = torch.zeros(shape[:3], dtype=torch.float16, device=device)
    else:
        kf, vf = static_scales or (1.0, 1.0)
        ks = torch.tensor([kf], dtype=torch.float32, device=device)
        vs = torch.tensor([vf], dtype=torch.float32, device=device)
    return LayerKV(k, v, ks, vs, spec.fp8_format, spec.dtype)


def _int_tensors(shape: tuple[int, int, int, int], bits: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed codes and fp16 parameters of one integer cache tensor (layout: ``kernels.kv_int``)."""
    codes = torch.zeros((*shape[:3], code_width(bits, shape[3])), dtype=torch.int8 if bits == 8 else torch.uint8,
                        device=device)
    return codes, torch.zeros((*shape[:3], PARAMS[bits]), dtype=torch.float16, device=device)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks out of a cache tensor, [len(block_ids), *cache.shape[1:]].

    NOTE: index_select over blocks viewed as flat rows is several times faster on CPU than
    advanced indexing (``cache[ids]``), which goes element-wise through TensorIterator.
    """
    return cache.view(cache.shape[0], -1).index_select(0, block_ids).view(-1, *cache.shape[1:])


def gather_kv(
    cache: LayerKV, block_table: torch.Tensor, length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each row of ``block_table`` [rows, blocks], as [rows, L, kvh, hd] with
    L = blocks * BLOCK_SIZE, or the first ``length`` positions."""
    rows = block_table.shape[0]
    keys, values = cache.read_blocks(block_table.flatten())
    kvh, hd = keys.shape[2], keys.shape[3]
    keys, values = keys.view(rows, -1, kvh, hd), values.view(rows, -1, kvh, hd)
    if length is not None:
        keys, values = keys[:, :length], values[:, :length]
    return keys, values
