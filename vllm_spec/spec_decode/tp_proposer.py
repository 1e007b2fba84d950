"""Proposals under tensor parallelism: the draft runs on a sub-group, every target rank gets its drafts.

The draft's sub-group is ranks [0, draft_tp) of the target's group, so rank 0 is rank 0 of both.
After each proposal rank 0 broadcasts its draft token ids to the whole target group (every rank
must feed the target the same tokens); the draft probabilities travel too when some rank did not
compute them (draft_tp < tp) and the step samples. Ranks outside the sub-group skip the draft
entirely: they hold no draft weights or KV cache, and only receive. The shapes are known on
every rank from the step itself ([R, k] and [R, k, V]), so only the tensors cross.
"""

from __future__ import annotations

import torch

from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.sample.metadata import SamplingMetadata
from vllm_spec.spec_decode.proposer import Proposals, Proposer
from vllm_spec.worker.batch import ExecuteModelRequest


class TPProposer:
    """Wraps the draft proposer on draft ranks (`inner`), stands in for it on the others (inner=None)."""

    def __init__(self, inner: Proposer | None, tp: GroupCoordinator, draft_covers_all_ranks: bool,
                 vocab_size: int, device: torch.device, greedy_drafts: bool = False):
        self.inner = inner
        self.greedy_drafts = greedy_drafts   # drafts are argmaxes: no distributions to send
        self.tp = tp
        self.send_probs = not draft_covers_all_ranks
        self.vocab_size = vocab_size
        self.device = device

    def catch_up(self, req: ExecuteModelRequest, num_drafts: list[int]) -> int:
        return self.inner.catch_up(req, num_drafts) if self.inner is not None else 0

    def propose(self, req: ExecuteModelRequest, num_drafts: list[int], md: SamplingMetadata | None) -> Proposals:
        asked = [n for n in num_drafts if n > 0]
        own = self.inner.propose(req, num_drafts, md) if self.inner is not None else None
        if not asked:
            return own if own is not None else Proposals(torch.empty(0, 0, dtype=torch.long), None, [])
        rows, k = len(asked), max(asked)
        sampled = not (md.all_greedy or self.greedy_drafts)
        if own is not None:
            token_ids, probs = own.token_ids.contiguous(), own.probs
            probs = probs.contiguous() if probs is not None else None
        else:
            token_ids = torch.empty(rows, k, dtype=torch.long, device=self.device)
            probs = torch.empty(rows, k, self.vocab_size, dtype=torch.float32, device=self.device) \
                if sampled else None
        self.tp.broadcast(token_ids, src=0)
        if sampled and self.send_probs:
            self.tp.broadcast(probs, src=0)
        return Proposals(token_ids, probs, asked)

    def on_verified(self, seq_ids: list[int], num_drafts: list[int], num_accepted: list[int]) -> None:
        if self.inner is not None:
            self.inner.on_verified(seq_ids, num_drafts, num_accepted)

    def release(self, seq_ids: list[int]) -> None:
        if self.inner is not None:
            self.inner.release(seq_ids)
