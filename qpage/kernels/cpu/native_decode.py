"""A whole decode step in one C call (``csrc/cpu_decode.c``): the per-layer weights, norms and
caches are described once as C structs (``DecodeStack``), and each step passes the rows'
hidden states, rotary rows (per rotary table), and slots and block tables (per KV group).

It runs only what it was built for: block-format weights on the native kernels (every
projection packed, ``native_gguf``; mixtures of experts through ``native_moe``), an fp32
paged cache, decode rows only; the caller keeps
the Python path for everything else and as the reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from itertools import pairwise

import torch

from qpage.kernels.cpu.matmul.native_gguf import PiecewiseMatmul
from qpage.kernels.cpu.native import as_i64, load
from qpage.kernels.cpu.native_moe import CMoe, MoeKernel
from qpage.kernels.cpu.native_step import CProj, c_proj

_p, _i32, _i64, _f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _p), ("post_norm", _p), ("qkv", CProj), ("o", CProj), ("gate_up", CProj),
                ("down", CProj), ("k_cache", _p), ("v_cache", _p), ("q_norm", _p), ("k_norm", _p),
                ("attn_out_norm", _p), ("mlp_out_norm", _p), ("rope", _i32), ("kv_group", _i32), ("window", _i64),
                ("moe", ctypes.POINTER(CMoe)), ("sinks", _p)]


class _Group(ctypes.Structure):
    _fields_ = [("start", _i32), ("end", _i32), ("block_table", _p), ("table_stride", _i64), ("table_cols", _i64),
                ("seq_lens", _p)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i32), ("heads", _i32), ("kv_heads", _i32), ("head_dim", _i32), ("inter", _i32),
                ("block_size", _i32), ("threads", _i32), ("gelu", _i32), ("eps", _f), ("scale", _f),
                ("softcap", _f), ("pad", _f), ("num_blocks", _i64)]


@dataclass
class LayerWeights:
    """One decoder layer as the step needs it (tensors fp32 and contiguous; norms as they
    multiply, Gemma's ``1 + w``)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    """Before the MLP."""
    qkv: PiecewiseMatmul
    qkv_bias: torch.Tensor | None
    o: PiecewiseMatmul
    gate_up: PiecewiseMatmul | None
    down: PiecewiseMatmul | None
    """The dense MLP (None where ``moe`` runs instead)."""
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    """Of the attention's output (Gemma)."""
    mlp_out_norm: torch.Tensor | None = None
    """Of the MLP's output (Gemma)."""
    rope: int = 0
    """Which of the step's rotary tables it uses."""
    window: int | None = None
    moe: MoeKernel | None = None
    """The layer's mixture of experts in place of the dense MLP."""
    sinks: torch.Tensor | None = None
    """fp32 [heads]: attention sinks (gpt-oss)."""
    o_bias: torch.Tensor | None = None

    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.in_norm, self.post_norm, self.q_norm, self.k_norm, self.attn_out_norm,
                            self.mlp_out_norm, self.sinks) if t is not None]


class DecodeStack:
    """The decoder layers of one model for ``qp_gguf_decode_layers``; bound to the runner's
    caches on first use (and again if they change)."""

    def __init__(self, layers: list[LayerWeights], heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, gelu: bool = False, softcap: float | None = None) -> None:
        """``gelu``: the MLP's activation is tanh-GELU (else SiLU); ``softcap``: attention scores
        are soft-capped."""
        lib = load()
        assert lib is not None, "DecodeStack needs the native kernels; check load() first"
        lib.qp_gguf_decode_layers.argtypes = [ctypes.POINTER(_Layer), ctypes.c_int, ctypes.POINTER(_Shape), _p, _p,
                                              ctypes.c_int, _p, _p, _p, _p, _p]
        lib.qp_gguf_decode_layers.restype = ctypes.c_int
        self._lib, self.layers = lib, layers
        first = layers[0]
        self.hidden = first.in_norm.numel()
        self.inter = max((w.down.k for w in layers if w.down is not None), default=0)
        self.num_ropes = 1 + max(w.rope for w in layers)
        self.shape = _Shape(self.hidden, heads, kv_heads, head_dim, self.inter, 0, first.qkv.threads, int(gelu), eps,
                            scale, softcap or 0.0, 0.0, 0)
        self._keep: list[object] = []  # what the layer structs point into: ctypes arrays, the caches
        self._structs: ctypes.Array[_Layer] | None = None
        self._bound: tuple[object, ...] = ()

    def bind(self, caches: list[tuple[torch.Tensor, torch.Tensor]], kv_groups: list[int]) -> None:
        """Point the layer structs at the fp32 caches [num_blocks, block, kv_heads, head_dim]
        (kept referenced here, so the addresses stay valid while bound) and each layer at its
        KV group (``layers.attention.kv_layout``)."""
        key = (*((t.data_ptr(), tuple(t.shape)) for pair in caches for t in pair), tuple(kv_groups))
        if key == self._bound:
            return
        k0 = caches[0][0]
        want = (k0.shape[0], k0.shape[1], self.shape.kv_heads, self.shape.head_dim)
        for k, v in caches:
            if any(t.dtype != torch.float32 or tuple(t.shape) != want or not t.is_contiguous() for t in (k, v)):
                raise ValueError(f"decode step: caches must be contiguous fp32 {want}, got {k.dtype} {tuple(k.shape)}")
        self._keep = [caches]
        structs = (_Layer * len(self.layers))()
        for s, w, (k, v), g in zip(structs, self.layers, caches, kv_groups, strict=True):
            s.in_norm, s.post_norm = w.in_norm.data_ptr(), w.post_norm.data_ptr()
            s.qkv, s.o = c_proj(w.qkv, w.qkv_bias, self._keep), c_proj(w.o, w.o_bias, self._keep)
            if w.gate_up is not None and w.down is not None:
                s.gate_up, s.down = c_proj(w.gate_up, None, self._keep), c_proj(w.down, None, self._keep)
            if w.moe is not None:
                s.moe = ctypes.pointer(w.moe.struct)
                self._keep.append(s.moe)
            s.sinks = w.sinks.data_ptr() if w.sinks is not None else None
            s.k_cache, s.v_cache = k.data_ptr(), v.data_ptr()
            s.q_norm, s.k_norm, s.attn_out_norm, s.mlp_out_norm = (
                t.data_ptr() if t is not None else None for t in (w.q_norm, w.k_norm, w.attn_out_norm, w.mlp_out_norm))
            s.rope, s.kv_group, s.window = w.rope, g, w.window or 0
        self.shape.num_blocks, self.shape.block_size = want[0], want[1]
        self._structs, self._bound = structs, key

    def __call__(self, h: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                 kv_groups: list[tuple[torch.Tensor, list[tuple[int, int, torch.Tensor, torch.Tensor]]]],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """h fp32 [rows, hidden] (the embeddings; overwritten) -> (h, residual) after the last
        layer. ropes: (cos, signed sin) rows of each rotary table; kv_groups: per KV group, its
        slot mapping and its decode groups (first row, end row, int64 block table, int64
        seq_lens), covering the rows."""
        assert self._structs is not None, "bind() the caches first"
        rows = h.shape[0]
        h = h.contiguous()
        tables = [(c.reshape(rows, -1).contiguous(), s.reshape(rows, -1).contiguous()) for c, s in ropes]
        parts = [(as_i64(slots), [(a, b, as_i64(bt), as_i64(lens)) for a, b, bt, lens in groups])
                 for slots, groups in kv_groups]
        if not self._fits(h, tables, parts):
            raise ValueError(f"decode step: inputs do not describe {rows} decode rows of hidden {self.hidden} "
                             f"(h {tuple(h.shape)} {h.dtype}, rotary {[tuple(c.shape) for c, _ in tables]}, "
                             f"slots {[tuple(s.shape) for s, _ in parts]}, groups "
                             f"{[sorted((a, b) for a, b, _, _ in g) for _, g in parts]})")
        residual = torch.empty_like(h)
        cgs = [(_Group * len(groups))(*[_Group(a, b, bt.data_ptr(), bt.stride(0), bt.shape[1], lens.data_ptr())
                                        for a, b, bt, lens in groups]) for _, groups in parts]
        ptrs = ctypes.c_void_p * len(parts)
        rope_ptrs = ctypes.c_void_p * len(tables)
        rc = self._lib.qp_gguf_decode_layers(
            self._structs, len(self.layers), ctypes.byref(self.shape), h.data_ptr(), residual.data_ptr(), rows,
            rope_ptrs(*[c.data_ptr() for c, _ in tables]), rope_ptrs(*[s.data_ptr() for _, s in tables]),
            ptrs(*[s.data_ptr() for s, _ in parts]), ptrs(*[ctypes.addressof(g) for g in cgs]),
            (ctypes.c_int * len(parts))(*[len(g) for _, g in parts]))
        if rc != 0:
            raise (MemoryError if rc == -3 else ValueError)(f"decode step: {_ERRORS.get(rc, f'error {rc}')}")
        return h, residual


    def _fits(self, h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
              parts: list[tuple[torch.Tensor, list[tuple[int, int, torch.Tensor, torch.Tensor]]]]) -> bool:
        """Whether the step's inputs describe its rows: every rotary table and KV group the
        layers use, each group's decode groups covering the rows once."""
        rows, hd = h.shape[0], self.shape.head_dim
        if h.dtype != torch.float32 or tuple(h.shape) != (rows, self.hidden) or len(tables) < self.num_ropes:
            return False
        if any(c.shape != (rows, hd) or s.shape != (rows, hd) or c.dtype != torch.float32 or s.dtype != torch.float32
               for c, s in tables):
            return False
        assert self._structs is not None
        if len(parts) <= max(s.kv_group for s in self._structs):
            return False
        for slots, groups in parts:
            spans = sorted((a, b) for a, b, _, _ in groups)
            if (slots.shape != (rows,) or not spans or spans[0][0] != 0 or spans[-1][1] != rows
                    or any(x[1] != y[0] for x, y in pairwise(spans))
                    or any(bt.dim() != 2 or bt.shape[0] != b - a or lens.shape != (b - a,)
                           for a, b, bt, lens in groups)):
                return False
        return True


_ERRORS = {-1: "a weight format or head size the kernels cannot run", -2: "a slot, seq_len or block id outside "
           "the cache", -3: "out of memory for the step's scratch"}
