"""Batched sampling parameters: one row per distribution to sample from."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_spec.sampling_params import BatchFields, SamplingParams
from vllm_spec.utils import KeptForIds, to_device


@dataclass
class SamplingRow:
    """One row's parameters and the token history its penalties and min_tokens depend on."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    # Tokens that follow output_token_ids but are not in it: speculative positions, or tokens in
    # flight (async scheduling). They count towards min_tokens; penalties need them in
    # output_token_ids, or added on the device (Penalties.add_tokens).
    num_pending: int = 0
    # [ceil(V / 32)] int32: the tokens the row's grammar allows (structured outputs), None: no grammar.
    token_bitmask: torch.Tensor | None = None


@dataclass
class Penalties:
    presence: torch.Tensor       # [N]
    frequency: torch.Tensor      # [N]
    repetition: torch.Tensor     # [N]
    output_counts: torch.Tensor  # [N, V] occurrences of each token in the output
    seen: torch.Tensor           # [N, V] bool: token in prompt or output

    def add_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one more output token per given row (tokens still on the device, in flight)."""
        self.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=self.output_counts.dtype),
                                      accumulate=True)
        self.seen[rows, tokens] = True


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
    logit_bias: torch.Tensor | None        # [N, V] added first: logit_bias, -inf outside allowed_token_ids
    banned_rows: torch.Tensor | None       # min_tokens: (row, token) pairs set to -inf
    banned_tokens: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    # Penalties, or a row short of min_tokens: the metadata follows the rows' tokens, so it holds for
    # one step only. Otherwise it depends on the rows' parameters and generators alone and may serve
    # again.
    follows_tokens: bool
    # Rows with bad words or a grammar: their bans and masks follow the output's last tokens, which the
    # next step's metadata then needs on the host (such a step is read before the next one is scheduled).
    needs_host_tokens: bool = False
    # Structured outputs: the rows with a grammar ([G] long) and the tokens each allows ([G, V] bool);
    # None: no row has one.
    grammar_rows: torch.Tensor | None = None
    grammar_mask: torch.Tensor | None = None
    # Every row greedy with nothing applied to its logits (no penalties, biases, bad words, grammar or
    # min_tokens): each row's token is its raw logits' argmax.
    plain_greedy: bool = False
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
        # One pass over the rows' cached fields, transposed into columns in C.
        (greedy, temperature, top_ks, top_ps, min_ps, penalized, logprobs, rates,
         min_tokens, biased, bad_words, structured) = tuple(zip(*(p.batch_fields for p in ps))) or ((),) * len(BatchFields._fields)
        top_k = top_p = min_p = None
        if any(top_ks):
            top_k = to_device([k if 0 < k < vocab_size else vocab_size for k in top_ks], device)
        if min(top_ps, default=1.0) < 1.0:
            top_p = to_device(top_ps, **f32)
        if max(min_ps, default=0.0) > 0.0:
            min_p = to_device(min_ps, **f32)
        with_penalties = not for_draft and any(penalized)
        with_min_tokens = not for_draft and any(min_tokens)
        with_bad_words = not for_draft and any(bad_words)
        with_grammar = not for_draft and any(structured)
        banned_r, banned_t = [], []
        if with_min_tokens or with_bad_words:
            for i, r in enumerate(rows):
                ids = set()
                if len(r.output_token_ids) + r.num_pending < r.params.min_tokens:
                    ids |= {t for t in r.params.all_stop_token_ids if t < vocab_size}
                if r.params.bad_words_token_ids:
                    ids |= _bad_word_bans(r.params.bad_words_token_ids, r.output_token_ids)
                banned_r += [i] * len(ids)
                banned_t += sorted(ids)
        num_logprobs = [n for n in logprobs if n is not None]
        return cls(
            temperature=to_device(temperature, **f32),
            greedy=to_device(greedy, device, torch.bool),
            all_greedy=all(greedy),
            top_k=top_k, top_p=top_p, min_p=min_p,
            penalties=_penalties(rows, vocab_size, device) if with_penalties else None,
            logit_bias=_logit_bias(ps, vocab_size, device) if not for_draft and any(biased) else None,
            banned_rows=to_device(banned_r, device) if banned_r else None,
            banned_tokens=to_device(banned_t, device) if banned_t else None,
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            # A row's output (plus pending) count only grows: once no row is short of min_tokens, none
            # will be again. Bad words' bans follow the output's last tokens.
            follows_tokens=with_penalties or with_bad_words or with_grammar or bool(banned_r),
            needs_host_tokens=with_bad_words or with_grammar,
            **(_grammar_masks(rows, vocab_size, device) if with_grammar else {}),
            plain_greedy=all(greedy) and not any(penalized) and not any(biased) and not any(bad_words)
            and not any(structured) and not any(min_tokens),
            synthetic_acceptance=(to_device([float("nan") if r is None else r for r in rates], **f32)
                                  if rates.count(None) < len(rates) else None),
        )

    def without_generators_of(self, rows: list[int]) -> "SamplingMetadata":
        """The same rows, those listed drawing from the shared generator: a seeded row must draw
        from its own only for what it uses, or its stream would depend on the rest of the batch."""
        if not any(r in self.generators for r in rows):
            return self
        return replace(self, generators={r: g for r, g in self.generators.items() if r not in rows})


class ReusedMetadata(KeptForIds[SamplingMetadata]):
    """The last batch's metadata, served again while the same sequences sample in the same order:
    metadata that does not follow the rows' tokens depends on the rows' parameters and generators alone."""

    def keeps(self, value: SamplingMetadata) -> bool:
        return not value.follows_tokens


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


def allowed_tokens(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmasks (bit t % 32 of word t // 32: token t allowed) -> [N, V] bool.
    Unpacked bytewise (little-endian words: byte j of word w holds tokens 32w + 8j ...), so the
    intermediate takes V bytes per row, not 4V."""
    as_bytes = bitmasks.contiguous().view(torch.uint8)
    bits = torch.arange(8, device=bitmasks.device, dtype=torch.uint8)
    return ((as_bytes.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def _grammar_masks(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """grammar_rows and grammar_mask: only the rows with a grammar ([G, V], not [N, V])."""
    constrained = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    bitmasks = torch.stack([rows[i].token_bitmask for i in constrained]).to(device, non_blocking=True)
    return dict(grammar_rows=to_device(constrained, device), grammar_mask=allowed_tokens(bitmasks, vocab_size))


def _bad_word_bans(words: list[list[int]], output: list[int]) -> set[int]:
    """The last token of each bad word whose other tokens end the output (a one-token word: always)."""
    return {word[-1] for word in words
            if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]}


def _logit_bias(params: list[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V]: each row's logit_bias, and -inf outside its allowed_token_ids. Built on the host once per
    distinct parameters (a verification's k+1 rows of a sequence share theirs; unbiased rows share a
    zero row) and expanded on the device."""
    slot: dict[int, int] = {}
    distinct: list[SamplingParams | None] = []
    index = []
    for p in params:
        key = id(p) if p.biases_logits else 0
        if key not in slot:
            slot[key] = len(distinct)
            distinct.append(p if p.biases_logits else None)
        index.append(slot[key])
    bias = torch.zeros(len(distinct), vocab_size, dtype=torch.float32)
    for i, p in enumerate(distinct):
        if p is None:
            continue
        if p.allowed_token_ids is not None:
            bias[i] = float("-inf")
            bias[i, p.allowed_token_ids] = 0.0
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            bias[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float32))
    bias = bias.to(device, non_blocking=True)
    return bias if len(distinct) == len(params) else bias[to_device(index, device)]
