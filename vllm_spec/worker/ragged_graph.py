"""CUDA graphs for decoding batches whose sequences feed different numbers of tokens.

A verification where each sequence drafted its own k feeds 1..K+1 tokens per sequence; eagerly such a
pass ran at 13-24 ms where the graph of a batch padded to K+1 tokens each took 8 ms (H200, 8B shape,
batch 32). The Triton attention kernel reads query starts and lengths on the device and takes its
grid from host ints only (the sequences, the longest query), so one graph per (batch-size bucket,
token bucket) replays every such batch: query_start_loc is a static buffer like the others, rows past
the batch feed no tokens, and the tokens past the batch's own up to the bucket's count belong to one
more row, a sink past the bucket's (positions from 0, its K/V in the null block, outputs never read:
the Triton kernel skips those past its query tiles, the CPU decoder computes them). A token
bucket pads a small share of what it runs (_TOKEN_STEPS), where padding to the longest draft adds up
to K - k tokens to every sequence that drafted k.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_spec.attention.metadata import NULL_BLOCK, AttentionMetadata
from vllm_spec.model.causal_lm import CausalLM
from vllm_spec.worker import cuda_graph
from vllm_spec.worker.cuda_graph import BATCH_BUCKETS, bucket_for, buckets_up_to
from vllm_spec.worker.staging import StagingBuffer
from vllm_spec.worker.token_counts import TokenPadding

# Token buckets split the span a batch-size bucket's passes may run (1 to max_q tokens per sequence)
# into this many steps (of this many tokens at least): what a pass pads is small against what it runs
# (under 1/16 of a sequence's drafts per sequence), and each batch bucket has at most 17 graphs.
_TOKEN_STEPS = 16
_MIN_TOKEN_STEP = 16


def token_step(bucket: int, max_q: int) -> int:
    """The spacing of the token buckets of a batch-size bucket."""
    return max(_MIN_TOKEN_STEP, bucket * (max_q - 1) // _TOKEN_STEPS)


def sink_fits(max_blocks: int, block_size: int, max_q: int) -> bool:
    """Whether a block-table row holds the sink's longest run (fewer tokens than the largest step):
    else ragged batches run eagerly (models of a few dozen tokens' context)."""
    return max_blocks * block_size >= token_step(BATCH_BUCKETS[-1], max_q)


def token_bucket(tokens: int, bucket: int, max_q: int) -> int:
    """The query tokens a batch of `tokens` in batch-size bucket `bucket` runs (at most bucket * max_q)."""
    step = token_step(bucket, max_q)
    return min(-(-tokens // step) * step, bucket * max_q)


def token_buckets(bucket: int, max_q: int) -> list[int]:
    """Every token bucket a batch of this batch-size bucket may run (its batches hold more sequences
    than the bucket below, each feeding at least one token)."""
    i = BATCH_BUCKETS.index(bucket)
    fewest = BATCH_BUCKETS[i - 1] + 1 if i else 1
    return sorted({token_bucket(t, bucket, max_q) for t in range(fewest, bucket * max_q + 1)})


class RaggedGraphedForward:
    """Graphs of `hidden = model(tokens)` for batches of at most max_q tokens per sequence.

    The static buffers are views of one staging buffer, [ids | positions | slots | seq_lens |
    query_start_loc] then the block tables (a row more than the largest bucket's: the sink's), written
    by `stage` and sent in one copy; `replay` runs the staged batch's graph. Every graph writes its
    hidden states into one output buffer (its own activations are pool memory the next capture reuses).
    """

    logits = False   # (the graphs end with hidden states: the rows a caller needs go to the LM head)

    def __init__(self, model: CausalLM, max_q: int, max_blocks: int, block_size: int,
                 max_seq_len: int, pool=None, padding: TokenPadding | None = None):
        """padding: where a token bucket's pass runs faster at a few more tokens (token_counts), the
        graph runs those (the sink takes them, up to what its block-table row holds)."""
        self.model, self.max_q, self.block_size, self.max_seq_len = model, max_q, block_size, max_seq_len
        self.padding, self._row_tokens = padding, max_blocks * block_size
        self._runs: dict[tuple[int, int], int] = {}   # (batch bucket, token bucket) -> tokens its graph runs
        dev = next(model.parameters()).device
        n, tokens = BATCH_BUCKETS[-1] + 1, BATCH_BUCKETS[-1] * max_q   # (n rows: the sink's too)
        self._staging = StagingBuffer(3 * tokens + 2 * n + 1, n, max_blocks, dev)
        buf = self._staging.device
        self._T = tokens
        self.input_ids, self.positions, self.slot_mapping = buf[:tokens], buf[tokens: 2 * tokens], \
            buf[2 * tokens: 3 * tokens]
        self.seq_lens = buf[3 * tokens: 3 * tokens + n]
        self.query_start_loc = buf[3 * tokens + n: 3 * tokens + 2 * n + 1]
        self.block_tables = self._staging.tables
        self.out: torch.Tensor | None = None   # [tokens, hidden], allocated by the first capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self._staged = 0     # how many batches were staged: a replay checks it replays the latest
        self._staged_key: tuple[int, int] | None = None
        self._staged_tokens = 0

    def _metadata(self, bucket: int, tokens: int) -> AttentionMetadata:
        """The graph's metadata: the bucket's rows and the sink."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 2], seq_lens=self.seq_lens[: bucket + 1],
            block_tables=self.block_tables[: bucket + 1], slot_mapping=self.slot_mapping[:tokens],
            max_query_len=self.max_q, max_seq_len=self.max_seq_len, block_size=self.block_size)

    def _write(self, batch: int, key: tuple[int, int], tokens: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, seq_lens: np.ndarray, qsl: np.ndarray) -> np.ndarray:
        """Write a batch of `batch` rows into the host mirror, and its graph's padding: the bucket's
        rows past the batch feed nothing, the sink row takes the tokens up to the token bucket."""
        bucket, padded = key
        host, T, n = self._staging.host(), self._T, len(self.seq_lens)
        real = len(tokens)
        host[:real] = tokens
        host[T: T + real] = positions
        host[2 * T: 2 * T + real] = slots
        offs = np.arange(padded - real)
        host[real: padded] = 0
        host[T + real: T + padded] = offs
        host[2 * T + real: 2 * T + padded] = NULL_BLOCK * self.block_size + offs % self.block_size
        host[3 * T: 3 * T + batch] = seq_lens
        host[3 * T + batch: 3 * T + bucket] = 0
        host[3 * T + bucket] = padded - real   # the sink
        host[3 * T + n: 3 * T + n + batch + 1] = qsl
        host[3 * T + n + batch + 1: 3 * T + n + bucket + 1] = real
        host[3 * T + n + bucket + 1] = padded
        return host

    def _capture(self, key: tuple[int, int]) -> torch.cuda.CUDAGraph:
        bucket, padded = key
        # Captured over a batch of the bucket's rows feeding `padded` tokens (at most max_q each, at
        # positions from 0, K/V into the null block): what the graph runs depends on the shapes alone,
        # and no row reads past a block-table row.
        q = np.full(bucket, padded // bucket, dtype=np.int64)
        q[: padded % bucket] += 1
        qsl = np.concatenate([[0], np.cumsum(q)])
        offsets = np.arange(padded) - np.repeat(qsl[:-1], q)
        slots = NULL_BLOCK * self.block_size + offsets % self.block_size
        self._write(bucket, key, np.zeros(padded, dtype=np.int64), offsets, slots, q, qsl)
        self._staging.send(np.zeros((0, 1), dtype=np.int64), bucket + 1)

        def run() -> torch.Tensor:
            hidden = self.model(self.input_ids[:padded], self.positions[:padded], self._metadata(bucket, padded))
            if self.out is None:   # (on the first warm-up run: outside any graph's pool)
                self.out = hidden.new_empty((self._T, hidden.shape[1]))
            return self.out[:padded].copy_(hidden)

        graph, _ = cuda_graph.capture_graph(run, self.pool)
        self.pool = graph.pool()
        self._staged += 1   # the capture ran over padding: a staged batch's inputs are gone
        return graph

    @torch.inference_mode()
    def capture(self, max_batch: int) -> None:
        """Capture every (batch bucket, token bucket) up to max_batch, largest first (smaller ones
        reuse its pool memory)."""
        for bucket in reversed(buckets_up_to(max_batch)):
            for padded in sorted({self._run(bucket, t) for t in token_buckets(bucket, self.max_q)}, reverse=True):
                self._graph((bucket, padded))

    def _graph(self, key: tuple[int, int]) -> torch.cuda.CUDAGraph:
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        return self.graphs[key]

    def key(self, batch: int, tokens: int) -> tuple[int, int]:
        bucket = bucket_for(batch)
        return bucket, self._run(bucket, token_bucket(tokens, bucket, self.max_q))

    def _run(self, bucket: int, tokens: int) -> int:
        """The tokens the graph of a token bucket runs: the bucket's, or more where they run faster. (The
        sink takes up to a step's tokens below the bucket's and the padding: one block-table row holds
        them, and the rotary tables their positions.)"""
        if self.padding is None:
            return tokens
        # (Asked at every stage and by the scorer before it: a lookup on the host's path, not a search.)
        run = self._runs.get((bucket, tokens))
        if run is None:
            room = min(self._row_tokens, self.max_seq_len)
            limit = min(bucket * self.max_q, tokens + room - token_step(bucket, self.max_q))
            run = self._runs[(bucket, tokens)] = self.padding.padded(tokens, limit)
        return run

    @torch.inference_mode()
    def stage(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
              qsl: np.ndarray, tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
        """Send a host-prepared batch (query starts qsl [B+1], each sequence at most max_q tokens) to the
        static buffers in one copy. Returns the device views of its ids, positions and metadata, and the
        stage number `replay` takes: they hold this batch until the next stage or capture."""
        batch, real = len(seq_lens), len(tokens)
        key = self.key(batch, real)
        self._graph(key)   # a capture overwrites the buffers: before the batch is sent, not after
        self._write(batch, key, tokens, positions, slots, seq_lens, qsl)
        self._staging.send(tables, key[0] + 1)
        self._staged += 1
        self._staged_key, self._staged_tokens = key, real
        md = AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch, : tables.shape[1]], slot_mapping=self.slot_mapping[:real],
            max_query_len=int((qsl[1:] - qsl[:-1]).max()), max_seq_len=int(seq_lens.max()),
            block_size=self.block_size)
        return self.input_ids[:real], self.positions[:real], md, self._staged

    def tokens_run(self, batch: int, tokens: int) -> int:
        """The query tokens the graph of such a batch runs."""
        return self.key(batch, tokens)[1]

    @torch.inference_mode()
    def replay(self, batch: int, stage: int) -> torch.Tensor:
        """Hidden states [tokens, hidden] of the batch `stage` sent (it must be the latest)."""
        if stage != self._staged:
            raise RuntimeError("the ragged graphs' inputs were restaged since this batch was prepared")
        self.graphs[self._staged_key].replay()
        return self.out[: self._staged_tokens]
