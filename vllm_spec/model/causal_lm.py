"""What every decoder-only model here shares: the LM head's logits (a draft's restricted vocabulary), the CPU
packing of its matmul weights, a draft borrowing its target's embeddings, and checked weight loading."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from vllm_spec.attention import Attention
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.block_quant import BlockWeight
from vllm_spec.model.cpu_decoder import CpuDecoder
from vllm_spec.model.layers import LinearBase, ParallelLMHead, VocabParallelEmbedding, linear, pack_for_cpu

logger = logging.getLogger(__name__)


def renamed(name: str, prefixes: tuple[tuple[str, str], ...], back: bool = False) -> str:
    """name with the first of its (checkpoint's, ours) prefixes replaced (back: ours by the checkpoint's)."""
    for theirs, ours in prefixes:
        old, new = (ours, theirs) if back else (theirs, ours)
        if name.startswith(old):
            return new + name[len(old):]
    return name


def per_head_qkv(tensor: torch.Tensor, heads: int, head_dim: int) -> list[tuple[str, torch.Tensor]]:
    """A fused q/k/v checkpoint tensor whose rows hold each head's q, k and v together (GPT-NeoX's, GPT-BigCode's
    without multi_query), regrouped into q | k | v parts."""
    if tensor.dim() == 0 or tensor.shape[0] != 3 * heads * head_dim:
        raise ValueError(f"shape {tuple(tensor.shape)}: a fused projection of {3 * heads * head_dim} rows "
                         f"({heads} heads x q, k, v of {head_dim}) was expected.")
    per_head = tensor.reshape(heads, 3, head_dim, *tensor.shape[1:])
    return [(shard, per_head[:, i].reshape(heads * head_dim, *tensor.shape[1:])) for i, shard in enumerate("qkv")]


class CausalLM(nn.Module):
    """A decoder + LM head over a flat token batch. forward() maps tokens to hidden states; compute_logits() is
    applied only to the rows that are sampled or verified. Subclasses build `embed_tokens`, `layers` (each with a
    `self_attn.attn`) and `lm_head`, define forward(input_ids, positions, attention metadata), and name their
    parameters' checkpoint tensors."""

    embed_tokens: VocabParallelEmbedding
    lm_head: ParallelLMHead
    layers: nn.ModuleList

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.config = cfg
        self.output_ids: torch.Tensor | None = None     # see restrict_output_vocab
        self.output_weight: torch.Tensor | BlockWeight | None = None
        self.output_bias: torch.Tensor | None = None
        self.cpu_decoder: CpuDecoder | None = None   # see pack_for_cpu

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary, or over `output_ids` once restrict_output_vocab was called."""
        logits = linear(hidden, self.output_weight, self.output_bias) if self.output_ids is not None \
            else self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:   # (Granite's)
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def restrict_output_vocab(self, ids: torch.Tensor) -> None:
        """Compute logits for these token ids only (column j of the logits is token ids[j]).

        Called once the LM head's weight is final (after share_embeddings); a sharded head keeps
        the whole vocabulary (its logits are gathered across ranks).
        """
        if self.lm_head.tp.world_size > 1:
            return
        self.output_ids = ids.to(self.lm_head.weight.device)
        self.output_weight = self.lm_head.weight.detach()[self.output_ids].clone()
        if self.lm_head.bias is not None:
            self.output_bias = self.lm_head.bias.detach()[self.output_ids].clone()

    def token_ids_of(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of logit columns (the identity without a restricted vocabulary)."""
        return columns if self.output_ids is None else self.output_ids[columns]

    def pack_for_cpu(self) -> None:
        """Keep every matmul weight packed for the CPU (see layers.pack_for_cpu); short query blocks then
        run the layers in one C++ call where they can (cpu_decoder). The layers' and the LM head's weights
        are quantized where the config says so (cpu_weights, a draft's); the embeddings never are."""
        fmt = self.config.cpu_weights
        # (with a restricted vocabulary the head in use is output_weight)
        head = {self.lm_head} if self.output_ids is None else set()
        quantized = set(self.layers.modules()) | head if fmt else set()
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.pack_for_cpu(fmt if module in quantized else None)
        if self.output_weight is not None:
            self.output_weight = pack_for_cpu(self.output_weight, fmt)
        self.cpu_decoder = self._build_cpu_decoder()

    def _build_cpu_decoder(self) -> CpuDecoder | None:
        """The C++ decoder that runs these layers on the CPU, or None where it cannot."""
        return None

    def share_embeddings(self, target: "CausalLM") -> None:
        """Use the target's embedding (and tied LM head) instead of a copy of our own."""
        mine, theirs = self.embed_tokens.weight.shape[-1], target.embed_tokens.weight.shape[-1]
        if mine != theirs:
            raise ValueError(f"a draft that borrows the target's embeddings needs embeddings of the same size "
                             f"({mine} vs {theirs}).")
        self.embed_tokens.weight = target.embed_tokens.weight
        self.lm_head.weight = target.embed_tokens.weight if self.config.tie_word_embeddings \
            else target.lm_head.weight

    def _parameter_of(self, ckpt_name: str) -> tuple[str, object]:
        """(our parameter, shard id) of a checkpoint tensor: shard ids name the part of a fused parameter the
        tensor fills (None: the whole of it, or the parts _fused_parts cuts it into)."""
        raise NotImplementedError

    def _checkpoint_names(self, name: str, shards: Iterable[object] | None = None) -> list[str]:
        """The checkpoint's names of one of our parameters (of a fused one: its parts, those of `shards` where
        given)."""
        raise NotImplementedError

    def _missing_names(self, name: str) -> list[str]:
        """The checkpoint tensors named when a parameter was not loaded at all."""
        return self._checkpoint_names(name)

    def _fused_parts(self, name: str, tensor: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
        """A checkpoint tensor of one of our parameters, as (shard id, rows) pieces (a fused checkpoint
        tensor's parts where the model splits it)."""
        return [(None, tensor)]

    def _skipped(self, ckpt_name: str) -> bool:
        """Checkpoint tensors that hold nothing we load (rotary tables)."""
        return "rotary_emb" in ckpt_name

    def _check_tied_head(self, head: torch.Tensor) -> None:
        """A warning where a tied model's checkpoint holds an LM head other than its embedding: like vLLM, the
        embedding serves (transformers would keep the checkpoint's head)."""
        emb = self.embed_tokens
        mine = emb.weight.detach()[: max(0, min(emb.shard, emb.vocab_size - emb.start))]
        theirs = head[emb.start: emb.start + mine.shape[0]]
        if theirs.shape != mine.shape or not torch.equal(theirs.to(mine.dtype).to(mine.device), mine):
            logger.warning("%s: tie_word_embeddings is true, so the LM head is the token embedding (as in vLLM); "
                           "the checkpoint's lm_head.weight, which differs from it, is ignored.",
                           self.config.architecture)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; each parameter's loader keeps only this rank's shard."""
        params = dict(self.named_parameters(remove_duplicate=False))
        got: dict[str, set] = {}   # our parameter -> the shard ids the checkpoint filled (None: the whole of it)
        tied_head = None
        for ckpt_name, tensor in weights:
            if self._skipped(ckpt_name):
                continue
            name, shard = self._parameter_of(ckpt_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                tied_head = tensor   # (vLLM's rule: the embedding is the head; checked against it below)
                continue
            if name not in params:
                raise ValueError(f"Unexpected weight {ckpt_name!r} in checkpoint for {self.config.architecture}.")
            param = params[name]
            try:
                parts = [(shard, tensor)] if shard is not None else self._fused_parts(name, tensor)
                ids = {part_shard for part_shard, _ in parts}
                if ids & got.get(name, set()):
                    raise ValueError("it holds weights another tensor of the checkpoint held already (a projection "
                                     "stored both fused and in parts, or one tensor twice).")
                with torch.no_grad():
                    for part_shard, part in parts:
                        param.weight_loader(param, part.to(param.dtype), part_shard)
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"Checkpoint tensor {ckpt_name!r}: {e}") from e
            got.setdefault(name, set()).update(ids)
        # A fused parameter loaded from some of its tensors only would keep garbage in the rest.
        for name, ids in got.items():
            absent = [] if None in ids else \
                [n for n in self._checkpoint_names(name) if n not in self._checkpoint_names(name, ids)]
            if absent:
                raise ValueError(f"Checkpoint is missing weights: {absent}")
        if tied_head is not None and "embed_tokens.weight" in got:
            self._check_tied_head(tied_head)
        loaded = set(got)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        if self.config.embeddings_from_target:
            loaded |= {"embed_tokens.weight", "lm_head.weight"}
        missing = [hf for n in params if n not in loaded and not n.startswith("rope.") for hf in self._missing_names(n)]
        if missing:
            raise ValueError(f"Checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
