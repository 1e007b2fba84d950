"""Per-sequence state: tokens, how many of them have KV in the cache, blocks, outputs.

A request with n > 1 becomes n sequences that share a request id.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_spec.outputs import Logprob
from vllm_spec.sampling_params import SamplingParams
from vllm_spec.utils import concat_slice
from vllm_spec.worker.batch import PLACEHOLDER_TOKEN


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        # Identity tests against module names: hashing an Enum member runs Python code, and so does
        # reading a member off the class (Python 3.11); this is asked per sequence per step.
        return self is _STOPPED or self is _LENGTH or self is _ABORTED

    @property
    def finish_reason(self) -> str | None:
        # Identity tests too (a dict lookup would hash the member): asked per request per step.
        return "stop" if self is _STOPPED else "length" if self is _LENGTH else "abort" if self is _ABORTED else None


_STOPPED, _LENGTH, _ABORTED = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                               SequenceStatus.FINISHED_ABORTED)


_seq_ids = itertools.count()


# Slots: its attributes are read per sequence per step, and past 30 of them an instance dict
# loses CPython's shared-key layout (a batch-256 step's host time then grew ~15%).
@dataclass(eq=False, slots=True)
class Sequence:
    """One generated continuation.

    num_computed_tokens counts the tokens whose K/V are in the cache; the
    scheduler feeds the model tokens[num_computed_tokens:], so prefill, chunked
    prefill, decode and recompute after preemption are one mechanism.
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens being sampled by launched steps whose outputs the engine has not read yet (async
    # scheduling): the next step feeds them from the device, and they count as uncomputed.
    num_in_flight: int = 0
    block_table: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0   # with scheduling_policy "priority": lower runs first
    first_scheduled_time: float | None = None   # when it first left the waiting queue (preemptions aside)
    first_token_time: float | None = None
    last_token_time: float | None = None   # when its newest tokens arrived
    num_preemptions: int = 0
    # Prefix caching: prompt tokens found cached at admission (and of them, the leading ones whose
    # draft-model K/V is cached too), full blocks registered so far, and the hashes of its blocks
    # computed so far (see BlockManager).
    num_cached_tokens: int = 0
    num_draft_cached_tokens: int = 0
    num_registered_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Detokenized output and its incremental-decoding state: a tokenizers DecodeStream for fast
    # tokenizers, else the offsets of the window decoded around each new token.
    output_text: str = ""
    detok_stream: Any = field(default=None, repr=False)
    prefix_offset: int = 0
    read_offset: int = 0
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # Requested prompt logprobs: one entry per prompt token (None for the first, which nothing scores).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    # Set by the output processor's start(): the tokens that can stop the sequence (subject to
    # min_tokens) and its output length limit (max_tokens or max_model_len, whichever comes first;
    # 0 before start(): every token then gets the full stop check).
    stop_check_ids: set[int] = field(default_factory=set, repr=False)
    max_output_len: int = 0
    # What the last DELTA output reported (tokens, characters).
    num_reported_tokens: int = 0
    num_reported_chars: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_in_flight - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output; PLACEHOLDER_TOKEN for those still in flight."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        if start >= len(prompt) + len(output):   # all in flight: a decode under async scheduling
            return [PLACEHOLDER_TOKEN] * (stop - start)
        known = concat_slice(prompt, output, start, stop)
        in_flight = stop - start - len(known)
        return known + [PLACEHOLDER_TOKEN] * in_flight if in_flight > 0 else known

    def num_tokens_to_schedule(self, max_model_len: int) -> int | None:
        """num_uncomputed_tokens, or None when its tokens in flight already reach max_tokens or
        max_model_len (no step can add to it). One call: the scheduler asks it of every running
        sequence at every step."""
        num_output, in_flight = len(self.output_token_ids), self.num_in_flight
        num_tokens = len(self.prompt_token_ids) + num_output
        if in_flight and (num_output + in_flight >= self.max_tokens or num_tokens + in_flight >= max_model_len):
            return None
        return num_tokens + in_flight - self.num_computed_tokens


@dataclass(eq=False)
class Request:
    """A request as the user sent it: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_logprobs_reported: bool = False   # DELTA outputs carry them once, as vLLM's

    @property
    def is_finished(self) -> bool:
        # A loop, not all() over a generator: asked per request per step.
        for seq in self.seqs:
            if not seq.status.finished:
                return False
        return True
