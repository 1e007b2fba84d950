"""CUDA graphs for batches whose sequences all feed the same number of tokens.

Plain decode (1 token per sequence), verification (k+1) and draft steps are
such batches. One graph per (query length, batch-size bucket), captured at
start-up (or on first use for shapes nobody announced), replays the model's
forward pass over persistent input buffers that are updated in place; the LM
head runs outside, on the rows that are needed. Padding rows point at the null
block, so they read and write nothing real.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from vllm_spec.attention.metadata import NULL_BLOCK, AttentionMetadata
from vllm_spec.model.llama import LlamaForCausalLM

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket_for(batch: int) -> int | None:
    """The smallest bucket that holds `batch` sequences (None past the largest)."""
    i = bisect.bisect_left(BATCH_BUCKETS, batch)
    return BATCH_BUCKETS[i] if i < len(BATCH_BUCKETS) else None


def capture_graph(run: Callable[[], torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `run` (over static buffers) into a CUDA graph in `pool`; returns the graph and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: autotuning and lazy initialisation stay out of the graph
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class GraphedForward:
    """Graphs of `hidden = model(tokens)` for a fixed query length per sequence."""

    def __init__(self, model: LlamaForCausalLM, q_len: int, max_blocks: int, block_size: int,
                 max_seq_len: int, pool=None):
        self.model, self.q_len, self.block_size, self.max_seq_len = model, q_len, block_size, max_seq_len
        dev = next(model.parameters()).device
        n, tokens = BATCH_BUCKETS[-1], BATCH_BUCKETS[-1] * q_len
        long = dict(dtype=torch.long, device=dev)
        self.input_ids = torch.zeros(tokens, **long)
        self.positions = torch.zeros(tokens, **long)
        self.slot_mapping = torch.zeros(tokens, **long)
        self.seq_lens = torch.zeros(n, **long)
        self.block_tables = torch.full((n, max_blocks), NULL_BLOCK, **long)
        self.query_start_loc = torch.arange(n + 1, **long) * q_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        # Every row from here on holds padding (a replay never changes its inputs): only a batch smaller
        # than the last resets rows, those the last one filled, so a steady batch launches no reset
        # (a reset is several launches, tens of microseconds of host time each on the H200).
        self._padding_from = 0

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[: batch * self.q_len],
            max_query_len=self.q_len, max_seq_len=self.max_seq_len, block_size=self.block_size,
        )

    def _reset_padding(self, start: int, stop: int) -> None:
        """Rows [start, stop) become harmless: length q_len at positions 0.., all in the null block."""
        q = self.q_len
        self.seq_lens[start:stop] = q
        self.block_tables[start:stop] = NULL_BLOCK
        offs = torch.arange(q, device=self.positions.device).repeat(stop - start)
        self.positions[start * q: stop * q] = offs
        self.slot_mapping[start * q: stop * q] = NULL_BLOCK * self.block_size + offs % self.block_size
        self.input_ids[start * q: stop * q] = 0

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._reset_padding(0, batch)
        if self._padding_from <= batch:
            self._padding_from = 0
        md = self._metadata(batch)
        tokens = batch * self.q_len
        graph, out = capture_graph(lambda: self.model(self.input_ids[:tokens], self.positions[:tokens], md),
                                   self.pool)
        self.pool = graph.pool()
        return graph, out

    @torch.inference_mode()
    def capture(self, max_batch: int) -> None:
        """Capture every bucket up to max_batch, largest first (smaller ones reuse its pool memory)."""
        for bucket in sorted((b for b in BATCH_BUCKETS if b <= bucket_for(max_batch)), reverse=True):
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs * q_len, hidden] for a uniform batch of at most the largest bucket."""
        batch, q = md.num_seqs, self.q_len
        bucket = bucket_for(batch)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, out = self.graphs[bucket]
        tokens = batch * q
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(md.slot_mapping)
        self.seq_lens[:batch].copy_(md.seq_lens)
        self.block_tables[:batch, : md.block_tables.shape[1]].copy_(md.block_tables)
        if self._padding_from > batch:   # an earlier, larger batch's inputs: padding again, once
            self._reset_padding(batch, self._padding_from)
        self._padding_from = batch
        graph.replay()
        return out[:tokens]
