"""Ragged CUDA graphs (k per sequence): token buckets, and what each replay sees (on CUDA with real
graphs; on the CPU with graphs that re-run their function eagerly, which tests the same bookkeeping)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import eager_capture

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.worker import cuda_graph
from vllm_spec.worker.cuda_graph import BATCH_BUCKETS, bucket_for
from vllm_spec.worker.ragged_graph import RaggedGraphedForward, token_bucket, token_buckets, token_step
from vllm_spec.worker import token_counts
from vllm_spec.worker.token_counts import GRID, TokenPadding

BLOCK, MAX_BLOCKS = 4, 12


@pytest.mark.parametrize("max_q", [2, 5, 9])
def test_every_ragged_batch_has_a_token_bucket_that_pads_little(max_q):
    for bucket in BATCH_BUCKETS:
        buckets = token_buckets(bucket, max_q)
        assert buckets == sorted(buckets) and buckets[-1] == bucket * max_q
        smallest = BATCH_BUCKETS[BATCH_BUCKETS.index(bucket) - 1] + 1 if bucket > 1 else 1
        for tokens in range(smallest, bucket * max_q + 1):
            run = token_bucket(tokens, bucket, max_q)
            assert run in buckets and tokens <= run < tokens + token_step(bucket, max_q), (bucket, tokens)
            assert run - tokens <= max(16, bucket * (max_q - 1) / 16), (bucket, tokens)   # a small share
        assert len(buckets) <= 20   # whatever max_q: a bounded number of graphs


class _Owners(torch.nn.Module):
    """A token's hidden state = (input id, position, slot, its sequence's row, that row's length, its
    query length): what the replay (or a capture) was given, token by token."""

    def __init__(self, device: str):
        super().__init__()
        self.one = torch.nn.Parameter(torch.ones((), device=device))

    def forward(self, input_ids, positions, md):
        qsl = md.query_start_loc
        tokens = torch.arange(len(input_ids), device=input_ids.device)
        if input_ids.device.type == "cpu" or not torch.cuda.is_current_stream_capturing():   # (CPU stand-ins: captures too)
            assert int(qsl[-1]) == len(input_ids), "every token belongs to a sequence"
            assert int(md.seq_lens.max()) <= MAX_BLOCKS * BLOCK, "a row reads past its block-table row"
        row = torch.searchsorted(qsl, tokens, right=True) - 1
        lens, q = md.seq_lens[row], (qsl[1:] - qsl[:-1])[row]
        return torch.stack([input_ids, positions, md.slot_mapping, row, lens, q], dim=1).float() * self.one


def _slow_counts(max_tokens: int) -> TokenPadding:
    """Matmul times that grow with the tokens, every other profiled count twice as slow as its neighbours."""
    counts = np.arange(GRID, max_tokens + GRID, GRID)
    return TokenPadding(counts, counts * 1e-6 * np.where(counts % (2 * GRID) == GRID, 2.0, 1.0))


def _ragged(device: str, max_q: int, monkeypatch, max_batch: int = 24,
            padding: TokenPadding | None = None) -> RaggedGraphedForward:
    if device == "cpu":
        monkeypatch.setattr(cuda_graph, "capture_graph", eager_capture)
    graphed = RaggedGraphedForward(_Owners(device), max_q, MAX_BLOCKS, BLOCK, 64, padding=padding)
    graphed.capture(max_batch)
    return graphed


def _batch(rng: np.random.Generator, batch: int, max_q: int):
    q = rng.integers(1, max_q + 1, batch)
    qsl = np.concatenate([[0], np.cumsum(q)])
    T = int(qsl[-1])
    tables = rng.integers(1, 50, (batch, int(rng.integers(1, MAX_BLOCKS + 1))))
    return (rng.integers(1, 1000, T), rng.integers(0, 20, T), rng.integers(BLOCK, 200, T),
            rng.integers(20, 24, batch), qsl, tables)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("max_q,slow_counts", [(3, False), (5, False), (5, True)])
def test_each_replay_sees_its_batch_and_padding_of_no_sequence(device, max_q, slow_counts, monkeypatch):
    """Batches of 1..max_q tokens per sequence that grow and shrink: a replay returns the batch's tokens
    with their own sequence's length and query length; the graph ran the batch's token bucket (or, where
    the matmuls run it slowly, a faster count a little above), whose tokens past the batch's belong to
    the sink row past the bucket (positions from 0, K/V into the null block); rows past the batch feed
    nothing; every graph was captured up front; a replay of a batch restaged since is refused."""
    padding = _slow_counts(24 * max_q) if slow_counts else None
    monkeypatch.setattr(token_counts, "MIN_ROWS", 0)   # (tiny batches: every count profiled)
    graphed = _ragged(device, max_q, monkeypatch, padding=padding)
    captured = len(graphed.graphs)
    if padding is None:
        assert captured == sum(len(token_buckets(b, max_q)) for b in BATCH_BUCKETS if b <= 24)
    padded_runs = 0
    rng = np.random.default_rng(0)
    for step, batch in enumerate([5, 17, 3, 24, 24, 1, 9, 20, 2]):
        ids, positions, slots, seq_lens, qsl, tables = _batch(rng, batch, max_q)
        ids_v, pos_v, md, stage = graphed.stage(ids, positions, slots, seq_lens, qsl, tables)
        assert md.max_query_len == int(np.diff(qsl).max()) and md.max_seq_len == int(seq_lens.max())
        assert np.array_equal(md.query_start_loc.cpu().numpy(), qsl)
        out = graphed.replay(batch, stage).long().cpu().numpy()
        T = len(ids)
        assert out.shape[0] == T and np.array_equal(ids_v.cpu().numpy(), ids)
        q = np.diff(qsl)
        rows = np.repeat(np.arange(batch), q)
        expected = np.stack([ids, positions, slots, rows, seq_lens[rows], q[rows]], axis=1)
        assert np.array_equal(out, expected), step
        bucket, run = bucket_for(batch), graphed.tokens_run(batch, T)
        own = token_bucket(T, bucket, max_q)
        if padding is None:
            assert run == own
        else:   # more tokens only where they run clearly faster, never past the bucket's rows
            assert run == own or padding.seconds_at(run) < padding.seconds_at(own)
            assert own <= run <= bucket * max_q and run - T <= MAX_BLOCKS * BLOCK   # the sink fits its row
            padded_runs += run > own
        full = graphed.out[:run].long().cpu().numpy()
        pad = full[T:run]
        assert (pad[:, 3] == bucket).all() and (pad[:, 0] == 0).all(), step
        assert np.array_equal(pad[:, 1], np.arange(run - T)) and (pad[:, 4] == run - T).all(), step
        assert (pad[:, 2] // BLOCK == NULL_BLOCK).all(), step
        assert (graphed.seq_lens[batch:bucket] == 0).all() and (graphed.query_start_loc[batch: bucket + 1] == T).all()
    assert len(graphed.graphs) == captured
    assert padded_runs > 0 or padding is None
    stale = graphed.stage(ids, positions, slots, seq_lens, qsl, tables)[3]
    graphed.stage(ids, positions, slots, seq_lens, qsl, tables)
    with pytest.raises(RuntimeError, match="restaged"):
        graphed.replay(batch, stale)
