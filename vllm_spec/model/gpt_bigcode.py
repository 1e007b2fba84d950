"""GPT-BigCode (StarCoder, SantaCoder, tiny_starcoder): GPT-2's layout and names with linear weights and, where
multi_query, one KV head."""

from __future__ import annotations

import torch

from vllm_spec.model.causal_lm import per_head_qkv
from vllm_spec.model.gpt2 import GPT2LMHeadModel


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPT-BigCode decoder + LM head (see CausalLM)."""

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
        """c_attn (an nn.Linear: no transpose) cut into q | k | v: multi-query, the query heads' rows then one key
        head's and one value head's; else each head's q, k and v together."""
        if ".qkv_proj." not in name:
            return [(None, tensor)]
        cfg = self.config
        if cfg.num_key_value_heads == cfg.num_attention_heads:
            return per_head_qkv(tensor, cfg.num_attention_heads, cfg.head_dim)
        rows = [cfg.num_attention_heads * cfg.head_dim, cfg.head_dim, cfg.head_dim]
        if tensor.dim() == 0 or tensor.shape[0] != sum(rows):
            raise ValueError(f"shape {tuple(tensor.shape)}: a multi-query c_attn of {sum(rows)} rows "
                             f"({' + '.join(map(str, rows))}) was expected.")
        return list(zip("qkv", tensor.split(rows)))
