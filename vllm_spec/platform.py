"""Where the engine runs and in which dtype: device and dtype resolution, the CPU's native types."""

from __future__ import annotations

import functools

import torch

_DTYPES = {
    "half": torch.float16, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float": torch.float32, "float32": torch.float32, "fp32": torch.float32,
}


def import_triton():
    """(triton, triton.language) where a CUDA device can run their kernels, else (None, None): on a
    CPU-only machine importing triton gains nothing, and some triton builds report leaked bindings at
    every interpreter exit there."""
    if not torch.cuda.is_available():
        return None, None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None, None
    return triton, tl


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of 'auto', 'cpu', 'cuda', got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available.")
    return torch.device(device)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (none where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), where bf16 beats float32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (exactness first) and the checkpoint's half type, else bfloat16, on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(str(checkpoint_dtype), torch.bfloat16) if checkpoint_dtype in ("float16", "bfloat16") \
            else torch.bfloat16
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}.")
    return _DTYPES[dtype]
