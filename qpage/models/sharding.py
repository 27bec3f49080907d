"""How a Llama-family model splits over N ranks (Megatron style), each rank's slice of a
checkpoint tensor, and the split layers' collectives (``Rank``).

- Column-parallel: the fused qkv (a rank's query heads and the KV heads they read) and gate_up
  (a range of the intermediate size). No communication.
- Row-parallel: o_proj and down_proj take the matching input columns and produce partial
  sums, all-reduced once each.
- Vocabulary-parallel: the embedding and the LM head hold a range of token rows; lookups are
  all-reduced, logits gathered to rank 0. Norms are replicated.

Heads split in whole GQA groups, so attention on a rank is ordinary GQA over its own heads.
With fewer KV heads than ranks each KV head is replicated on N / kv_heads ranks, which split
its group of query heads (as vLLM does). When the KV heads do not divide by N (SmolLM2-135M:
3 over 2 ranks) the ranks get unequal whole groups; the KV cache is sized for the largest.

Quantized weights are validated (and converted) by their layer at the whole model's shape,
then sliced (``Rank.quant``), so their scales go with their weights. Row-parallel layers
whose scales cover groups of input columns (GPTQ/AWQ/compressed-tensors groups, FP8 128x128
blocks) split by whole groups, in the order of ``g_idx`` (the checkpoint's act-order): each
rank's part is an ordinary in-order weight that the kernels run. When those columns are not
the rank's own input columns (act-order, or a group that straddles a head boundary) the layer
all-gathers its input and picks them. Block formats (GGUF, bitsandbytes) split on their 32- or
256-weight blocks.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from qpage.formats.awq import AwqConfig
from qpage.formats.bnb import BnbConfig
from qpage.formats.compressed_tensors import CtIntConfig
from qpage.formats.detect import LinearConfig, linear_config
from qpage.formats.fp8 import Fp8Config
from qpage.formats.gguf_model import GgufConfig, GgufTensor
from qpage.formats.gptq import GptqConfig
from qpage.formats.safetensors_io import LazyTensor, read_parts
from qpage.kernels.packing import pack_rows, unpack_rows
from qpage.layers.linear.block_linear import BlockLinear
from qpage.layers.linear.embedding import Embedding
from qpage.layers.linear.fp8_linear import Fp8Linear
from qpage.layers.linear.parallel import RowParallel, VocabParallelEmbedding, VocabParallelHead
from qpage.layers.linear.quant_linear import IntLinear
from qpage.models.arch import GEMMA_ARCHITECTURES, ArchConfig
from qpage.parallel.comm import Collectives

_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(\w+_proj)\.(weight|bias)$")
Module = IntLinear | Fp8Linear | BlockLinear | Embedding
"""The layers a quantized checkpoint's projections (and a GGUF embedding) load into."""
IntConfig = GptqConfig | AwqConfig | CtIntConfig
"""Integer formats, all held in the GPTQ layout once loaded (``IntLinear.check_part``)."""
SPLITS = (GptqConfig, AwqConfig, CtIntConfig, Fp8Config, BnbConfig)
"""The safetensors weight formats a rank's part is sliced from (GGUF files: ``GgufConfig``)."""
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def row_group(quant: LinearConfig | None) -> int | None:
    """The input columns a row-parallel quantized weight keeps together on one rank (a
    quantization group, an FP8 scale block), or None when any split of the columns works."""
    if isinstance(quant, IntConfig):
        return quant.group_size
    if isinstance(quant, Fp8Config):
        return quant.block
    return None


def _even(n: int, world: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank's share [a, b) of n items split in units of ``unit`` as evenly as possible."""
    units = -(-n // unit)
    return min(n, rank * units // world * unit), min(n, (rank + 1) * units // world * unit)


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds, as global [start, stop) ranges."""

    rank: int
    world: int
    heads: tuple[int, int]
    """Query heads."""
    kv_heads: tuple[int, int]
    """KV heads (replicated ones counted on each rank that holds them)."""
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    def local_arch(self, arch: ArchConfig) -> ArchConfig:
        """The shape of this rank's part: a smaller model of the same architecture (its
        row-parallel projections' input widths follow ``row_inputs``)."""
        group = row_group(linear_config(arch.quantization, "config.json") if arch.quantization else None)
        (o0, o1), (d0, d1) = (self.row_inputs(proj, arch, group) for proj in ROW_PARALLEL)
        return dataclasses.replace(
            arch, num_heads=self.heads[1] - self.heads[0], num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0], vocab_size=self.vocab[1] - self.vocab[0],
            o_proj_inputs=o1 - o0, down_proj_inputs=d1 - d0)

    def own_inputs(self, proj: str, arch: ArchConfig) -> tuple[int, int]:
        """The input columns of a row-parallel projection this rank computes itself."""
        if proj == "o_proj":
            return self.heads[0] * arch.head_dim, self.heads[1] * arch.head_dim
        return self.intermediate

    def row_inputs(self, proj: str, arch: ArchConfig, group: int | None) -> tuple[int, int]:
        """[a, b) in ``g_idx`` order of the input columns this rank's row-parallel weight covers:
        its own columns when any split works, else its share of whole groups (``row_group``)."""
        if group is None:
            return self.own_inputs(proj, arch)
        k = arch.q_size if proj == "o_proj" else arch.intermediate_size
        g = group
        g0, g1 = _even(-(-k // g), self.world, self.rank)
        return g0 * g, min(g1 * g, k)


def check_parallel(arch: ArchConfig, world: int, source: str) -> None:
    """Refuse a configuration tensor parallelism cannot run, with the reason."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size={world} must be at least 1")
    if world == 1:
        return
    if arch.fused_checkpoint:
        raise ValueError(f"{source}: tensor_parallel_size={world} does not split a {arch.architecture}'s fused "
                         "qkv_proj and gate_up_proj tensors yet; run it with tensor_parallel_size=1")
    if (arch.architecture in GEMMA_ARCHITECTURES or arch.num_experts
            or len({arch.layer_window(i) for i in range(arch.num_layers)}) > 1):
        raise ValueError(f"{source}: tensor_parallel_size={world} does not run {arch.architecture}'s layers (Gemma, "
                         "mixtures of experts, or local layers beside global ones) yet; run it with "
                         "tensor_parallel_size=1")
    q = arch.quantization
    quant = linear_config(q, source) if q is not None else None
    if quant is not None and not isinstance(quant, (*SPLITS, GgufConfig)):
        raise ValueError(f"{source}: tensor_parallel_size={world} does not split {type(quant).__name__} weights "
                         f"({q.get('quant_method')!r}); run it with tensor_parallel_size=1")
    h, hk = arch.num_heads, arch.num_kv_heads
    if hk < world and (world % hk or (h // hk) % (world // hk)):
        raise ValueError(f"{source}: tensor_parallel_size={world} does not fit {h} query heads over {hk} KV heads: "
                         f"with fewer KV heads than ranks, the ranks must divide by the KV heads ({world} % {hk}) and "
                         f"each group of {h // hk} query heads by the ranks per KV head; choose a size that divides "
                         f"{hk} or a multiple of it")
    if arch.intermediate_size < world or arch.vocab_size < world:
        raise ValueError(f"{source}: tensor_parallel_size={world} is larger than the model's intermediate size "
                         f"or vocabulary")
    g = row_group(quant)
    for name, k in (("attention output", arch.q_size), ("intermediate", arch.intermediate_size)):
        if g and -(-k // g) < world:
            raise ValueError(f"{source}: the {name} size {k} holds {-(-k // g)} quantization groups of {g}, fewer "
                             f"than tensor_parallel_size={world}: a rank would hold none; use fewer ranks")


def plan_shards(arch: ArchConfig, world: int) -> list[ShardPlan]:
    """Every rank's share (``check_parallel`` first)."""
    h, hk = arch.num_heads, arch.num_kv_heads
    group = h // hk
    # Whole GGUF blocks (256 or 32 weights) or packed int32 columns of GPTQ zeros (8), where they divide.
    n = arch.intermediate_size
    unit = next(u for u in (256, 32, 8, 1) if n % u == 0 and n // u >= world)
    plans = []
    for r in range(world):
        if hk >= world:
            k0, k1 = _even(hk, world, r)
            q0, q1 = k0 * group, k1 * group
        else:
            reps = world // hk
            k0, k1 = r // reps, r // reps + 1
            per = group // reps
            q0 = k0 * group + (r % reps) * per
            q1 = q0 + per
        plans.append(ShardPlan(r, world, (q0, q1), (k0, k1), _even(arch.intermediate_size, world, r, unit),
                               _even(arch.vocab_size, world, r)))
    return plans


def _rows(plan: ShardPlan, arch: ArchConfig, proj: str) -> tuple[int, int]:
    """Output rows of a column-parallel projection (or the LM head) this rank holds."""
    if proj == "lm_head":
        return plan.vocab
    hd = arch.head_dim
    if proj == "q_proj":
        return plan.heads[0] * hd, plan.heads[1] * hd
    if proj in ("k_proj", "v_proj"):
        return plan.kv_heads[0] * hd, plan.kv_heads[1] * hd
    return plan.intermediate


Weight = torch.Tensor | GgufTensor | LazyTensor
"""A dense tensor, blocks (GGUF, bitsandbytes ``Bnb4Tensor``), or a tensor not read yet, of
which only the slice is read."""


def _row_slice(t: Weight, a: int, b: int) -> Weight:
    return t.take_rows(a, b) if isinstance(t, GgufTensor) else t[a:b]


def _col_slice(t: Weight, a: int, b: int) -> Weight:
    """Input columns [a, b): for blocks, whole blocks of each row."""
    return t.take_cols(a, b) if isinstance(t, GgufTensor) else t[:, a:b]


def shard_weight(name: str, t: Weight, plan: ShardPlan, arch: ArchConfig) -> Weight:
    """This rank's slice of a checkpoint's ``.weight`` or ``.bias`` tensor, dense or in blocks
    (norms, and what no layer splits, whole)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _row_slice(t, *plan.vocab)
    m = _LAYER.match(name)
    if m is None:
        return t
    proj, kind = m.group(2), m.group(3)
    if proj in COLUMN_PARALLEL:
        return _row_slice(t, *_rows(plan, arch, proj))
    if kind == "bias":  # a row-parallel bias is added once: by rank 0
        t = t.read() if isinstance(t, LazyTensor) else t
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: a quantized bias is not supported with tensor parallelism")
        return t if plan.rank == 0 else torch.zeros_like(t)
    return _col_slice(t, *plan.own_inputs(proj, arch))


def global_shape(proj: str, arch: ArchConfig) -> tuple[int, int]:
    """(in_features, out_features) of one checkpoint projection of the whole model."""
    return {"q_proj": (arch.hidden_size, arch.q_size), "k_proj": (arch.hidden_size, arch.kv_size),
            "v_proj": (arch.hidden_size, arch.kv_size), "o_proj": (arch.q_size, arch.hidden_size),
            "gate_proj": (arch.hidden_size, arch.intermediate_size),
            "up_proj": (arch.hidden_size, arch.intermediate_size),
            "down_proj": (arch.intermediate_size, arch.hidden_size),
            "lm_head": (arch.hidden_size, arch.vocab_size)}[proj]


def _row_part(proj: str, plans: list[ShardPlan], rank: int, arch: ArchConfig, group: int | None,
              order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A row-parallel weight's input columns on ``rank`` (global, in ``order``: the whole
    groups ``row_inputs`` gives it) and the same to gather its input by, or None when every
    rank reads its own input as it is (all ranks decide alike: a gather is a collective)."""

    def reads_own(p: ShardPlan) -> bool:
        a, b = p.row_inputs(proj, arch, group)
        return (a, b) == p.own_inputs(proj, arch) and torch.equal(order[a:b], torch.arange(a, b))

    c0, c1 = plans[rank].row_inputs(proj, arch, group)
    cols = order[c0:c1]
    return cols, None if all(reads_own(p) for p in plans) else cols


def shard_fp8(prefix: str, codes: torch.Tensor | LazyTensor, scale: torch.Tensor, plans: list[ShardPlan], rank: int,
              arch: ArchConfig, block: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s part of one FP8 projection: codes [out, in] (uint8 or float8, possibly
    unread) and scale [out] per channel or [out, in / block] (``formats.fp8.check_linear``'s
    layout), as uint8 codes and scale, and the global input columns
    a row-parallel part gathers (``_row_part``). Block scales split by whole blocks."""
    proj = prefix.rpartition(".")[2]
    if proj in (*COLUMN_PARALLEL, "lm_head"):
        a, b = _rows(plans[rank], arch, proj)
        return codes[a:b].view(torch.uint8), scale[a:b], None
    if proj not in ROW_PARALLEL:
        raise ValueError(f"{prefix}: not a projection tensor parallelism splits")
    _, gather = _row_part(proj, plans, rank, arch, block, torch.arange(codes.shape[1]))
    c0, c1 = plans[rank].row_inputs(proj, arch, block)
    if block is not None:
        scale = scale[:, c0 // block : -(-c1 // block)]
    return codes[:, c0:c1].view(torch.uint8), scale, gather


def shard_gptq(prefix: str, parts: dict[str, torch.Tensor | None], plans: list[ShardPlan], rank: int,
               arch: ArchConfig, cfg: IntConfig) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """Rank ``rank``'s part of one integer projection in the GPTQ layout (v2 zeros, g_idx None
    when in order), and for a row-parallel one the global input columns it reads, or None
    when every rank reads its own input as it is (all ranks decide alike: a gather is a
    collective)."""
    plan = plans[rank]
    proj = prefix.rpartition(".")[2]
    pack = 32 // cfg.bits
    out = dict(parts)
    qweight, scales, qzeros = parts["qweight"], parts["scales"], parts["qzeros"]
    assert qweight is not None and scales is not None and qzeros is not None
    if proj in COLUMN_PARALLEL:
        a, b = _rows(plan, arch, proj)
        if a % pack or b % pack:
            raise ValueError(f"{prefix}: rank {plan.rank}'s output columns [{a}, {b}) do not start and end on a "
                             f"packed int32 of qzeros ({pack} columns); choose another tensor_parallel_size")
        out["qweight"], out["scales"], out["qzeros"] = qweight[:, a:b], scales[:, a:b], qzeros[:, a // pack : b // pack]
        return out, None
    if proj not in ROW_PARALLEL:
        raise ValueError(f"{prefix}: not a projection tensor parallelism splits")
    k = arch.q_size if proj == "o_proj" else arch.intermediate_size
    g = cfg.group_size or k
    g_idx = parts.get("g_idx")
    order = torch.argsort(torch.arange(k) // g if g_idx is None else g_idx.long(), stable=True)

    cols, gather = _row_part(proj, plans, rank, arch, cfg.group_size, order)
    c0, c1 = plan.row_inputs(proj, arch, cfg.group_size)
    if c0 % pack == 0 and torch.equal(cols, torch.arange(c0, c1)):  # in order: whole packed rows
        out["qweight"] = qweight[c0 // pack : -(-c1 // pack)]
    else:
        whole = qweight.read() if isinstance(qweight, LazyTensor) else qweight
        out["qweight"] = pack_rows(unpack_rows(whole, cfg.bits, k)[cols], cfg.bits)
    out["g_idx"] = None  # whole groups in g_idx order: in order on the rank
    if cfg.group_size is not None:
        g0 = c0 // g
        out["scales"], out["qzeros"] = scales[g0 : -(-c1 // g)], qzeros[g0 : -(-c1 // g)]
    return out, gather


class PartLoader(Protocol):
    """What a process holds of each checkpoint tensor (``LlamaForCausalLM.load_weights``)."""

    def dense(self, name: str, t: Weight) -> Weight:
        """A dense or block tensor (its ``.weight`` or ``.bias``) as this process holds it."""
        ...

    def quant(self, target: tuple[Module, int, int], prefix: str, parts: dict[str, Any], file: str) -> None:
        """Store one quantized projection's parts (or a GGUF embedding) into its layer
        (``target``: the layer, its first output row there, its rows)."""
        ...


class WholeModel:
    """A model that is not split: every tensor whole."""

    def dense(self, name: str, t: Weight) -> Weight:
        return t

    def quant(self, target: tuple[Module, int, int], prefix: str, parts: dict[str, Any], file: str) -> None:
        mod, offset, cols = target
        mod.load_part(prefix, parts, offset, cols, file)


WHOLE_MODEL = WholeModel()


@dataclass
class Rank:
    """This process's rank of a split model: every rank's share, the whole shape, what it
    takes of each checkpoint tensor (a ``PartLoader``), and its layers' collectives (``wrap``)."""

    plans: list[ShardPlan]
    """Every rank's share, indexed by rank."""
    arch: ArchConfig
    """The whole model's shape (``plan.local_arch(arch)`` is this rank's)."""
    comm: Collectives
    input_widths: dict[str, list[int]] = field(init=False)
    """Each row-parallel projection's own input columns per rank (its all-gather's widths)."""
    vocab_widths: list[int] = field(init=False)
    """Each rank's vocabulary columns (the logits' gather)."""
    gathers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Checkpoint prefix of a row-parallel projection -> the global input columns it gathers
    (``_row_part``), for the ones that do."""

    def __post_init__(self) -> None:
        self.input_widths = {proj: [b - a for a, b in (p.own_inputs(proj, self.arch) for p in self.plans)]
                             for proj in ROW_PARALLEL}
        self.vocab_widths = [p.vocab[1] - p.vocab[0] for p in self.plans]

    @property
    def plan(self) -> ShardPlan:
        return self.plans[self.comm.rank]

    def dense(self, name: str, t: Weight) -> Weight:
        return shard_weight(name, t, self.plan, self.arch)

    def quant(self, target: tuple[Module, int, int], prefix: str, parts: dict[str, Any], file: str) -> None:
        """Store this rank's part of one quantized projection (or GGUF embedding) into its
        layer, which takes it by its own form (``load_split`` with this rank as its
        ``Splitter``); a row-parallel part's global input columns, when it gathers them
        (``_row_part``), are kept for ``wrap``."""
        mod, offset, cols = target
        inputs = mod.load_split(prefix, read_parts(parts, mod.unread_parts()), offset, cols, file, self)
        if inputs is not None:
            self.gathers[prefix] = inputs

    # The Splitter: what this rank takes of a projection, by form.
    def whole_shape(self, prefix: str) -> tuple[int, int]:
        return global_shape(prefix.rpartition(".")[2], self.arch)

    def int_part(self, prefix: str, parts: dict[str, Any], cfg: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
        return shard_gptq(prefix, parts, self.plans, self.comm.rank, self.arch, cfg)

    def fp8_part(self, prefix: str, codes: Any, scale: torch.Tensor, block: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return shard_fp8(prefix, codes, scale, self.plans, self.comm.rank, self.arch, block)

    def tensor_part(self, name: str, value: Any) -> Any:
        part = shard_weight(name, value, self.plan, self.arch)
        assert not isinstance(part, LazyTensor), "block formats are read by their layer's check_part"
        return part

    def wrap(self, model: Any) -> None:
        """Give a loaded and prepared Llama-family part its collectives (``layers.linear.parallel``):
        the row-parallel projections all-reduce, the embedding and the head are split by
        vocabulary. The fused decode step has no collectives: decode runs the Python layers."""
        comm = self.comm
        for i, layer in enumerate(model.layers):
            for part, proj in (("self_attn", "o_proj"), ("mlp", "down_proj")):
                owner = getattr(layer, part)
                cols = self.gathers.get(f"model.layers.{i}.{part}.{proj}")
                setattr(owner, proj, RowParallel(getattr(owner, proj), comm, self.input_widths[proj], cols))
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, self.plan.vocab, comm, self.vocab_widths)
        if model.lm_head is not None:
            model.lm_head = VocabParallelHead(model.lm_head, comm, self.vocab_widths)
        model.decode_stack = None
