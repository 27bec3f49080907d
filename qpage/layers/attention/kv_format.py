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
    (``KVTransform``): the centered values quantize with less error.
  - ``per_tensor`` (vLLM-compatible): one fp32 scale per layer for K and one for V, read
    from the checkpoint's ``self_attn.k_scale`` / ``v_scale`` tensors, else 1.0 (vLLM's
    default). Cheaper, but one outlier-heavy head sets the precision of all.
- ``int8`` / ``int4`` (vLLM's ``int8_per_token_head`` / ``int4_per_token_head``), and
  ``k8v4`` (int8 keys, int4 values): integer codes with fp16 parameters per (token, kv head)
  in ``k_scale``/``v_scale`` (layout: ``kernels.kv_int``). K and V are centered as above and
  rotated by an orthonormal Hadamard matrix over head_dim (``KVTransform``) before they
  are quantized, so one outlier channel no longer sets a row's scale; the query is rotated
  the same way (scores are unchanged) and the attention output rotated back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from qpage.config import BLOCK_SIZE, INT_BITS, KV_CACHE_FORMATS
from qpage.kernels.cpu import native_ops
from qpage.kernels.fp8.codec import decode_fp8_ref
from qpage.kernels.kv_int import (
    PARAMS,
    code_width,
    dequantize_ref,
    hadamard,
    head_dim_of,
    walsh_hadamard,
    write_int_cache_ref,
)
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
    """Integer caches: Hadamard-rotate K and V before quantizing (``KVTransform``)."""

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
class KVTransform:
    """What a quantized cache does to q, k and v before attention and to its output after,
    so K and V quantize with less error; both steps are exact (scores and output unchanged).

    - Centering (FP8 per-token and integer caches): ``k_shift``/``v_shift`` [kv_heads, head_dim],
      calibrated per-channel means, are subtracted from K and V before they are stored. A
      query's scores all move by q . k_shift, which softmax ignores; the probabilities sum to
      1, so ``v_shift`` is added back to the output. None until calibrated.
    - Rotation (integer caches): ``rotation`` fp32 [head_dim, head_dim], orthonormal and
      symmetric (``kernels.kv_int.hadamard``). K, V and the query are multiplied by it (q.k
      unchanged), the output after (it is its own inverse): one outlier channel no longer sets
      a row's scale.
    """

    k_shift: torch.Tensor | None = None
    v_shift: torch.Tensor | None = None
    rotation: torch.Tensor | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] as they are to be attended and stored."""
        if self.k_shift is not None and self.v_shift is not None:
            k, v = k - self.k_shift, v - self.v_shift
        if self.rotation is not None:
            q, k, v = self._rotate(q), self._rotate(k), self._rotate(v)
        return q, k, v

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [T, H, D] as it would be over the untransformed K and V."""
        if self.rotation is not None:
            out = self._rotate(out)
        if self.v_shift is not None:
            t, h, d = out.shape
            out = (out.view(t, self.v_shift.shape[0], -1, d) + self.v_shift[:, None]).view(t, h, d)
        return out

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] times ``rotation``, in fp32 (1/sqrt(block) is not exact in fp16 or
        bf16: there R.R would be off the identity by about 2e-4), rounded once to x's dtype.
        Computed as a fast Walsh-Hadamard transform (``kv_int.walsh_hadamard``, in C where it
        can run: ``native_ops.hadamard``, the same bits): elementwise steps, so each row's
        result is the same however many rows share the call (a matmul's is not)."""
        assert self.rotation is not None
        block = hadamard(self.rotation.shape[0])[1]
        y = native_ops.hadamard(x, block)
        if y is None:
            y = walsh_hadamard(x.float(), block)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


@dataclass
class LayerKV:
    """One layer's cache in the model dtype (see the module docstring); ``Fp8KV`` and ``IntKV``
    store codes. Each kind writes and reads its own layout (the torch reference); an attention
    backend binds its kernels to the kind once, from the ``KVCacheSpec``."""

    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype = torch.float32
    """What reads return (the model's dtype)."""
    transform: KVTransform = field(default_factory=KVTransform)

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    def set_shifts(self, k_shift: torch.Tensor, v_shift: torch.Tensor) -> None:
        self.transform.k_shift = k_shift.to(self.dtype)
        self.transform.v_shift = v_shift.to(self.dtype)

    def write_ref(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's K and V (quantizing them, for the code kinds) in plain torch."""
        write_kv_cache_ref(k, v, self.k, self.v, slot_mapping)

    def read_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, [len(block_ids), BLOCK, kvh, hd] in ``dtype``."""
        return gather_blocks(self.k, block_ids), gather_blocks(self.v, block_ids)

    def read_span(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``count`` consecutive blocks from ``first`` (a view when not quantized)."""
        return self.k[first : first + count], self.v[first : first + count]


@dataclass
class Fp8KV(LayerKV):
    """FP8 codes (``fp8_format``) with fp16 per-(token, kv head) scales [blocks, BLOCK, kvh] or
    one fp32 [1] scale per tensor (``per_tensor``)."""

    k_scale: torch.Tensor = field(default_factory=lambda: torch.ones(1))
    v_scale: torch.Tensor = field(default_factory=lambda: torch.ones(1))
    fp8_format: str = "e4m3"

    @property
    def per_token(self) -> bool:
        return self.k_scale.dim() >= 3

    def write_ref(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv_cache_ref(k, v, self.k, self.v, slot_mapping, self.k_scale, self.v_scale, self.fp8_format)

    def read_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = gather_blocks(self.k, block_ids), gather_blocks(self.v, block_ids)
        if not self.per_token:
            return self._decode(keys, self.k_scale), self._decode(values, self.v_scale)
        return (self._decode(keys, gather_blocks(self.k_scale, block_ids)),
                self._decode(values, gather_blocks(self.v_scale, block_ids)))

    def read_span(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = slice(first, first + count)
        ks, vs = (self.k_scale[span], self.v_scale[span]) if self.per_token else (self.k_scale, self.v_scale)
        return self._decode(self.k[span], ks), self._decode(self.v[span], vs)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = decode_fp8_ref(codes, self.fp8_format)
        x = x * (scale.float()[..., None] if scale.dim() == codes.dim() - 1 else scale.float())
        return x.to(self.dtype)


@dataclass
class IntKV(LayerKV):
    """int8/int4 codes with fp16 parameters per (token, kv head) (layout: ``kernels.kv_int``);
    K and V may differ in bits (``k8v4``)."""

    k_scale: torch.Tensor = field(default_factory=lambda: torch.ones(1))
    v_scale: torch.Tensor = field(default_factory=lambda: torch.ones(1))
    k_bits: int = 8
    v_bits: int = 8

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.k_bits, self.k.shape[3])

    def write_ref(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_int_cache_ref(k, self.k, self.k_scale, slot_mapping, self.k_bits)
        write_int_cache_ref(v, self.v, self.v_scale, slot_mapping, self.v_bits)

    def read_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self._decode(gather_blocks(self.k, block_ids), gather_blocks(self.k_scale, block_ids), self.k_bits),
                self._decode(gather_blocks(self.v, block_ids), gather_blocks(self.v_scale, block_ids), self.v_bits))

    def read_span(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = slice(first, first + count)
        return (self._decode(self.k[span], self.k_scale[span], self.k_bits),
                self._decode(self.v[span], self.v_scale[span], self.v_bits))

    def _decode(self, codes: torch.Tensor, params: torch.Tensor, bits: int) -> torch.Tensor:
        return dequantize_ref(codes, params, bits).to(self.dtype)


def make_layer_kv(
    spec: KVCacheSpec, num_blocks: int, kv_heads: int, head_dim: int, device: torch.device,
    static_scales: tuple[float, float] | None = None,
) -> LayerKV:
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    if spec.kv_bits is not None:
        (k, ks), (v, vs) = (_int_tensors(shape, bits, device) for bits in spec.kv_bits)
        rotation = hadamard(head_dim)[0].to(device) if spec.rotate else None
        return IntKV(k, v, spec.dtype, KVTransform(rotation=rotation), ks, vs, *spec.kv_bits)
    if spec.fp8_format is None:
        return LayerKV(torch.zeros(shape, dtype=spec.dtype, device=device),
                       torch.zeros(shape, dtype=spec.dtype, device=device), spec.dtype)
    k = torch.zeros(shape, dtype=torch.uint8, device=device)
    v = torch.zeros(shape, dtype=torch.uint8, device=device)
    if spec.per_token:
        ks = torch.zeros(shape[:3], dtype=torch.float16, device=device)
        vs = torch.zeros(shape[:3], dtype=torch.float16, device=device)
    else:
        kf, vf = static_scales or (1.0, 1.0)
        ks = torch.tensor([kf], dtype=torch.float32, device=device)
        vs = torch.tensor([vf], dtype=torch.float32, device=device)
    return Fp8KV(k, v, spec.dtype, KVTransform(), ks, vs, spec.fp8_format)


def layer_view(slot: LayerKV, static_scales: tuple[float, float] | None = None) -> LayerKV:
    """A layer's cache over a slot tensor that layers of other groups share (``kv_layout``):
    the slot's storage (codes and per-token scales), the layer's own transform (its K/V
    shifts) and, for a per-tensor FP8 cache, its own scales."""
    view = dataclasses.replace(slot, transform=KVTransform(rotation=slot.transform.rotation))
    if isinstance(view, Fp8KV) and not view.per_token:
        kf, vf = static_scales or (1.0, 1.0)
        view.k_scale = torch.tensor([kf], dtype=torch.float32, device=slot.k.device)
        view.v_scale = torch.tensor([vf], dtype=torch.float32, device=slot.k.device)
    return view


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
