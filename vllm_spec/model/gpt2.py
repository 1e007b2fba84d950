"""GPT-2 (and DistilGPT-2): OPT's pre-norm layout under its own checkpoint names, with Conv1D weights."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from vllm_spec.model.causal_lm import renamed
from vllm_spec.model.opt import OPTForCausalLM

# Checkpoint names (under transformer.) -> ours: the model's own (a name's start), its layers' (h.N.*).
_TOP = (("wte.", "embed_tokens."), ("wpe.", "embed_positions."), ("ln_f.", "final_layer_norm."), ("h.", "layers."))
_LAYER = ((".ln_1.", ".self_attn_layer_norm."), (".ln_2.", ".final_layer_norm."),
          (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.out_proj."),
          (".mlp.c_fc.", ".fc1."), (".mlp.c_proj.", ".fc2."))

# The causal-mask buffers older checkpoints hold, which transformers ignores too.
_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$")
# Our parameters whose checkpoint tensors are Conv1D weights: [in, out], the transpose of a linear layer's.
_CONV1D = re.compile(r"\.(qkv_proj|out_proj|fc1|fc2)\.weight$")


class GPT2LMHeadModel(OPTForCausalLM):
    """GPT-2 decoder + LM head (see CausalLM): positions from row 0 of the table, tied embeddings."""

    def _skipped(self, ckpt_name: str) -> bool:
        return _BUFFERS.search(ckpt_name) is not None

    def _parameter_of(self, ckpt_name: str) -> tuple[str, object]:
        """GPT2LMHeadModel's names (transformer.*) and GPT2Model's (no prefix: OpenAI's gpt2 ships them)."""
        if ckpt_name.startswith("lm_head."):
            return ckpt_name, None
        name = renamed(ckpt_name.removeprefix("transformer."), _TOP)
        for old, new in _LAYER:
            name = name.replace(old, new) if name.startswith("layers.") else name
        return name, None

    def _checkpoint_names(self, name: str, shards: Iterable[object] | None = None) -> list[str]:
        if name.startswith("lm_head."):
            return [name]
        for old, new in _LAYER:
            name = name.replace(new, old) if name.startswith("layers.") else name
        return [f"transformer.{renamed(name, _TOP, back=True)}"]

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
        """Conv1D weights ([in, out], checked as the checkpoint holds them) transposed; c_attn's columns (rows, once
        transposed) cut into q | k | v."""
        cfg = self.config
        hidden, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        if m := _CONV1D.search(name):
            expected = {"qkv_proj": (hidden, 3 * q), "out_proj": (q, hidden), "fc1": (hidden, cfg.intermediate_size),
                        "fc2": (cfg.intermediate_size, hidden)}[m[1]]
            if tuple(tensor.shape) != expected:
                raise ValueError(f"shape {tuple(tensor.shape)}: a Conv1D weight of shape {expected} ([in, out]) "
                                 "was expected.")
            tensor = tensor.t()
        if ".qkv_proj." not in name:
            return [(None, tensor)]
        if tensor.dim() != 2 and tuple(tensor.shape) != (3 * q,):   # (the bias; the weight is checked above)
            raise ValueError(f"shape {tuple(tensor.shape)}: c_attn's bias of 3 x {q} (q, k, v) was expected.")
        return list(zip("qkv", tensor.split(q)))
