"""Logits processing and sampling, vectorised over the batch.

process_logits() turns raw logits into the distribution the request asks for
(a grammar's mask, logit_bias, allowed_token_ids, penalties, min_tokens, temperature, top-k, top-p,
min-p); the speculative verifier uses the very same function, which is what keeps
speculation lossless.
Random rows sample by the exponential race argmax(p / E), E ~ Exp(1), drawing E
from the row's own generator when it has a seed, so a seeded row's tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_spec.sample.argmax import argmax_rows
from vllm_spec.sample.metadata import SamplingMetadata
from vllm_spec.sampling_params import LOGPROBS_MODES


@dataclass
class SamplerOutput:
    sampled: torch.Tensor                   # [N] token ids
    logprob_token_ids: torch.Tensor | None  # [N, 1 + K]: sampled token, then the top-K
    logprobs: torch.Tensor | None           # [N, 1 + K]
    sampled_ranks: torch.Tensor | None      # [N] 1-based rank of the sampled token


def apply_grammar(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """-inf where a row's grammar (structured outputs) forbids the token. As in vLLM, where the mask
    is applied to the model's logits, logprobs are of the masked distribution too."""
    if md.grammar_mask is None:
        return logits
    return logits.index_put((md.grammar_rows,), logits[md.grammar_rows].masked_fill(~md.grammar_mask, float("-inf")))


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The grammar's mask, logit_bias and allowed_token_ids (first, as vLLM), then the penalties and
    min_tokens' and bad words' bans. Where those bans leave a row nothing its grammar allows (e.g. a
    complete grammar allows only the stop token that min_tokens bans), the grammar alone decides: the
    output stays in the grammar's language."""
    logits = grammar_only = apply_grammar(logits, md)
    logits = _bias_penalties_and_bans(logits, md)
    if md.grammar_mask is not None and logits is not grammar_only:
        rows = md.grammar_rows
        banned = logits[rows]
        dead = (banned == float("-inf")).all(dim=-1, keepdim=True)
        logits = logits.index_put((rows,), torch.where(dead, grammar_only[rows], banned))
    return logits


def _bias_penalties_and_bans(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.logit_bias is not None:
        logits = logits + md.logit_bias
    pen = md.penalties
    if pen is not None:
        rep = pen.repetition.unsqueeze(1)
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(pen.seen, scaled, logits)
        logits = logits - pen.frequency.unsqueeze(1) * pen.output_counts
        logits = logits - pen.presence.unsqueeze(1) * (pen.output_counts > 0).to(logits.dtype)
    if md.banned_rows is not None:
        logits = logits.index_put((md.banned_rows, md.banned_tokens),
                                  torch.full((), float("-inf"), device=logits.device, dtype=logits.dtype))
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask to -inf everything outside each row's top-k, nucleus (top-p) and min-p sets."""
    if md.top_k is None and md.top_p is None and md.min_p is None:
        return logits
    neg_inf = torch.full((), float("-inf"), device=logits.device, dtype=logits.dtype)
    if md.top_k is not None or md.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if md.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
            remove |= ranks >= md.top_k.unsqueeze(1)
        if md.top_p is not None:
            probs = sorted_logits.masked_fill(remove, neg_inf).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when
            # the mass strictly before it already does. The first token always stays.
            mass_before = probs.cumsum(dim=-1) - probs
            # Rows with top_p == 1 keep everything: in float32 the cumulative mass reaches
            # 1.0 before the tail of a peaked distribution, which would cut that tail.
            top_p = md.top_p.unsqueeze(1)
            remove |= (mass_before >= top_p) & (top_p < 1.0)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(remove, neg_inf))
    if md.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = md.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, neg_inf)
    return logits


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Raw logits [N, V] (float32) -> the logits each row samples from (greedy rows: argmax of these)."""
    logits = apply_penalties(logits, md)
    if not md.all_greedy:
        logits = logits / md.temperature.unsqueeze(1)
        logits = apply_top_k_top_p_min_p(logits, md)
    return logits


def exponential_noise(shape: tuple[int, ...], md: SamplingMetadata, device: torch.device,
                      generator: torch.Generator | None, row_lengths: list[int] | None = None) -> torch.Tensor:
    """Exp(1) noise [N, ...]; seeded rows draw from their own generators (only their first
    row_lengths[row] entries along dim 1, when given: what the row itself uses)."""
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for row, gen in md.generators.items():
        (noise[row] if row_lengths is None else noise[row, : row_lengths[row]]).exponential_(generator=gen)
    return noise


def sample_from_logits(logits: torch.Tensor, md: SamplingMetadata,
                       generator: torch.Generator | None) -> torch.Tensor:
    greedy_tokens = argmax_rows(logits)
    if md.all_greedy:
        return greedy_tokens
    probs = logits.softmax(dim=-1)
    noise = exponential_noise(tuple(probs.shape), md, probs.device, generator)
    random_tokens = argmax_rows(probs / noise)
    return torch.where(md.greedy, greedy_tokens, random_tokens)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int, as_logits: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of these logits (as_logits: the logits themselves): the chosen tokens', their
    ranks, and the top-k."""
    logprobs = logits if as_logits else logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], tokens.new_empty(tokens.shape[0], 0))
    return torch.cat([tokens.unsqueeze(-1), top_ids], dim=-1), torch.cat([chosen, top_lp], dim=-1), ranks


class Sampler:
    """Samples one token per row. `generator` serves the rows without a seed."""

    def __init__(self, generator: torch.Generator | None = None, logprobs_mode: str = "raw_logprobs"):
        self.generator = generator
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {logprobs_mode!r}.")
        self.processed_logprobs = logprobs_mode.startswith("processed")
        self.logits_as_logprobs = logprobs_mode.endswith("logits")

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # Greedy rows that nothing modifies take the argmax of the model-dtype logits (float32 holds
        # every bf16/fp16 value exactly: the same token), without a float32 copy of them.
        argmax_only = (md.all_greedy and md.penalties is None and md.logit_bias is None and md.banned_rows is None
                       and md.grammar_mask is None and md.max_num_logprobs is None)
        raw = logits if argmax_only else logits.float()
        processed = process_logits(raw, md)
        tokens = sample_from_logits(processed, md, self.generator)
        if md.max_num_logprobs is None:
            return SamplerOutput(tokens, None, None, None)
        ids, lps, ranks = gather_logprobs(processed if self.processed_logprobs else apply_grammar(raw, md), tokens,
                                          md.max_num_logprobs, self.logits_as_logprobs)
        return SamplerOutput(tokens, ids, lps, ranks)
