"""The one choice of INT4/INT8 matmul kernel: per call, by the batch's row count.

``choose_config`` takes the GPU's tuned config for the problem, else the default for its
regime (``configs.default_matmul_config``), and keeps the first whose kernel can run it; the
tiled kernel runs every case, so it is the last resort. ``int_matmul`` launches that kernel.
Layouts: ``common``.
"""

import functools

import torch

from qpage.kernels.configs import MatmulConfig, default_matmul_config
from qpage.kernels.int_matmul import dequant, gemv, tiled
from qpage.kernels.tuned import matmul_kind, on_install, tuned_matmul_config


def reject(cfg: MatmulConfig, m: int, bits: int, group_size: int, awq: bool, act_order: bool) -> str | None:
    """Why ``cfg``'s kernel cannot run this problem, or None."""
    if cfg.kind == "gemv":
        why = gemv.can_implement(cfg, m, group_size, act_order)
        return why if why is not None else tiled.can_implement(cfg, bits, awq)
    if cfg.kind == "dequant":
        return None
    return tiled.can_implement(cfg, bits, awq)


@functools.lru_cache(maxsize=4096)
def choose_config(device: torch.device, m: int, n: int, k: int, bits: int, group_size: int, awq: bool,
                  act_order: bool) -> MatmulConfig:
    """The config ``int_matmul`` runs for this problem on ``device`` (see the module docstring)."""
    candidates = (
        tuned_matmul_config(device, matmul_kind(bits, group_size, k, awq, act_order), m, n, k),
        default_matmul_config(m, n, k, device, group_size),
        default_matmul_config(m, n, k, device, group_size, kind="tiled"),
    )
    reasons = []
    for cfg in candidates:
        if cfg is None:
            continue
        why = reject(cfg, m, bits, group_size, awq, act_order)
        if why is None:
            return cfg
        reasons.append(f"{cfg}: {why}")
    raise ValueError(f"no INT{bits} matmul config fits M={m} N={n} K={k} group={group_size}: " + "; ".join(reasons))


on_install(choose_config.cache_clear)


def int_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    awq: bool = False,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W [K, N]`` with W packed as described in ``common``.

    ``group_size`` is the group length along K (K itself for per-channel); ``qzeros=None``
    means symmetric (zero = 2**(bits-1)). Inputs are validated at load time. ``config``
    insists on one launch (benchmarks, tests): it raises if its kernel cannot run the problem.
    """
    if bits not in (4, 8) or (awq and bits != 4):
        raise ValueError(f"bits={bits} is not supported (GPTQ layout: 4 or 8; AWQ: 4)")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], scales.shape[1]
    act_order = g_idx is not None
    if config is None:
        cfg = choose_config(x.device, m, n, k, bits, group_size, awq, act_order)
    else:
        why = reject(config, m, bits, group_size, awq, act_order)
        if why is not None:
            raise ValueError(f"{config} cannot run M={m} N={n} K={k}: {why}")
        cfg = config
    if cfg.kind == "dequant":
        y = dequant.dequant_matmul(x2, qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size, awq=awq)
    elif cfg.kind == "gemv":
        y = gemv.gemv(x2, qweight, scales, qzeros, bits=bits, group_size=group_size, awq=awq, cfg=cfg)
    else:
        y = tiled.tiled_matmul(x2, qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size, awq=awq, cfg=cfg)
    return y.view(*lead, n)
