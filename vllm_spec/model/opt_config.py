"""OPT's options, read from its HF config as transformers' OPTConfig reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_spec.utils import check_int

# transformers' OPTConfig values for keys a config.json leaves out.
_DEFAULTS = dict(ffn_dim=3072, max_position_embeddings=2048, activation_function="relu", enable_bias=True,
                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=2)


@dataclass(frozen=True)
class OptConfig:
    """What OPT (and GPT-2, its layout) has that Llama-family decoders do not: learned absolute positions,
    LayerNorm with biases, one un-gated MLP (fc1, activation, fc2), embeddings of word_embed_proj_dim projected
    in and out of the hidden size (OPT-350m), and norms after each block rather than before
    (do_layer_norm_before false, OPT-350m: then without a final norm)."""

    word_embed_proj_dim: int
    do_layer_norm_before: bool = True
    final_layer_norm: bool = True   # (do_layer_norm_before and not _remove_final_layer_norm)
    layer_norm_affine: bool = True  # layer_norm_elementwise_affine: the norms' weights and biases
    position_offset: int = 2        # the position table's row of position 0 (GPT-2's: 0)
    unscaled_attention: bool = False     # GPT-2's scale_attn_weights false: scores not scaled by head_dim ** -0.5
    scale_by_inverse_layer: bool = False  # GPT-2's scale_attn_by_inverse_layer_idx: scores / (layer + 1) more


def read_opt(cfg: dict[str, Any]) -> tuple[dict[str, Any], OptConfig]:
    """(the config as the Llama-family keys OPT's map to, OptConfig): ffn_dim is the intermediate size,
    enable_bias biases every projection, every head is a KV head, no rotary settings count; the norms' eps is
    nn.LayerNorm's 1e-5."""
    for key in ("do_layer_norm_before", "_remove_final_layer_norm", "layer_norm_elementwise_affine", "enable_bias"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"{key} must be true or false, got {cfg[key]!r}.")
    cfg = {**_DEFAULTS, **cfg}
    check_int("ffn_dim", cfg["ffn_dim"], 1)
    proj = cfg.get("word_embed_proj_dim")
    check_int("word_embed_proj_dim", proj, 1, optional=True)
    proj = cfg.get("hidden_size") if proj is None else proj   # (a missing hidden_size is named later)
    before = cfg.get("do_layer_norm_before", True)
    opt = OptConfig(word_embed_proj_dim=proj, do_layer_norm_before=before,
                    final_layer_norm=before and not cfg.get("_remove_final_layer_norm", False),
                    layer_norm_affine=cfg.get("layer_norm_elementwise_affine", True))
    llama = {**cfg, "intermediate_size": cfg["ffn_dim"], "num_key_value_heads": cfg.get("num_attention_heads"),
             "head_dim": None, "rms_norm_eps": 1e-5,
             "attention_bias": cfg["enable_bias"], "mlp_bias": cfg["enable_bias"],
             # (learned positions: transformers' OPT reads no rotary settings, and neither may max_model_len)
             "rope_theta": None, "rope_scaling": None, "rope_parameters": None}
    return llama, opt
