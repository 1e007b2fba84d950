"""A model's decoder layers in one C++ call for short query blocks on the CPU (csrc/cpu/decoder.cpp).

A decode step of a small model on the CPU spent more time in Python between the ops than in most of the
ops (the default model at batch 1: 6.6 ms of a 17 ms step outside the matmuls). Steps whose query blocks
are all short (decode, verification of drafts, the draft's catch-up: the C++ attention's) run the layers
in C++ instead. Its layers call the ops the Python layers call, in their order, so the bits are the same;
prompt chunks (torch's attention), tensor parallelism, a forced attention backend and weights the CPU
kernel does not take keep the Python layers, as do Granite's (residual multipliers). Gemma's layers (norms
around the attention and the MLP, GELU, Gemma 3's windowed layers rotated by their own base, Gemma 2's
soft-capped attention) run there too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_spec import cpu_ops
from vllm_spec.attention import cpu_backend, torch_backend
from vllm_spec.attention.metadata import AttentionMetadata
from vllm_spec.model import cpu_linear
from vllm_spec.model.block_quant import BlockWeight
from vllm_spec.model.layers import LinearBase

if TYPE_CHECKING:
    from vllm_spec.attention import Attention
    from vllm_spec.model.llama import LlamaDecoderLayer


class CpuDecoder:
    """A model's layers as a C++ Decoder (made after pack_for_cpu: it holds the weights the layers multiply
    by) and their attention modules (whose caches the worker binds later)."""

    def __init__(self, decoder, attentions: list[Attention], head_dim: int, dtype: torch.dtype):
        self.decoder, self.attentions, self.head_dim, self.dtype = decoder, attentions, head_dim, dtype

    @classmethod
    def build(cls, layers: list[LlamaDecoderLayer]) -> CpuDecoder | None:
        """None where one of the layers cannot run there. (It holds the tensors the layers hold now: weights
        loaded in place later are seen, parameters or attention settings rebound are not.)"""
        if not layers or not cpu_ops.available():
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in cpu_ops.DTYPES:
            return None
        ext = cpu_ops.module()
        decoder = ext.Decoder()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            # (a mixture of experts' layers stay in Python, as do activations the C++ MLP lacks)
            if not hasattr(mlp, "gate_up_proj") or mlp.act not in ("silu", "gelu_tanh"):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            sandwich = (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if layer.sandwich else ()
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            head_norms = () if attn.q_norm is None else (attn.q_norm, attn.k_norm)
            every_norm = norms + sandwich + head_norms
            if (attn.head_dim != layers[0].self_attn.head_dim or attn.head_dim % 2 or attn.rotary_dim != attn.head_dim
                    or not attn.rotates
                    or layer.residual_multiplier is not None
                    or any(m.tp.world_size > 1 for m in linears)
                    or any(n.weight.dtype != dtype or not n.weight.is_contiguous() or n.weight.requires_grad
                           for n in every_norm)
                    or any(n.eps != norms[0].eps for n in every_norm)):
                return None
            projections = [_projection(ext, m, dtype, bias_after=m in (attn.o_proj, mlp.down_proj)) for m in linears]
            if None in projections:
                return None
            head = [n.weight for n in head_norms] or [None, None]
            decoder.add_layer(ext.Layer(norms[0].weight, norms[1].weight, norms[0].eps, *projections,
                                        attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale,
                                        attn.attn.sliding_window or 0, *head,
                                        *([n.weight for n in sandwich] or [None, None]),
                                        mlp.act == "gelu_tanh", layer.local_rope, attn.attn.softcap or 0.0))
        return cls(decoder, [layer.self_attn.attn for layer in layers], layers[0].self_attn.head_dim, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttentionMetadata,
                local: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after every layer, or None where this step is not the decoder's (the caller runs
        the Python layers). local: the locally rotated layers' (cos, sin)."""
        rotations = (cos, sin) + (local or ())
        if (md.max_query_len > torch_backend.SHORT_QUERY or x.dim() != 2 or x.device.type != "cpu"
                or x.dtype != self.dtype or x.requires_grad
                or any(t.dtype != x.dtype or t.shape != (x.shape[0], self.head_dim) or not t.is_contiguous()
                       for t in rotations)):
            return None
        k_caches, v_caches = [], []
        for attn in self.attentions:
            k, v = attn.k_cache, attn.v_cache
            # (the caches cpu_backend takes; in another dtype than the queries', torch_backend's)
            if (attn.backend is not None and attn.backend is not cpu_backend or k.dtype != x.dtype
                    or v.dtype != x.dtype or k.dim() != 4 or not (k.is_contiguous() and v.is_contiguous())):
                return None
            k_caches.append(k)
            v_caches.append(v)
        meta = [cpu_ops.contiguous_as(t, torch.long) for t in (md.slot_mapping, md.block_tables, md.seq_lens,
                                                                md.query_start_loc)]
        return self.decoder.forward(cpu_ops.contiguous_as(x, x.dtype), cos, sin, k_caches, v_caches, *meta,
                                    *(local or ()))


def _projection(ext, module: LinearBase, dtype: torch.dtype, bias_after: bool):
    weight = module.weight if module.packed is None else module.packed
    bias = module.bias
    # (the Python path takes the C++ ops for these only without autograd on them)
    if (not cpu_linear.handles(torch.empty(0, weight.shape[-1], dtype=dtype), weight)
            or getattr(weight, "requires_grad", False) or bias is not None and (bias.dtype != dtype or bias.requires_grad)):
        return None
    if isinstance(weight, BlockWeight):
        return ext.Projection(weight.blocks, weight.format, bias, bias_after)
    return ext.Projection(weight, "", bias, bias_after)
