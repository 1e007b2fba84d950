"""The attention layer: writes new K/V into its paged cache, then attends over it."""

from __future__ import annotations

import torch
from torch import nn

from vllm_spec import cpu_ops
from vllm_spec.attention import cpu_backend, torch_backend
from vllm_spec.attention.metadata import AttentionMetadata

_triton_backend = None   # the module once imported, False if triton is unusable here


def triton_backend_or_none():
    """The Triton backend module, or None where triton does not import (CPU-only installs)."""
    global _triton_backend
    if _triton_backend is None:
        try:
            from vllm_spec.attention import triton_backend
            _triton_backend = triton_backend
        except ImportError:
            _triton_backend = False
    return _triton_backend or None


# float32 tiles of heads wider than this (padded to 256) need more shared memory than an H100/H200 has.
_MAX_FP32_TRITON_HEAD = 128


def select_backend(device: torch.device, head_dim: int, dtype: torch.dtype):
    """Triton kernels for CUDA tensors when triton imports; on the CPU the C++ kernel where it is built;
    the torch reference else."""
    if device.type == "cuda" and not (dtype == torch.float32 and head_dim > _MAX_FP32_TRITON_HEAD):
        return triton_backend_or_none() or torch_backend
    if device.type == "cpu" and dtype in cpu_ops.DTYPES and cpu_ops.available():
        return cpu_backend
    return torch_backend


class Attention(nn.Module):
    """Paged attention for one decoder layer. The worker binds `k_cache`/`v_cache` after allocating them.

    `backend` is None (choose per call from the query's device: `select_backend`) or a module with
    `write_kv_cache`/`paged_attention` to force one, e.g. `torch_backend` to run the oracle on a GPU.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap   # Gemma 2's: scores become softcap * tanh(scores / softcap)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = None

    def backend_for(self, q: torch.Tensor):
        return self.backend if self.backend is not None else select_backend(q.device, self.head_dim, q.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]."""
        backend = self.backend_for(q)
        backend.write_kv_cache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        return backend.paged_attention(q, self.k_cache, self.v_cache, md, self.scale, self.sliding_window,
                                      self.softcap)
