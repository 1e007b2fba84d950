"""The next step's drafts, proposed as soon as a verification is queued.

A speculative step cannot overlap the next one: the next step's inputs are this step's
accepted tokens. Without help the device idles from the moment those tokens are ready
until the next proposal is launched: the host reads them, processes the outputs,
schedules, and prepares the draft. For a greedy decoding batch that keeps speculating,
the next proposal needs only the host-known tokens of this step, so it is launched
right after they are read, and the device drafts while the host does the rest; the next
step adopts the drafts if it is the step they were made for (same sequences at the
expected lengths, the same k), and otherwise gives them back (the draft K/V they wrote
is recomputed when needed, to the same values). The drafts' K/V slots are reserved by
the scheduler (EngineConfig.num_lookahead_slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_spec.spec_decode.draft_model_proposer import DraftModelProposer
from vllm_spec.spec_decode.proposer import Proposals
from vllm_spec.worker.batch import SeqInput
from vllm_spec.worker.cuda_graph import BATCH_BUCKETS


@dataclass
class DraftsAhead:
    """Drafts proposed for the step after the one that made them."""

    seq_ids: list[int]
    lens: list[int]        # each sequence's length when the drafts were made
    k: int
    proposals: Proposals
    before: dict[int, tuple[int | None, int | None]]   # DraftModelProposer.take_back's argument

    def fits(self, seqs: list[SeqInput], asked: list[int]) -> bool:
        """Whether this step is the one the drafts were made for."""
        return (len(seqs) == len(self.seq_ids) and all(n == self.k for n in asked)
                and all(s.seq_id == sid and s.seq_len == n and len(s.token_ids) == 1 and s.sample
                        for s, sid, n in zip(seqs, self.seq_ids, self.lens)))


def propose_ahead(proposer: DraftModelProposer, seqs: list[SeqInput], emitted: list[list[int]], k: int,
                  max_model_len: int) -> DraftsAhead | None:
    """Drafts for the next step of `seqs` (every one decoding, greedy, verified with k drafts and
    emitted[i] kept), k each; None where the next step could not use them (a sequence would
    outgrow max_model_len, or the batch is larger than the proposal graphs)."""
    if len(seqs) > BATCH_BUCKETS[-1]:
        return None
    lens = [s.seq_len + len(e) for s, e in zip(seqs, emitted)]
    if max(lens) + k > max_model_len:
        return None
    last_two = [([s.token_ids[-1]] + e)[-2:] for s, e in zip(seqs, emitted)]
    proposals, before = proposer.propose_ahead(seqs, last_two, lens, k)
    return DraftsAhead([s.seq_id for s in seqs], lens, k, proposals, before)
