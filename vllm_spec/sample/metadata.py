"""Batched sampling parameters: one row per distribution to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_spec.sampling_params import SamplingParams
from vllm_spec.utils import to_device


@dataclass
class SamplingRow:
    """One row's parameters and the token history its penalties and min_tokens depend on."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    # Speculative positions: tokens that follow output_token_ids but are not in it
    # (they count towards min_tokens; penalties need them in output_token_ids).
    num_pending: int = 0


@dataclass
class Penalties:
    presence: torch.Tensor       # [N]
    frequency: torch.Tensor      # [N]
    repetition: torch.Tensor     # [N]
    output_counts: torch.Tensor  # [N, V] occurrences of each token in the output
    seen: torch.Tensor           # [N, V] bool: token in prompt or output


@dataclass
class SamplingMetadata:
    """Tensors for a batch of rows; None fields mean "no row uses this"."""

    temperature: torch.Tensor              # [N], 1.0 on greedy rows (never divides by 0)
    greedy: torch.Tensor                   # [N] bool
    all_greedy: bool
    top_k: torch.Tensor | None             # [N] long, V when disabled
    top_p: torch.Tensor | None             # [N]
    min_p: torch.Tensor | None             # [N]
    penalties: Penalties | None
    banned_rows: torch.Tensor | None       # min_tokens: (row, token) pairs set to -inf
    banned_tokens: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    # Benchmarks only: [N] per-row probability of accepting each draft token (extra_args
    # "synthetic_acceptance_rate"), NaN on rows without one (they keep the engine-wide rate, if any).
    synthetic_acceptance: torch.Tensor | None = None

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device,
              for_draft: bool = False) -> "SamplingMetadata":
        """`for_draft` keeps only what shapes a proposal distribution (temperature and truncation):
        the verifier corrects for any draft distribution, so penalties are not worth their cost there."""
        ps = [r.params for r in rows]
        f32 = dict(device=device, dtype=torch.float32)
        greedy = [p.is_greedy for p in ps]
        temperature = to_device([1.0 if g else p.temperature for p, g in zip(ps, greedy)], **f32)
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in ps):
            top_k = to_device([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps], device)
        if any(p.top_p < 1.0 for p in ps):
            top_p = to_device([p.top_p for p in ps], **f32)
        if any(p.min_p > 0.0 for p in ps):
            min_p = to_device([p.min_p for p in ps], **f32)
        banned_r, banned_t = [], []
        for i, r in enumerate(rows):
            if not for_draft and len(r.output_token_ids) + r.num_pending < r.params.min_tokens:
                ids = sorted(t for t in r.params.all_stop_token_ids if t < vocab_size)
                banned_r += [i] * len(ids)
                banned_t += ids
        logprobs = [p.logprobs for p in ps if p.logprobs is not None]
        rates = [p.synthetic_acceptance_rate for p in ps]
        return cls(
            temperature=temperature,
            greedy=to_device(greedy, device, torch.bool),
            all_greedy=all(greedy),
            top_k=top_k, top_p=top_p, min_p=min_p,
            penalties=(_penalties(rows, vocab_size, device)
                       if not for_draft and any(p.has_penalties for p in ps) else None),
            banned_rows=to_device(banned_r, device) if banned_r else None,
            banned_tokens=to_device(banned_t, device) if banned_t else None,
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            max_num_logprobs=max(logprobs) if logprobs else None,
            synthetic_acceptance=(to_device([float("nan") if r is None else r for r in rates], **f32)
                                  if any(r is not None for r in rates) else None),
        )


def _token_matrix(seqs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Counts [N, V] of each token id in each row's list."""
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    width = max((len(s) for s in seqs), default=0)
    if width:
        padded = torch.full((len(seqs), width), vocab_size, dtype=torch.long)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        padded = padded.clamp(max=vocab_size).to(device, non_blocking=True)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _penalties(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> Penalties:
    f32 = dict(device=device, dtype=torch.float32)
    out_counts = _token_matrix([r.output_token_ids for r in rows], vocab_size, device)
    prompt_counts = _token_matrix([r.prompt_token_ids for r in rows], vocab_size, device)
    return Penalties(
        presence=to_device([r.params.presence_penalty for r in rows], **f32),
        frequency=to_device([r.params.frequency_penalty for r in rows], **f32),
        repetition=to_device([r.params.repetition_penalty for r in rows], **f32),
        output_counts=out_counts,
        seen=(out_counts > 0) | (prompt_counts > 0),
    )
