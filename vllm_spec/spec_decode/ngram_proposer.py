"""Prompt-lookup (n-gram) proposer: copy what followed the last earlier occurrence of the tail."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from vllm_spec.sample.metadata import SamplingMetadata
from vllm_spec.spec_decode.proposer import Proposals, tokens_from
from vllm_spec.worker.batch import ExecuteModelRequest


def ngram_lookup(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the earliest earlier match of the longest matching tail n-gram (as
    vLLM's: in a repeating run, the earliest match has the most tokens after it)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)   # candidate starts 0..length-1-n
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = hits[0] + n
            return tokens[start: start + k]
    return tokens[:0]


class NgramProposer:
    """Deterministic drafts from the sequence's own history: q is one-hot, so sampled requests work too."""

    def __init__(self, n_max: int, n_min: int, device: torch.device):
        self.n_max, self.n_min = n_max, n_min
        self.device = device

    def catch_up(self, req: ExecuteModelRequest, num_drafts: list[int]) -> int:
        return 0   # no state: every proposal reads the whole history

    def propose(self, req: ExecuteModelRequest, num_drafts: list[int], md: SamplingMetadata) -> Proposals:
        seqs = req.seqs
        spec = [i for i, n in enumerate(num_drafts) if n > 0]
        k = max(num_drafts, default=0)
        drafts = np.zeros((len(spec), k), dtype=np.int64)
        found = []
        for row, i in enumerate(spec):
            cont = ngram_lookup(np.asarray(tokens_from(seqs[i], 0)), self.n_max, self.n_min, num_drafts[i])
            drafts[row, : len(cont)] = cont
            found.append(len(cont))
        return Proposals(torch.from_numpy(drafts).to(self.device), None, found)

    def on_verified(self, seq_ids: list[int], num_drafts: list[int], num_accepted: list[int]) -> None:
        pass

    def release(self, seq_ids: list[int]) -> None:
        pass
