"""Rotary position embeddings (rotate-half layout) with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The kind of a config's rope_scaling (transformers' newer "rope_type" key, or its older "type")."""
    return scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = rope_type(scaling)
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "default":
        return inv
    raise ValueError(f"Unsupported rope_scaling type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}.")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D] tables for a batch's positions, looked up once per forward and shared by all layers."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
