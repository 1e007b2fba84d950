"""GPT-NeoX's options (Pythia, StableLM-alpha, Dolly v2) and Phi's, read from their HF configs as transformers'
GPTNeoXConfig and PhiConfig read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_spec.utils import FLOAT32_MAX, is_float32_scale, is_number

# transformers' PhiConfig values for keys a config.json leaves out.
_PHI_DEFAULTS = dict(hidden_act="gelu_new", layer_norm_eps=1e-5, max_position_embeddings=2048,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# transformers' GPTNeoXConfig values for keys a config.json leaves out.
_DEFAULTS = dict(hidden_act="gelu", layer_norm_eps=1e-5, max_position_embeddings=2048, attention_bias=True,
                 use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)


@dataclass(frozen=True)
class NeoxConfig:
    """What GPT-NeoX has that Llama-family decoders do not: LayerNorms with biases, an un-gated MLP with biases,
    q/k/v fused per head in the checkpoint, and (use_parallel_residual) the attention and the MLP both reading the
    layer's input, their outputs added to it together."""

    use_parallel_residual: bool = True


def read_gpt_neox(cfg: dict[str, Any]) -> tuple[dict[str, Any], NeoxConfig]:
    """(the config as the Llama-family keys GPT-NeoX's map to, NeoxConfig): layer_norm_eps is the norms' eps,
    attention_bias biases the q/k/v and output projections (the MLP's always), every head is a KV head; the rotary
    settings as transformers standardizes them: rope_parameters (or a legacy rope_scaling in its place), its
    rope_theta from rotary_emb_base and partial_rotary_factor from rotary_pct (0.25) where it has none."""
    for key in ("use_parallel_residual", "attention_bias"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"{key} must be true or false, got {cfg[key]!r}.")
    checks = (("layer_norm_eps", lambda v: is_number(v) and 0 <= v <= FLOAT32_MAX, "a finite number >= 0"),
              ("rotary_emb_base", is_float32_scale, "a positive number"),
              ("rotary_pct", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"))
    for key, ok, allowed in checks:
        if key in cfg and not ok(cfg[key]):
            raise ValueError(f"{key} must be {allowed}, got {cfg[key]!r}.")
    cfg = {**_DEFAULTS, **cfg}
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"{key} must be an object (dict) or null, got {cfg[key]!r}.")
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    params = {"rope_theta": cfg.get("rotary_emb_base", 10000.0), "partial_rotary_factor": cfg.get("rotary_pct", 0.25),
              **params}
    llama = {**cfg, "rope_parameters": params, "rope_scaling": None, "rms_norm_eps": cfg["layer_norm_eps"],
             "num_key_value_heads": cfg.get("num_attention_heads"), "head_dim": None, "mlp_bias": True}
    return llama, NeoxConfig(use_parallel_residual=cfg["use_parallel_residual"])


def read_phi(cfg: dict[str, Any]) -> tuple[dict[str, Any], NeoxConfig]:
    """(the config as the Llama-family keys Phi's map to, NeoxConfig): layer_norm_eps is the norms' eps, every
    projection is biased, a head rotates its leading half unless partial_rotary_factor (at the top level or in
    rope_parameters) says otherwise; the attention and the MLP run in parallel on one norm's output."""
    if not isinstance(cfg.get("qk_layernorm", False), bool):
        raise ValueError(f"qk_layernorm must be true or false, got {cfg['qk_layernorm']!r}.")
    eps = cfg.get("layer_norm_eps", _PHI_DEFAULTS["layer_norm_eps"])
    if not (is_number(eps) and 0 <= eps <= FLOAT32_MAX):
        raise ValueError(f"layer_norm_eps must be a finite number >= 0, got {eps!r}.")
    cfg = {**_PHI_DEFAULTS, **cfg}
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if "partial_rotary_factor" not in (params if isinstance(params, dict) else {}) \
            and cfg.get("partial_rotary_factor") is None:   # (absent or null: transformers' 0.5)
        cfg["partial_rotary_factor"] = 0.5
    return ({**cfg, "rms_norm_eps": eps, "attention_bias": True, "mlp_bias": True},
            NeoxConfig(use_parallel_residual=True))
