"""Phi (phi-1, phi-1.5, phi-2): GPT-NeoX's parallel block with one norm for both branches, separate q/k/v
projections, optional per-head q/k LayerNorms, and a biased LM head."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm_spec.attention import AttentionMetadata
from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.causal_lm import renamed
from vllm_spec.model.fused import rotary_leading
from vllm_spec.model.gpt_neox import GPTNeoXAttention, GPTNeoXForCausalLM, GPTNeoXMLP
from vllm_spec.model.layers import LayerNorm

# Checkpoint names (under model.) -> ours: the model's own (a name's start), its layers'.
_TOP = (("final_layernorm.", "final_layer_norm."),)
_LAYER = ((".self_attn.dense.", ".self_attn.out_proj."), (".mlp.fc1.", ".mlp.dense_h_to_4h."),
          (".mlp.fc2.", ".mlp.dense_4h_to_h."))
_QKV = {".q_proj.": "q", ".k_proj.": "k", ".v_proj.": "v"}


class PhiAttention(GPTNeoXAttention):
    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__(cfg, tp, dtype)
        # (qk_layernorm: each head's q and k normed)
        self.q_layernorm = LayerNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_layernorm = LayerNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(x)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        return self._attend(*rotary_leading(q, k, cos, sin, self.rotary_dim), v, md)


class PhiLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = PhiAttention(cfg, tp, dtype)
        self.mlp = GPTNeoXMLP(cfg, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, cos, sin, md) + self.mlp(h)


class PhiForCausalLM(GPTNeoXForCausalLM):
    """Phi decoder + LM head (see CausalLM)."""

    _layer_class = PhiLayer
    _head_bias = True

    def _skipped(self, ckpt_name: str) -> bool:
        return "rotary_emb" in ckpt_name

    def _parameter_of(self, ckpt_name: str) -> tuple[str, object]:
        name = renamed(ckpt_name.removeprefix("model."), _TOP)
        for old, new in _LAYER:
            name = name.replace(old, new)
        for old, shard in _QKV.items():
            if old in name:
                return name.replace(old, ".qkv_proj."), shard
        return name, None

    def _checkpoint_names(self, name: str, shards: Iterable[object] | None = None) -> list[str]:
        for old, new in _LAYER:
            name = name.replace(new, old)
        hf = name if name.startswith("lm_head.") else f"model.{renamed(name, _TOP, back=True)}"
        if ".qkv_proj." not in hf:
            return [hf]
        return [hf.replace(".qkv_proj.", old) for old, shard in _QKV.items() if shards is None or shard in shards]

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
        return [(None, tensor)]
