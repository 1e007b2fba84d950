"""The proposer interface: k draft tokens for each speculating sequence of a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_spec.sample.metadata import SamplingMetadata
from vllm_spec.utils import concat_slice
from vllm_spec.worker.batch import ExecuteModelRequest, SeqInput


@dataclass
class Proposals:
    """Drafts for the speculating rows of a step (row i = i-th sequence with drafts asked for).

    token_ids: [R, k] on the device. probs: [R, k, V] distributions the drafts were
    sampled from, or None when the proposer is deterministic (one-hot q).
    num_drafts: drafts actually proposed per row (<= asked; the n-gram proposer may find none).
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None
    num_drafts: list[int]


class Proposer(Protocol):
    def catch_up(self, req: ExecuteModelRequest, num_drafts: list[int]) -> int:
        """Before `propose`: bring the proposer's own state up to date where it fell behind;
        the tokens it fed to do so (0: nothing to do).

        Timed apart from the proposal: it is a debt of earlier steps, not a cost of this one's k.
        """
        ...

    def propose(self, req: ExecuteModelRequest, num_drafts: list[int], md: SamplingMetadata) -> Proposals:
        """Propose num_drafts[i] tokens after req.seqs[i] for every i with num_drafts[i] > 0.

        `req` is the whole step (prefill chunks too, so a model-based proposer keeps its
        cache in step); md has one row per speculating sequence.
        """
        ...

    def on_verified(self, seq_ids: list[int], num_drafts: list[int], num_accepted: list[int]) -> None:
        """Learn how many drafts of each speculating sequence the target kept."""
        ...

    def release(self, seq_ids: list[int]) -> None:
        """Forget finished sequences."""
        ...


def token_at(seq: SeqInput, pos: int) -> int:
    """The sequence's token at position `pos` (< seq_len): of this step's chunk, else of its prompt and output."""
    if pos >= seq.start_pos:
        return seq.token_ids[pos - seq.start_pos]
    prompt = seq.prompt_token_ids
    return prompt[pos] if pos < len(prompt) else seq.output_token_ids[pos - len(prompt)]


def tokens_from(seq: SeqInput, start: int) -> list[int]:
    """The sequence's tokens from `start` up to the end of this step's chunk."""
    return concat_slice(seq.prompt_token_ids, seq.output_token_ids, start, seq.start_pos) + seq.token_ids
