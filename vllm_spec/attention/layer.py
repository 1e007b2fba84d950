"""The attention layer: writes new K/V into its paged cache, then attends over it."""

from __future__ import annotations

import torch
from torch import nn

from vllm_spec.attention import torch_backend
from vllm_spec.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention for one decoder layer. The worker binds `k_cache`/`v_cache` after allocating them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = torch_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]."""
        self.backend.write_kv_cache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, md, self.scale, self.sliding_window)
