"""x W^T on x86-64 CPUs by the AVX2/FMA kernel in csrc/cpu/rows_linear.cpp, built on first use: float32,
and bfloat16 on CPUs without bf16 arithmetic (weights widened in registers, sums in float32, the result
rounded once, as torch's), where torch's own bf16 matmul was 6x slower than float32 at 16 rows.

A float32 model's weights that bfloat16 or float16 holds exactly (a half-precision checkpoint run in
float32, as most HF checkpoints and the shipped draft are) are stored in that type (`narrowed`): the
kernel widens them exactly, so the products are bit-for-bit the float32 ones, from half the bytes.

Decoding reads every weight once per step for a few rows of activations. oneDNN (even with its packed
weights) did not overlap those reads with the arithmetic: on a 2-core AMD EPYC a (k+1)-row verification
cost 11-46% more than a 1-row step. This kernel reads each weight row once for all rows and prefetches
ahead; it runs 1-row steps faster than oneDNN too, and stays on par up to prefill sizes, so on such CPUs
it serves every float32 linear layer and the weights stay in their plain layout (no blocked copy).

It also sums each output element in the same order whatever the number of rows: a token's logits in a
(k+1)-token verification are bit-for-bit those of a 1-token step.

The kernel is compiled with torch.utils.cpp_extension (a C++ compiler and ninja) into torch's extension
directory ($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions; one folder per source, flags, torch and
Python version) the first time a process needs it (about 30 s, once per machine). Where that is not possible (no compiler, not x86-64 with AVX2, no csrc/
folder beside the package as in a wheel install, or VLLM_SPEC_CPU_KERNELS=0) `available()` is False and
linear layers use oneDNN / torch as before.
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

from vllm_spec.platform import cpu_flags, cpu_has_native_bf16

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "rows_linear.cpp"
ENV_SWITCH = "VLLM_SPEC_CPU_KERNELS"
# (-ffp-contract=off: the k tail's products and adds stay as written in every instantiation, one order of
# rounding for every row count.)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
# A build lock older than this was left by a build that died (torch's lock would wait for it forever).
STALE_LOCK_S = 600.0


def handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) runs on the kernel: CPU rows of the weight's dtype (or float32 rows and a
    `narrowed` weight), a weight it takes."""
    if (x.device.type != "cpu" or x.shape[-1] != weight.shape[-1]
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):   # (no backward)
        return False
    if x.dtype == weight.dtype:
        return keeps_plain(weight)
    return x.dtype == torch.float32 and weight.dtype in narrow_dtypes() and _plain(weight)


def keeps_plain(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight as it is (a plain, contiguous 2-D CPU weight of a dtype it
    serves here), so it is best left in that layout."""
    # (The device and a dtype it could take first: other models' weights must not build the kernel.)
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and _plain(weight)
            and weight.dtype in dtypes())


def narrowed(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight the kernel takes, as a bfloat16 or float16 copy where that type holds every element
    exactly (products bit-for-bit the float32 ones, half the bytes read); else the weight itself."""
    if weight.dtype != torch.float32 or not keeps_plain(weight):
        return weight
    for dtype in (torch.bfloat16, torch.float16):   # bfloat16 first: the cheaper widening
        if dtype not in narrow_dtypes():
            continue
        copy = weight.detach().to(dtype)
        if torch.equal(copy.to(torch.float32), weight):
            return copy
    return weight


def _plain(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and not weight.is_mkldnn and weight.dim() == 2 and weight.is_contiguous()


def available() -> bool:
    """The kernel is built (or was built before) and this CPU runs it."""
    return _module() is not None


@functools.cache
def dtypes() -> frozenset[torch.dtype]:
    """The dtypes the kernel serves here: none without it; bfloat16 only where the CPU has no bf16
    arithmetic (with it, oneDNN's packed bf16 path is the faster one)."""
    if not available():
        return frozenset()
    return frozenset({torch.float32} if cpu_has_native_bf16() else {torch.float32, torch.bfloat16})


@functools.cache
def narrow_dtypes() -> frozenset[torch.dtype]:
    """The half types a float32 model's exact weights may be stored in here (float16 needs F16C)."""
    if not available():
        return frozenset()
    return frozenset({torch.bfloat16, torch.float16} if "f16c" in cpu_flags() else {torch.bfloat16})


def kernel() -> ModuleType:
    """The built extension: rows_linear(x [M, K] float32, w [N, K] float32, bfloat16 or float16) -> [M, N]
    float32."""
    module = _module()
    if module is None:
        raise RuntimeError("the CPU linear kernel is not available here")
    return module


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for x [..., K], W [N, K]; only where handles(x, weight)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    y = kernel().rows_linear(rows, weight)
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


@functools.cache
def _module() -> ModuleType | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or \
            torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None   # (torch's AVX2 level implies FMA)
    if not SOURCE.is_file():
        logger.debug("CPU linear kernel: no source at %s (an installed wheel): torch's linear", SOURCE)
        return None
    stamp = f"{' '.join(FLAGS)} {torch.__version__} {sys.version_info[:2]}".encode()
    version = hashlib.sha256(SOURCE.read_bytes() + stamp).hexdigest()[:12]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    build = root / f"vllm_spec_rows_linear_{version}"
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        if not any(build.glob("*.so")):
            logger.info("building the CPU linear kernel (once, about 30 s) in %s", build)
        return load(f"vllm_spec_rows_linear_{version}", [str(SOURCE)], extra_cflags=FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means the fallback
        lines = str(e).strip().splitlines()
        reason = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
        logger.warning("CPU linear kernel not built (%s: %s); using torch's linear (%s=0 skips the attempt).",
                       type(e).__name__, reason, ENV_SWITCH)
        logger.debug("CPU linear kernel build failure", exc_info=True)
        return None
