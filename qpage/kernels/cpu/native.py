"""The CPU kernels' C library (``csrc/``), compiled once with the system C compiler and
called through ctypes. Its wrappers, by operation: paged decode attention and the cache
write for an fp32 cache (``cpu_attention.c``; ``attention.native_fp32``), the FP8 cache
(``cpu_fp8.c``; ``attention.native_fp8``) and the int8/int4 cache (``cpu_int.c``;
``attention.native_int``); RMSNorm with the residual add, SiLU-and-mul and rotary embedding
(``cpu_ops.c``; ``native_ops``); matmuls on weights in llama.cpp's block formats
(``cpu_gguf.c``; their layouts in ``cpu_gguf_layout.c``, Q4_K/Q5_K, Q6_K and IQ4 in
``cpu_gguf_q4k.c``, ``cpu_gguf_q6k.c``, ``cpu_gguf_iq4.c``; ``matmul.native_gguf``); and a
whole decode step over them (``cpu_decode.c``; ``native_decode``); a mixture-of-experts
block over them (``cpu_moe.c``; ``native_moe``), both on one projection routine
(``cpu_step.c``); and dense fp32 matmuls on
weights packed in panels (``cpu_dense.c``; ``matmul.dense``).

Why: at batch 1 the torch path spends most of its attention time gathering the sequence's
blocks into one tensor and dispatching ops, and each norm and activation is several small
ops, each allocating (docs/cpu.md); the C kernels read the cache blocks in place and do each
step in one call. No compiler, a failed build, or ``QPAGE_NATIVE=0``:
``load()`` returns None with the reason logged once, and the torch/NumPy path runs instead.
Every kernel has its torch reference beside the caller (tests/kernels/test_cpu_native.py).

The shared library is cached under ``$QPAGE_CACHE/native`` (default ``~/.cache/qpage``),
keyed by the source, the compiler's version, the flags and this CPU's feature flags
(``-march=native`` code must not run on another CPU), and written to a temporary name
then renamed, so a concurrent or interrupted build never leaves a broken file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from qpage.config import cache_root

logger = logging.getLogger("qpage")

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "cpu_attention.c", CSRC / "cpu_ops.c", CSRC / "cpu_fp8.c", CSRC / "cpu_int.c", CSRC / "cpu_gguf.c",
           CSRC / "cpu_gguf_layout.c", CSRC / "cpu_gguf_q4k.c", CSRC / "cpu_gguf_q6k.c", CSRC / "cpu_gguf_iq4.c",
           CSRC / "cpu_step.c", CSRC / "cpu_decode.c", CSRC / "cpu_moe.c", CSRC / "cpu_dense.c")
HEADERS = (CSRC / "qp_math.h", CSRC / "qp_half.h", CSRC / "qp_gguf.h", CSRC / "qp_step.h")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c11", "-shared", "-fPIC")
OPENMP = "-fopenmp"
"""Threads for the block-quantized matmuls (``cpu_gguf.c``); without it they run on one thread."""
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""

# Pointers go over as plain addresses (``Tensor.data_ptr()``): cheaper than ctypes pointer casts.
_ptr, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((ln for ln in info.splitlines() if ln.startswith("flags")), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return cc if cc and shutil.which(cc) else None


def _library_path(cc: str) -> Path:
    """Where the build for these sources, this compiler and this CPU is cached."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\n".join([*texts, version, " ".join(FLAGS), _cpu_key()]).encode())
    return cache_root() / "native" / f"qpage_cpu-{key.hexdigest()[:16]}.so"


def _build(cc: str) -> Path:
    lib = _library_path(cc)
    if lib.is_file():
        return lib
    out_dir = lib.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        for extra in ((OPENMP,), ()):  # a compiler without OpenMP builds single-threaded matmuls
            proc = subprocess.run([cc, *FLAGS, *extra, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                                  text=True, timeout=120, check=False)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _toolchain() -> tuple[str | None, str]:
    """(the C compiler to build with, "") or (None, why the kernels are off)."""
    if os.environ.get("QPAGE_NATIVE", "1") == "0":
        return None, "disabled by QPAGE_NATIVE=0"
    cc = _compiler()
    return (cc, "") if cc is not None else (None, "no C compiler found (install gcc or set CC)")


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (the reason is logged once; see ``unavailable_reason``)."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    _tried = True
    cc, why = _toolchain()
    if cc is None:
        _why_not = why
    else:
        try:
            lib = ctypes.CDLL(str(_build(cc)))
            lib.qp_paged_decode_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr,
                                                _int, _int, _int, _int, _int, _float, _i64, _int, _i64, _float,
                                                _ptr]
            lib.qp_paged_decode_f32.restype = _int
            lib.qp_write_kv_f32.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64]
            lib.qp_write_kv_f32.restype = _int
            lib.qp_hadamard_f32.argtypes = [_ptr, _i64, _ptr, _int, _int, _int, _int]
            lib.qp_hadamard_f32.restype = _int
            lib.qp_rms_norm_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _int, _int, _float]
            lib.qp_rms_norm_f32.restype = None
            lib.qp_rms_norm_heads_f32.argtypes = [_ptr, _i64, _ptr, _int, _int, _int, _float]
            lib.qp_rms_norm_heads_f32.restype = None
            lib.qp_add_rms_norm_f32.argtypes = [_ptr, _ptr, _ptr, _int, _int, _float]
            lib.qp_add_rms_norm_f32.restype = None
            lib.qp_silu_mul_f32.argtypes = [_ptr, _i64, _ptr, _int, _int]
            lib.qp_silu_mul_f32.restype = None
            lib.qp_gelu_tanh_mul_f32.argtypes = [_ptr, _i64, _ptr, _int, _int]
            lib.qp_gelu_tanh_mul_f32.restype = None
            lib.qp_rope_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _int, _int, _int]
            lib.qp_rope_f32.restype = _int
            lib.qp_write_kv_fp8.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _float, _float, _ptr, _int,
                                            _int, _int, _i64, _ptr, _int, _ptr, _int]
            lib.qp_write_kv_fp8.restype = _int
            lib.qp_paged_decode_fp8.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _float, _float, _ptr, _int, _ptr,
                                                _i64, _i64, _ptr, _ptr, _int, _int, _int, _int, _int, _float, _i64,
                                                _int, _i64, _float, _ptr]
            lib.qp_paged_decode_fp8.restype = _int
            lib.qp_write_int.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _int, _int, _int, _i64, _int]
            lib.qp_write_int.restype = _int
            lib.qp_paged_decode_int.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _int, _int, _ptr, _i64, _i64,
                                                _ptr, _ptr, _int, _int, _int, _int, _int, _float, _i64, _int,
                                                _i64, _float, _ptr]
            lib.qp_paged_decode_int.restype = _int
            lib.qp_quantize_act.argtypes = [_ptr, _i64, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            lib.qp_quantize_act.restype = None
            lib.qp_gguf_repack.argtypes = [_int, _ptr, _i64, _int, _ptr, _i64, _int]
            lib.qp_gguf_repack.restype = _int
            lib.qp_gguf_matmul.argtypes = [_int, _ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr,
                                           _i64, _int, _int]
            lib.qp_gguf_matmul.restype = _int
            lib.qp_gguf_act_residual.argtypes = [_int]
            lib.qp_gguf_act_residual.restype = _int
            lib.qp_gguf_dequant_rows.argtypes = [_int, _ptr, _i64, _int, _ptr, _i64, _ptr]
            lib.qp_gguf_dequant_rows.restype = _int
            lib.qp_gguf_block_type.argtypes = [_int, _ptr]
            lib.qp_gguf_block_type.restype = _int
            lib.qp_gguf_isa_supported.argtypes = [_int]
            lib.qp_gguf_isa_supported.restype = _int
            lib.qp_gguf_best_isa.argtypes = []
            lib.qp_gguf_best_isa.restype = _int
            lib.qp_dense_pack.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr]
            lib.qp_dense_pack.restype = None
            lib.qp_dense_matmul.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _int]
            lib.qp_dense_matmul.restype = None
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why_not = f"building the C kernels in {CSRC} failed: {e}"
    if _lib is None:
        level = logging.INFO if _why_not.startswith("disabled") else logging.WARNING
        logger.log(level, "native CPU kernels unavailable (%s); using the slower torch/NumPy path", _why_not)
    return _lib


def no_compiler_or_disabled() -> bool:
    """True when the kernels are off by choice (``QPAGE_NATIVE=0``) or for want of a compiler,
    False when they loaded or a compiler failed to build them."""
    return load() is None and (_why_not.startswith("disabled") or _why_not.startswith("no C compiler"))


def build_status() -> str:
    """One line on the C kernels without building them: loaded, built, to be built, or why not."""
    if _lib is not None:
        return "loaded"
    if _tried:
        return f"unavailable: {_why_not}"
    cc, why = _toolchain()
    if cc is None:
        return f"unavailable: {why}"
    try:
        built = _library_path(cc).is_file()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {cc} --version failed ({e})"
    return f"built with {cc}" if built else f"built with {cc} on first use (a few seconds, then cached)"


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None, or None when the kernels are loaded."""
    return None if load() is not None else (_why_not or "not loaded")


def sink_pointer(sinks: torch.Tensor | None, heads: int) -> int | None:
    """The address of attention sinks for a decode kernel: fp32 [heads] contiguous on the CPU, or
    None (no sinks)."""
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,) or not sinks.is_contiguous():
        raise ValueError(f"attention sinks must be contiguous fp32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    return sinks.data_ptr()


def check_decode(rc: int, name: str, num_blocks: int) -> None:
    """Raise on a paged decode kernel's error code (-2: bad lengths or block ids; else no memory)."""
    if rc == -2:
        raise ValueError(f"{name}: a seq_len < 1 or a block id outside [0, {num_blocks}) in the block table")
    if rc != 0:
        raise MemoryError(f"{name}: could not allocate the score scratch")


def num_threads() -> int:
    """The cores this process may run on (the matmuls split their rows across them, attention
    a prompt chunk's rows). Passed to each call: the OpenMP runtime is torch's, whose thread
    count is set to 1 for torch's own ops on this path (``layers.ops``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def as_i64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous int64 (itself when it already is: no copy on the hot path)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
