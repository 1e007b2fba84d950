"""The next step's drafts, proposed as soon as a verification's tokens are read.

A speculative step cannot overlap the next one: the next step's inputs are this step's
accepted tokens. Without help the device idles from the moment those tokens are ready
until the next proposal is launched: the host reads them, processes the outputs,
schedules, and prepares the draft. For a greedy decoding batch that keeps speculating,
the next proposal needs only the tokens the host has just read, so it is launched right
away, and the device drafts while the host does the rest. The next step adopts the
drafts if it is the step they were made for (the same sequences at the expected
lengths, each asking 1..k drafts: the first n greedy drafts are those of a proposal of
n) and otherwise drops them: the proposer records nothing until they are used, and the
draft K/V they wrote is either what its cache held already (the two tokens fed) or past
what it is known to hold (recomputed when needed, to the same values). Their K/V slots are reserved by the scheduler
(EngineConfig.num_lookahead_slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_spec.spec_decode.draft_model_proposer import DraftModelProposer
from vllm_spec.spec_decode.proposer import Proposals
from vllm_spec.spec_decode.timer import StepTimer
from vllm_spec.worker.batch import SeqInput
from vllm_spec.worker.cuda_graph import BATCH_BUCKETS


@dataclass
class DraftsAhead:
    """Drafts proposed for the step after the one that made them, and their device time."""

    seq_ids: list[int]
    lens: list[int]        # each sequence's length when the drafts were made
    drafts: torch.Tensor   # [B, k]
    timer: StepTimer       # one phase: the proposal

    def fits(self, seqs: list[SeqInput], asked: list[int]) -> bool:
        """Whether this step is the one the drafts were made for."""
        k = self.drafts.shape[1]
        return (len(seqs) == len(self.seq_ids) and all(1 <= n <= k for n in asked)
                and all(s.seq_id == sid and s.seq_len == n and len(s.token_ids) == 1 and s.sample
                        for s, sid, n in zip(seqs, self.seq_ids, self.lens)))

    def adopt(self, proposer: DraftModelProposer, asked: list[int]) -> Proposals:
        """The drafts as this step's proposal, n = asked[i] for row i (a step that `fits`)."""
        proposer.record_proposal(self.seq_ids, self.lens, asked)
        return Proposals(self.drafts[:, : max(asked)], None, asked)


def drafts_for_next_step(proposer: DraftModelProposer, seqs: list[SeqInput], emitted: list[list[int]], k: int,
                         max_model_len: int, block_size: int) -> DraftsAhead | None:
    """Drafts for the next step of `seqs` (every one decoding, greedy, verified with k drafts and
    emitted[i] kept), k each; None where the next step could not use them (a sequence would
    outgrow max_model_len or its reserved slots, or the batch is larger than the proposal graphs)."""
    if len(seqs) > BATCH_BUCKETS[-1]:
        return None
    lens = [s.seq_len + len(e) for s, e in zip(seqs, emitted)]
    # The proposal writes draft K/V up to position len + k - 2.
    if max(lens) + k > max_model_len or any(n + k - 1 > len(s.block_table) * block_size for s, n in zip(seqs, lens)):
        return None
    last_two = [([s.token_ids[-1]] + e)[-2:] for s, e in zip(seqs, emitted)]
    timer = StepTimer(proposer.runner.device)
    drafts = proposer.propose_ahead(seqs, last_two, lens, k)
    timer.mark()
    return DraftsAhead([s.seq_id for s in seqs], lens, drafts, timer)
