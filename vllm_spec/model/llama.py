"""One Llama-family decoder (Llama 1-3, Granite, Mistral, Mixtral, Qwen2, Qwen3, Qwen2/3-MoE, Gemma 1-3, Phi-3,
SmolLM2 and 3) over a flat token batch."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm_spec.attention import Attention, AttentionMetadata
from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model import gemv
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.causal_lm import CausalLM
from vllm_spec.model.cpu_decoder import CpuDecoder
from vllm_spec.model.fused import rotary_leading
from vllm_spec.model.layers import (
    ACTIVATION_FNS,
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from vllm_spec.model.moe import EXPERT_KIND, EXPERT_TENSORS, SparseMoE
from vllm_spec.model.moe_config import LAYOUTS
from vllm_spec.model.rotary import RotaryEmbedding

# Checkpoint sub-name -> (our fused parameter, shard id).
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


# Architectures whose checkpoints store the q/k/v and gate/up projections fused, as we hold them.
_FUSED_CHECKPOINTS = ("Phi3ForCausalLM",)


def _checkpoint_names(name: str, shards: Iterable[object] | None = None, fused: bool = False) -> list[str]:
    """The checkpoint's names of one of our parameters (a fused one's parts: those of `shards`, else all; the
    fused tensor itself where the checkpoint stores it so)."""
    hf = name if name.startswith("lm_head.") else f"model.{name}"
    if fused:
        return [hf]
    parts = [hf.replace(new, old) for old, (new, shard) in _FUSED.items()
             if new in hf and (shards is None or shard in shards)]
    return parts or [hf]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias,
                                        tp, dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.rotates = layer not in cfg.unrotated_layers   # (SmolLM3's NoPE layers do not)
        self.q_norm = _norm(cfg, cfg.head_dim, dtype) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, cfg.head_dim, dtype) if cfg.qk_norm else None
        scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, scale, cfg.sliding_window_for(layer),
                              cfg.attn_logit_softcapping)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, cos: torch.Tensor,
                sin: torch.Tensor, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention of norm(x + residual), x + residual)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv, residual = self.qkv_proj.forward_normed(x, residual, norm)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None:   # each head's query and key vector normed on its own
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotates:
            q, k = rotary_leading(q, k, cos, sin, self.rotary_dim)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), md)
        return self.o_proj(out.reshape(-1, q_size)), residual


def _norm(cfg: ArchConfig, size: int, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(size, cfg.rms_norm_eps, dtype, unit_offset=cfg.norm_unit_offset)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, tp, dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp, dtype)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP of norm(x + residual), x + residual)."""
        if self.act != "silu":   # (Gemma's GELU: the fused kernels are SiLU's)
            gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(ACTIVATION_FNS[self.act](gate) * up), residual
        if gemv.gate_up_eligible(x, self.gate_up_proj.weight):   # SiLU·mul in the gate/up product's epilogue
            x, residual = norm(x, residual)
            return self.down_proj(gemv.gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias)), residual
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj.forward_silu_mul(gate_up), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, tp, dtype)
        sparse = cfg.moe is not None and layer in cfg.moe.layers
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, tp, dtype) if sparse else \
            LlamaMLP(cfg, tp, dtype)
        self.input_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        # Llama's norm before the MLP; Gemma's of the attention's output, before the residual add.
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        self.local_rope = cfg.rotates_locally(layer)   # rotated by the model's local cos / sin
        self.sandwich = cfg.sandwich_norms
        # Granite's: the attention's and the MLP's outputs scaled before their residual adds.
        self.residual_multiplier = cfg.residual_multiplier if cfg.residual_multiplier != 1.0 else None
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size, dtype)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream kept apart: each norm adds the previous block's output to it first (and runs
        inside the projection after it where the gemv kernels take the row)."""
        x, residual = self.self_attn(x, residual, self.input_layernorm, cos, sin, md)
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
            x, residual = self.mlp(x, residual, self.post_attention_layernorm)
            return x * self.residual_multiplier, residual
        if not self.sandwich:
            return self.mlp(x, residual, self.post_attention_layernorm)
        x, residual = self.mlp(self.post_attention_layernorm(x)[0], residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(x)[0], residual


class LlamaForCausalLM(CausalLM):
    """A Llama-family decoder + LM head (see CausalLM)."""

    def __init__(self, cfg: ArchConfig, tp: GroupCoordinator, dtype: torch.dtype, max_positions: int):
        super().__init__(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = _norm(cfg, cfg.hidden_size, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        positions = max(max_positions, cfg.max_position_embeddings)
        self.rope = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling,
                                    max_positions)
        # Gemma 3's windowed layers rotate with their own base (LlamaDecoderLayer.local_rope).
        self.local_rope = None if cfg.local_rope_theta is None else \
            RotaryEmbedding(cfg.head_dim, positions, cfg.local_rope_theta, None, max_positions)
        # (the scale in the model's dtype, as transformers' Gemma)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype) if cfg.embed_scale else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.config.embedding_multiplier != 1.0:   # (Granite's)
            x = x * self.config.embedding_multiplier
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        local = self.local_rope.cos_sin(positions, x.dtype) if self.local_rope is not None else None
        done = self.cpu_decoder.forward(x, cos, sin, md, local) if self.cpu_decoder is not None else None
        if done is not None:
            x, residual = done
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, *(local if layer.local_rope else (cos, sin)), md)
        return self.norm(x, residual)[0]

    def _build_cpu_decoder(self) -> CpuDecoder | None:
        return CpuDecoder.build(list(self.layers))

    def _parameter_of(self, ckpt_name: str) -> tuple[str, object]:
        """(our parameter, shard id) of a checkpoint tensor: a q/k/v or gate/up part of a fused projection, or
        (expert, "gate" / "up" / "down") of a sparse MLP's expert (Mixtral's block_sparse_moe is our mlp); else
        (name, None)."""
        name = ckpt_name.removeprefix("model.")
        moe = self.config.moe
        if moe is not None:   # (only the model's own layout's names: the other's stay unexpected)
            module = LAYOUTS[moe.layout][0]
            name = name.replace(f".{module}.", ".mlp.")
            if m := EXPERT_TENSORS[moe.layout].search(name):
                kind = EXPERT_KIND[m[2]]
                return f"{name[:m.start()]}.{'w2' if kind == 'down' else 'w13'}", (int(m[1]), kind)
        for old, (new, shard_id) in _FUSED.items():
            if old in name:
                return name.replace(old, new), shard_id
        return name, None

    def _checkpoint_names(self, name: str, shards: Iterable[object] | None = None) -> list[str]:
        """The checkpoint's names of one of our parameters (of a fused projection or of the experts: their
        parts, those of `shards` where given)."""
        moe = self.config.moe
        m = re.fullmatch(r"layers\.(\d+)\.mlp\.(gate\.weight|w13|w2)", name)
        if moe is None or m is None or int(m[1]) not in moe.layers:
            return _checkpoint_names(name, shards)
        module, names = LAYOUTS[moe.layout]
        prefix = f"model.layers.{m[1]}.{module}"
        if m[2] == "gate.weight":
            return [f"{prefix}.gate.weight"]
        kinds = ("gate", "up") if m[2] == "w13" else ("down",)
        return [f"{prefix}.experts.{e}.{names[kind]}.weight" for e in range(moe.num_experts) for kind in kinds
                if shards is None or (e, kind) in shards]

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
        """A checkpoint tensor of one of our parameters, as (shard id, rows) pieces: a projection the checkpoint
        stores fused (Phi-3's qkv_proj and gate_up_proj) is split into the parts separate tensors would be."""
        cfg = self.config
        if ".qkv_proj." in name:
            kv = cfg.num_key_value_heads * cfg.head_dim
            ids, rows = ("q", "k", "v"), [cfg.num_attention_heads * cfg.head_dim, kv, kv]
        elif ".gate_up_proj." in name:
            ids, rows = (0, 1), [cfg.intermediate_size] * 2
        else:
            return [(None, tensor)]
        if tensor.dim() == 0 or tensor.shape[0] != sum(rows):
            raise ValueError(f"shape {tuple(tensor.shape)}: a fused projection of {sum(rows)} rows "
                             f"({' + '.join(map(str, rows))}) was expected.")
        return list(zip(ids, tensor.split(rows)))

    def _missing_names(self, name: str) -> list[str]:
        if self.config.architecture in _FUSED_CHECKPOINTS:
            return _checkpoint_names(name, fused=True)
        return self._checkpoint_names(name)
