"""A config's rotary embedding settings, read as transformers reads them for each architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_spec.model.rotary import SUPPORTED_ROPE_TYPES, rope_type
from vllm_spec.utils import check_int, is_float32_scale, is_number

# transformers' rope_theta where a config has none (Gemma 3's: read_rope; the others' 10000).
_DEFAULT_THETA = {"MixtralForCausalLM": 1000000.0, "SmolLM3ForCausalLM": 2000000.0}
# The architectures that rotate partially in transformers (the others ignore partial_rotary_factor).
_PARTIAL_ROTARY = ("Phi3ForCausalLM", "GPTNeoXForCausalLM", "PhiForCausalLM")
# Phi-3's config always has an original context (transformers' Phi3Config field): this where the key is absent.
_PHI3_ORIGINAL_CONTEXT = 4096


@dataclass(frozen=True)
class RopeSettings:
    """The base, the scaling (None: plain rotation), the rotated dims of a head (None: all of them) and Gemma 3's
    windowed layers' own base (None: they rotate as the others)."""

    theta: float
    scaling: dict[str, Any] | None
    rotary_dim: int | None
    local_theta: float | None


def read_rope(cfg: dict[str, Any], arch: str, head_dim: int, max_positions: int) -> RopeSettings:
    """From rope_parameters (transformers >= 5) or a legacy rope_scaling object, which transformers takes in its
    place, rope_theta included; each scaling type checked and completed with transformers' defaults."""
    rope_scaling = cfg.get("rope_scaling")
    rope_params = cfg.get("rope_parameters")
    for key, value in (("rope_scaling", rope_scaling), ("rope_parameters", rope_params)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{key} must be an object (dict) or null, got {value!r}.")
    theta = cfg.get("rope_theta", _DEFAULT_THETA.get(arch))
    local_theta = None
    params = rope_scaling or rope_params
    if arch == "Gemma3ForCausalLM":
        params, local_theta = _gemma_rope(cfg, params)
        theta = theta if theta is not None else 1000000.0
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
    scaling = params
    rotary_dim = _rotary_dim(cfg, params, head_dim) if arch in _PARTIAL_ROTARY else None
    kind = rope_type(scaling)
    if arch == "Phi3ForCausalLM" and kind in ("su", "yarn"):   # (transformers' Phi-3 names for LongRoPE)
        kind, scaling = "longrope", {**scaling, "rope_type": "longrope"}
    if kind == "default":
        scaling = None
    elif kind == "yarn":   # (transformers' defaults, from the model's context length)
        original = scaling.get("original_max_position_embeddings")
        scaling = {**scaling, "original_max_position_embeddings": max_positions if original is None else original}
        check_int("original_max_position_embeddings", scaling["original_max_position_embeddings"], 1)
        if scaling.get("factor") is None:
            scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    elif kind == "longrope":
        scaling = _longrope(cfg, scaling, arch, max_positions, rotary_dim or head_dim)
    if kind in SUPPORTED_ROPE_TYPES and kind != "default":
        factor = scaling.get("factor")
        if not (is_number(factor) and factor > 0):
            raise ValueError(f"rope_scaling of type {kind!r} needs a positive number 'factor', got {scaling!r}.")
    theta = 10000.0 if theta is None else theta
    if not is_float32_scale(theta):
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}.")
    return RopeSettings(float(theta), scaling, rotary_dim, local_theta)


def _gemma_rope(cfg: dict[str, Any], params: Any) -> tuple[Any, float]:
    """Gemma 3's rotary settings: (those of the global layers, in the usual rope_parameters / rope_scaling
    layout, and the windowed layers' base): per layer type (transformers >= 5), or rope_theta with
    rope_local_base_freq. The windowed layers' rotation is never scaled."""
    if isinstance(params, dict) and "full_attention" in params:
        for key in ("full_attention", "sliding_attention"):
            if not isinstance(params.get(key) or {}, dict):
                raise ValueError(f"rope_parameters[{key!r}] must be an object (dict) or null, got {params[key]!r}.")
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters['sliding_attention'] must be of rope_type 'default', got {local!r}.")
        return params["full_attention"], float(local.get("rope_theta", 10000.0))
    return params, float(cfg.get("rope_local_base_freq", 10000.0))


def _rotary_dim(cfg: dict[str, Any], rope_params: Any, head_dim: int) -> int | None:
    """The rotated dimensions (Phi's, Phi-3's, GPT-NeoX's), head_dim x partial_rotary_factor (in rope_parameters or at
    the top level, as transformers reads it); None where that is the whole head."""
    factor = (rope_params or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = 1.0 if factor is None else factor
    if not (is_number(factor) and 0 < factor <= 1):
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}.")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor ({factor!r}) x head_dim ({head_dim}) must give an even number of "
                         f"rotated dimensions >= 2, got {dim}.")
    return None if dim == head_dim else dim


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any], arch: str, max_positions: int,
              rotary_dim: int) -> dict[str, Any]:
    """LongRoPE's settings checked and completed as transformers does: the original context from the config's top
    level first (Phi-3's config always has one: 4096 where the key is absent; others then take rope_scaling's, else
    max_position_embeddings), factor from the two contexts where absent."""
    original = cfg.get("original_max_position_embeddings", _PHI3_ORIGINAL_CONTEXT if arch == "Phi3ForCausalLM"
                       else scaling.get("original_max_position_embeddings", max_positions))
    check_int("original_max_position_embeddings", original, 2)
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not (isinstance(factors, list) and len(factors) == rotary_dim // 2
                and all(is_float32_scale(f) for f in factors)):
            raise ValueError(f"rope_scaling of type 'longrope' needs {key!r}: a list of {rotary_dim // 2} positive "
                             f"numbers (one per rotated frequency), got {factors!r}.")
    attention = scaling.get("attention_factor")
    if not (attention is None or is_float32_scale(attention)):
        raise ValueError(f"rope_scaling's attention_factor must be a positive number or null, got {attention!r}.")
    factor = scaling.get("factor")
    return {**scaling, "original_max_position_embeddings": original,
            "factor": max_positions / original if factor is None else factor}
