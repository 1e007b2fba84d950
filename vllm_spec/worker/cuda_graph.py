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

import numpy as np
import torch

from vllm_spec.attention.metadata import NULL_BLOCK, AttentionMetadata
from vllm_spec.model.llama import LlamaForCausalLM
from vllm_spec.worker.staging import StagingBuffer

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
    """Graphs of `hidden = model(tokens)` for a fixed query length per sequence.

    Inputs reach the graph's static buffers in one of two ways: a batch prepared on the host is
    staged (`stage`, then `replay`): written into a host mirror laid out as the buffers are and sent
    in ONE copy; inputs computed on the device (a sampled draft's next step) are copied in by
    `__call__`. The static buffers are views of one staging buffer: [ids | positions | slots |
    seq_lens | block tables (rows of max_blocks)].
    """

    def __init__(self, model: LlamaForCausalLM, q_len: int, max_blocks: int, block_size: int,
                 max_seq_len: int, pool=None):
        self.model, self.q_len, self.block_size, self.max_seq_len = model, q_len, block_size, max_seq_len
        self.max_blocks = max_blocks
        dev = next(model.parameters()).device
        n, tokens = BATCH_BUCKETS[-1], BATCH_BUCKETS[-1] * q_len
        self._tables_at = 3 * tokens + n
        self._staging = StagingBuffer(self._tables_at + n * max_blocks, dev)
        buf = self._staging.device
        self.input_ids, self.positions, self.slot_mapping = buf[:tokens], buf[tokens: 2 * tokens], \
            buf[2 * tokens: 3 * tokens]
        self.seq_lens = buf[3 * tokens: self._tables_at]
        self.block_tables = buf[self._tables_at:].view(n, max_blocks)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.long, device=dev) * q_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        # Every row from here on holds padding (a replay never changes its inputs): only a batch smaller
        # than the last resets rows, those the last one filled, so a steady batch launches no reset
        # (a reset is several launches, tens of microseconds of host time each on the H200). One mark
        # for the device buffers (inputs copied in on the device), one for the host mirror (staged).
        self._padding_from = self._host_padding_from = 0
        self._reset_host_padding(self._staging.host(), 0, n)
        self._staging.send(len(buf))
        self._staged = 0   # how many batches were staged: a replay checks it replays the latest

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

    def _reset_host_padding(self, host: np.ndarray, start: int, stop: int) -> None:
        """The mirror's rows [start, stop) become padding, as _reset_padding makes the device's."""
        q, tokens = self.q_len, len(self.input_ids)
        offs = np.tile(np.arange(q), stop - start)
        host[start * q: stop * q] = 0
        host[tokens + start * q: tokens + stop * q] = offs
        host[2 * tokens + start * q: 2 * tokens + stop * q] = NULL_BLOCK * self.block_size + offs % self.block_size
        host[3 * tokens + start: 3 * tokens + stop] = q
        host[self._tables_at + start * self.max_blocks: self._tables_at + stop * self.max_blocks] = NULL_BLOCK

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._reset_padding(0, batch)
        if self._padding_from <= batch:
            self._padding_from = 0
        tokens = batch * self.q_len
        # Metadata built inside the captured function: a backend may cache layouts on the object.
        graph, out = capture_graph(
            lambda: self.model(self.input_ids[:tokens], self.positions[:tokens], self._metadata(batch)), self.pool)
        self.pool = graph.pool()
        self._staged += 1   # the capture ran over padding: a staged batch's inputs are gone
        return graph, out

    @torch.inference_mode()
    def capture(self, max_batch: int) -> None:
        """Capture every bucket up to max_batch, largest first (smaller ones reuse its pool memory)."""
        for bucket in sorted((b for b in BATCH_BUCKETS if b <= bucket_for(max_batch)), reverse=True):
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)

    def _graph(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        bucket = bucket_for(batch)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        return self.graphs[bucket]

    @torch.inference_mode()
    def stage(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
              tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
        """Send a host-prepared batch (B sequences of q_len tokens; tables [B, width]) to the static
        buffers in one copy. Returns the device views of its ids, positions and metadata, and the
        stage number `replay` takes: they hold this batch until the next stage."""
        batch, q = len(seq_lens), self.q_len
        bucket = bucket_for(batch)
        self._graph(batch)   # a capture overwrites the buffers: before the batch is sent, not after
        host = self._staging.host()
        n_tok, width, W = batch * q, tables.shape[1], self.max_blocks
        T = len(self.input_ids)
        host[:n_tok] = tokens
        host[T: T + n_tok] = positions
        host[2 * T: 2 * T + n_tok] = slots
        host[3 * T: 3 * T + batch] = seq_lens
        # Columns past a table's width keep older ids: a row never reads past its length.
        host[self._tables_at: self._tables_at + batch * W].reshape(batch, W)[:, :width] = tables
        if self._host_padding_from > batch:
            self._reset_host_padding(host, batch, self._host_padding_from)
        self._host_padding_from = batch
        # Rows past the bucket are not read by its graph: their tables are not sent.
        self._staging.send(self._tables_at + bucket * W)
        # The device's rows past this batch are padding now, but for tables past the bucket.
        self._padding_from = max(self._padding_from, batch)
        self._staged += 1
        md = AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch, :width], slot_mapping=self.slot_mapping[:n_tok],
            max_query_len=q, max_seq_len=int(seq_lens.max()), block_size=self.block_size)
        return self.input_ids[:n_tok], self.positions[:n_tok], md, self._staged

    @torch.inference_mode()
    def replay(self, batch: int, stage: int) -> torch.Tensor:
        """Hidden states [batch * q_len, hidden] of the batch `stage` sent (it must be the latest)."""
        if stage != self._staged:
            raise RuntimeError(f"the q_len={self.q_len} graph's inputs were restaged since this batch was prepared")
        graph, out = self._graph(batch)
        graph.replay()
        return out[: batch * self.q_len]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs * q_len, hidden] for a uniform batch of at most the largest bucket,
        its inputs on the device."""
        batch, q = md.num_seqs, self.q_len
        graph, out = self._graph(batch)
        tokens = batch * q
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(md.slot_mapping)
        self.seq_lens[:batch].copy_(md.seq_lens)
        self.block_tables[:batch, : md.block_tables.shape[1]].copy_(md.block_tables)
        if self._padding_from > batch:   # an earlier, larger batch's inputs: padding again, once
            self._reset_padding(batch, self._padding_from)
        self._padding_from = batch
        self._staged += 1   # a staged batch's inputs are gone
        graph.replay()
        return out[:tokens]
