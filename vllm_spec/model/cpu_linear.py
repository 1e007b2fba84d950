"""float32 x W^T on x86-64 CPUs by the AVX2/FMA kernel in csrc/cpu/rows_linear.cpp, built on first use.

Decoding reads every weight once per step for a few rows of activations. oneDNN (even with its packed
weights) did not overlap those reads with the arithmetic: on a 2-core AMD EPYC a (k+1)-row verification
cost 11-46% more than a 1-row step. This kernel reads each weight row once for all rows and prefetches
ahead; it runs 1-row steps faster than oneDNN too, and stays on par up to prefill sizes, so on such CPUs
it serves every float32 linear layer and the weights stay in their plain layout (no packed copy).

It also sums each output element in the same order whatever the number of rows: a token's logits in a
(k+1)-token verification are bit-for-bit those of a 1-token step.

The kernel is compiled with torch.utils.cpp_extension (a C++ compiler and ninja) into torch's extension
cache the first time a process needs it (about 30 s, once per machine). Where that is not possible (no
compiler, not x86-64 with AVX2, the source not shipped, or VLLM_SPEC_CPU_KERNELS=0) `available()` is
False and linear layers use oneDNN / torch as before.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "rows_linear.cpp"
ENV_SWITCH = "VLLM_SPEC_CPU_KERNELS"


def handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) runs on the kernel (float32 CPU tensors, a plain 2-D weight)."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and not weight.is_mkldnn
            and weight.is_contiguous() and x.shape[-1] == weight.shape[1] and available())


def available() -> bool:
    """The kernel is built (or was built before) and this CPU runs it."""
    return _module() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for x [..., K], W [N, K]; only where handles(x, weight)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = _module().rows_linear(rows, weight)
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], weight.shape[0])


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
    try:
        from torch.utils.cpp_extension import load

        return load("vllm_spec_rows_linear", [str(SOURCE)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means the fallback
        logger.warning("CPU linear kernel not built (%s: %s); using torch's linear. Set %s=0 to skip the "
                       "attempt.", type(e).__name__, str(e).strip().splitlines()[-1:] or "", ENV_SWITCH)
        return None
