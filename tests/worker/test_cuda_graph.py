"""CUDA graphs: batch-size buckets, and the persistent inputs' padding rows at every replay (on CUDA
with real graphs; on the CPU with graphs that re-run their function eagerly, which tests the same
bookkeeping)."""

from __future__ import annotations

import pytest
import torch
from conftest import eager_capture

from vllm_spec.attention.metadata import NULL_BLOCK, AttentionMetadata
from vllm_spec.worker import cuda_graph
from vllm_spec.worker.cuda_graph import BATCH_BUCKETS, GraphedForward, bucket_for

BLOCK, MAX_BLOCKS = 4, 6


def test_a_batch_goes_to_the_smallest_bucket_that_holds_it():
    for batch in range(0, BATCH_BUCKETS[-1] + 50):
        fits = [b for b in BATCH_BUCKETS if b >= batch]
        assert bucket_for(batch) == (min(fits) if fits else None), batch


class _Echo(torch.nn.Module):
    """A row's hidden state = (input id, position, slot): what the replay was given, row by row."""

    def __init__(self, device: str):
        super().__init__()
        self.one = torch.nn.Parameter(torch.ones((), device=device))

    def forward(self, input_ids, positions, md):
        return torch.stack([input_ids, positions, md.slot_mapping], dim=1).float() * self.one

    def compute_logits(self, hidden):
        """A stand-in LM head: four 'logits' per row that name the row's hidden state."""
        return torch.cat([hidden, hidden.sum(dim=1, keepdim=True)], dim=1) * 2


def _batch(batch: int, q: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    tokens = batch * q
    positions = torch.randint(0, 20, (tokens,), generator=g)
    md = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1) * q, seq_lens=positions.view(batch, q)[:, -1] + 1,
        block_tables=torch.randint(1, 50, (batch, int(torch.randint(1, MAX_BLOCKS + 1, (), generator=g))), generator=g),
        slot_mapping=torch.randint(BLOCK, 200, (tokens,), generator=g), max_query_len=q, max_seq_len=21,
        block_size=BLOCK)
    md = AttentionMetadata(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v) for f, v in vars(md).items()})
    return torch.randint(1, 1000, (tokens,), generator=g).to(device), positions.to(device), md


def _check_padding(graphed: GraphedForward, batch: int, q: int, step: int) -> None:
    """Every row of the batch's bucket past the batch is padding: q tokens at 0..q-1 whose K/V go to the
    null block (their block-table rows are not reset: see GraphedForward)."""
    device = graphed.positions.device
    bucket, tokens = bucket_for(batch), batch * q
    pad_positions = torch.arange(q, device=device).repeat(bucket - batch)
    assert torch.equal(graphed.positions[tokens: bucket * q], pad_positions), step
    assert torch.equal(graphed.slot_mapping[tokens: bucket * q], NULL_BLOCK * BLOCK + pad_positions % BLOCK)
    assert (graphed.input_ids[tokens: bucket * q] == 0).all(), step
    assert (graphed.seq_lens[batch: bucket] == q).all(), step


def _graphed(device: str, q: int, monkeypatch) -> GraphedForward:
    if device == "cpu":
        monkeypatch.setattr(cuda_graph, "capture_graph", eager_capture)
    graphed = GraphedForward(_Echo(device), q, MAX_BLOCKS, BLOCK, 64)
    graphed.capture(16)
    return graphed


BATCHES = [5, 5, 3, 3, 7, 2, 16, 1, 12, 9, 9, 1, 12, 4, 16, 16, 2]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("q", [1, 3])
def test_rows_past_the_batch_are_padding_at_every_replay(device, q, monkeypatch):
    """Batches that grow and shrink within and across buckets (a steady batch resets nothing): the
    replay sees the batch's rows, and every other row of its bucket as padding (null block, q tokens at
    positions 0..q-1), never an earlier batch's inputs."""
    graphed = _graphed(device, q, monkeypatch)
    resets, reset = [], graphed._reset_padding
    monkeypatch.setattr(graphed, "_reset_padding", lambda start: (resets.append(start), reset(start)))
    previous = None
    for step, batch in enumerate(BATCHES):
        ids, positions, md = _batch(batch, q, step, device)
        resets.clear()
        out = graphed(ids, positions, md)
        assert not (batch == previous and resets), step   # a steady batch launches no reset
        previous = batch
        assert torch.equal(out[:, 0].long(), ids) and torch.equal(out[:, 1].long(), positions)
        assert torch.equal(out[:, 2].long(), md.slot_mapping)
        _check_padding(graphed, batch, q, step)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("q", [1, 3])
def test_staged_batches_mixed_with_device_inputs(device, q, monkeypatch):
    """Batches sent from the host in one copy (stage + replay), alternating at random with inputs
    copied in on the device, growing and shrinking: each replay sees its own batch, the metadata views
    hold what was staged, every other row of the bucket is padding, and a replay of a batch whose
    inputs were replaced since is refused."""
    graphed = _graphed(device, q, monkeypatch)
    rng = torch.Generator().manual_seed(0)
    for step, batch in enumerate(BATCHES * 2):
        ids, positions, md = _batch(batch, q, step, device)
        if torch.rand((), generator=rng) < 0.4:
            out = graphed(ids, positions, md)
        else:
            host = [t.cpu().numpy() for t in (ids, positions, md.slot_mapping, md.seq_lens, md.block_tables)]
            ids_v, positions_v, md_v, stage = graphed.stage(*host)
            assert torch.equal(ids_v, ids) and torch.equal(positions_v, positions)
            assert torch.equal(md_v.block_tables, md.block_tables) and torch.equal(md_v.seq_lens, md.seq_lens)
            assert torch.equal(md_v.slot_mapping, md.slot_mapping) and md_v.max_seq_len == int(md.seq_lens.max())
            assert torch.equal(md_v.query_start_loc, md.query_start_loc)
            out = graphed.replay(batch, stage)
        assert torch.equal(out[:, 0].long(), ids) and torch.equal(out[:, 1].long(), positions), step
        assert torch.equal(out[:, 2].long(), md.slot_mapping), step
        _check_padding(graphed, batch, q, step)
    host = [t.cpu().numpy() for t in (ids, positions, md.slot_mapping, md.seq_lens, md.block_tables)]
    for overwrite in (lambda: graphed.stage(*host), lambda: graphed(ids, positions, md),
                      lambda: graphed.capture(BATCH_BUCKETS[-1])):
        stale = graphed.stage(*host)[3]
        overwrite()
        with pytest.raises(RuntimeError, match="restaged"):
            graphed.replay(batch, stale)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_logits_graph_ends_with_the_lm_head(device, monkeypatch):
    """A graph made with logits=True (a target's plain decode) returns the LM head's output for its
    batch, staged or copied in, and a runner's run() takes the rows asked of it from those logits."""
    from vllm_spec.worker.model_runner import ModelRunner, PreparedBatch

    if device == "cpu":
        monkeypatch.setattr(cuda_graph, "capture_graph", eager_capture)
    model = _Echo(device)
    graphed = GraphedForward(model, 1, MAX_BLOCKS, BLOCK, 64, logits=True)
    graphed.capture(16)
    for step, batch in enumerate([5, 3, 12]):
        ids, positions, md = _batch(batch, 1, step, device)
        expected = model.compute_logits(model(ids, positions, md))
        assert torch.equal(graphed(ids, positions, md), expected)
        host = [t.cpu().numpy() for t in (ids, positions, md.slot_mapping, md.seq_lens, md.block_tables)]
        ids_v, positions_v, md_v, stage = graphed.stage(*host)
        runner = ModelRunner.__new__(ModelRunner)
        prepared = PreparedBatch(ids_v, positions_v, md_v, 1, list(range(batch)), None, host[0], graphed, stage)
        assert torch.equal(runner.run(prepared), expected)
        rows = torch.tensor([batch - 1, 0], device=device)
        assert torch.equal(runner.run(prepared, rows), expected[rows])
    # A pass run for its K/V alone skips the graph (and with it the LM head).
    runner.model, heads = model, []
    monkeypatch.setattr(model, "compute_logits", lambda hidden: heads.append(hidden))
    runner.write_kv(prepared)
    assert heads == []


def test_capture_past_the_largest_bucket_takes_every_bucket(monkeypatch):
    """max_num_seqs above the largest bucket: every bucket is captured (larger batches run eagerly),
    not a failed comparison with no bucket."""
    from vllm_spec.worker.cuda_graph import buckets_up_to

    assert buckets_up_to(5) == [1, 2, 4, 8] and buckets_up_to(BATCH_BUCKETS[-1] + 1) == list(BATCH_BUCKETS)
    graphed = _graphed("cpu", 1, monkeypatch)
    graphed.capture(BATCH_BUCKETS[-1] * 2)
    assert sorted(graphed.graphs) == list(BATCH_BUCKETS)
