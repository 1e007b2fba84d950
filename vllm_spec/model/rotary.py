"""Rotary position embeddings (rotate-half layout) with Llama-3, linear, dynamic-NTK, YaRN and LongRoPE scaling."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The kind of a config's rope_scaling (transformers' newer "rope_type" key, or its older "type")."""
    return scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def _yarn(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it: frequencies between the original and the
    interpolated ones along a ramp over the dimensions, and an attention factor on cos/sin."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv, float(attention)


def _longrope(pos_freqs: torch.Tensor, scaling: dict[str, Any], max_model_len: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its own factor, from the long set where the engine's context
    (max_model_len) passes the original one, else the short set, fixed for the whole run as vLLM does
    (transformers switches with each sequence's length, which would invalidate the keys already cached); cos/sin
    scaled by sqrt(1 + ln factor / ln original) unless the config gives the attention factor."""
    original = scaling["original_max_position_embeddings"]
    long = max_model_len > original
    if long:
        logger.warning("LongRoPE: max_model_len %d passes the original context %d, so every position rotates with the "
                       "long factors (shorter sequences may lose some quality); max_model_len <= %d keeps the short "
                       "ones.", max_model_len, original, original)
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling["factor"]
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return 1.0 / (factors * pos_freqs), float(attention)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
              max_model_len: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies, and the factor cos/sin are scaled by (YaRN's and LongRoPE's attention factor,
    else 1)."""
    if rope_type(scaling) == "dynamic":
        # As vLLM: NTK-aware scaling fixed at the longest context, L = max_position_embeddings x factor
        # (base x (factor L / max_position_embeddings - (factor - 1)) ^ (d / (d - 2))), where transformers'
        # dynamic version arrives too; below it transformers keeps the original base.
        factor = scaling["factor"]
        theta = theta * (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))
        scaling = None
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / pos_freqs
    if not scaling:
        return inv, 1.0
    kind = rope_type(scaling)
    if kind == "yarn":
        return _yarn(pos_freqs, head_dim, theta, scaling)
    if kind == "longrope":
        return _longrope(pos_freqs, scaling, max_model_len)
    if kind == "linear":
        return inv / scaling["factor"], 1.0
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
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "default":
        return inv, 1.0
    raise ValueError(f"Unsupported rope_scaling type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}.")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotary_dim: how many leading dimensions of a head
    rotate; max_model_len: the engine's context, which picks LongRoPE's factors)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 max_model_len: int):
        super().__init__()
        inv, attention = _inv_freq(rotary_dim, theta, scaling, max_model_len)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attention, persistent=False)
        self.register_buffer("sin", emb.sin() * attention, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D] tables for a batch's positions, looked up once per forward and shared by all layers."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
