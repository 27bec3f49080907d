"""What this machine can run: versions, CPU features, the C and GPU toolchains, and the
kernel each selector picks here (``qpage --version``). The paths come from asking the
selectors themselves, so they are the engine's choices; asking the attention selector
builds the C kernels once if they are not cached yet, as the engine's first start would."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

import torch

from qpage.kernels.cpu import native
from qpage.kernels.cpu.matmul import native_gguf
from qpage.kernels.triton_utils import HAS_TRITON, INSTALLED, triton, triton_unavailable_reason
from qpage.layers.attention.kv_format import KVCacheSpec
from qpage.layers.attention.selector import select_attention_backend
from qpage.layers.linear.kernel_spec import LinearSpec
from qpage.layers.linear.linear_kernels import select_linear_kernel
from qpage.layers.ops import select_ops
from qpage.version import __version__

CPU_FEATURES = (("AVX2", ("avx2",)), ("AVX-512", ("avx512f",)), ("VNNI", ("avx512_vnni", "avx_vnni")),
                ("AMX", ("amx_tile",)))
# Representative layers for the linear-path question: a 4096-wide projection, group 128.
_WIDTH, _GROUP = 4096, 128


def cpu_line() -> str:
    """Model name, thread count and the vector features the CPU kernels care about."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine(), platform.processor()):
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    feats = ", ".join(f"{label} {'yes' if any(f in flags for f in names) else 'no'}" for label, names in CPU_FEATURES)
    head = f"{name}; {torch.get_num_threads()} threads"
    return f"{head}; {feats}" if flags else head


def cuda_line() -> str:
    if not torch.cuda.is_available():
        return "not available" + ("" if torch.version.cuda else " (this torch is built for CPU only)")
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name}, compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB "
            f"(CUDA {torch.version.cuda})")


def triton_line(device: str) -> str:
    if not INSTALLED:
        return "not installed (GPU kernels need it: pip install triton)"
    if not HAS_TRITON:
        return (f"{importlib.metadata.version('triton')}, not loaded: its kernels need a CUDA device "
                "(or TRITON_INTERPRET=1)")
    why = triton_unavailable_reason(device)
    return f"{triton.__version__}" + ("" if why is None else f"; {why}")


def linear_paths(device: torch.device, dtype: torch.dtype) -> str:
    """The linear kernel each weight scheme gets on ``device`` with ``dtype`` activations."""
    out = []
    for label, scheme, bits in (("dense", "dense", 0), ("INT4 g128", "int", 4), ("INT8 sym", "int", 8),
                                ("FP8", "fp8", 8)):
        group = _GROUP if bits == 4 else (_WIDTH if bits == 8 else 0)
        spec = LinearSpec(scheme, device, dtype, _WIDTH, _WIDTH, bits=bits, group_size=group)
        try:
            out.append(f"{label} {select_linear_kernel(spec).name}")
        except ValueError:
            out.append(f"{label} none")
    return ", ".join(out)


def paths(device: torch.device) -> list[tuple[str, str]]:
    """(dtype, 'attention X; ops Y; linears ...') for the dtypes that matter on ``device``."""
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cpu" else (torch.float16, torch.bfloat16)
    rows = []
    for dtype in dtypes:
        try:
            attn = getattr(select_attention_backend(device, KVCacheSpec.from_config("auto", "auto", dtype), 64),
                           "name", "?")
        except ValueError:
            attn = "none"
        rows.append((str(dtype).removeprefix("torch."),
                     f"attention {attn}; ops {select_ops(device, dtype).name}; linears: {linear_paths(device, dtype)}"))
    return rows


def gguf_line() -> str:
    """The instruction path the block-format matmuls take on this CPU."""
    if native.load() is None:
        return f"unavailable ({native.unavailable_reason()})"
    have = [isa for isa in ("vnni", "avx2", "scalar") if native_gguf.isa_supported(isa)]
    return f"{native_gguf.best_isa()} (this CPU runs: {', '.join(have)})"


def report() -> str:
    """The ``qpage --version`` text."""
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = [(device, dtype, row) for device in devices for dtype, row in paths(device)]
    lines = [f"qpage {__version__}",
             f"python {platform.python_version()}, torch {torch.__version__}",
             f"cpu: {cpu_line()}",
             f"C kernels (cpu-native): {native.build_status()}",
             f"block kernels (cpu-blocks): {gguf_line()}",
             f"cuda: {cuda_line()}",
             f"triton: {triton_line('cuda' if torch.cuda.is_available() else 'cpu')}"]
    lines += [f"paths on {device.type} with {dtype}: {row}" for device, dtype, row in rows]
    return "\n".join(lines)
