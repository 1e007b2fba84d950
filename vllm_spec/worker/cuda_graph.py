"""CUDA graphs for batches whose sequences all feed the same number of tokens.

Plain decode (1 token per sequence), verification (k+1) and draft steps are
such batches. One graph per (query length, batch-size bucket), captured at
start-up (or on first use for shapes nobody announced), replays the model's
forward pass over persistent input buffers that are updated in place; the LM
head runs outside, on the rows that are needed, except in graphs whose every row
is needed (a target's plain decode: `logits`). Padding rows write their K/V into
the null block, so they change nothing real.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from vllm_spec.attention.metadata import NULL_BLOCK, AttentionMetadata
from vllm_spec.model.causal_lm import CausalLM
from vllm_spec.worker.staging import StagingBuffer

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket_for(batch: int) -> int | None:
    """The smallest bucket that holds `batch` sequences (None past the largest)."""
    i = bisect.bisect_left(BATCH_BUCKETS, batch)
    return BATCH_BUCKETS[i] if i < len(BATCH_BUCKETS) else None


def buckets_up_to(batch: int) -> list[int]:
    """The buckets a batch of at most `batch` sequences may use (every one past the largest: larger
    batches run eagerly)."""
    largest = bucket_for(batch) or BATCH_BUCKETS[-1]
    return [b for b in BATCH_BUCKETS if b <= largest]


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
    seq_lens] then the block tables.

    Rows of a bucket past the batch are padding: q_len tokens at positions 0.. whose K/V go to the
    null block. Their block-table rows are not reset: whatever ids they hold are blocks of this
    cache, read for rows whose outputs are discarded, and written by nothing (the slots say where).
    """

    def __init__(self, model: CausalLM, q_len: int, max_blocks: int, block_size: int,
                 max_seq_len: int, pool=None, logits: bool = False):
        """logits: the graphs end with the LM head (outputs are logits, not hidden states)."""
        self.model, self.q_len, self.block_size, self.max_seq_len = model, q_len, block_size, max_seq_len
        self.logits = logits
        dev = next(model.parameters()).device
        n, tokens = BATCH_BUCKETS[-1], BATCH_BUCKETS[-1] * q_len
        self._staging = StagingBuffer(3 * tokens + n, n, max_blocks, dev)
        buf = self._staging.device
        self.input_ids, self.positions, self.slot_mapping = buf[:tokens], buf[tokens: 2 * tokens], \
            buf[2 * tokens: 3 * tokens]
        self.seq_lens = buf[3 * tokens: 3 * tokens + n]
        self.block_tables = self._staging.tables
        self.query_start_loc = torch.arange(n + 1, dtype=torch.long, device=dev) * q_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        # Rows from here on hold padding, in the host mirror and in the device's buffers. Only a
        # batch smaller than the last makes rows padding again, so a steady batch resets nothing.
        self._padding_from = n
        self._reset_padding(0)
        self._staged = 0   # how many batches were staged: a replay checks it replays the latest
        # Views of the static buffers and outputs by batch shape: a steady batch slices nothing (a
        # tensor slice costs the host 2.5-5.5 µs, and a step took eight).
        self._input_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._output_views: dict[int, torch.Tensor] = {}

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[: batch * self.q_len],
            max_query_len=self.q_len, max_seq_len=self.max_seq_len, block_size=self.block_size,
        )

    def _pad_host(self, start: int) -> np.ndarray:
        """The mirror's rows from `start` on become padding (the device's too, once it is sent);
        returns the mirror."""
        host, stop = self._staging.host(), self._padding_from
        if stop > start:
            q, tokens = self.q_len, len(self.input_ids)
            offs = np.tile(np.arange(q), stop - start)
            host[start * q: stop * q] = 0
            host[tokens + start * q: tokens + stop * q] = offs
            host[2 * tokens + start * q: 2 * tokens + stop * q] = NULL_BLOCK * self.block_size + offs % self.block_size
            host[3 * tokens + start: 3 * tokens + stop] = q
        self._padding_from = start
        return host

    def _reset_padding(self, start: int) -> None:
        """The device's rows from `start` on become padding (the mirror's, sent in one copy)."""
        self._pad_host(start)
        self._staging.send()

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._reset_padding(0)
        tokens = batch * self.q_len
        def run() -> torch.Tensor:
            # Metadata built inside the captured function: a backend may cache layouts on the object.
            hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], self._metadata(batch))
            return self.model.compute_logits(hidden) if self.logits else hidden

        graph, out = capture_graph(run, self.pool)
        self.pool = graph.pool()
        self._staged += 1   # the capture ran over padding: a staged batch's inputs are gone
        return graph, out

    @torch.inference_mode()
    def capture(self, max_batch: int) -> None:
        """Capture every bucket up to max_batch, largest first (smaller ones reuse its pool memory)."""
        for bucket in reversed(buckets_up_to(max_batch)):
            self._graph(bucket)

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
        stage number `replay` takes: they hold this batch until the next stage, capture or call."""
        batch, q = len(seq_lens), self.q_len
        self._graph(batch)   # a capture overwrites the buffers: before the batch is sent, not after
        host = self._pad_host(batch)
        n_tok, T = batch * q, len(self.input_ids)
        host[:n_tok] = tokens
        host[T: T + n_tok] = positions
        host[2 * T: 2 * T + n_tok] = slots
        host[3 * T: 3 * T + batch] = seq_lens
        self._staging.send(tables, batch)
        self._staged += 1
        width = tables.shape[1]
        views = self._input_views.get((batch, width))
        if views is None:
            views = self._input_views[(batch, width)] = (
                self.input_ids[:n_tok], self.positions[:n_tok], self.query_start_loc[: batch + 1],
                self.seq_lens[:batch], self.block_tables[:batch, :width], self.slot_mapping[:n_tok])
        input_ids, positions, query_start_loc, lens, block_tables, slot_mapping = views
        md = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=lens, block_tables=block_tables, slot_mapping=slot_mapping,
            max_query_len=q, max_seq_len=int(seq_lens.max()), block_size=self.block_size)
        return input_ids, positions, md, self._staged

    def tokens_run(self, batch: int, tokens: int) -> int:
        """The query tokens counted for such a batch (its bucket's padding rows are not)."""
        return tokens

    @torch.inference_mode()
    def replay(self, batch: int, stage: int) -> torch.Tensor:
        """Hidden states [batch * q_len, hidden] (logits [batch * q_len, vocab] with `logits`) of the
        batch `stage` sent (it must be the latest)."""
        if stage != self._staged:
            raise RuntimeError(f"the q_len={self.q_len} graph's inputs were restaged since this batch was prepared")
        graph, out = self._graph(batch)
        graph.replay()
        return self._output_view(batch, out)

    def _output_view(self, batch: int, out: torch.Tensor) -> torch.Tensor:
        """The batch's rows of its bucket's output."""
        view = self._output_views.get(batch)
        if view is None:
            view = self._output_views[batch] = out[: batch * self.q_len]
        return view

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs * q_len, hidden] (logits with `logits`) for a uniform batch of at
        most the largest bucket, its inputs on the device."""
        batch, q = md.num_seqs, self.q_len
        graph, out = self._graph(batch)
        if self._padding_from > batch:   # an earlier, larger batch's inputs: padding again, once
            self._reset_padding(batch)
        tokens = batch * q
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(md.slot_mapping)
        self.seq_lens[:batch].copy_(md.seq_lens)
        self.block_tables[:batch, : md.block_tables.shape[1]].copy_(md.block_tables)
        self._padding_from = batch
        self._staged += 1   # a staged batch's inputs are gone
        graph.replay()
        return self._output_view(batch, out)
