"""Lossless verification of draft tokens (Leviathan et al. / Chen et al. speculative sampling).

For each sequence, with target distribution p_j and draft distribution q_j at
draft position j: accept draft token d_j with probability min(1, p_j(d)/q_j(d));
at the first rejection emit a token from norm(max(0, p_j - q_j)); if every
draft is accepted emit a bonus token from p_k. Greedy rows accept while
d_j == argmax p_j and emit argmax at the stop position. The emitted tokens are
distributed exactly as sampling the target alone. Vectorised over the batch and
positions: no Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_spec.sample.argmax import argmax_rows
from vllm_spec.sample.metadata import SamplingMetadata
from vllm_spec.sample.sampler import exponential_noise
from vllm_spec.spec_decode import greedy_verify


@dataclass
class VerifyOutput:
    tokens: torch.Tensor        # [B, k+1] emitted tokens, -1 past each row's end
    num_accepted: torch.Tensor  # [B] accepted draft tokens per row (emitted = num_accepted + 1)


def _uniform(shape: tuple[int, ...], md: SamplingMetadata, device: torch.device,
             generator: torch.Generator | None, row_drafts: list[int]) -> torch.Tensor:
    """Uniforms [B, k]; a seeded row draws one per draft of its own from its generator."""
    u = torch.rand(shape, device=device, generator=generator)
    for row, gen in md.generators.items():
        u[row, : row_drafts[row]] = torch.rand(row_drafts[row], device=device, generator=gen)
    return u


@dataclass
class SyntheticDraws:
    """Benchmarks only: where a row's synthetic acceptance draws come from. The draw for the draft
    at sequence position p of the request with key r is a hash of (r, p): every run of the same
    requests (another policy, another batch) sees the same acceptance at the same position, so
    comparisons are not decided by the luck of the draws."""

    keys: np.ndarray              # [B] int64, per request (e.g. a hash of its prompt)
    first_positions: np.ndarray   # [B] int64, the sequence position of the row's first draft

    def uniforms(self, k: int) -> np.ndarray:
        """[B, k] float64 in [0, 1): splitmix64 of (key, position) per draft. Hashed on the host, where
        the keys are: on the device the hash was some twenty small kernels per verification."""
        x = (self.keys.astype(np.uint64)[:, None] * np.uint64(1000003)
             + self.first_positions.astype(np.uint64)[:, None] + np.arange(k, dtype=np.uint64) + _GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x = x ^ (x >> np.uint64(31))
        return (x >> np.uint64(40)).astype(np.float64) / float(1 << 24)


# splitmix64's constants (uint64 arithmetic wraps).
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _synthetic_inputs(md: SamplingMetadata, engine_rate: float | None, B: int, k: int, device: torch.device,
                      generator: torch.Generator | None, uniforms: torch.Tensor | None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rates [B], draws [B, k]) of synthetic acceptance, or (None, None): a row's own rate, else the
    engine-wide one (NaN: verify for real); the given draws, else fresh ones from `generator`."""
    if engine_rate is None:
        rates = md.synthetic_acceptance
    elif md.synthetic_acceptance is None:
        rates = torch.full((B,), engine_rate, device=device)
    else:
        rates = md.synthetic_acceptance.nan_to_num(nan=engine_rate)
    if rates is None:
        return None, None
    return rates, uniforms if uniforms is not None else torch.rand((B, k), device=device, generator=generator)


def rejection_sample(
    target_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    md: SamplingMetadata,
    generator: torch.Generator | None = None,
    synthetic_acceptance_rate: float | None = None,
    target_argmax: torch.Tensor | None = None,
    host_num_drafts: list[int] | None = None,
    synthetic_uniforms: torch.Tensor | None = None,
) -> VerifyOutput:
    """Verify drafts against the target.

    target_probs: [B, k+1, V] the target's processed distributions (greedy rows: any
        distribution whose argmax is the greedy token). May be None when every row is
        greedy and target_argmax is given.
    target_argmax: [B, k+1] the target's greedy tokens, when the caller has them already
        (then no [B, k+1, V] tensor needs to exist for an all-greedy batch).
    draft_tokens: [B, k]; entries past num_drafts[b] are ignored.
    draft_probs: [B, k, V] the draft's distributions the tokens were sampled from,
        or None for a deterministic proposer (q is one-hot at the draft token).
    num_drafts: [B] drafts per row (0..k).
    md: per-row sampling metadata (greedy mask, per-row generators), rows = B.
    synthetic_acceptance_rate: benchmarks only; accept each draft with this probability
        (the output is then NOT the target's distribution). Rows with their own rate
        (md.synthetic_acceptance) use theirs.
    host_num_drafts: num_drafts on the host, if the caller has it (seeded rows need it).
    synthetic_uniforms: [B, k] the synthetic acceptance draws (SyntheticDraws.uniforms; else drawn
        from `generator`).

    A seeded row draws from its own generator what its own drafts need (a uniform per draft,
    noise for each of its stop positions), never what the batch's longest row needs: its tokens
    do not depend on the other rows.
    """
    if target_argmax is None:
        B, k1, _ = target_probs.shape
        target_argmax = argmax_rows(target_probs.reshape(B * k1, -1)).view(B, k1)
    B, k1 = target_argmax.shape
    k = k1 - 1
    device = target_argmax.device
    assert target_probs is not None or md.all_greedy, "sampled rows need the target's distributions"
    rates, synthetic_u = _synthetic_inputs(md, synthetic_acceptance_rate, B, k, device, generator, synthetic_uniforms)
    if md.all_greedy and greedy_verify.available(target_argmax):
        return VerifyOutput(*greedy_verify.greedy_verify(target_argmax, draft_tokens, num_drafts, rates, synthetic_u))
    pos = torch.arange(k, device=device).unsqueeze(0)
    in_range = pos < num_drafts.unsqueeze(1)                                   # [B, k]
    safe_drafts = draft_tokens.clamp(min=0)
    accept = target_argmax[:, :k] == safe_drafts
    row_drafts = None
    if md.generators:
        row_drafts = host_num_drafts if host_num_drafts is not None else num_drafts.tolist()
    if not md.all_greedy:
        p = target_probs[:, :k].gather(-1, safe_drafts.unsqueeze(-1)).squeeze(-1)
        q = (draft_probs.gather(-1, safe_drafts.unsqueeze(-1)).squeeze(-1) if draft_probs is not None
             else torch.ones_like(p))
        u = _uniform((B, k), md, device, generator, row_drafts)
        # Strict: u == 0 (torch.rand can return it) must not accept a token the target gives p = 0.
        accept_random = u * q < p
        accept = torch.where(md.greedy.unsqueeze(1), accept, accept_random)
    if rates is not None:
        synthetic = synthetic_u < rates.unsqueeze(1)
        accept = torch.where(rates.isnan().unsqueeze(1), accept, synthetic)
    accept &= in_range
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)                      # [B]

    # The token emitted after the accepted prefix, for every possible stop position.
    final = target_argmax
    if not md.all_greedy:
        residual = target_probs.clone()
        if draft_probs is not None:
            residual[:, :k] = (residual[:, :k] - draft_probs).clamp(min=0)
        else:
            residual[:, :k].scatter_(-1, safe_drafts.unsqueeze(-1), 0.0)
        # A stop position that is a bonus (past the row's drafts) samples from p itself.
        is_bonus = torch.arange(k1, device=device).unsqueeze(0) >= num_drafts.unsqueeze(1)
        residual = torch.where(is_bonus.unsqueeze(-1), target_probs, residual)
        # Rounding can empty a residual that is mathematically positive: fall back to p.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, target_probs, residual)
        noise = exponential_noise(tuple(residual.shape), md, device, generator,
                                  None if row_drafts is None else [n + 1 for n in row_drafts])
        sampled = argmax_rows((residual / noise).reshape(B * k1, -1)).view(B, k1)
        final = torch.where(md.greedy.unsqueeze(1), target_argmax, sampled)
    emitted_final = final.gather(1, num_accepted.long().unsqueeze(1))         # [B, 1]
    tokens = torch.full((B, k1), -1, dtype=torch.long, device=device)
    tokens[:, :k] = torch.where(pos < num_accepted.unsqueeze(1), draft_tokens, tokens[:, :k])
    tokens.scatter_(1, num_accepted.long().unsqueeze(1), emitted_final)
    return VerifyOutput(tokens, num_accepted)
