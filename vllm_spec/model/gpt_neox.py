"""GPT-NeoX (Pythia, StableLM-alpha, Dolly v2; Pythia's sizes are the classic speculative decoding pairs, e.g.
pythia-160m drafting for pythia-6.9b) over a flat token batch."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm_spec.attention import AttentionMetadata
from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.causal_lm import CausalLM, per_head_qkv, renamed
from vllm_spec.model.fused import rotary_leading
from vllm_spec.model.layers import (
    ACTIVATION_FNS,
    ColumnParallelLinear,
    LayerNorm,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from vllm_spec.model.opt import OPTAttention
from vllm_spec.model.rotary import RotaryEmbedding

# Checkpoint names (under gpt_neox., or without it as GPTNeoXModel saves them) -> ours: the model's own (a name's
# start), its layers'.
_TOP = (("embed_in.", "embed_tokens."), ("embed_out.", "lm_head."))
_LAYER = ((".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.out_proj."))
# The causal-mask buffers old checkpoints hold, which transformers ignores too (rotary tables: CausalLM._skipped).
_BUFFERS = re.compile(r"\.attention\.(bias|masked_bias)$")


class GPTNeoXAttention(OPTAttention):
    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__(cfg, tp, dtype, cfg.head_dim ** -0.5)
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(x)
        return self._attend(*rotary_leading(q, k, cos, sin, self.rotary_dim), v, md)


class GPTNeoXMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], True, tp, dtype)
        self.dense_4h_to_h = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, dtype)
        self.act = ACTIVATION_FNS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = GPTNeoXAttention(cfg, tp, dtype)
        self.mlp = GPTNeoXMLP(cfg, tp, dtype)
        self.parallel = cfg.neox.use_parallel_residual

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Parallel: x + attention(norm1(x)) + mlp(norm2(x)); else the MLP reads the attention's residual sum."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, md)
        if self.parallel:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXForCausalLM(CausalLM):
    """GPT-NeoX decoder + LM head (see CausalLM)."""

    _layer_class: type[nn.Module] = GPTNeoXLayer
    _head_bias = False

    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype, max_positions: int):
        super().__init__(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(self._layer_class(cfg, tp, dtype) for _ in range(cfg.num_hidden_layers))
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, bias=self._head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, max(max_positions, cfg.max_position_embeddings),
                                    cfg.rope_theta, cfg.rope_scaling, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, md)
        return self.final_layer_norm(x)

    def _skipped(self, ckpt_name: str) -> bool:
        return super()._skipped(ckpt_name) or _BUFFERS.search(ckpt_name) is not None

    def _parameter_of(self, ckpt_name: str) -> tuple[str, object]:
        name = renamed(ckpt_name.removeprefix("gpt_neox."), _TOP)
        for old, new in _LAYER:
            name = name.replace(old, new) if name.startswith("layers.") else name
        return name, None

    def _checkpoint_names(self, name: str, shards: Iterable[object] | None = None) -> list[str]:
        for old, new in _LAYER:
            name = name.replace(new, old) if name.startswith("layers.") else name
        hf = renamed(name, _TOP, back=True)
        return [hf if hf.startswith("embed_out.") else f"gpt_neox.{hf}"]

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
        """The checkpoint's query_key_value holds each head's q, k and v rows together (head-major)."""
        if ".qkv_proj." not in name:
            return [(None, tensor)]
        return per_head_qkv(tensor, self.config.num_attention_heads, self.config.head_dim)
