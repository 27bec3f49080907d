"""A sparse mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss): a router scores
every expert for each token; the token runs its ``top_k`` best experts (SwiGLU MLPs) and sums
their outputs weighted by the router's softmax probabilities (renormalised over the chosen ones
when ``norm_topk``); Qwen2-MoE adds a shared expert to every token, gated by a sigmoid;
gpt-oss's router and experts have biases and its SwiGLU is clamped.

Each expert's projections are linears from the one factory (packed GGUF blocks, GPTQ/AWQ
integers, dense), so experts load, quantize and run as any other linear. The router stays in
full precision. Two paths: the C block (``kernels.cpu.native_moe``) when every expert is on
the block-format kernels and the ops are the C ones, chosen at ``prepare`` (``experts_path``
says which, ``unfit`` why not); else the torch path here, which is the reference: rows grouped
by expert, each chosen expert one matmul over its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qpage.formats.detect import LinearConfig
from qpage.kernels.cpu.native_moe import MoeKernel, MoeWeights, weights_unfit_reason
from qpage.layers.linear.factory import make_linear
from qpage.layers.ops import TORCH_OPS, CpuNativeOps, TorchOps


class ExpertMLP(nn.Module):
    """One expert: down(act(x W_gate) * (x W_up)), gate and up fused in ``gate_up_proj`` (gate
    rows first); act SiLU, or with ``swiglu`` (limit, alpha) gpt-oss's clamped form
    (``clamped_swiglu``)."""

    def __init__(self, hidden: int, inter: int, quant: LinearConfig | None, bias: bool = False,
                 swiglu: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(hidden, 2 * inter, bias, quant)
        self.down_proj = make_linear(inter, hidden, bias, quant)
        self.swiglu = swiglu

    def run(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        act = ops.silu_mul(gate_up) if self.swiglu is None else clamped_swiglu(gate_up, *self.swiglu)
        return self.down_proj.forward(act)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation on [rows, 2 inter] (gate then up): the gate clamped above at
    ``limit``, up to [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].clamp(max=limit), gate_up[..., inter:].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def route(logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [rows, top_k], expert ids [rows, top_k]): the softmax (in fp32) over all
    experts, its top_k largest (ties to the lower id, as the C block), renormalised to sum 1
    with ``norm_topk``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoe(nn.Module):
    """A sparse layer's MLP: router, experts, optional shared expert (names as Qwen's checkpoints)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, norm_topk: bool,
                 shared_inter: int, quant: LinearConfig | None, bias: bool = False,
                 swiglu: tuple[float, float] | None = None) -> None:
        """``shared_inter``: width of the shared expert (0: none); ``bias``: the router and the
        experts have biases; ``swiglu``: gpt-oss's clamped activation (limit, alpha)."""
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.gate = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        """The router [experts, hidden] (never quantized)."""
        self.gate_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None
        self.experts = nn.ModuleList(ExpertMLP(hidden, inter, quant, bias, swiglu) for _ in range(num_experts))
        self.shared_expert = ExpertMLP(hidden, shared_inter, quant) if shared_inter else None
        self.shared_expert_gate = (nn.Parameter(torch.empty(1, hidden), requires_grad=False)
                                   if shared_inter else None)
        self.ops: TorchOps = TORCH_OPS
        self.kernel: MoeKernel | None = None
        self.unfit = "not prepared"
        """Why the C block does not run this layer ("" when it does)."""

    def prepare(self, ops: TorchOps) -> None:
        """Choose the path, once the experts' linears are prepared (``ops``: the model's)."""
        self.ops = ops
        self.kernel = None
        if not isinstance(ops, CpuNativeOps):
            self.unfit = f"the model's ops are {ops.name}, not the C kernels"
            return
        shared = self.shared_expert
        w = MoeWeights(self.gate.data.float().contiguous(),
                       [(getattr(e.gate_up_proj, "kernel_mm", None), getattr(e.down_proj, "kernel_mm", None))
                        for e in self.experts], self.top_k, self.norm_topk,
                       None if shared is None else (getattr(shared.gate_up_proj, "kernel_mm", None),
                                                    getattr(shared.down_proj, "kernel_mm", None)),
                       None if self.shared_expert_gate is None else self.shared_expert_gate.data.float().reshape(-1),
                       None if self.gate_bias is None else self.gate_bias.data.float().contiguous(),
                       [(_vector(e.gate_up_proj.bias), _vector(e.down_proj.bias)) for e in self.experts],
                       self.experts[0].swiglu)
        why = weights_unfit_reason(w)  # type: ignore[arg-type]
        self.unfit = why or ""
        if why is None:
            self.kernel = MoeKernel(w)

    @property
    def experts_path(self) -> str:
        """How the block runs: "cpu-native" (the C block) or "torch"."""
        return "torch" if self.kernel is None else "cpu-native"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path: rows grouped by expert, experts in id order, each output added to its
        rows times the routing weight (in x's dtype, as the reference models)."""
        weights, ids = route(F.linear(x, self.gate, self.gate_bias), self.top_k, self.norm_topk)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            y = self.experts[e].run(x[rows], self.ops)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert.run(x, self.ops)
        return out


def _vector(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.data.float().contiguous()


def describe_experts(model: nn.Module) -> str:
    """The start line's words on a model's mixtures of experts ("" for a dense model): how many
    sparse layers, experts and top-k, and on which path they run (and why not the C block)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoe)]
    if not blocks:
        return ""
    first = blocks[0]
    paths = sorted({b.experts_path for b in blocks})
    why = next((b.unfit for b in blocks if b.kernel is None), "")
    return (f"; experts: {len(blocks)} sparse layers of {len(first.experts)} (top {first.top_k}"
            f"{', a shared expert' if first.shared_expert is not None else ''}) on {', '.join(paths)}"
            + (f" ({why})" if why else ""))
