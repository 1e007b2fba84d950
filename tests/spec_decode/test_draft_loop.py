"""The greedy draft loop's static inputs: sent from the host in one copy, every row of the batch's
bucket past the batch padding (token 0 at positions 0, 1 of the null block) whatever came before."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.spec_decode.draft_loop import GreedyDraftLoop
from vllm_spec.worker.cuda_graph import bucket_for

MAX_BLOCKS = 5


class _Stub(torch.nn.Module):
    def __init__(self, device: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros((), device=device))
        self.lm_head = SimpleNamespace(tp=SimpleNamespace(world_size=1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_past_the_batch_are_padding(device, monkeypatch):
    loop = GreedyDraftLoop(_Stub(device), MAX_BLOCKS, 4, 64, use_graphs=False)
    seen = []

    def run(batch, k, max_seq_len):   # what the device program would read
        bucket = bucket_for(batch)
        seen.append([t[:bucket].cpu().clone() for t in (loop.tokens, loop.first_pos, loop.limits, loop.block_tables)])
        return torch.zeros(batch, k, dtype=torch.long)

    monkeypatch.setattr(loop, "_run", run)
    rng = np.random.default_rng(0)
    for step, batch in enumerate([6, 6, 3, 16, 1, 9, 9, 2, 13, 5]):
        width = int(rng.integers(1, MAX_BLOCKS + 1))
        tokens = rng.integers(1, 100, (batch, 2))
        first = rng.integers(0, 20, batch)
        limits = first + rng.integers(1, 4, batch)
        tables = rng.integers(1, 50, (batch, width))
        loop(tokens, first, limits, tables, 3, 40)
        got_tokens, got_first, got_limits, got_tables = seen[-1]
        assert got_tokens[:batch].tolist() == tokens.tolist(), step
        assert got_first[:batch].tolist() == first.tolist() and got_limits[:batch].tolist() == limits.tolist()
        assert got_tables[:batch, :width].tolist() == tables.tolist(), step
        assert (got_tokens[batch:] == 0).all() and (got_first[batch:] == 0).all(), step
        assert (got_limits[batch:] == 1).all() and (got_tables[batch:] == NULL_BLOCK).all(), step
