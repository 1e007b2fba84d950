"""OPT (Meta's; vLLM's classic draft-model pairs, e.g. opt-125m drafting for opt-6.7b) over a flat token batch."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm_spec.attention import Attention, AttentionMetadata
from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.causal_lm import CausalLM
from vllm_spec.model.layers import (
    ACTIVATION_FNS,
    ColumnParallelLinear,
    LayerNorm,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _default_loader,
    _param,
)

_QKV = {".q_proj.": "q", ".k_proj.": "k", ".v_proj.": "v"}


class OPTAttention(nn.Module):
    """Attention without a rotation (OPT's, GPT-2's, GPT-BigCode's multi-query one; GPT-NeoX's adds one), biases as
    the config says."""

    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype, scale: float):
        super().__init__()
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, heads, kv_heads, cfg.attention_bias, tp, dtype)
        self.out_proj = RowParallelLinear(heads * head_dim, cfg.hidden_size, cfg.attention_bias, tp, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale, None, None)

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return self._attend(*self._qkv(x), md)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [T, heads, head_dim]."""
        sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        q, k, v = self.qkv_proj(x).split(sizes, -1)
        return tuple(t.reshape(-1, t.shape[-1] // self.head_dim, self.head_dim) for t in (q, k, v))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return self.out_proj(self.attn(q, k, v, md).reshape(-1, self.num_heads * self.head_dim))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        opt = cfg.opt
        affine = opt.layer_norm_affine
        scale = 1.0 if opt.unscaled_attention else cfg.head_dim ** -0.5
        if opt.scale_by_inverse_layer:   # (GPT-2's option)
            scale /= layer + 1
        self.self_attn = OPTAttention(cfg, tp, dtype, scale)
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, affine)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], cfg.mlp_bias, tp, dtype)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp, dtype)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, affine)
        self.act = ACTIVATION_FNS[cfg.hidden_act]
        self.norm_before = opt.do_layer_norm_before

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Each block's norm before it (OPT-125m and most), or after its residual add (OPT-350m)."""
        before = self.norm_before
        x = x + self.self_attn(self.self_attn_layer_norm(x) if before else x, md)
        if not before:
            x = self.self_attn_layer_norm(x)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x) if before else x)))
        return x if before else self.final_layer_norm(x)


class OPTForCausalLM(CausalLM):
    """OPT decoder + LM head (see CausalLM); the embeddings (and the tied LM head) are word_embed_proj_dim wide,
    projected in and out of the hidden size where that differs."""

    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype, max_positions: int):
        super().__init__(cfg)
        opt, hidden = cfg.opt, cfg.hidden_size
        width = opt.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, width, tp, dtype)
        self.embed_positions = nn.Module()
        self.position_offset = opt.position_offset
        self.embed_positions.weight = _param(cfg.max_position_embeddings + opt.position_offset, hidden, dtype=dtype,
                                             loader=_default_loader)
        self.project_in = ReplicatedLinear(width, hidden, False, dtype) if width != hidden else None
        self.project_out = ReplicatedLinear(hidden, width, False, dtype) if width != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i, tp, dtype) for i in range(cfg.num_hidden_layers))
        norm = LayerNorm(hidden, cfg.rms_norm_eps, dtype, opt.layer_norm_affine)
        self.final_layer_norm = norm if opt.final_layer_norm \
            else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, width, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions.weight[positions + self.position_offset if self.position_offset else positions]
        for layer in self.layers:
            x = layer(x, md)
        return x if self.final_layer_norm is None else self.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden if self.project_out is None else self.project_out(hidden))

    def _parameter_of(self, ckpt_name: str) -> tuple[str, object]:
        """OPTForCausalLM's names (model.decoder.*) and OPTModel's (decoder.*, as facebook/opt-125m ships them);
        q/k/v are parts of our qkv_proj."""
        name = ckpt_name.removeprefix("model.").removeprefix("decoder.")
        for old, shard in _QKV.items():
            if old in name:
                return name.replace(old, ".qkv_proj."), shard
        return name, None

    def _checkpoint_names(self, name: str, shards: Iterable[object] | None = None) -> list[str]:
        hf = name if name.startswith("lm_head.") else f"model.decoder.{name}"
        if ".qkv_proj." not in hf:
            return [hf]
        return [hf.replace(".qkv_proj.", old) for old, shard in _QKV.items() if shards is None or shard in shards]
