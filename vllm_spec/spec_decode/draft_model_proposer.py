"""Draft-model proposer: a small model with its own KV cache on the target's block tables.

One call proposes k tokens for the whole batch. The first forward feeds every
token the draft has not seen yet (prefill chunks, and for decoding sequences the
1-2 tokens the last verification added: no special case); the next k-1 forwards
feed one draft token per sequence, with positions, lengths and slots advanced
on the device. Nothing goes back to the host in between. A greedy decoding
batch (the steady state) runs all of it as one device program: `GreedyDraftLoop`.
Nothing is fed at or past the draft's limit (its context, or speculative_max_model_len):
sequences there do not speculate, and prompts are fed up to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Iterator

import numpy as np
import torch

from vllm_spec.attention.metadata import AttentionMetadata, compute_slot_mapping
from vllm_spec.sample.argmax import argmax_rows
from vllm_spec.sample.metadata import SamplingMetadata
from vllm_spec.sample.sampler import apply_top_k_top_p_min_p, exponential_noise
from vllm_spec.spec_decode.draft_loop import GreedyDraftLoop
from vllm_spec.spec_decode.proposer import Proposals, token_at, tokens_from
from vllm_spec.utils import to_device
from vllm_spec.worker.batch import ExecuteModelRequest, SeqInput
from vllm_spec.worker.cuda_graph import BATCH_BUCKETS, bucket_for
from vllm_spec.worker.block_table import BlockTableArray
from vllm_spec.worker.model_runner import ModelRunner


# Query lengths of the catch-up graphs, and their most query tokens (a longer lag or a larger
# batch runs eagerly: the lag follows a long run of plain steps, over which its cost is spread).
CATCH_UP_LENGTHS = (4, 8, 16, 32, 64)
CATCH_UP_MAX_TOKENS = 4096

_draft_cached = operator.attrgetter("draft_cached")


class DraftModelProposer:
    """Proposes with a draft model; tracks how much of each sequence its cache holds."""

    def __init__(self, runner: ModelRunner, generator: torch.Generator | None, max_positions: int,
                 max_tokens: int, block_tables: BlockTableArray | None = None, greedy_drafts: bool = False):
        """max_tokens: the most tokens an eager forward feeds (the scheduler's token budget, which the
        activations' memory was sized for); block_tables: the verifying runner's array, so the step's
        batch is laid out once for the draft's loop and the verification (they share the block
        manager's tables); greedy_drafts: every row drafts its argmax (vLLM's draft_sample_method
        "greedy"), which the verifier treats as a one-hot distribution."""
        self.runner = runner
        self.greedy_drafts = greedy_drafts
        self.max_tokens = max_tokens
        self.generator = generator
        # The draft's limit: it drafts only below it (the worker caps k), and prompts are fed up to it.
        self.max_positions = max_positions
        self._computed: dict[int, int] = {}   # seq_id -> leading positions with valid draft K/V
        self._fed: dict[int, int] = {}        # seq_id -> draft tokens fed back in the last proposal
        self.loop = GreedyDraftLoop(runner.model, runner.max_blocks_per_seq, runner.block_size,
                                    runner.max_model_len, use_graphs=runner.cuda_graphs)
        # Catch-ups feed one query length to every row (replayed in a graph) where graphs run.
        self.uniform_catch_up = runner.cuda_graphs
        self._block_tables = block_tables if block_tables is not None else BlockTableArray()

    def capture_graphs(self, max_k: int, max_batch: int) -> None:
        """Capture the whole-proposal and catch-up graphs up front, so no step pays for a capture
        (a capture inside serving costs tens of milliseconds)."""
        self.loop.capture(max_k, max_batch)
        if self.uniform_catch_up:
            self.runner.capture_graphs(list(CATCH_UP_LENGTHS), max_batch, CATCH_UP_MAX_TOKENS)

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._computed.pop(sid, None)
            self._fed.pop(sid, None)

    def _starts(self, req: ExecuteModelRequest) -> np.ndarray:
        """Per sequence of the step, the first position whose draft K/V it lacks (int64 [B]). After
        preemption the target restarts from 0 on new blocks: so must the draft. A new sequence starts
        where the prefix cache's blocks stop holding the draft's K/V."""
        cached = np.fromiter(map(self._computed.get, req.columns.seq_ids, map(_draft_cached, req.seqs)),
                             dtype=np.int64, count=len(req.seqs))
        return np.minimum(cached, req.columns.start_pos)

    @torch.inference_mode()
    def catch_up(self, req: ExecuteModelRequest, num_drafts: list[int]) -> int:
        """Feed speculating decoding sequences all but the last two tokens the draft has not seen.

        A sequence lags by more than two after steps that did not speculate (the draft does not
        run then); one forward brings it back (a graph replay where graphs run, see below), so the
        proposal itself feeds at most two tokens per decoding sequence and stays on the
        whole-proposal graph.
        """
        cols = req.columns
        starts_all = self._starts(req)
        idx = np.flatnonzero((np.asarray(num_drafts) > 0) & cols.sample & (cols.num_new == 1)
                             & (cols.seq_len - starts_all > 2)).tolist()
        if not idx:
            return 0
        behind = [req.seqs[i] for i in idx]
        starts = starts_all[idx].tolist()
        q = self._uniform_catch_up_length(behind, starts)
        if q is not None:
            # Every row feeds q tokens (a graph replay: eagerly, a deep draft's forward is host-bound
            # and cost more than a target step), front-padded with tokens whose K/V the draft already
            # holds: recomputing them rewrites the same values, up to rounding (the verifier uses the
            # draft distributions actually sampled from, so this stays lossless).
            starts = [s.seq_len - 2 - q for s in behind]
        feed = [SeqInput(s.seq_id, tokens_from(s, start)[:-2], start, s.block_table, sample=False)
                for s, start in zip(behind, starts)]
        if q is not None:   # a graph replay: its activations live in the graph's own memory
            self.runner.write_kv(self.runner.prepare(feed))
        else:
            self._write_kv(feed)
        for s in feed:
            self._computed[s.seq_id] = s.seq_len
        return sum(len(s.token_ids) for s in feed)

    def _write_kv(self, feed: list[SeqInput]) -> None:
        """Feed these tokens for their K/V alone, in eager forwards of at most max_tokens tokens: after
        a long run of plain steps a batch of 256 lags by tens of thousands of tokens, whose
        activations in one forward would take gigabytes the KV cache was given."""
        for piece in _pieces(feed, self.max_tokens):
            self.runner.write_kv(self.runner.prepare(piece))

    def _uniform_catch_up_length(self, behind: list[SeqInput], starts: list[int]) -> int | None:
        """The catch-up graph's query length for these rows (None: a ragged eager forward), when
        graphs are on and every row has enough tokens before its lag to pad with."""
        if not self.uniform_catch_up:
            return None
        lag = max(s.seq_len - 2 - start for s, start in zip(behind, starts))
        q = next((q for q in CATCH_UP_LENGTHS if q >= lag), None)
        bucket = bucket_for(len(behind))
        if q is None or bucket is None or bucket * q > CATCH_UP_MAX_TOKENS or any(s.seq_len - 2 < q for s in behind):
            return None
        return q

    @torch.inference_mode()
    def propose(self, req: ExecuteModelRequest, num_drafts: list[int], md: SamplingMetadata) -> Proposals:
        seqs, cols = req.seqs, req.columns
        counts = np.asarray(num_drafts, dtype=np.int64)
        spec_np = np.flatnonzero(counts)
        spec = spec_np.tolist()
        limit = self.max_positions
        starts = self._starts(req)
        # Every prompt chunk is fed (the prefix cache counts on a prompt block holding the draft's K/V
        # once the step computing it ran), and whatever the draft lags by with it.
        fed = [i for i in range(len(seqs)) if counts[i] > 0 or (
            (not cols.sample[i] or cols.num_new[i] > 1 or cols.start_pos[i] < len(seqs[i].prompt_token_ids))
            and starts[i] < limit)] if len(spec) < len(seqs) else spec
        k = int(counts.max(initial=0))
        argmax_only = bool(spec) and (self.greedy_drafts or md.all_greedy)   # (md: None without drafts)
        if argmax_only and fed == spec and len(spec) <= BATCH_BUCKETS[-1]:
            lens = cols.seq_len[spec_np]
            if lens.min() >= 2 and (lens - starts[spec_np]).max() <= 2:
                return self._propose_in_loop(req, spec_np, counts[spec_np], lens, k)
        starts = starts.tolist()
        catch_up = [SeqInput(seqs[i].seq_id, tokens_from(seqs[i], starts[i])[: limit - starts[i]], starts[i],
                             seqs[i].block_table, sample=False) for i in fed]
        for s in catch_up:
            self._computed[s.seq_id] = s.seq_len
        if not spec:
            self._write_kv(catch_up)
            return Proposals(torch.empty(0, 0, dtype=torch.long), None, [])
        if sum(len(s.token_ids) for s in catch_up) > self.max_tokens:
            # Rows that only feed (prompt chunks, a cached prompt whose draft K/V the draft recomputes)
            # go first, in forwards within the budget; the proposal's forward feeds the speculating rows.
            self._write_kv([s for i, s in zip(fed, catch_up) if counts[i] == 0])
            fed, catch_up = spec, [s for i, s in zip(fed, catch_up) if counts[i] > 0]
        batch = self.runner.prepare(catch_up)
        row_in_batch = {i: r for r, i in enumerate(fed)}
        spec_rows = [row_in_batch[i] for i in spec]
        dev = self.runner.device
        ends = batch.md.query_start_loc[1:][to_device(spec_rows, dev)] - 1
        tokens, probs = self._sample(self.runner.run(batch, ends), md)
        all_tokens, all_probs = [tokens], [probs]
        if k > 1:
            lens = [catch_up[r].seq_len for r in spec_rows]
            # A row asking fewer than k drafts keeps rewriting its last legal slot (a
            # position the target overwrites when verifying), never past its reservation.
            limits = to_device([n + num_drafts[i] - 1 for n, i in zip(lens, spec)], dev)
            positions = to_device(lens, dev)
            md_step = self._decode_metadata(batch.md.block_tables[to_device(spec_rows, dev)],
                                            positions, max(lens) + 1, batch.md.block_size)
            graph = self.runner.graph_for(1, len(spec_rows))
            asked = [num_drafts[i] for i in spec]
            for step in range(1, k):
                hidden = graph(tokens, positions, md_step) if graph is not None \
                    else self.runner.model(tokens, positions, md_step)
                logits = self.runner.model.compute_logits(hidden)
                tokens, probs = self._sample(logits, md.without_generators_of(
                    [r for r, n in enumerate(asked) if n <= step]))
                all_tokens.append(tokens)
                all_probs.append(probs)
                positions = torch.minimum(positions + 1, limits)
                md_step = self._decode_metadata(md_step.block_tables, positions, md_step.max_seq_len + 1,
                                                md_step.block_size)
        for i in spec:
            self._fed[seqs[i].seq_id] = num_drafts[i] - 1
            self._computed[seqs[i].seq_id] += num_drafts[i] - 1
        token_ids = torch.stack(all_tokens, dim=1)
        stacked = None if argmax_only else torch.stack(all_probs, dim=1)
        return Proposals(token_ids, stacked, [num_drafts[i] for i in spec])

    def _propose_in_loop(self, req: ExecuteModelRequest, spec: np.ndarray, num_drafts: np.ndarray, lens: np.ndarray,
                         k: int) -> Proposals:
        """Every row of `spec` feeds its last two tokens (see draft_loop); one device program proposes
        all. num_drafts, lens: those rows' counts and seq_len."""
        B = len(spec)
        # The whole batch's tables, as the verification asks for them next: one update serves both.
        tables = self._block_tables(req.seqs)
        if B < len(req.seqs):
            tables = tables[spec]
        rows = spec.tolist()
        seqs = req.seqs_of(rows)
        limits = lens + num_drafts - 1
        tokens = np.empty((B, 2), dtype=np.int64)
        tokens[:, 0] = np.fromiter(map(token_at, seqs, (lens - 2).tolist()), dtype=np.int64, count=B)
        tokens[:, 1] = np.fromiter(map(token_at, seqs, (lens - 1).tolist()), dtype=np.int64, count=B)
        drafts = self.loop(tokens, lens - 2, limits, tables, k, max_seq_len=int(limits.max()) + 1)
        seq_ids = req.columns.ids_of(rows)
        self._computed.update(zip(seq_ids, limits.tolist()))
        self._fed.update(zip(seq_ids, (num_drafts - 1).tolist()))
        return Proposals(drafts, None, num_drafts.tolist())

    def on_verified(self, seq_ids: list[int], num_drafts: list[int], num_accepted: list[int]) -> None:
        # Of the drafts fed back into the model, only the accepted ones hold valid K/V.
        fed = np.fromiter(map(self._fed.pop, seq_ids, itertools.repeat(0)), dtype=np.int64, count=len(seq_ids))
        dead = fed - np.minimum(np.asarray(num_accepted, dtype=np.int64), fed)
        computed = self._computed
        if len(computed.keys() & seq_ids) == len(seq_ids):   # none released meanwhile: one pass in C
            values = np.fromiter(map(computed.__getitem__, seq_ids), dtype=np.int64, count=len(seq_ids))
            computed.update(zip(seq_ids, (values - dead).tolist()))
            return
        for sid, n in zip(seq_ids, dead.tolist()):
            if sid in computed:
                computed[sid] -= n

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens from logits over the draft's vocabulary (maybe a subset of the target's), and
        for sampled rows the distribution q they came from, over the target's whole vocabulary."""
        model = self.runner.model
        if md.all_greedy or self.greedy_drafts:
            return model.token_ids_of(argmax_rows(logits)), None
        logits = apply_top_k_top_p_min_p(logits.float() / md.temperature.unsqueeze(1), md)
        probs = logits.softmax(dim=-1)
        noise = exponential_noise(tuple(probs.shape), md, probs.device, self.generator)
        sampled = argmax_rows(probs / noise)
        tokens = model.token_ids_of(torch.where(md.greedy, argmax_rows(logits), sampled))
        if model.output_ids is not None:   # q is 0 outside the subset: verification stays exact
            probs = probs.new_zeros(probs.shape[0], model.config.vocab_size).index_copy_(1, model.output_ids, probs)
        return tokens, probs

    @staticmethod
    def _decode_metadata(block_tables: torch.Tensor, positions: torch.Tensor, max_seq_len: int,
                         block_size: int) -> AttentionMetadata:
        """One token per speculating sequence at `positions`, slots derived on the device."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        return AttentionMetadata(
            query_start_loc=torch.arange(positions.shape[0] + 1, device=positions.device),
            seq_lens=positions + 1,
            block_tables=block_tables,
            slot_mapping=compute_slot_mapping(block_tables, rows, positions, block_size),
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=block_size,
        )


def _pieces(feed: list[SeqInput], max_tokens: int) -> Iterator[list[SeqInput]]:
    """The feed in batches of at most max_tokens tokens, in order: a sequence cut between two batches
    feeds its later positions in the next one (they attend to the K/V the earlier batch wrote)."""
    piece: list[SeqInput] = []
    room = max_tokens
    for s in feed:
        done = 0
        while done < len(s.token_ids):
            take = s.token_ids[done:done + room]
            piece.append(dataclasses.replace(s, token_ids=take, start_pos=s.start_pos + done))
            done, room = done + len(take), room - len(take)
            if room == 0:
                yield piece
                piece, room = [], max_tokens
    if piece:
        yield piece
