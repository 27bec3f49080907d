"""Static cost of the INT4/INT8 GEMV kernels on NVIDIA GPUs, measured without a GPU.

Compiles the kernels ahead of time for sm_80/86/89/90 (A100, RTX 3090, RTX 4090, H100/H200)
with the ptxas that ships inside the Triton wheel, disassembles the cubin with its cuobjdump,
and counts the SASS instructions in the kernel's main loop per weight each thread handles.
Specialization mirrors the JIT's for a 4096x14336 call (unit strides become compile-time 1;
pointers and 16-divisible ints carry ``tt.divisibility=16``), so the code is what a GPU runs.
The GEMVs counted: in-place and shift (``quant_gemv``) and half2 (``quant_gemv_h2``, whose
inline PTX only ever runs on a GPU: compiling it here is also its check that ptxas accepts it).

``--attention`` adds the paged decode kernel (Llama-3-8B heads: 8 KV heads, GQA 4, d=128,
64-token tiles) for each cache mode: loop instructions per token, registers, shared memory,
the resident warps per SM these allow, and the global loads (LDG: the block ids and per-token
scales; with ``scales_ahead`` their results are used one iteration later) and shared-memory
loads (LDS) in the loop; then the FP8 decoders side by side (the element-wise Triton bit
trick against the packed PTX of ``fp8_codec``) and the prefill kernel. ``--fp8-matmul`` counts
the FP8 weight matmul's loop per weight for each decoder.

Why this figure: on an H200 the M=1 INT4 GEMV ran at 22.8 us for 4096x14336, a third of the
memory floor and about half of the SMs' issue rate (docs/kernels.md), so the
instructions per weight bound it there. On a 24 GB card (3090/4090: ~1 TB/s) the same kernel
is memory-bound; fewer instructions still free issue slots for the loads.

    python benchmarks/kernel_sass.py                 # table + benchmarks/results/kernel_sass.json
    python benchmarks/kernel_sass.py --arch 90 --quick
    python benchmarks/kernel_sass.py --arch 90 --attention
    python benchmarks/kernel_sass.py --arch 90 --small-m    # INT4 tl.dot kernels for 2 <= M <= 32
    python benchmarks/kernel_sass.py --arch 86 --fp8-matmul # FP8 weights: bit trick vs PTX decoder
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, even from a shell (or a test) that interprets
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default of Triton <= 3.9 (silences 3.9's warning)
sys.path.insert(0, str(ROOT))

PTR_TYPES = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i32", "y_ptr": "*fp16",
             "ws_ptr": "*fp32", "lock_ptr": "*i32"}
UNIT_STRIDES = {"stride_xk", "stride_qn", "stride_sn", "stride_zn", "stride_yn"}
DIV16 = {"N", "K", "group_size", "magic", "stride_qk", "stride_sg", "stride_zg"}
ARCHS = {80: "A100", 86: "RTX 3090", 89: "RTX 4090", 90: "H100/H200"}


def tool(name: str) -> Path:
    """A CUDA binary bundled with Triton (ptxas is used by ``triton.compile`` itself)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: this Triton wheel has no NVIDIA tools (pip install triton on Linux)")
    return path


def compile_cubin(fn: Any, constexprs: dict[str, Any], arch: int, num_warps: int, num_stages: int,
                  types: dict[str, str] | None = None, maxnreg: int | None = None) -> Any:
    """``fn`` compiled for ``sm_<arch>`` as the JIT would specialize it (module docstring)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(constexprs, **{n: 1 for n in UNIT_STRIDES if n in fn.arg_names})
    types = types or PTR_TYPES
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in const and (n.endswith("_ptr") or n in DIV16 or n.startswith("stride"))}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def sass_of(cubin: bytes) -> tuple[str, int, int]:
    """(SASS text, registers per thread, spill bytes) of a cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(tool("cuobjdump")), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([str(tool("cuobjdump")), "-res-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill", res)]
    return sass, int(regs.group(1)) if regs else -1, sum(spills)


def main_loop(sass: str) -> tuple[int, collections.Counter[str]]:
    """Instruction count and opcode histogram of the largest loop (the body between a
    backward branch and its target)."""
    ins: list[tuple[int, str]] = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    best: list[tuple[int, str]] = []
    for i, (addr, text) in enumerate(ins):
        target = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
        if target and int(target[-1], 16) < addr and int(target[-1], 16) in index:
            body = ins[index[int(target[-1], 16)]: i + 1]
            best = body if len(body) > len(best) else best
    if not best:
        raise RuntimeError("no loop found in the SASS")
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in best)
    return len(best), ops


def gemv_rows(archs: list[int], configs: list[tuple[int, int, int]], quick: bool) -> list[dict[str, Any]]:
    """The GEMV kernels per case and tile with their K loop pipelined in 2 stages, as launched
    (``quant_gemv``); at the first tile also in 1 stage (``loop_stages``), as the H200 timed them
    before 2026-12-01: their loads then wait for each tile in turn (no LDGSTS in the loop)."""
    rows = []
    cases = [(4, True), (4, False), (8, False)] if not quick else [(4, True)]
    for arch in archs:
        for bits, zeros in cases:
            for i, tile in enumerate(configs):
                for stages in (2, 1) if i == 0 else (2,):
                    rows += [_gemv_row(arch, name, bits, zeros, tile, stages) for name in ("in-place", "shift", "half2")
                             if stages == 2 or name != "shift"]
    return rows


def _gemv_row(arch: int, name: str, bits: int, zeros: bool, tile: tuple[int, int, int], stages: int
              ) -> dict[str, Any]:
    from qpage.kernels.quant_gemv import _gptq_gemv_kernel, _int_gemv_kernel
    from qpage.kernels.quant_gemv_h2 import _gptq_h2_gemv_kernel

    fn, extra = {"in-place": (_gptq_gemv_kernel, {"BITS": bits}),
                 "shift": (_int_gemv_kernel, {"BITS": bits, "AWQ": False}),
                 "half2": (_gptq_h2_gemv_kernel, {"BITS": bits, "ASM": True})}[name]  # half2: inline PTX, fp16 pairs
    block_n, block_k, warps = tile
    const = dict(HAS_ZEROS=zeros, SPLIT_K=8, SERIAL=True, BLOCK_N=block_n, BLOCK_K=block_k, LOOP_STAGES=stages,
                 **extra)
    t = time.perf_counter()
    kernel = compile_cubin(fn, const, arch, warps, stages)
    sass, regs, spill = sass_of(kernel.asm["cubin"])
    n, ops = main_loop(sass)
    per_thread = block_k * block_n / (32 * warps)
    smem = kernel.metadata.shared
    r = dict(arch=arch, gpu=ARCHS.get(arch, ""), kernel=name, bits=bits, zeros=zeros, block_n=block_n,
             block_k=block_k, num_warps=warps, loop_stages=stages, loop_instructions=n, weights_per_thread=per_thread,
             per_weight=round(n / per_thread, 3), registers=regs, spill_bytes=spill, smem_bytes=smem,
             warps_per_sm=resident_warps(arch, regs, warps, smem), ldgsts_in_loop=ops.get("LDGSTS", 0),
             top_ops={k: round(v / per_thread, 3) for k, v in ops.most_common(8)},
             compile_s=round(time.perf_counter() - t, 1))
    case = f"int{bits} {'asym' if zeros else 'sym '}"
    print(f"sm_{arch} {name:8s} {case} bn={block_n:3d} bk={block_k} w={warps} stages={stages}  {n:5d} instr / "
          f"{per_thread:.0f} weights = {r['per_weight']:.2f} per weight  regs {regs} -> {r['warps_per_sm']} warps/SM, "
          f"{r['ldgsts_in_loop']} LDGSTS  " + " ".join(f"{k}:{v}" for k, v in r["top_ops"].items()), flush=True)
    return r


SMEM_PER_SM = {80: 164, 86: 100, 89: 100, 90: 228}
"""Shared memory per SM, KB (the CUDA programming guide's table)."""
MAX_WARPS_PER_SM = {80: 64, 86: 48, 89: 48, 90: 64}


def resident_warps(arch: int, regs: int, warps: int, smem: int) -> int:
    """Warps per SM of a kernel with ``regs`` registers per thread, ``warps`` per program and
    ``smem`` bytes of shared memory, as the occupancy calculator counts them: registers are
    allocated per warp in units of 256 (so per thread in steps of 8), and each program holds
    1 KB of shared memory beside its own."""
    reg_units = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 65536 // reg_units // warps
    by_smem = SMEM_PER_SM[arch] * 1024 // (smem + 1024)
    by_warps = MAX_WARPS_PER_SM[arch] // warps
    return min(by_regs, by_smem, by_warps) * warps


def attention_rows(archs: list[int]) -> list[dict[str, Any]]:
    """The decode kernel per cache mode and setting at 2 stages, as launched (module docstring);
    then the FP8 decoders side by side: the element-wise Triton bit trick against its packed
    PTX (e4m3 on sm_80/86, e5m2 everywhere), per-token, 4 warps."""
    rows = []
    modes = [("fp16", False, False, False), ("fp8 per-token", True, True, False), ("fp8 per-token", True, True, True),
             ("fp8 per-tensor", True, False, False), ("fp8 per-tensor", True, False, True)]
    for arch in archs:
        for label, fp8, per_token, v_f16 in modes:
            for warps in (4, 8):
                rows.append(_decode_row(arch, label, fp8, per_token, v_f16, warps, "e4m3", None))
        # 8 warps with registers capped at 80: three programs per SM (a tuned setting, maxnreg).
        rows.append(_decode_row(arch, "fp8 per-token", True, True, True, 8, "e4m3", None, maxnreg=80))
        # A bf16 model: its FP8 codes are multiplied in fp16 too, the V scale on P (in fp32).
        rows.append(_decode_row(arch, "fp8 per-token bf16", True, True, arch >= 90, 4, "e4m3", None, bf16=True))
        for fmt in ("e4m3", "e5m2"):
            if fmt == "e4m3" and arch >= 89:
                continue  # hardware cvt there
            for cvt in (0, 1):
                rows.append(_decode_row(arch, f"decoder {fmt}", True, True, arch >= 90, 4, fmt, cvt))
        if arch >= 89:  # paged_decode_t; q K^T in FP8 on sm_89+
            rows += [_decode_t_row(arch, per_token, qk_fp8, block_n) for per_token in (True, False)
                     for qk_fp8 in (True, False) for block_n in (64, 128)]
            rows.append(_decode_t_row(arch, True, True, 64, q_pad=16))  # FP8 wgmma with Triton < 3.8
            rows.append(_decode_t_row(arch, True, True, 64, loop_stages=3))  # every load pipelined
            if arch == 90:  # without the default register cap
                rows.append(_decode_t_row(arch, True, True, 64, maxnreg=0))
        else:  # sm_80/86: codes decoded by the packed PTX, q K^T in fp16
            rows += [_decode_t_row(arch, per_token, False, 64) for per_token in (True, False)]
        rows.append(_decode_t_row(arch, True, False, 64, fmt="e5m2"))
    rows += prefill_rows(archs)
    return rows


def _decode_t_row(arch: int, per_token: bool, qk_fp8: bool, block_n: int, q_pad: int = 8,
                  fmt: str = "e4m3", maxnreg: int | None = None, loop_stages: int | None = None) -> dict[str, Any]:
    """The tokens-as-rows decode (``paged_decode_t``), 4 warps, 2 stages, fp16 queries, with
    the launcher's register cap (``default_maxnreg``: 80 or 96 on sm_90) unless ``maxnreg`` is given
    (0: none); ``mma`` counts its tensor-core instructions by kind (QGMMA: FP8 wgmma; HGMMA:
    fp16 wgmma; HMMA: mma.sync), which shows whether q K^T really runs in FP8."""
    import triton.language as tl
    from qpage.kernels.paged_decode_t import P_SHIFT, _decode_t_kernel, default_maxnreg

    types = dict(q_ptr="*fp16", kc_ptr="*u8", vc_ptr="*u8", ks_ptr="*fp16", vs_ptr="*fp16", bt_ptr="*i32",
                 lens_ptr="*i32", out_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", qk_scale="fp32", v_unit="fp32")
    const = dict(KV_HEADS=8, QPK=4, Q_PAD=q_pad, HEAD_DIM=128, DIM_PAD=128, PAGE=16, SPLIT=True, BLOCK_N=block_n,
                 PER_TOKEN=per_token, QK_FP8=qk_fp8, IS_E5M2=fmt == "e5m2",
                 CVT=2 if fmt == "e4m3" and arch >= 89 else 1, DOT_DTYPE=tl.float16, PRECISION="tf32",
                 SHIFT=P_SHIFT, stride_op=1, LOOP_STAGES=loop_stages)
    cap = default_maxnreg((arch // 10, arch % 10), 4, block_n, q_pad) if maxnreg is None else maxnreg or None
    kernel = compile_cubin(_decode_t_kernel, const, arch, 4, 2, types, cap)
    sass, regs, spill = sass_of(kernel.asm["cubin"])
    n, ops = main_loop(sass)
    smem = kernel.metadata.shared
    resident = resident_warps(arch, regs, 4, smem)
    label = (f"tokens-as-rows {'per-token' if per_token else 'per-tensor'}{' qk-fp8' if qk_fp8 else ''}"
             f"{f' q_pad={q_pad}' if q_pad != 8 else ''}{' e5m2' if fmt == 'e5m2' else ''}"
             f"{' no cap' if maxnreg == 0 else f' maxnreg={maxnreg}' if maxnreg else ''}"
             f"{f' loop_stages={loop_stages}' if loop_stages else ''}")
    row = dict(arch=arch, mode=label, fp8_cvt=["bits", "ptx", "hw"][const["CVT"]], v_f16=False, num_warps=4,
               maxnreg=cap, block_n=block_n, q_pad=q_pad, loop_stages=loop_stages,
               loop_instructions=n, per_token=round(n / block_n, 2), registers=regs, spill_bytes=spill,
               smem_bytes=smem, warps_per_sm=resident, ldg_in_loop=ops.get("LDG", 0), lds=ops.get("LDS", 0),
               warp_instr_per_token=round(n * 4 / block_n, 1),
               mma={k: v for k, v in ops.items() if k in ("QGMMA", "HGMMA", "HMMA")})
    print(f"sm_{arch} decode {label:42s} bn={block_n:3d}: loop {n:4d} ({n / block_n:5.2f}/token, "
          f"{n * 4 / block_n:4.1f} warp instr/token) regs {regs:3d} smem {smem:6d} -> {resident:2d} warps/SM, "
          f"{row['ldg_in_loop']} LDG, {row['lds']} LDS, {row['mma']}", flush=True)
    return row


def _decode_row(arch: int, label: str, fp8: bool, per_token: bool, v_f16: bool, warps: int, fmt: str,
                cvt: int | None, maxnreg: int | None = None, bf16: bool = False) -> dict[str, Any]:
    import triton.language as tl
    from qpage.kernels.paged_attention import _decode_kernel

    cvt = cvt if cvt is not None else (2 if fmt == "e4m3" and arch >= 89 else 1) if fp8 else 0
    cache = "*u8" if fp8 else "*fp16"
    types = dict(q_ptr="*fp16", kc_ptr=cache, vc_ptr=cache, ks_ptr="*fp16", vs_ptr="*fp16",
                 bt_ptr="*i32", lens_ptr="*i32", out_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32",
                 qk_scale="fp32", unit="fp32")
    const = dict(KV_HEADS=8, QPK=4, Q_PAD=16, HEAD_DIM=128, DIM_PAD=128, PAGE=16, SPLIT=True, BLOCK_N=64,
                 FP8=fp8, IS_E5M2=fmt == "e5m2", PER_TOKEN=per_token, FP8_CVT=cvt,
                 DOT_DTYPE=tl.float16, PRECISION="tf32", PREFETCH=False, SCALES_AHEAD=True, V_F16=v_f16,
                 stride_op=1)
    if bf16:  # a bf16 model: bf16 queries and output, the FP8 codes still multiplied in fp16
        types.update(q_ptr="*bf16")
    kernel = compile_cubin(_decode_kernel, const, arch, warps, 2, types, maxnreg)
    sass, regs, spill = sass_of(kernel.asm["cubin"])
    n, ops = main_loop(sass)
    smem = kernel.metadata.shared
    resident = resident_warps(arch, regs, warps, smem)
    row = dict(arch=arch, mode=label, fp8_cvt=["bits", "ptx", "hw"][cvt] if fp8 else "", v_f16=v_f16,
               num_warps=warps, maxnreg=maxnreg, loop_instructions=n, per_token=round(n / 64, 2), registers=regs,
               spill_bytes=spill, smem_bytes=smem, warps_per_sm=resident, ldg_in_loop=ops.get("LDG", 0),
               lds=ops.get("LDS", 0))
    cap = f" maxnreg={maxnreg}" if maxnreg else ""
    print(f"sm_{arch} decode {label:14s} cvt={row['fp8_cvt'] or '-':4s} v_f16={int(v_f16)} warps={warps}{cap}: "
          f"loop {n:4d} ({n / 64:5.2f}/token) regs {regs:3d} smem {smem:6d} -> {resident:2d} warps/SM, "
          f"{row['ldg_in_loop']} LDG, {row['lds']} LDS in the loop", flush=True)
    return row


def prefill_rows(archs: list[int]) -> list[dict[str, Any]]:
    """The prefill kernel (64 query rows x 64-token tiles, 4 warps, 2 stages as launched) per cache mode;
    "rows": per-token scales applied to the K/V rows (``scale_rows``)."""
    import triton.language as tl
    from qpage.kernels.paged_prefill import _prefill_kernel

    rows = []
    for arch in archs:
        for label, fp8, per_token, rows_ in (("fp16", False, False, False), ("fp8 per-token", True, True, False),
                                             ("fp8 per-token rows", True, True, True),
                                             ("fp8 per-tensor", True, False, False)):
            cache = "*u8" if fp8 else "*fp16"
            types = dict(q_ptr="*fp16", kc_ptr=cache, vc_ptr=cache, ks_ptr="*fp16", vs_ptr="*fp16", bt_ptr="*i32",
                         cu_ptr="*i32", ctx_ptr="*i32", out_ptr="*fp16", qk_scale="fp32", unit="fp32")
            const = dict(KV_HEADS=8, QPK=4, HEAD_DIM=128, DIM_PAD=128, PAGE=16, BLOCK_M=64, BLOCK_N=64, FP8=fp8,
                         IS_E5M2=False, PER_TOKEN=per_token, FP8_CVT=(2 if arch >= 89 else 1) if fp8 else 0,
                         DOT_DTYPE=tl.float16,
                         PRECISION="tf32", SCALE_ROWS=rows_)
            sass, regs, spill = sass_of(compile_cubin(_prefill_kernel, const, arch, 4, 2, types).asm["cubin"])
            n, ops = main_loop(sass)
            rows.append(dict(arch=arch, mode=f"prefill {label}", loop_instructions=n, registers=regs,
                             spill_bytes=spill, ldg_in_loop=ops.get("LDG", 0), ldgsts_in_loop=ops.get("LDGSTS", 0)))
            print(f"sm_{arch} prefill {label:18s}: loop {n:4d} regs {regs:3d}, {ops.get('LDG', 0)} LDG and "
                  f"{ops.get('LDGSTS', 0)} async copies in the loop", flush=True)
    return rows


SMALL_M_TILES = {"gptq": [(16, 64, 128, 4), (16, 128, 128, 4), (32, 64, 64, 4), (32, 128, 128, 4)],
                 "gptq8": [(16, 64, 128, 4), (16, 128, 128, 4), (32, 64, 64, 4), (32, 128, 128, 4)],
                 "awq": [(16, 64, 128, 4), (16, 256, 128, 4)]}
"""(block_m, block_n, block_k, warps) per layout: the tl.dot kernel's former defaults (GPTQ:
16x64x128 for M <= 16 and 32x64x64 for 17-32; AWQ: 16x64x128) and the tiles the pairs
kernels take. ``gptq`` is 4-bit group 128 with zeros, ``gptq8`` 8-bit per-channel symmetric
(the INT8 weight-only case), ``awq`` 4-bit group 128 with zeros."""


def small_m_rows(archs: list[int], quick: bool) -> list[dict[str, Any]]:
    """Integer weights at decode batch sizes, fp16 and (unless quick) bf16 activations, the
    layouts of ``SMALL_M_TILES`` (quick: 4-bit GPTQ): the general tl.dot kernel
    (``quant_matmul``) and the pairs kernels (``quant_pairs``), per tile."""
    from qpage.kernels.quant_matmul import _int_matmul_kernel
    from qpage.kernels.quant_pairs import _awq_pairs_kernel, _gptq_pairs_kernel

    rows = []
    for arch in archs:
        for layout in ("gptq",) if quick else tuple(SMALL_M_TILES):
            for act in ("fp16",) if quick else ("fp16", "bf16"):
                types = dict(PTR_TYPES, x_ptr=f"*{act}", s_ptr=f"*{act}", y_ptr=f"*{act}")
                for bm, bn, bk, warps in SMALL_M_TILES[layout][1:2] if quick else SMALL_M_TILES[layout]:
                    rows += _small_m_tile(arch, layout, act, types, (bm, bn, bk, warps), _int_matmul_kernel,
                                          _awq_pairs_kernel if layout == "awq" else _gptq_pairs_kernel)
    return rows


def _small_m_tile(arch: int, layout: str, act: str, types: dict[str, str], tile: tuple[int, int, int, int],
                  general: Any, pairs: Any) -> list[dict[str, Any]]:
    from qpage.kernels.quant_matmul import PAIRS_MIN_WORDS

    bm, bn, bk, warps = tile
    awq = layout == "awq"
    bits = 8 if layout == "gptq8" else 4
    common = dict(HAS_ZEROS=bits == 4, SPLIT_K=8, SERIAL=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    kernels = [("tl.dot", general, dict(common, BITS=bits, AWQ=awq, HAS_GIDX=False, GATHER=False,
                                        ONE_GROUP_PER_TILE=True, DOT_F32=False, MAGIC_F16=act == "fp16"))]
    if awq and bn >= 128:
        kernels.append(("pairs", pairs, dict(common, DOT_F32=False)))
    elif not awq and bk * bits >= PAIRS_MIN_WORDS * 32:
        kernels.append(("pairs", pairs, dict(common, BITS=bits, DOT_F32=False)))
    rows = []
    for name, fn, const in kernels:
        sass, regs, spill = sass_of(compile_cubin(fn, const, arch, warps, 3, types).asm["cubin"])
        n, ops = main_loop(sass)
        per_thread = bk * bn / (32 * warps)
        rows.append(dict(arch=arch, layout=layout, activations=act, kernel=name, block_m=bm, block_n=bn,
                         block_k=bk, num_warps=warps, loop_instructions=n, per_weight=round(n / per_thread, 3),
                         registers=regs, spill_bytes=spill,
                         top_ops={k: round(v / per_thread, 3) for k, v in ops.most_common(8)}))
        print(f"sm_{arch} small-M {layout} {act} {name:6s} {bm}x{bn}x{bk} w={warps}: {n:4d} instr = "
              f"{n / per_thread:5.2f} per weight  regs {regs:3d}  "
              + " ".join(f"{k}:{v}" for k, v in rows[-1]["top_ops"].items()), flush=True)
    return rows


FP8_MATMUL_TILES = [(16, 64, 128, 4), (16, 128, 128, 4), (64, 128, 64, 4), (128, 128, 64, 8)]
"""(block_m, block_n, block_k, warps) of the FP8 weight matmul counted by ``--fp8-matmul``."""


def fp8_matmul_rows(archs: list[int]) -> list[dict[str, Any]]:
    """The FP8 (E4M3) weight matmul's loop per weight on GPUs without e4m3 conversion (sm_80/86):
    the element-wise Triton bit trick against the packed PTX decoder (``fp8_codec.CVT_PTX``),
    and on sm_89/90 the hardware conversion for scale."""
    from qpage.kernels.fp8_matmul import _fp8_matmul_kernel

    types = dict(x_ptr="*fp16", w_ptr="*u8", s_ptr="*fp32", y_ptr="*fp16", ws_ptr="*fp32", lock_ptr="*i32",
                 unit="fp32")
    rows = []
    for arch in archs:
        for bm, bn, bk, warps in FP8_MATMUL_TILES:
            for cvt in (0, 1) if arch < 89 else (2,):
                const = dict(BLOCK_SCALES=False, SCALE_BLOCK_=128, SPLIT_K=1, SERIAL=True, DOT_F32=False, FP8_CVT=cvt,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, stride_wk=1, stride_xk=1, stride_yn=1, stride_sk=1)
                kernel = compile_cubin(_fp8_matmul_kernel, const, arch, warps, 3, types)
                sass, regs, spill = sass_of(kernel.asm["cubin"])
                n, _ = main_loop(sass)
                per = n / (bn * bk / (32 * warps))
                rows.append(dict(arch=arch, kernel="fp8 matmul", fp8_cvt=["bits", "ptx", "hw"][cvt], block_m=bm,
                                 block_n=bn, block_k=bk, num_warps=warps, loop_instructions=n,
                                 per_weight=round(per, 3), registers=regs, spill_bytes=spill))
                print(f"sm_{arch} fp8 matmul {bm}x{bn}x{bk} w{warps} cvt={rows[-1]['fp8_cvt']:4s}: loop {n:4d} "
                      f"({per:5.2f} per weight) regs {regs:3d} spill {spill}", flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per arch and case: the in-place kernel's instructions per weight against the shift
    kernel's and the half2 kernel's."""
    out = []
    rows = [r for r in rows if r["loop_stages"] == 2]
    keys = sorted({(r["arch"], r["bits"], r["zeros"], r["block_n"], r["block_k"], r["num_warps"]) for r in rows})
    for key in keys:
        pair = {r["kernel"]: r["per_weight"] for r in rows
                if (r["arch"], r["bits"], r["zeros"], r["block_n"], r["block_k"], r["num_warps"]) == key}
        if {"in-place", "shift"} <= set(pair):
            half2 = f", half2 {pair['half2']:.2f} ({pair['half2'] / pair['in-place']:.2f}x in-place)" \
                if "half2" in pair else ""
            out.append(f"sm_{key[0]} int{key[1]} {'asym' if key[2] else 'sym'} bn={key[3]} bk={key[4]} w={key[5]}: "
                       f"in-place {pair['in-place']:.2f} vs shift {pair['shift']:.2f} per weight "
                       f"({pair['shift'] / pair['in-place']:.2f}x fewer){half2}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, action="append", help="compute capability x10 (default: 80 86 89 90)")
    ap.add_argument("--quick", action="store_true", help="one case and one tile config (a smoke run)")
    ap.add_argument("--attention", action="store_true", help="also the paged decode attention kernel")
    ap.add_argument("--small-m", action="store_true", help="also the INT4 tl.dot kernels at decode batch sizes")
    ap.add_argument("--fp8-matmul", action="store_true", help="also the FP8 weight matmul, per FP8 decoder")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernel_sass.json")
    args = ap.parse_args()
    archs = args.arch or sorted(ARCHS)
    configs = [(128, 128, 4)] if args.quick else [(128, 128, 4), (64, 128, 2), (256, 128, 4), (128, 64, 4)]
    import triton

    print(f"triton {triton.__version__}; SASS of the main loop per weight (static count, no GPU)")
    rows = gemv_rows(archs, configs, args.quick)
    lines = summary(rows)
    print("\n" + "\n".join(lines))
    attention = attention_rows(archs) if args.attention else []
    small_m = small_m_rows(archs, args.quick) if args.small_m else []
    fp8_matmul = fp8_matmul_rows(archs) if args.fp8_matmul else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"triton": triton.__version__, "rows": rows, "summary": lines, "attention": attention,
                               "small_m": small_m, "fp8_matmul": fp8_matmul},
                              indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
