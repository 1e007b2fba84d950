"""The whole greedy proposal of a decoding batch as ONE device program (one CUDA graph).

In the steady state every speculating sequence feeds the draft one or two tokens
(the target's correction, or the last draft and the bonus token after a fully
accepted step). Rows that feed one are front-padded with the token before it,
whose K/V the draft already holds (recomputing it rewrites the same values), so
every row feeds exactly two: then the catch-up forward, the K-1 one-token draft
steps, the LM heads, the argmaxes and the advance of positions and slots all
run on the device from a handful of static buffers. The host writes those
buffers once, replays one graph per (K, batch bucket) and reads nothing back.
Without CUDA graphs (CPU, enforce_eager) the same code runs eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_spec.attention.metadata import AttentionMetadata, compute_slot_mapping
from vllm_spec.model.causal_lm import CausalLM
from vllm_spec.sample.argmax import argmax_rows
from vllm_spec.worker.cuda_graph import BATCH_BUCKETS, bucket_for, capture_graph
from vllm_spec.worker.staging import StagingBuffer


_NO_TABLES = np.zeros((0, 1), dtype=np.int64)   # every row sent as padding


class GreedyDraftLoop:
    """Greedy drafts [B, K] for decoding rows that feed the draft their last two tokens."""

    def __init__(self, model: CausalLM, max_blocks: int, block_size: int, max_model_len: int,
                 use_graphs: bool, pool=None):
        self.model, self.block_size, self.max_model_len = model, block_size, max_model_len
        # A draft sharded over ranks gathers its logits: a collective kept out of graphs.
        self.use_graphs = use_graphs and model.lm_head.tp.world_size == 1
        dev = next(model.parameters()).device
        n = self._rows = BATCH_BUCKETS[-1]
        # The static buffers: views of one staging buffer the host fills and sends in one copy,
        # [tokens (n x 2) | first positions | limits] then the block tables.
        self._staging = StagingBuffer(4 * n, n, max_blocks, dev)
        buf = self._staging.device
        self.tokens = buf[: 2 * n].view(n, 2)             # [t_{p-1}, t_p] per row
        self.first_pos = buf[2 * n: 3 * n]                 # p - 1
        self.limits = buf[3 * n: 4 * n]                    # last position a row's draft steps may write
        self.block_tables = self._staging.tables
        self._host_padding_from = n   # the mirror's rows from here on are padding
        self._pad_host(0)
        self._staging.send(_NO_TABLES, n)
        # (batch bucket, k) -> the graph and its drafts tensor (in the graph's pool)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool

    def _run(self, batch: int, k: int, max_seq_len: int) -> torch.Tensor:
        """The device program over the first `batch` rows of the static buffers: drafts [batch, k].

        Every position the program feeds is known up front (p-1 and p, then one per draft
        step, clamped to the row's limit), so slots and lengths are computed once, not per step.
        """
        dev = self.tokens.device
        tables = self.block_tables[:batch]
        steps = torch.arange(k + 1, device=dev)
        rows = torch.arange(batch, device=dev)
        positions = torch.minimum(self.first_pos[:batch, None] + steps, self.limits[:batch, None])   # [B, k+1]
        slots = compute_slot_mapping(tables, rows[:, None], positions, self.block_size)
        by_step = torch.stack([positions, slots], dim=0).transpose(1, 2).contiguous()    # [2, k+1, B]

        def metadata(q_len: int, lens: torch.Tensor, slot_mapping: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(
                query_start_loc=torch.arange(batch + 1, device=dev) * q_len, seq_lens=lens, block_tables=tables,
                slot_mapping=slot_mapping, max_query_len=q_len, max_seq_len=max_seq_len,
                block_size=self.block_size)

        # Catch-up: [t_{p-1}, t_p] per row; the draft follows the row's last token.
        md = metadata(2, positions[:, 1] + 1, slots[:, :2].reshape(-1))
        hidden = self.model(self.tokens[:batch].reshape(-1), positions[:, :2].reshape(-1), md)
        token = self.model.token_ids_of(argmax_rows(self.model.compute_logits(hidden[1::2])))
        drafts = [token]
        lens = by_step[0] + 1
        for j in range(2, k + 1):
            md = metadata(1, lens[j], by_step[1, j])
            logits = self.model.compute_logits(self.model(token, by_step[0, j], md))
            token = self.model.token_ids_of(argmax_rows(logits))
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _capture(self, batch: int, k: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._pad_host(0)
        self._staging.send(_NO_TABLES, batch)
        graph, drafts = capture_graph(lambda: self._run(batch, k, self.max_model_len), self.pool)
        self.pool = graph.pool()
        return graph, drafts

    @torch.inference_mode()
    def capture(self, max_k: int, max_batch: int) -> None:
        """Graphs for every K <= max_k and batch bucket <= max_batch, largest first (pool reuse)."""
        if not self.use_graphs:
            return
        for bucket in sorted((b for b in BATCH_BUCKETS if b <= bucket_for(max_batch)), reverse=True):
            for k in range(max_k, 0, -1):
                if (bucket, k) not in self.graphs:
                    self.graphs[(bucket, k)] = self._capture(bucket, k)

    def _pad_host(self, start: int) -> np.ndarray:
        """The mirror's rows from `start` on feed token 0 at positions 0, 1 (their block-table rows
        are sent as the null block: a row's slots come from its table); returns the mirror."""
        host, stop, n = self._staging.host(), self._host_padding_from, self._rows
        if stop > start:
            host[2 * start: 2 * stop] = 0
            host[2 * n + start: 2 * n + stop] = 0
            host[3 * n + start: 3 * n + stop] = 1
        self._host_padding_from = start
        return host

    @torch.inference_mode()
    def __call__(self, tokens: np.ndarray, first_pos: np.ndarray, limits: np.ndarray, block_tables: np.ndarray,
                 k: int, max_seq_len: int) -> torch.Tensor:
        """tokens [B, 2] at positions first_pos, first_pos + 1 (host arrays, sent in one copy);
        drafts [B, k] (greedy) on the device: a graph's output, valid until the next call (readers
        queued on the device before it read them in order; no copy, a launch costs the host)."""
        batch, n = len(first_pos), self._rows
        bucket = bucket_for(batch)
        graphed = self.use_graphs and (bucket, k) in self.graphs
        host = self._pad_host(batch)
        host[: 2 * batch] = tokens.ravel()
        host[2 * n: 2 * n + batch] = first_pos
        host[3 * n: 3 * n + batch] = limits
        self._staging.send(block_tables, bucket)   # the bucket's rows past the batch: the null block
        if not graphed:
            return self._run(batch, k, max_seq_len)
        graph, drafts = self.graphs[(bucket, k)]
        graph.replay()
        return drafts[:batch]
