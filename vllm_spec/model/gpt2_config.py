"""GPT-2's options (and GPT-BigCode's), read from its HF config (n_embd, n_head, ...) as transformers' GPT2Config
(GPTBigCodeConfig) reads them."""

from __future__ import annotations

from typing import Any

from vllm_spec.model.opt_config import OptConfig
from vllm_spec.utils import FLOAT32_MAX, check_int, is_number

# GPT-2's config keys -> the Llama-family keys they stand for. The first four are transformers' attribute_map: a
# config may spell them either way (the Llama-family spelling wins); the others only GPT-2's way.
GPT2_KEYS = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
             "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
             "activation_function": "hidden_act", "layer_norm_epsilon": "rms_norm_eps"}
_ALIASED = ("n_embd", "n_head", "n_layer", "n_positions")
# transformers' GPT2Config values for keys a config.json leaves out.
_DEFAULTS = dict(n_positions=1024, activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                 bos_token_id=50256, eos_token_id=50256)


def read_gpt2(cfg: dict[str, Any], bigcode: bool = False) -> tuple[dict[str, Any], OptConfig]:
    """(the config as the Llama-family keys GPT-2's map to, its OptConfig): GPT-2 is OPT's pre-norm layout with
    positions from table row 0, every projection biased, n_inner (null: 4 x n_embd) as the MLP's width; attention
    scores scaled by head_dim ** -0.5 where scale_attn_weights (else 1), and by 1 / (layer + 1) more where
    scale_attn_by_inverse_layer_idx. bigcode: GPT-BigCode's config (StarCoder's): GPT-2's keys, its tanh GELU by
    default, one KV head where multi_query (the default), no per-layer scaling."""
    for key in ("scale_attn_weights", "add_cross_attention",
                "multi_query" if bigcode else "scale_attn_by_inverse_layer_idx"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"{key} must be true or false, got {cfg[key]!r}.")
    if cfg.get("add_cross_attention"):
        raise ValueError("add_cross_attention is not supported: it must be false (a decoder without an encoder).")
    cfg = dict(cfg)
    for theirs, ours in GPT2_KEYS.items():
        if theirs in _ALIASED and ours in cfg:
            cfg[theirs] = cfg[ours]
    cfg = {**_DEFAULTS, **({"activation_function": "gelu_pytorch_tanh"} if bigcode else {}), **cfg}
    for key in ("n_embd", "n_head", "n_layer"):
        if key not in cfg:
            raise ValueError(f"The model config (config.json) has no {key!r}: it is required.")
    for key in ("n_embd", "n_head", "n_layer", "n_positions", "n_inner"):
        check_int(key, cfg.get(key), 1, optional=key == "n_inner")
    cfg |= {ours: cfg.get(theirs) for theirs, ours in GPT2_KEYS.items()}
    eps = cfg["layer_norm_epsilon"]
    if not (is_number(eps) and 0 <= eps <= FLOAT32_MAX):
        raise ValueError(f"layer_norm_epsilon must be a finite number >= 0, got {eps!r}.")
    hidden = cfg["hidden_size"]
    if cfg["intermediate_size"] is None:
        cfg["intermediate_size"] = 4 * hidden
    kv_heads = 1 if bigcode and cfg.get("multi_query", True) else cfg.get("num_attention_heads")
    return ({**cfg, "num_key_value_heads": kv_heads, "head_dim": None, "attention_bias": True,
             "mlp_bias": True, "rope_theta": None, "rope_scaling": None, "rope_parameters": None},
            OptConfig(word_embed_proj_dim=hidden, position_offset=0,
                      unscaled_attention=not cfg.get("scale_attn_weights", True),
                      scale_by_inverse_layer=not bigcode and cfg.get("scale_attn_by_inverse_layer_idx", False)))
