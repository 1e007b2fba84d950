"""MQAScorer: the drafts of every speculating sequence scored in ONE target pass, then verified.

Each speculating sequence feeds [its last token, draft_1..draft_n] as one query block of the
target's pass (the multi-query paged attention kernel, causal within the block): no batch
expansion. Sequences without drafts in the same step are the n = 0 case of the same pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_spec.config import EngineConfig
from vllm_spec.sample.argmax import argmax_rows
from vllm_spec.sample.metadata import SamplingMetadata, SamplingRow
from vllm_spec.sample.sampler import SamplerOutput, apply_grammar, gather_logprobs, process_logits
from vllm_spec.sampling_params import BatchFields
from vllm_spec.spec_decode.policy import pads_verification
from vllm_spec.spec_decode.proposer import Proposals, Proposer
from vllm_spec.spec_decode.rejection_sampler import SyntheticDraws, rejection_sample
from vllm_spec.utils import to_device
from vllm_spec.worker.batch import ExecuteModelRequest, SeqInput, SpecStepStats, StepOutput
from vllm_spec.worker.model_runner import ragged_grid, to_device_aligned
from vllm_spec.worker.step_handle import HostCopy
from vllm_spec.worker.worker import PromptLogprobRows, Worker, logprob_dicts


class MQAScorer:
    """Scores proposals with the target worker's model and verifies them with the rejection sampler."""

    def __init__(self, config: EngineConfig, target: Worker, proposer: Proposer):
        self.config = config
        self.target = target
        self.proposer = proposer   # told what was accepted of its proposals
        self.tp, self.device, self.vocab_size = target.tp, target.device, target.vocab_size
        self._synthetic_keys: dict[int, int] = {}   # seq_id -> key of its synthetic acceptance draws
        self._k_columns: dict[int, torch.Tensor] = {}   # k -> a device column of k (see _all_k)

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._synthetic_keys.pop(sid, None)

    def _all_k(self, rows: int, k: int) -> torch.Tensor:
        """[rows] long, every entry k, on the device: kept per k and grown as batches grow, not sent each step."""
        kept = self._k_columns.get(k)
        if kept is None or len(kept) < rows:
            kept = self._k_columns[k] = torch.full((max(rows, 64),), k, dtype=torch.long, device=self.device)
        return kept[:rows]

    def score_and_verify(self, req: ExecuteModelRequest, spec_idx: list[int], proposals: Proposals,
                         draft_md: SamplingMetadata, mark: Callable[..., None],
                         while_device_runs: Callable[[], None]) -> StepOutput:
        """Score the drafts in one target pass and verify them. `mark` is called as the target pass
        starts and once the verification is queued (with `last=` the event recorded after its copy to
        the host), before the host waits for its tokens: the verification's device span lies between the
        two; the host's input preparation before it and its reading of the tokens after it are host time,
        as around a plain step.
        `while_device_runs`: host work that needs none of this step's outputs, done before the wait."""
        dev = self.device
        drafted = np.asarray(proposals.num_drafts, dtype=np.int64)
        found_np = np.zeros(len(req.seqs), dtype=np.int64)            # seq index -> drafts proposed
        found_np[spec_idx] = drafted
        # Score: each speculating sequence feeds [last token, draft_1..draft_n] in one target pass.
        # When every sequence is decoding, all may be padded to the longest draft (placeholder tokens in
        # reserved slots, ignored by the verifier) so the pass has one query length and replays a graph.
        k = int(drafted.max(initial=0))
        max_len = self.config.model.max_model_len
        real = len(req.seqs) + int(drafted.sum())
        cols = req.columns
        runner = self.target.runner
        ragged = runner.ragged_for(len(req.seqs), k + 1)
        uniform = (pads_verification(len(req.seqs), k, real, runner.cuda_graphs,
                                     ragged.tokens_run(len(req.seqs), real) if ragged is not None else None)
                   and bool((cols.sample & (cols.num_new == 1)).all())
                   and int(cols.seq_len.max()) + k <= max_len)
        pads = np.full(len(req.seqs), k, dtype=np.int64) if uniform else found_np
        batch = self.target.runner.prepare(req.seqs, placeholders=pads, columns=cols)
        starts = batch.token_starts
        fed_ends = batch.last_rows + 1 - pads   # each sequence's row after the tokens it feeds
        sampled_np = np.flatnonzero(cols.sample)
        sampled = sampled_np.tolist()
        found = found_np[sampled_np]   # drafts each sampled row verifies
        num_scored = len(sampled) + int(found.sum())   # rows of logits: each one's last token and its drafts
        sampler = self.target.sampler
        prompt_rows = PromptLogprobRows.of(req.seqs, starts)
        # The verifier's per-row metadata is the draft's when every sampled sequence speculated.
        all_drafted = spec_idx == sampled
        # Each speculating sequence's row among the sampled (the sampled rows are in order).
        spec_rows = None if all_drafted else np.searchsorted(sampled_np, spec_idx)
        row_md = draft_md if all_drafted else self.target.rows_metadata([req.seqs[i] for i in sampled], for_draft=True)
        rate = self.config.speculative.synthetic_acceptance_rate
        # Synthetic draws (benchmarks) travel as float64 bits in the index arrays' one copy.
        synthetic = rate is not None or row_md.synthetic_acceptance is not None
        uniforms = self._synthetic_draws(req, sampled_np).uniforms(k) if synthetic \
            else np.zeros((0, k))
        # Every sampled row verifies k drafts (the padded, graphed case): its rows of logits are the
        # [R, k+1] grid in order, and its drafts are the proposals' rows, with no scatter into either.
        full = all_drafted and bool((found == k).all())
        # ...and where every sequence is such a row, the pass's tokens are that grid too: [B, k+1].
        dense = full and len(sampled) == len(req.seqs) and batch.uniform_q == k + 1 and not prompt_rows.rows
        # Plain greedy rows (no penalties or logit biases, min_tokens met) verify against argmax of the raw
        # logits: no per-position sampling metadata, no softmax over [rows, V]. (batch_fields: cached.)
        plain_greedy = row_md.plain_greedy or all(
            f.greedy and not _reads_drafts(f) and not f.biases_logits and f.min_tokens <= len(s.output_token_ids)
            for s, f in ((req.seqs[i], req.seqs[i].sampling_params.batch_fields) for i in sampled))
        if dense and plain_greedy:
            # Nothing to index on the device: no host->device copy (each call queueing work costs the host)
            # but a benchmark's synthetic draws, so that its steps cost the host what real greedy ones do.
            rows_t = grid = spec_rows_t = None
            uniforms_t = to_device(uniforms, dev, torch.float64) if synthetic else None
            num_drafts_t = self._all_k(len(sampled), k)
        else:
            # Index arrays, built in numpy and sent in one copy: the j-th draft of speculating row r goes
            # right after its sequence's last token (a decode feeds one; a seeded row's recompute after
            # preemption, its whole last chunk); sampled row r is scored at its last token and at each
            # of its drafts (grid: row r, position j).
            src_row, src_pos = ragged_grid(drafted)
            dst = fed_ends[spec_idx][src_row] + src_pos
            grid_r, grid_j = ragged_grid(found + 1)
            logit_rows = fed_ends[sampled_np][grid_r] - 1 + grid_j
            dst_t, src_row_t, src_pos_t, rows_t, grid_r_t, grid_j_t, spec_rows_t, num_drafts_t, uniforms_t = \
                to_device_aligned(
                    [dst, src_row, src_pos, np.concatenate([logit_rows, np.asarray(prompt_rows.rows, dtype=np.int64)]),
                     grid_r, grid_j, np.arange(len(sampled)) if spec_rows is None else spec_rows, found,
                     uniforms.view(np.int64).ravel()], dev)
            grid = (grid_r_t, grid_j_t)
            if not dense and len(dst):
                batch.input_ids[dst_t] = proposals.token_ids[src_row_t, src_pos_t]
        if dense:
            batch.input_ids.view(len(req.seqs), k + 1)[:, 1:] = proposals.token_ids[:, :k]
        exp_rows = [] if plain_greedy else self._verified_rows(req.seqs, sampled, spec_idx, found_np, proposals)
        mark()
        all_logits = self.target.runner.run(batch, None if dense else rows_t)
        raw = all_logits[:num_scored]
        prompt_logprobs = prompt_rows.results(all_logits[num_scored:], req.seqs)
        R = len(sampled)
        target_probs = target_argmax = None
        scored = raw   # the logits logprobs are of: with the grammars' masks, as the distribution sampled
        if plain_greedy:   # the greedy tokens are all the verifier needs: no [R, k+1, V] tensor
            if full:
                target_argmax = argmax_rows(raw).view(R, k + 1)
            else:
                target_argmax = torch.zeros(R, k + 1, dtype=torch.long, device=dev)
                target_argmax[grid] = argmax_rows(raw)
        else:
            exp_md = SamplingMetadata.build(exp_rows, self.vocab_size, dev)
            processed = process_logits(raw.float(), exp_md)
            if exp_md.max_num_logprobs is not None:
                scored = processed if sampler.processed_logprobs else apply_grammar(raw, exp_md)
            probs = processed if exp_md.all_greedy else processed.softmax(dim=-1)
            target_probs = probs.new_zeros(R, k + 1, self.vocab_size)
            target_probs[grid] = probs
        if full:
            draft_tokens = proposals.token_ids[:, :k]
            draft_probs = None if proposals.probs is None else proposals.probs[:, :k]
        else:
            draft_tokens = torch.zeros(R, k, dtype=torch.long, device=dev)
            draft_probs = None if proposals.probs is None else proposals.probs.new_zeros(R, k, self.vocab_size)
            draft_tokens[spec_rows_t] = proposals.token_ids[:, :k]
            if draft_probs is not None:
                draft_probs[spec_rows_t] = proposals.probs[:, :k]
        result = rejection_sample(target_probs, draft_tokens, draft_probs, num_drafts_t, row_md,
                                  self.target.sampler.generator, rate, target_argmax, found.tolist(),
                                  uniforms_t.view(torch.float64).view(len(sampled), k) if synthetic else None)
        tokens = self.tp.broadcast(result.tokens.contiguous())   # tp > 1: rank 0's verdict everywhere
        copy = HostCopy(tokens, timed=True)   # the step's one device->host copy; its event ends the verification
        mark(last=copy.event)
        while_device_runs()
        rows, wait = copy.values(), copy.wait_time
        emitted = [row[: row.index(-1)] if row[-1] < 0 else row for row in rows]   # -1 past each row's end

        logprobs = None if row_md.max_num_logprobs is None else \
            self._logprobs(scored, emitted, [req.seqs[i] for i in sampled], found + 1)
        lengths = np.fromiter(map(len, emitted), dtype=np.int64, count=len(emitted))
        accepted = (lengths if spec_rows is None else lengths[spec_rows]) - 1
        seq_ids = cols.ids_of(sampled)
        self.proposer.on_verified(seq_ids if all_drafted else cols.ids_of(spec_idx), proposals.num_drafts,
                                  accepted.tolist())
        per_pos = (accepted[:, None] > np.arange(k)).sum(axis=0).tolist()
        stats = SpecStepStats(int(np.count_nonzero(drafted)), int(drafted.sum()), int(accepted.sum()), per_pos,
                              0.0, 0.0, num_verified_tokens=runner.tokens_run(batch))
        return StepOutput(seq_ids, emitted, logprobs, stats, prompt_logprobs, device_wait_time=wait)

    def _synthetic_draws(self, req: ExecuteModelRequest, rows: np.ndarray) -> SyntheticDraws:
        """Benchmarks only: synthetic acceptance keyed by the request's prompt and the draft's position,
        so runs of the same requests under different policies or batches see the same acceptance."""
        keys = self._synthetic_keys
        indices = rows.tolist()
        seq_ids = req.columns.ids_of(indices)
        for i, sid in zip(indices, seq_ids):
            if sid not in keys:
                keys[sid] = hash(tuple(req.seqs[i].prompt_token_ids))
        return SyntheticDraws(np.fromiter(map(keys.__getitem__, seq_ids), dtype=np.int64, count=len(seq_ids)),
                              req.columns.seq_len[rows])

    def _verified_rows(self, seqs: list[SeqInput], sampled: list[int], spec_idx: list[int], found: np.ndarray,
                       proposals: Proposals) -> list[SamplingRow]:
        """Sampling rows of every verified position of the sampled sequences, in the grid's order."""
        spec_row = {i: r for r, i in enumerate(spec_idx)}   # seq index -> row in proposals
        drafts_host = proposals.token_ids.tolist() if any(
            _reads_drafts(seqs[i].sampling_params.batch_fields) for i in spec_idx) else None
        return [row for i in sampled for row in self._position_rows(
            seqs[i], int(found[i]), drafts_host[spec_row[i]] if drafts_host and i in spec_row else None)]

    def _position_rows(self, seq: SeqInput, n: int, drafts: list[int] | None) -> list[SamplingRow]:
        """Sampling rows for the n+1 verified positions: position j follows the first j drafts."""
        gen = self.target.generator_for(seq)
        params = seq.sampling_params
        drafts = (drafts or [])[:n]
        bitmasks = self.target.grammar_bitmasks(seq, drafts)
        masks = [None] * (n + 1) if bitmasks is None else list(bitmasks)
        if drafts and _follows_drafts(params.batch_fields):
            return [SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids + drafts[:j], gen,
                                token_bitmask=masks[j]) for j in range(n + 1)]
        return [SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, gen, num_pending=j,
                            token_bitmask=masks[j]) for j in range(n + 1)]

    def _logprobs(self, raw: torch.Tensor, emitted: list[list[int]], seqs: list[SeqInput],
                  verified: np.ndarray) -> list[list | None] | None:
        """Logprobs (logprobs_mode's) of each emitted token, at the position that emitted it (None: none
        asked); raw holds verified[r] rows of logits per sequence, in order."""
        wanted = [s.sampling_params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return None
        grid_r, grid_j = (a.tolist() for a in ragged_grid(verified))
        keep = [n for n, (r, j) in enumerate(zip(grid_r, grid_j)) if j < len(emitted[r])]
        tokens = to_device([emitted[grid_r[n]][grid_j[n]] for n in keep], raw.device)
        ids, lps, ranks = gather_logprobs(raw[to_device(keep, raw.device)].float(), tokens,
                                          max(w for w in wanted if w is not None),
                                          self.target.sampler.logits_as_logprobs)
        dicts = logprob_dicts(SamplerOutput(tokens, ids, lps, ranks), [wanted[grid_r[n]] for n in keep])
        per_seq: list[list | None] = [[] if w is not None else None for w in wanted]
        for n, d in zip(keep, dicts):
            if d is not None:
                per_seq[grid_r[n]].append(d)
        return per_seq


def _follows_drafts(fields: BatchFields) -> bool:
    """A row whose distribution depends on the tokens before it (penalties, bad words): each verified
    position's rows count the drafts before it as output."""
    return fields.has_penalties or fields.has_bad_words


def _reads_drafts(fields: BatchFields) -> bool:
    """A row whose verified positions need the drafts on the host: those above, and a grammar's (its
    matcher walks the drafts for each position's mask)."""
    return _follows_drafts(fields) or fields.structured
