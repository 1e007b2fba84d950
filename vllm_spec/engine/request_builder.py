"""A request from add_request's arguments: every field checked and the prompt tokenized before the engine
keeps anything of it (one bad request fails alone), then its sequences built."""

from __future__ import annotations

import math
import time

from vllm_spec.config import EngineConfig
from vllm_spec.core.sequence import Request, Sequence
from vllm_spec.engine.request_input import as_token_ids, check_prompt_keys
from vllm_spec.executor.base import check_sendable_to_ranks
from vllm_spec.inputs import PromptType
from vllm_spec.sampling_params import SamplingParams
from vllm_spec.structured_output.grammar import compiler_for
from vllm_spec.utils import check_text, is_number


def tokenize_prompt(prompt: PromptType, tokenizer) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt in any of its forms; tokenizer None: token ids only."""
    if isinstance(prompt, dict):
        check_prompt_keys(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), as_token_ids(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'.")
        prompt = prompt["prompt"]
    if isinstance(prompt, list):
        return None, as_token_ids(prompt)
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; this engine was built with skip_tokenizer_init=True.")
    check_text("prompt", prompt)
    return prompt, tokenizer(prompt).input_ids


def new_request(request_id: str, prompt: PromptType, params: SamplingParams | None, config: EngineConfig,
                tokenizer, eos_token_ids: set[int], arrival_time: float | None,
                priority: int) -> tuple[Request, int]:
    """The request (its n sequences on the engine's own copy of params) and its max_tokens; raises
    ValueError naming what is wrong. arrival_time: time.time() (None: now)."""
    if arrival_time is not None and not (is_number(arrival_time) and math.isfinite(arrival_time)):
        raise ValueError(f"arrival_time must be a time.time() timestamp, got {arrival_time!r}.")
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
    # Checked again on the engine's own copy: a caller may have changed fields since construction.
    params = params.checked_copy()
    if params.stop and (tokenizer is None or not params.detokenize):
        # As vLLM: stop strings match text, which only detokenized tokens have.
        raise ValueError(f"stop strings ({params.stop!r}) need detokenized output: detokenize=True and an engine "
                         "with a tokenizer (not skip_tokenizer_init). Use stop_token_ids instead.")
    for name in ("bad_words", "structured_outputs"):
        if getattr(params, name) and tokenizer is None:
            raise ValueError(f"{name} ({getattr(params, name)!r}) need a tokenizer (an engine without "
                             "skip_tokenizer_init).")
    if params.extra_args and config.parallel.tensor_parallel_size > 1:
        check_sendable_to_ranks(params.extra_args, "extra_args")
    if params.structured_outputs is not None:   # compiled now: a bad schema fails this request alone
        compiler_for(config.model, tokenizer).compile(params.structured_outputs)
    text, ids = tokenize_prompt(prompt, tokenizer)
    vocab, max_len = config.model.arch.vocab_size, config.model.max_model_len
    ids = params.truncate_prompt(ids, max_len)
    # (vLLM's wording: callers match it.)
    if not ids:
        raise ValueError("The decoder prompt cannot be empty (prompt_token_ids has length 0).")
    if len(ids) > max_len:
        raise ValueError(
            f"The decoder prompt (length {len(ids)}) is longer than the maximum model length of {max_len}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens."
        )
    if len(ids) == max_len:
        raise ValueError(
            f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens (at least 1) is "
            f"longer than the maximum model length of {max_len}. Make sure that `max_model_len` is no smaller "
            "than the number of text tokens (prompt + requested output tokens)."
        )
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"Token id {bad!r} is out of vocabulary (the prompt's token ids must be in [0, {vocab})).")
    if params.bad_words:
        params.update_from_tokenizer(tokenizer)
    params.check_vocab(vocab, config.model.max_logprobs)
    params.all_stop_token_ids |= eos_token_ids   # min_tokens holds EOS back, ignore_eos or not (as vLLM)
    max_tokens = max_len - len(ids) if params.max_tokens is None else params.max_tokens
    # The engine's clock is monotonic; a given arrival_time is on the wall clock.
    now = time.monotonic()
    arrived = now if arrival_time is None else now - max(time.time() - arrival_time, 0.0)
    seqs = []
    for i in range(params.n):
        seq = Sequence(request_id, i, ids, params.for_child(i) if params.n > 1 else params, max(1, max_tokens))
        seq.arrival_time = arrived
        seq.priority = int(priority)
        seqs.append(seq)
    if params.prompt_logprobs is not None:   # scored once, by the first sequence's prefill
        seqs[0].prompt_logprobs = [None] * len(ids)
    return Request(request_id, text, ids, params, seqs, arrival_time=arrived), max_tokens
