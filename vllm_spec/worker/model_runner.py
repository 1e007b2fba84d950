"""Runs one model over a flat batch of sequences against its paged KV cache."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from vllm_spec.attention import torch_backend
from vllm_spec.attention.layer import select_backend
from vllm_spec.attention.metadata import AttentionMetadata, compute_slot_mapping
from vllm_spec.config import MAX_SPECULATIVE_TOKENS
from vllm_spec.model import gemv
from vllm_spec.model.causal_lm import CausalLM
from vllm_spec.sample.argmax import argmax_rows
from vllm_spec.worker.batch import BatchColumns, SeqInput
from vllm_spec.worker.block_table import BlockTableArray
from vllm_spec.worker.cuda_graph import GraphedForward, bucket_for, buckets_up_to
from vllm_spec.worker.ragged_graph import RaggedGraphedForward, sink_fits, token_buckets
from vllm_spec.worker.token_counts import GRID, TokenPadding, profile_linear


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor    # [T]
    positions: torch.Tensor    # [T]
    md: AttentionMetadata
    uniform_q: int | None      # tokens per sequence when every sequence feeds the same number
    token_starts: list[int]    # host copy of query_start_loc[:-1]: each sequence's first row
    last_rows: np.ndarray      # int64 [B]: each sequence's last row (where its next token is sampled)
    host_tokens: np.ndarray    # int64 [T]: input_ids as sent (PLACEHOLDER_TOKEN where a token is in flight)
    # The graph whose static buffers hold the inputs (views of them above), and its stage number.
    graph: GraphedForward | RaggedGraphedForward | None = None
    stage: int = 0


# Graphs serve decode and verification (at most k+1 tokens per sequence) and the query lengths
# announced by capture_graphs (the draft's catch-ups): a uniform prefill runs eagerly rather than
# capturing a graph for its prompt length.
MAX_GRAPH_QUERY_LEN = MAX_SPECULATIVE_TOKENS + 1
# A uniform batch runs in a ragged graph where that graph's matmuls take at most this share of the
# uniform graph's (token_counts): a ragged pass of as many tokens cost 7-9% more on an H100.
_RAGGED_GAIN = 0.85


class ModelRunner:
    """Owns a model and its KV cache; knows batches and blocks, not requests.

    With `cuda_graphs` on, uniform batches (decode, verification, draft steps) replay
    CUDA graphs, and so do batches of at most max_q tokens per sequence once ragged graphs for
    max_q were captured (capture_ragged: verification with k per sequence); anything else runs eagerly.
    """

    def __init__(self, model: CausalLM, device: torch.device, block_size: int,
                 max_model_len: int, cuda_graphs: bool = False, graph_logits: bool = False):
        """graph_logits: one-token-per-sequence graphs end with the LM head. A target's plain decode
        step wants the logits of every row, so its LM head runs in the graph, off the host's path
        (launching it took the host 34-87 µs a step on an H200)."""
        self.model = model
        self.graph_logits = graph_logits
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = 0
        # (The torch attention, where the Triton kernels are not used, reads lengths on the host: eager only.)
        dtype = model.embed_tokens.weight.dtype
        self.cuda_graphs = (cuda_graphs and device.type == "cuda"
                            and select_backend(device, model.config.head_dim, dtype) is not torch_backend)
        if device.type == "cpu":
            model.pack_for_cpu()
        self._graphs: dict[int, GraphedForward] = {}
        self._ragged: RaggedGraphedForward | None = None
        self._via_ragged: dict[tuple[int, int], bool] = {}   # (sequences, q) -> uniform batches run ragged
        self._graph_pool = None
        # Kept across steps (see block_table); a speculative worker lends it to the draft's loop,
        # which drafts for the batch this runner then verifies.
        self.block_tables = BlockTableArray()

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width that fits the longest sequence plus its lookahead slots."""
        return -(-(self.max_model_len + MAX_SPECULATIVE_TOKENS) // self.block_size)

    def kv_bytes_per_block(self, dtype: torch.dtype) -> int:
        attn = self.model.attention_layers()
        per_layer = 2 * self.block_size * attn[0].num_kv_heads * attn[0].head_dim
        return per_layer * len(attn) * torch.empty(0, dtype=dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        # Zeroed so that never-written slots (masked out) cannot hold NaN bit patterns.
        self.num_blocks = num_blocks
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        attn = self.model.attention_layers()[0]
        backend = attn.backend_for(attn.k_cache)
        if hasattr(backend, "warm_up"):   # compiled kernels (Triton): compile them before serving
            # Once per window the layers use (Qwen2 may window some layers only).
            for window in {a.sliding_window: None for a in self.model.attention_layers()}:
                backend.warm_up(attn.num_heads, attn.k_cache, attn.v_cache, attn.scale, window, dtype, attn.softcap)
            self._warm_up_argmax(dtype)
            self._warm_up_gate_up(dtype)

    @torch.inference_mode()
    def _warm_up_argmax(self, dtype: torch.dtype) -> None:
        """Compile the argmax of this model's logits (greedy rows: the model's dtype; sampled rows:
        float32) before serving: a compile mid-serving stalls a step for about half a second."""
        logits = self.model.compute_logits(torch.zeros(1, self.model.config.hidden_size, dtype=dtype,
                                                       device=self.device))
        argmax_rows(logits)
        argmax_rows(logits.float())

    def _warm_up_gate_up(self, dtype: torch.dtype) -> None:
        """Compile the MLP's gate/up-with-SiLU·mul kernel for its row tilings before serving (a dense layer's: a
        mixture of experts' sparse layers and OPT's MLPs have none)."""
        gate_up = next((layer.mlp.gate_up_proj for layer in self.model.layers
                        if hasattr(getattr(layer, "mlp", None), "gate_up_proj")), None)
        if gate_up is None:
            return
        rows = torch.zeros(gemv.GATE_UP_MIN_ROWS, gate_up.weight.shape[1], dtype=dtype, device=self.device)
        if gemv.gate_up_eligible(rows, gate_up.weight):
            gemv.warm_up_gate_up(gate_up.weight, gate_up.bias)

    def prepare(self, seqs: list[SeqInput], use_graph: bool = True, placeholders: np.ndarray | None = None,
                columns: BatchColumns | None = None) -> PreparedBatch:
        """Flatten the sequences' new tokens and build the attention metadata.

        Everything is assembled on the host and sent in ONE copy; the device tensors are views into
        it. A batch a CUDA graph will replay is written straight into that graph's static buffers
        (valid until that graph's buffers are next written: the next prepare of the same query
        length, a capture, or a call with device inputs); use_graph=False keeps it off graphs.
        `placeholders` (int64 [B]): that many token 0s after each sequence's new tokens, for the
        caller to fill on the device (a verification's drafts). `columns`: the sequences' columns, where
        the caller has them.
        """
        B = len(seqs)
        columns = columns or BatchColumns.of(seqs)
        fed, starts = columns.num_new, columns.start_pos
        q_lens = fed if placeholders is None else fed + placeholders
        T = int(q_lens.sum())
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        tables = self.block_tables(seqs)
        width = tables.shape[1]
        req_idx, offsets = ragged_grid(q_lens)
        positions = starts[req_idx] + offsets
        slots = compute_slot_mapping(tables, req_idx, positions, self.block_size)
        new_tokens = itertools.chain.from_iterable(s.token_ids for s in seqs)
        if placeholders is None:
            tokens = np.fromiter(new_tokens, dtype=np.int64, count=T)
        else:
            tokens = np.zeros(T, dtype=np.int64)
            rows, cols = ragged_grid(fed)
            tokens[qsl[rows] + cols] = np.fromiter(new_tokens, dtype=np.int64, count=len(rows))
        seq_lens = starts + q_lens
        uniform = int(q_lens[0]) if (q_lens == q_lens[0]).all() else None
        graph = self.graph_for(uniform, B) if uniform and use_graph and not self._runs_ragged(B, uniform) else None
        if graph is not None:
            input_ids, pos_t, md, stage = graph.stage(tokens, positions, slots, seq_lens, tables)
            return PreparedBatch(input_ids, pos_t, md, uniform, qsl[:-1].tolist(), qsl[1:] - 1, tokens, graph, stage)
        ragged = self.ragged_for(B, int(q_lens.max())) if use_graph and graph is None else None
        if ragged is not None:
            input_ids, pos_t, md, stage = ragged.stage(tokens, positions, slots, seq_lens, qsl, tables)
            return PreparedBatch(input_ids, pos_t, md, uniform, qsl[:-1].tolist(), qsl[1:] - 1, tokens, ragged, stage)
        input_ids, pos_t, slot_t, qsl_t, lens_t, tables_t = to_device_aligned(
            [tokens, positions, slots, qsl, seq_lens, tables.ravel()], self.device)
        md = AttentionMetadata(
            query_start_loc=qsl_t, seq_lens=lens_t, block_tables=tables_t.view(B, width), slot_mapping=slot_t,
            max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()), block_size=self.block_size,
        )
        return PreparedBatch(input_ids, pos_t, md, uniform, qsl[:-1].tolist(), qsl[1:] - 1, tokens)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden[rows])

    def graph_for(self, q_len: int, num_seqs: int) -> GraphedForward | None:
        """The graph runner for this batch shape, or None when it must run eagerly."""
        if not self.cuda_graphs or bucket_for(num_seqs) is None:
            return None
        graph = self._graphs.get(q_len)
        if graph is None and q_len <= MAX_GRAPH_QUERY_LEN:
            graph = self._new_graph(q_len)
        return graph

    def ragged_for(self, num_seqs: int, max_q: int) -> RaggedGraphedForward | None:
        """The ragged graphs for a batch of num_seqs sequences feeding at most max_q tokens each, or None
        (none captured, or the batch is past them)."""
        ragged = self._ragged
        if ragged is None or max_q > ragged.max_q or bucket_for(num_seqs) is None:
            return None
        return ragged

    def _runs_ragged(self, num_seqs: int, q_len: int) -> bool:
        """Whether a uniform batch of q_len > 1 tokens a sequence runs in a ragged graph rather than its
        uniform one: where its bucket's token count is one the matmuls run slowly at and the ragged
        graph's count is clearly faster (_RAGGED_GAIN: a ragged pass's attention costs more)."""
        ragged = self.ragged_for(num_seqs, q_len) if q_len > 1 else None
        if ragged is None or ragged.padding is None:
            return False
        key = (num_seqs, q_len)
        if key not in self._via_ragged:
            profile, uniform = ragged.padding, bucket_for(num_seqs) * q_len
            run = ragged.tokens_run(num_seqs, num_seqs * q_len)
            self._via_ragged[key] = profile.covers(run) and profile.covers(uniform) and \
                profile.seconds_at(run) < _RAGGED_GAIN * profile.seconds_at(uniform)
        return self._via_ragged[key]

    @staticmethod
    def tokens_run(batch: PreparedBatch) -> int:
        """The query tokens the forward of a prepared batch runs (a ragged graph's padding included)."""
        T = int(batch.input_ids.shape[0])
        return T if batch.graph is None else batch.graph.tokens_run(batch.md.num_seqs, T)

    def capture_ragged(self, max_q: int, max_batch: int) -> None:
        """Capture up front the graphs of batches of at most max_batch sequences feeding 1..max_q tokens
        each (every token bucket: no step pays for a capture)."""
        if not self.cuda_graphs or not sink_fits(self.max_blocks_per_seq, self.block_size, max_q):
            return
        self._ragged = RaggedGraphedForward(self.model, max_q, self.max_blocks_per_seq, self.block_size,
                                            self.max_model_len, self._pool(), self._token_padding(max_q, max_batch))
        self._ragged.capture(max_batch)
        self._via_ragged.clear()

    def _token_padding(self, max_q: int, max_batch: int) -> TokenPadding | None:
        """The model's matmul times per token count (token_counts), on a GPU with a single rank: tensor-
        parallel ranks would time theirs apart and could pick different counts for passes that must match."""
        if (self.device.type != "cuda" or self.model.lm_head.tp.world_size > 1
                or self.model.config.moe is not None):   # (profile_linear times a dense MLP's products)
            return None
        buckets = buckets_up_to(max_batch)
        # Every count a uniform graph (q > 1) or a ragged token bucket runs, and the grid to pad to.
        counts = {b * q for b in buckets for q in range(2, max_q + 1)}
        counts |= {t for b in buckets for t in token_buckets(b, max_q)}
        counts |= set(range(GRID, max(counts) + GRID, GRID))
        return profile_linear(self.model.layers[0], counts)

    def _pool(self):
        """The memory pool every graph of this runner is captured into (made on first use)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def _new_graph(self, q_len: int) -> GraphedForward:
        graph = self._graphs[q_len] = GraphedForward(self.model, q_len, self.max_blocks_per_seq, self.block_size,
                                                     self.max_model_len, self._pool(),
                                                     logits=self.graph_logits and q_len == 1)
        return graph

    @torch.inference_mode()
    def _forward(self, batch: PreparedBatch) -> torch.Tensor:
        """The model's forward: a graph replay for a batch staged in a graph's buffers (its hidden
        states, or its logits where the graph ends with the LM head), else eager (hidden states)."""
        if batch.graph is not None:
            return batch.graph.replay(batch.md.num_seqs, batch.stage)
        return self.model(batch.input_ids, batch.positions, batch.md)

    @torch.inference_mode()
    def write_kv(self, batch: PreparedBatch) -> None:
        """The forward pass for its K/V alone (a chunk that samples nothing)."""
        if batch.graph is not None and batch.graph.logits:   # eager over the staged inputs: no LM head
            self.model(batch.input_ids, batch.positions, batch.md)
        else:
            self._forward(batch)

    @torch.inference_mode()
    def run(self, batch: PreparedBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the given token rows (every token when rows is None), in the model's dtype: a
        greedy row needs only their argmax, and converting [rows, vocab] to float32 is a pass over
        twice their bytes (callers that compute distributions convert)."""
        out = self._forward(batch)
        if batch.graph is not None and batch.graph.logits:
            return out if rows is None else out[rows]
        if rows is None:
            return self.model.compute_logits(out)
        return self.logits(out, rows)

    def capture_graphs(self, q_lens: list[int], max_batch: int, max_tokens: int | None = None) -> None:
        """Capture up front the graphs the worker will replay, so no step pays for a capture
        (batches of at most max_tokens query tokens, when given)."""
        if not self.cuda_graphs:
            return
        for q in q_lens:
            graph = self._graphs.get(q) or self._new_graph(q)
            graph.capture(max_batch if max_tokens is None else min(max_batch, max_tokens // q))

    @torch.inference_mode()
    def warm_logits(self, max_rows: int) -> None:
        """Run the LM head once for every row count up to max_rows (CUDA only). Serving computes eager
        logits for whatever rows a step verifies or samples, and cuBLAS picks its matmul kernel by
        shape; CUDA loads a kernel the first time it runs (lazy loading), and that load waits for the
        device: a step that met a new kernel mid-serving waited a whole device step on the host."""
        if self.device.type != "cuda":
            return
        hidden = torch.zeros(max_rows, self.model.config.hidden_size, dtype=self.model.embed_tokens.weight.dtype,
                             device=self.device)
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])


def ragged_grid(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, offset within the row) of every cell, row-major, for rows of counts[r] cells."""
    rows = np.repeat(np.arange(len(counts)), counts)
    return rows, np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)


# Each view starts on a 64-byte boundary: Triton specialises kernels on pointer alignment, so
# views whose alignment followed the batch's token count would compile new variants mid-serving.
_ALIGN = 8


def to_device_aligned(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays -> device views of one buffer sent in a single copy, each view aligned."""
    offsets, total = [], 0
    for a in parts:
        offsets.append(total)
        total += -(-len(a) // _ALIGN) * _ALIGN
    host = np.zeros(max(total, 1), dtype=np.int64)
    for off, a in zip(offsets, parts):
        host[off: off + len(a)] = a
    dev = torch.from_numpy(host).to(device, non_blocking=True)
    return [dev[off: off + len(a)] for off, a in zip(offsets, parts)]
