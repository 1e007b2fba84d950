"""A config's mixture-of-experts settings (Mixtral, Qwen2-MoE, Qwen3-MoE), read as transformers reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_spec.utils import check_int, is_int

# Each layout's checkpoint names: (the block's module, the gate / up / down tensors of an expert).
LAYOUTS = {"mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
           "qwen_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})}
# The keys a config may name its expert count by, the one transformers takes first where both are given (its
# Mixtral and Qwen3-MoE configs read either; Qwen2-MoE's num_experts alone).
_EXPERT_COUNT_KEYS = {"MixtralForCausalLM": ("num_experts", "num_local_experts"),
                      "Qwen3MoeForCausalLM": ("num_local_experts", "num_experts"),
                      "Qwen2MoeForCausalLM": ("num_experts",)}
# transformers' defaults of the Qwen MoE configs: (experts, top_k, expert size).
_QWEN_DEFAULTS = {"Qwen2MoeForCausalLM": (60, 4, 1408), "Qwen3MoeForCausalLM": (128, 8, 768)}


@dataclass(frozen=True)
class MoeConfig:
    """num_experts MLPs of `intermediate` each, top_k of them mixed per token by the router's softmax, in `layers`
    (the others keep a dense MLP of the model's intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate: int
    renormalize: bool               # the top-k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    weights_in_model_dtype: bool    # Qwen's MoEs round the weights to the model's dtype before mixing
    layers: tuple[int, ...]
    layout: str                     # a key of LAYOUTS
    # Qwen2-MoE's shared expert: a dense MLP of this size every token takes, scaled by sigmoid(its gate) (0: none).
    shared_intermediate: int = 0


def read_moe(cfg: dict[str, Any], arch: str, num_layers: int, intermediate: int) -> MoeConfig | None:
    """None for a dense model; transformers' defaults for the keys a config leaves out."""
    if arch not in _EXPERT_COUNT_KEYS:
        return None
    keys = _EXPERT_COUNT_KEYS[arch]
    key = next((k for k in keys if k in cfg), keys[-1])
    if arch == "MixtralForCausalLM":
        experts, top_k = cfg.get(key, 8), cfg.get("num_experts_per_tok", 2)
        _check_counts(key, experts, top_k)
        return MoeConfig(experts, top_k, intermediate, True, False, tuple(range(num_layers)), "mixtral")
    experts, top_k, size = _QWEN_DEFAULTS[arch]
    experts, top_k = cfg.get(key, experts), cfg.get("num_experts_per_tok", top_k)
    _check_counts(key, experts, top_k)
    size, step = cfg.get("moe_intermediate_size", size), cfg.get("decoder_sparse_step", 1)
    check_int("moe_intermediate_size", size, 1)
    check_int("decoder_sparse_step", step, 1)
    dense = cfg.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(is_int(i) for i in dense)):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {dense!r}.")
    renormalize = cfg.get("norm_topk_prob", False)
    if not isinstance(renormalize, bool):
        raise ValueError(f"norm_topk_prob must be true or false, got {renormalize!r}.")
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = cfg.get("shared_expert_intermediate_size", 5632)
        check_int("shared_expert_intermediate_size", shared, 1)
    return MoeConfig(experts, top_k, size, renormalize, True, layers, "qwen_moe", shared)


def _check_counts(key: str, experts: Any, top_k: Any) -> None:
    check_int(key, experts, 1)
    check_int("num_experts_per_tok", top_k, 1)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be <= {key} ({experts}).")
