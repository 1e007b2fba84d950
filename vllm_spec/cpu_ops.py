"""The CPU extension: csrc/cpu/*.cpp (x86-64, AVX2/FMA; AVX-512F/VL where the CPU has them) built on first
use, for the CPU path's matmuls (vllm_spec.model.cpu_linear) and its paged attention
(vllm_spec.attention.cpu_backend).

It is compiled with torch.utils.cpp_extension (a C++ compiler and ninja) into torch's extension directory
($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions; one folder per sources and their place, flags, torch
and Python version) the first time a process needs it (about 40 s, once per checkout). Where that is not possible
(no compiler, not x86-64 with AVX2, no csrc/ folder beside the package as in a wheel install, or
VLLM_SPEC_CPU_KERNELS=0) `available()` is False and the callers use torch's ops as before.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from vllm_spec.platform import cpu_flags

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cpu"
ENV_SWITCH = "VLLM_SPEC_CPU_KERNELS"
AVX512_SWITCH = "VLLM_SPEC_CPU_AVX512"
# (-ffp-contract=off: the sums' scalar tails keep their products and adds as written in every
# instantiation, one order of rounding for every row count.)
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
# The element types of the ops' activations and caches (csrc/cpu: float32, and bfloat16 widened in registers).
DTYPES = (torch.float32, torch.bfloat16)
# A build lock older than this was left by a build that died (torch's lock would wait for it forever).
STALE_LOCK_S = 600.0


def available() -> bool:
    """The extension is built (or was built before) and this CPU runs it."""
    return _build() is not None


def module() -> ModuleType:
    """The built extension (its ops: csrc/cpu/module.cpp)."""
    built = _build()
    if built is None:
        raise RuntimeError("the CPU kernels are not available here")
    return built


def contiguous_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of dtype for the ops: t itself where it is one (a no-op .to() or
    .contiguous() costs more than these checks, and the CPU path makes a few hundred such calls a step)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def cache_clear() -> None:
    """Forget the build's outcome (tests that switch the environment)."""
    _build.cache_clear()


def build_flags() -> list[str]:
    """The compiler's flags: AVX2/FMA/F16C, plus AVX-512F/VL on a CPU that has both (csrc/cpu/rows_linear.cpp's
    16-lane sums and Q4_1 widening: the matmul's bits then differ from an AVX2 build's, each build's own
    order of sums for every row count) unless VLLM_SPEC_CPU_AVX512=0; with them AVX512-VNNI where the CPU
    has it (csrc/cpu/q8_int8.cpp's integer dot products: the same integers, and bits, as without)."""
    flags = cpu_flags()
    if not {"avx512f", "avx512vl"} <= flags or os.environ.get(AVX512_SWITCH, "1") == "0":
        return BASE_FLAGS
    return BASE_FLAGS + ["-mavx512f", "-mavx512vl"] + (["-mavx512vnni"] if "avx512_vnni" in flags else [])


def build_name(source_dir: Path) -> str:
    """The build's folder: one per sources (their content and where they are), flags, torch and Python.
    (The place counts: ninja's build file names the sources, so two checkouts of one version sharing a
    folder rebuilt it, about a minute, each time the other had loaded it.)"""
    stamp = f"{' '.join(build_flags())} {torch.__version__} {sys.version_info[:2]} {source_dir.resolve()}".encode()
    digest = hashlib.sha256(stamp)
    for path in [*sorted(source_dir.glob("*.cpp")), *sorted(source_dir.glob("*.h"))]:
        digest.update(path.name.encode() + path.read_bytes())
    return f"vllm_spec_cpu_{digest.hexdigest()[:12]}"


@functools.cache
def _build() -> ModuleType | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or \
            torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None   # (torch's AVX2 level implies FMA)
    sources = sorted(SOURCE_DIR.glob("*.cpp")) if (SOURCE_DIR / "module.cpp").is_file() else []
    if not sources:
        logger.debug("CPU kernels: no sources in %s (an installed wheel): torch's ops", SOURCE_DIR)
        return None
    name = build_name(SOURCE_DIR)
    build = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / name
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        if not any(build.glob("*.so")):
            logger.info("building the CPU kernels (once, about 40 s) in %s", build)
        return load(name, [str(s) for s in sources], extra_cflags=build_flags(), extra_ldflags=["-fopenmp"],
                    build_directory=str(build), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means the fallback
        lines = str(e).strip().splitlines()
        reason = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
        logger.warning("CPU kernels not built (%s: %s); using torch's ops (%s=0 skips the attempt).",
                       type(e).__name__, reason, ENV_SWITCH)
        logger.debug("CPU kernel build failure", exc_info=True)
        return None
