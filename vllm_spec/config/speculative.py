"""SpeculativeConfig: the proposer (a draft model or n-gram lookup), k and the speculation policy."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from vllm_spec.config.model import ModelConfig
from vllm_spec.utils import check_int, is_int, is_number

logger = logging.getLogger(__name__)

SPEC_METHODS = ("draft_model", "ngram")
NGRAM_NAMES = ("ngram", "[ngram]")
SPEC_POLICIES = ("adaptive", "fixed")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
MAX_SPECULATIVE_TOKENS = 16
_SCHEDULE = "speculative_config['num_speculative_tokens_per_batch_size']"


@dataclass
class SpeculativeConfig:
    """Speculative decoding: the proposer, k, and (for a draft model) its resolved ModelConfig, whose
    max_model_len is the draft's limit: positions past it are never fed to the draft."""

    method: str
    num_speculative_tokens: int
    max_model_len: int   # positions a proposal may reach (the draft's limit): a sequence drafts only up to it
    draft: ModelConfig | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    draft_tensor_parallel_size: int = 1
    disable_by_batch_size: int | None = None
    # Benchmarks only: accept each draft token with this probability whatever the models say.
    synthetic_acceptance_rate: float | None = None
    policy: str = "adaptive"   # "fixed", or "table": k from num_speculative_tokens_per_batch_size
    # vLLM's: "probabilistic" samples drafts from the draft's distribution q (verified against q);
    # "greedy" drafts its argmax, verified as a one-hot q (cheaper, accepts less at high temperature).
    draft_sample_method: str = "probabilistic"
    enforce_eager: bool | None = None   # the draft's CUDA graphs off (None: as the engine's enforce_eager)
    # vLLM's static schedule: (first batch size, last batch size, k) ranges, from batch size 1 on.
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None

    # vLLM's names.
    @property
    def model(self) -> str:
        """The draft model (its path), or "ngram"."""
        return self.draft.model if self.draft is not None else "ngram"

    @property
    def draft_model_config(self) -> ModelConfig | None:
        return self.draft

    @property
    def draft_parallel_config(self):
        """The draft's ParallelConfig: its tensor-parallel sub-group's size."""
        from vllm_spec.config.engine import ParallelConfig

        return ParallelConfig(self.draft_tensor_parallel_size)

    @classmethod
    def create(cls, target: ModelConfig, model: str | None, num_speculative_tokens: int | None,
               method: str | None = None, prompt_lookup_max: int | None = None,
               prompt_lookup_min: int | None = None, draft_tensor_parallel_size: int | None = None,
               disable_by_batch_size: int | None = None,
               synthetic_acceptance_rate: float | None = None,
               policy: str | None = None, max_model_len: int | None = None,
               draft_sample_method: str | None = None, enforce_eager: bool | None = None,
               num_speculative_tokens_per_batch_size: list | None = None) -> "SpeculativeConfig":
        """max_model_len: the draft's (vLLM's speculative_max_model_len), at most the target's. The
        draft's limit is the least of it, the target's and the positions the draft supports; a
        sequence speculates only while its drafts stay inside it (as vLLM's), so a draft of a shorter
        context never shortens the target's."""
        if model in NGRAM_NAMES or method in NGRAM_NAMES:   # (vLLM's spellings)
            if model not in (None, *NGRAM_NAMES):   # (a draft that would be ignored)
                raise ValueError(f"speculative method 'ngram' takes no draft model, got model {model!r}: give "
                                 "method 'draft_model' for a draft, or no model for prompt lookup.")
            method = "ngram"
        elif method in (None, "draft_model"):
            method = "draft_model"
            if not model or not isinstance(model, (str, os.PathLike)):
                raise ValueError("speculative_model (speculative_config['model']) must be given for a draft model: "
                                 f"a model folder or a .gguf file, got {model!r}.")
        else:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {method!r}.")
        k = num_speculative_tokens
        if not (is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}.")
        # (vLLM's bound: a threshold of 1 would never speculate.)
        check_int("speculative_disable_by_batch_size", disable_by_batch_size, 2, optional=True)
        for name, value in (("speculative_max_model_len", max_model_len),
                            ("ngram_prompt_lookup_max", prompt_lookup_max),
                            ("ngram_prompt_lookup_min", prompt_lookup_min)):
            check_int(name, value, 1, optional=True)
        if method == "draft_model":
            for name, value in (("ngram_prompt_lookup_max", prompt_lookup_max),
                                ("ngram_prompt_lookup_min", prompt_lookup_min)):
                if value is not None:
                    raise ValueError(f"{name} ({value!r}) applies to n-gram speculation (speculative_model="
                                     f"'[ngram]'), not to a draft model ({model!r}).")
        rate = synthetic_acceptance_rate
        if max_model_len is not None and max_model_len > target.max_model_len:
            raise ValueError(f"speculative_max_model_len (speculative_config['max_model_len']) must be <= "
                             f"max_model_len ({target.max_model_len}), got {max_model_len}.")
        if rate is not None and not (is_number(rate) and 0 <= rate <= 1):
            raise ValueError(f"synthetic_acceptance_rate must be a number in [0, 1], got {rate!r}.")
        if rate is not None:
            logger.warning("speculative_config['synthetic_acceptance_rate'] = %s (benchmarks only): draft tokens "
                           "are accepted at random, whatever the models say; outputs are NOT the target's.", rate)
        if policy not in (None, *SPEC_POLICIES):
            raise ValueError(f"speculative_policy must be one of {SPEC_POLICIES}, got {policy!r}.")
        if draft_sample_method not in (None, *DRAFT_SAMPLE_METHODS):
            raise ValueError(f"speculative_config['draft_sample_method'] must be one of "
                             f"{list(DRAFT_SAMPLE_METHODS)}, got {draft_sample_method!r}.")
        if enforce_eager not in (None, True, False):
            raise ValueError(f"speculative_config['enforce_eager'] must be True, False or None (the engine's), got "
                             f"{enforce_eager!r}.")
        schedule = num_speculative_tokens_per_batch_size
        if schedule is not None:
            if policy is not None:
                raise ValueError(f"speculative_policy ({policy!r}) conflicts with {_SCHEDULE}: the schedule is "
                                 "the policy; give one of them.")
            schedule, policy = batch_size_schedule(schedule), "table"
        cfg = cls(method, k, max_model_len or target.max_model_len,
                  draft_tensor_parallel_size=1 if draft_tensor_parallel_size is None else draft_tensor_parallel_size,
                  disable_by_batch_size=disable_by_batch_size, synthetic_acceptance_rate=synthetic_acceptance_rate,
                  policy=policy or "adaptive", draft_sample_method=draft_sample_method or "probabilistic",
                  enforce_eager=enforce_eager, num_speculative_tokens_per_batch_size=schedule)
        if method == "ngram":
            # As vLLM V1: neither bound given is 5 and 5; one given sets the other to itself.
            hi = prompt_lookup_max or prompt_lookup_min or 5
            lo = prompt_lookup_min or prompt_lookup_max or 5
            if lo > hi:
                raise ValueError(
                    f"ngram_prompt_lookup_min ({lo}) must be <= ngram_prompt_lookup_max ({hi})."
                )
            cfg.prompt_lookup_max, cfg.prompt_lookup_min = hi, lo
            return cfg
        # The draft's sampling defaults are never used: requests sample from the target's distribution.
        try:
            draft = ModelConfig.create(model, None, target.dtype, target.device.type, None, "auto"
                                       if target.load_format != "dummy" else "dummy", target.seed,
                                       generation_config="vllm")
        except (ValueError, FileNotFoundError) as e:   # (which of the two models it was about)
            raise type(e)(f"speculative_model: {e}") from e
        if draft.arch.vocab_size != target.arch.vocab_size:
            raise ValueError(
                f"The draft model's vocabulary ({draft.arch.vocab_size} tokens) differs from the target's "
                f"({target.arch.vocab_size}); speculative decoding needs the same tokenizer."
            )
        if max_model_len is not None and max_model_len > draft.max_model_len:
            raise ValueError(f"speculative_max_model_len={max_model_len} cannot be larger than the draft's "
                             f"max_model_len={draft.max_model_len} (the positions it supports).")
        cfg.max_model_len = draft.max_model_len = min(draft.max_model_len, cfg.max_model_len)
        cfg.draft = draft
        return cfg


def batch_size_schedule(entries: object) -> list[tuple[int, int, int]]:
    """vLLM's num_speculative_tokens_per_batch_size, checked by vLLM's rules: [first, last, k] ranges of
    batch sizes, from 1, in order, not overlapping, k >= 0 (a batch size between two ranges takes the
    earlier's k, one past the last range the last's; k is capped at num_speculative_tokens)."""
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(f"{_SCHEDULE} must be a non-empty list of [first batch size, last batch size, k] "
                         f"entries, got {entries!r}.")
    ranges = []
    for entry in entries:
        if isinstance(entry, (list, tuple)) and len(entry) == 5:
            raise ValueError(f"{_SCHEDULE}: entries by context length (5 items) are not supported; give "
                             f"[first batch size, last batch size, k], got {list(entry)!r}.")
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(is_int(v) for v in entry)):
            raise ValueError(f"{_SCHEDULE} entries must be [first batch size, last batch size, k] integers, "
                             f"got {entry!r}.")
        lo, hi, k = map(int, entry)
        if not 1 <= lo <= hi:
            raise ValueError(f"{_SCHEDULE}: a batch-size range must be positive with first <= last, got {entry!r}.")
        if k < 0:
            raise ValueError(f"{_SCHEDULE}: k must be >= 0, got {entry!r}.")
        ranges.append((lo, hi, k))
    ranges.sort()
    if ranges[0][0] != 1:
        raise ValueError(f"{_SCHEDULE}: the first range must start at batch size 1, got {ranges[0]!r}.")
    for (_, last, _), (first, _, _) in zip(ranges, ranges[1:]):
        if first <= last:
            raise ValueError(f"{_SCHEDULE}: ranges must not overlap, got {sorted(ranges)!r}.")
    return ranges
