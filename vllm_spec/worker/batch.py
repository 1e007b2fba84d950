"""What crosses the engine/worker boundary each step: batches, not requests."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from vllm_spec.outputs import Logprob
from vllm_spec.sampling_params import SamplingParams

# A token sampled by a step still on the device (async scheduling): the worker fills it in from
# that step's output. Only ever the last token of a decoding sequence's chunk.
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)   # built per sequence per step: slots make it cheaper to build and read
class SeqInput:
    """One sequence's slice of a step: feed `token_ids` at positions start_pos, start_pos+1, ...

    When `sample` is set the chunk ends the sequence and the step returns new
    token(s) for it, sampled with `sampling_params` (prompt/output ids feed the
    penalties and min_tokens).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # A prefill chunk of a request that asked for prompt logprobs: how many top entries.
    prompt_logprobs: int | None = None
    # Leading positions whose draft-model K/V the prefix cache's shared blocks hold (a new sequence
    # that found its prompt's start cached): the draft starts there, not at 0.
    draft_cached: int = 0

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


_seq_id, _token_ids, _start_pos, _sample = (operator.attrgetter(name) for name in
                                            ("seq_id", "token_ids", "start_pos", "sample"))


@dataclass(slots=True)
class BatchColumns:
    """Per-sequence fields of a step's sequences as columns, read off the SeqInputs once: at batch 256
    a Python pass over them costs the host 0.1-0.2 ms, and a speculative step reads these in several
    places (C-level maps here: ~20 us a column)."""

    seq_ids: list[int]
    num_new: np.ndarray    # int64 [B]: tokens fed
    start_pos: np.ndarray  # int64 [B]
    seq_len: np.ndarray    # int64 [B]: start_pos + num_new
    sample: np.ndarray     # bool [B]

    @classmethod
    def of(cls, seqs: list[SeqInput]) -> "BatchColumns":
        B = len(seqs)
        num_new = np.fromiter(map(len, map(_token_ids, seqs)), dtype=np.int64, count=B)
        start_pos = np.fromiter(map(_start_pos, seqs), dtype=np.int64, count=B)
        return cls(list(map(_seq_id, seqs)), num_new, start_pos, start_pos + num_new,
                   np.fromiter(map(_sample, seqs), dtype=bool, count=B))

    def ids_of(self, rows) -> list[int]:
        """The seq ids of these rows (increasing indices): the column itself when they are every row."""
        ids = self.seq_ids
        return ids if len(rows) == len(ids) else [ids[i] for i in rows]


@dataclass
class ExecuteModelRequest:
    seqs: list[SeqInput]
    # Sequences that ended since the last step: the worker drops their state.
    finished_seq_ids: list[int] = field(default_factory=list)
    num_lookahead_slots: int = 0
    # Seconds the engine waited (no request, or none it could run) since its last request to the
    # worker: no step's cost, for the speculation policy.
    engine_idle_time: float = 0.0

    @cached_property
    def columns(self) -> BatchColumns:
        """The sequences' columns (computed on first use; the sequences are not changed in place)."""
        return BatchColumns.of(self.seqs)

    def seqs_of(self, rows) -> list[SeqInput]:
        """The sequences of these rows (increasing indices): the list itself when they are every row."""
        return self.seqs if len(rows) == len(self.seqs) else [self.seqs[i] for i in rows]


@dataclass
class PolicyEstimates:
    """What the speculation policy believed when a step was read (NaN where it keeps no such
    estimate; it learns from a step while the next runs), and the mean k it chose for the step's
    decoding sequences (set by the worker)."""

    mean_k: float = float("nan")
    acceptance: float = float("nan")   # per draft token, of a new request (first drafts accepted per drafting step)
    draft_cost_ratio: float = float("nan")


@dataclass
class SpecStepStats:
    """What one speculative step proposed and kept."""

    num_drafts: int                  # sequences that got >= 1 draft token
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]      # [k] sequences whose j-th draft was accepted
    draft_time: float                # seconds
    verify_time: float
    policy: PolicyEstimates | None = None
    num_verified_tokens: int = 0     # query tokens of the target pass, padding included
    catch_up_time: float = 0.0       # seconds of draft_time spent feeding tokens of earlier steps
    catch_up_tokens: int = 0         # the tokens it fed (query tokens, padding included)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens start, start+1, ... of one sequence (computed by a prefill chunk)."""

    seq_id: int
    start: int
    entries: list[dict[int, Logprob]]


@dataclass
class StepOutput:
    """The new tokens of each sampled sequence, as columns (no object per sequence per step)."""

    seq_ids: list[int]
    token_ids: list[list[int]]   # one token per sequence, or several when drafts were accepted
    # Per sequence, one entry per new token, or None where not asked; None: no sequence asked.
    logprobs: list[list[dict[int, Logprob]] | None] | None = None
    spec: SpecStepStats | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Seconds the worker's host thread waited for the device (the step's device->host copy):
    # the rest of the worker's time is host work (input preparation, launches, sampling metadata).
    device_wait_time: float = 0.0
    # Seconds from the step's first device operation to its last, on the device's clock (0 on CPU):
    # against the wall time per step, what the device spent idle between steps.
    device_time: float = 0.0
