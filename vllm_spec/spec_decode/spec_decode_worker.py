"""SpecDecodeWorker: propose -> score -> verify -> commit, in the place of a plain Worker.

Every sampled sequence of a step goes through the same verification path: a
sequence with drafts scores k+1 query tokens (its last token and the drafts)
in the target's ONE forward pass; a sequence without drafts (still in prefill,
or not speculating this step) is the k = 0 case of the same thing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_spec.config import EngineConfig
from vllm_spec.distributed.parallel_state import get_draft_tp_group
from vllm_spec.model.loader import load_model
from vllm_spec.sample.argmax import argmax_rows
from vllm_spec.sample.metadata import ReusedMetadata, SamplingMetadata, SamplingRow
from vllm_spec.sample.sampler import SamplerOutput, gather_logprobs, process_logits
from vllm_spec.spec_decode.draft_model_proposer import DraftModelProposer
from vllm_spec.spec_decode.ngram_proposer import NgramProposer
from vllm_spec.spec_decode.adaptive_policy import AdaptivePolicy
from vllm_spec.spec_decode.policy import FixedPolicy, SpeculationPolicy, StepShape, pads_verification
from vllm_spec.spec_decode.proposer import Proposals, Proposer
from vllm_spec.spec_decode.rejection_sampler import SyntheticDraws, rejection_sample
from vllm_spec.spec_decode.step_cost import StepCharges
from vllm_spec.spec_decode.timer import StepTimer
from vllm_spec.spec_decode.tp_proposer import TPProposer
from vllm_spec.utils import to_device
from vllm_spec.worker.batch import ExecuteModelRequest, SeqInput, SpecStepStats, StepOutput
from vllm_spec.worker.model_runner import ModelRunner, ragged_grid, to_device_aligned
from vllm_spec.worker.step_handle import DoneStep, HostCopy, StepHandle
from vllm_spec.worker.worker import PromptLogprobRows, Worker, logprob_dicts


class SpecDecodeWorker:
    """Wraps the target Worker and a proposer; one engine step = one call of execute_model."""

    def __init__(self, config: EngineConfig):
        spec = config.speculative
        assert spec is not None
        self.config = config
        self.target = Worker(config)
        self.tp = self.target.tp
        self.device = self.target.device
        self.vocab_size = self.target.vocab_size
        self.draft_runner: ModelRunner | None = None
        self.draft_proposer: DraftModelProposer | None = None   # on ranks of the draft's group
        self.proposer: Proposer
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min, self.device)
            cost_ratio = 0.01
        else:
            # Tensor parallel: the draft lives on its own sub-group of these processes (None: not on this rank).
            draft_tp = get_draft_tp_group()
            proposer, cost_ratio = None, 0.1   # ranks outside the sub-group follow rank 0's policy
            if draft_tp is not None:
                draft = load_model(spec.draft, draft_tp)
                if spec.draft.arch.embeddings_from_target:
                    draft.share_embeddings(self.target.runner.model)
                if spec.draft.arch.draft_vocab is not None:
                    draft.restrict_output_vocab(torch.tensor(spec.draft.arch.draft_vocab, dtype=torch.long))
                self.draft_runner = ModelRunner(draft, self.device, config.cache.block_size,
                                                config.model.max_model_len, cuda_graphs=not config.enforce_eager)
                proposer = self.draft_proposer = DraftModelProposer(self.draft_runner,
                                                                    self.target.sampler.generator)
                cost_ratio = _num_params(draft) / _num_params(self.target.runner.model)   # per-rank shards
            self.proposer = proposer
            if self.tp.world_size > 1:
                self.proposer = TPProposer(proposer, self.tp, draft_tp is self.tp, self.vocab_size, self.device)
        k = spec.num_speculative_tokens
        # What a draft forward costs against a target forward, before anything is measured.
        self.draft_cost_ratio = cost_ratio
        self.policy: SpeculationPolicy = (FixedPolicy(k) if spec.policy == "fixed"
                                          else AdaptivePolicy(k, draft_cost_ratio=cost_ratio))
        self._charges = StepCharges(config.uses_async_scheduling)   # what each step cost, for the policy
        self._synthetic_keys: dict[int, int] = {}   # seq_id -> key of its synthetic acceptance draws
        self._unread: _SpecStep | None = None   # a launched step that the next may overlap
        self._reused_draft_md = ReusedMetadata()

    # KV cache: one block manager, two caches of the same number of blocks ----------------
    def kv_bytes_per_block(self) -> int:
        draft = self.draft_runner.kv_bytes_per_block(self.config.model.dtype) if self.draft_runner else 0
        return self.target.kv_bytes_per_block() + draft

    def available_kv_bytes(self) -> int:
        return self.target.available_kv_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.target.init_kv_cache(num_blocks)
        max_batch = self.config.scheduler.max_num_seqs
        # Plain decode, and verification of any k up to the configured one (the policy varies it).
        k = self.config.speculative.num_speculative_tokens
        self.target.runner.capture_graphs(list(range(1, k + 2)), max_batch)
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(num_blocks, self.config.model.dtype)
            # Draft steps (1 token) and the catch-up after a fully accepted step (2 tokens).
            self.draft_runner.capture_graphs([1, 2], max_batch)
            self.draft_proposer.capture_graphs(k, max_batch)

    # Steps ------------------------------------------------------------------------------
    def num_drafts(self, req: ExecuteModelRequest) -> tuple[list[int], StepShape, list[int]]:
        """k per sequence, the policy's shape and the rows of its sequences: decoding sequences
        speculate as the policy says, never past max_model_len, and not at all while the batch
        holds speculative_disable_by_batch_size sequences or more.

        Otherwise seeded sampled requests always draft the full k: their output then depends on
        their seed alone, not on the batch they share (which steers the policy).
        """
        spec = self.config.speculative
        lookahead, max_len = req.num_lookahead_slots, self.config.model.max_model_len
        if spec.disable_by_batch_size is not None and len(req.seqs) >= spec.disable_by_batch_size:
            lookahead = 0   # no drafts at all (the policy still sees the step: it keeps track of what ran)
        asked = [0] * len(req.seqs)
        rows, seq_ids, caps = [], [], []
        # Tokens the policy does not choose: prefill chunks, and seeded rows with their full drafts
        # (so a step with them is not costed as an all-decoding step of the policy's own k).
        other_tokens = 0
        for i, s in enumerate(req.seqs):
            n = len(s.token_ids)
            if n != 1 or not s.sample:
                other_tokens += n
                continue
            cap = min(lookahead, max_len - s.start_pos - 1)
            if s.sampling_params.seeded_sampling:
                asked[i] = cap
                other_tokens += 1 + cap
            else:
                rows.append(i)
                seq_ids.append(s.seq_id)
                caps.append(cap)
        shape = StepShape(seq_ids, caps, other_tokens)
        chosen = self.policy.choose(shape)
        for i, k in zip(rows, chosen):
            asked[i] = k
        return asked, shape, rows

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        return self.launch(req).result()

    @torch.inference_mode()
    def launch(self, req: ExecuteModelRequest) -> StepHandle:
        """Queue the step. A step that speculates runs to completion here (its outputs decide what
        comes next); one that does not is the target's plain step, which may overlap the next."""
        self.target.release(req.finished_seq_ids)
        self.proposer.release(req.finished_seq_ids)
        self.policy.release(req.finished_seq_ids)
        for sid in req.finished_seq_ids:
            self._synthetic_keys.pop(sid, None)
        if not req.seqs:
            return DoneStep(StepOutput([], []))
        asked, shape, rows = self.num_drafts(req)
        if self.tp.world_size > 1:  # rank 0's policy decides (its timings differ from the other ranks')
            asked = self.tp.broadcast(torch.tensor(asked, dtype=torch.long, device=self.device)).tolist()
        spec_idx = [i for i, n in enumerate(asked) if n > 0]
        unread, self._unread = self._unread, None
        if spec_idx:
            # The proposer reads every token on the host: read the step still in flight first, so
            # that its cost is measured before this one starts.
            if unread is not None:
                unread.result()
            req = self.target.resolve_placeholders(req)
        start = time.perf_counter()
        timer = StepTimer(self.device)
        caught_up = self.proposer.catch_up(req.seqs, asked)
        timer.mark()
        draft_md = self._draft_metadata([req.seqs[i] for i in spec_idx])
        proposals = self.proposer.propose(req.seqs, asked, draft_md)
        timer.mark()
        if spec_idx:
            step: StepHandle = DoneStep(self._score_and_verify(req, spec_idx, proposals, draft_md, timer.mark))
        else:
            step = self.target.launch(req, on_pass=timer.mark)
            timer.mark()
        handle = _SpecStep(self, step, timer, _Observation(shape, [asked[i] for i in rows], start,
                                                           req.engine_host_time, bool(spec_idx), caught_up))
        if handle.one_token_per_seq:
            self._unread = handle
        return handle

    def _observe(self, result: StepOutput, timer: StepTimer, obs: "_Observation") -> None:
        """Step statistics and the policy's lesson, once the step's outputs are on the host."""
        if result.spec is None:
            result.spec = SpecStepStats(0, 0, 0, [], 0.0, 0.0)
        stats = result.spec
        # Between the draft's end and the target pass's start the device waits for the host's input
        # preparation (of a plain step as of a verification): host time, not any phase's.
        catch_up_time, draft_time, prepare_time, stats.verify_time = timer.finish()
        stats.catch_up_time = catch_up_time if obs.caught_up else 0.0
        stats.draft_time = stats.catch_up_time + draft_time
        if timer.cuda:
            result.device_time = stats.draft_time + prepare_time + stats.verify_time
        by_id = {sid: len(toks) - 1 for sid, toks in zip(result.seq_ids, result.token_ids)}
        charge = self._charges.read(time.perf_counter(), obs.start, obs.engine_host_time, obs.speculative)
        charge.seconds = max(charge.seconds - stats.catch_up_time, 1e-6)
        self.policy.observe(obs.shape, obs.asked, [by_id.get(sid, 0) for sid in obs.shape.seq_ids], stats, charge)
        stats.policy = self.policy.estimates()

    def _metadata(self, rows: list[SamplingRow], for_draft: bool = False) -> SamplingMetadata | None:
        return SamplingMetadata.build(rows, self.vocab_size, self.device, for_draft) if rows else None

    def _draft_metadata(self, seqs: list[SeqInput]) -> SamplingMetadata | None:
        """The speculating rows' proposal metadata: for a draft it never follows tokens (no penalties,
        no min_tokens), so it is built once while the same sequences speculate."""
        if not seqs:
            return None
        return self._reused_draft_md.get([s.seq_id for s in seqs], lambda: self._metadata(
            [self.target.sampling_row(s) for s in seqs], for_draft=True))

    def _score_and_verify(self, req: ExecuteModelRequest, spec_idx: list[int], proposals: Proposals,
                          draft_md: SamplingMetadata, mark: Callable[[], None]) -> StepOutput:
        """Score the drafts in one target pass and verify them. `mark` is called as the target pass
        starts and once the verification is queued, before the host waits for its tokens: the
        verification's device span lies between the two; the host's input preparation before it
        and its reading of the tokens after it are host time, as around a plain step."""
        dev = self.device
        found = dict(zip(spec_idx, proposals.num_drafts))            # seq index -> drafts proposed
        spec_row = {i: r for r, i in enumerate(spec_idx)}             # seq index -> row in proposals
        # Score: each speculating sequence feeds [last token, draft_1..draft_n] in one target pass.
        # When every sequence is decoding, all may be padded to the longest draft (placeholder tokens in
        # reserved slots, ignored by the verifier) so the pass has one query length and replays a graph.
        k = max(found.values(), default=0)
        max_len = self.config.model.max_model_len
        real = len(req.seqs) + sum(found.values())
        uniform = pads_verification(len(req.seqs), k, real) and all(
            s.sample and len(s.token_ids) == 1 and s.seq_len + k <= max_len for s in req.seqs)
        verify = [SeqInput(s.seq_id, s.token_ids + [0] * (k if uniform else found.get(i, 0)), s.start_pos,
                           s.block_table, s.sample, s.sampling_params, s.prompt_token_ids, s.output_token_ids)
                  for i, s in enumerate(req.seqs)]
        batch = self.target.runner.prepare(verify)
        starts = batch.token_starts
        starts_np = np.asarray(starts, dtype=np.int64)
        sampled = [i for i, s in enumerate(req.seqs) if s.sample]
        # Index arrays, built in numpy and sent in one copy: the j-th draft of speculating row r goes
        # right after its sequence's last token; sampled row r is scored at its last token and at
        # each of its drafts (grid: row r, position j).
        drafted = np.asarray(proposals.num_drafts, dtype=np.int64)
        src_row, src_pos = ragged_grid(drafted)
        dst = starts_np[np.asarray(spec_idx, dtype=np.int64)][src_row] + 1 + src_pos
        found_np = np.zeros(len(req.seqs), dtype=np.int64)
        found_np[spec_idx] = drafted
        sampled_np = np.asarray(sampled, dtype=np.int64)
        grid_r, grid_j = ragged_grid(found_np[sampled_np] + 1)
        last = starts_np[sampled_np] + np.fromiter((len(req.seqs[i].token_ids) for i in sampled), dtype=np.int64,
                                                   count=len(sampled)) - 1
        logit_rows = last[grid_r] + grid_j
        prompt_rows = PromptLogprobRows.of(req.seqs, starts)
        row_of = {i: r for r, i in enumerate(sampled)}
        # The verifier's per-row metadata is the draft's when every sampled sequence speculated.
        all_drafted = spec_idx == sampled
        row_md = draft_md if all_drafted else self._metadata(
            [self.target.sampling_row(req.seqs[i]) for i in sampled], for_draft=True)
        rate = self.config.speculative.synthetic_acceptance_rate
        # Synthetic draws (benchmarks) travel as float64 bits in the index arrays' one copy.
        synthetic = rate is not None or row_md.synthetic_acceptance is not None
        uniforms = self._synthetic_draws([req.seqs[i] for i in sampled]).uniforms(k) if synthetic \
            else np.zeros((0, k))
        dst_t, src_row_t, src_pos_t, rows_t, grid_r_t, grid_j_t, spec_rows_t, num_drafts_t, uniforms_t = \
            to_device_aligned(
                [dst, src_row, src_pos, np.concatenate([logit_rows, np.asarray(prompt_rows.rows, dtype=np.int64)]),
                 grid_r, grid_j, np.asarray([row_of[i] for i in spec_idx], dtype=np.int64), found_np[sampled_np],
                 uniforms.view(np.int64).ravel()], dev)
        if len(dst):
            batch.input_ids[dst_t] = proposals.token_ids[src_row_t, src_pos_t]

        drafts_host = proposals.token_ids.tolist() if any(
            req.seqs[i].sampling_params.batch_fields.has_penalties for i in spec_idx) else None
        # Plain greedy rows (no penalties, min_tokens met) verify against argmax of the raw logits: no
        # per-position sampling metadata, no softmax over [rows, V]. (batch_fields: cached on the params.)
        plain_greedy = all(f.greedy and not f.has_penalties and f.min_tokens <= len(s.output_token_ids)
                           for s, f in ((req.seqs[i], req.seqs[i].sampling_params.batch_fields) for i in sampled))
        exp_rows = [] if plain_greedy else [
            row for i in sampled for row in self._position_rows(
                req.seqs[i], found.get(i, 0), drafts_host[spec_row[i]] if drafts_host and i in spec_row else None)]
        mark()
        all_logits = self.target.runner.run(batch, rows_t)
        raw = all_logits[: len(logit_rows)]
        prompt_logprobs = prompt_rows.results(all_logits[len(logit_rows):], req.seqs)
        R = len(sampled)
        grid = (grid_r_t, grid_j_t)
        # Every sampled row verifies k drafts (the padded, graphed case): its rows of logits are the
        # [R, k+1] grid in order, and its drafts are the proposals' rows, with no scatter into either.
        full = all_drafted and bool((found_np[sampled_np] == k).all())
        target_probs = target_argmax = None
        if plain_greedy:   # the greedy tokens are all the verifier needs: no [R, k+1, V] tensor
            if full:
                target_argmax = argmax_rows(raw).view(R, k + 1)
            else:
                target_argmax = torch.zeros(R, k + 1, dtype=torch.long, device=dev)
                target_argmax[grid] = argmax_rows(raw)
        else:
            exp_md = self._metadata(exp_rows)
            processed = process_logits(raw, exp_md)
            probs = processed if exp_md.all_greedy else processed.softmax(dim=-1)
            target_probs = probs.new_zeros(R, k + 1, self.vocab_size)
            target_probs[grid] = probs
        if full:
            draft_tokens = proposals.token_ids[:, :k]
            draft_probs = None if proposals.probs is None else proposals.probs[:, :k]
        else:
            draft_tokens = torch.zeros(R, k, dtype=torch.long, device=dev)
            draft_probs = None if proposals.probs is None else raw.new_zeros(R, k, self.vocab_size)
            draft_tokens[spec_rows_t] = proposals.token_ids[:, :k]
            if draft_probs is not None:
                draft_probs[spec_rows_t] = proposals.probs[:, :k]
        result = rejection_sample(target_probs, draft_tokens, draft_probs, num_drafts_t, row_md,
                                  self.target.sampler.generator, rate, target_argmax, found_np[sampled_np].tolist(),
                                  uniforms_t.view(torch.float64).view(len(sampled), k) if synthetic else None)
        tokens = self.tp.broadcast(result.tokens.contiguous())   # tp > 1: rank 0's verdict everywhere
        copy = HostCopy(tokens)   # the step's one device->host copy
        mark()
        rows, wait = copy.values(), copy.wait_time
        emitted = [row[: row.index(-1)] if row[-1] < 0 else row for row in rows]   # -1 past each row's end

        logprobs = self._logprobs(raw, emitted, [req.seqs[i] for i in sampled], grid_r, grid_j)
        accepted = [len(emitted[row_of[i]]) - 1 for i in spec_idx]
        self.proposer.on_verified([req.seqs[i].seq_id for i in spec_idx], proposals.num_drafts, accepted)
        per_pos = (np.asarray(accepted, dtype=np.int64)[:, None] > np.arange(k)).sum(axis=0).tolist()
        stats = SpecStepStats(sum(1 for n in proposals.num_drafts if n > 0), sum(proposals.num_drafts),
                              sum(accepted), per_pos, 0.0, 0.0, num_verified_tokens=int(batch.input_ids.shape[0]))
        return StepOutput([req.seqs[i].seq_id for i in sampled], emitted, logprobs, stats, prompt_logprobs,
                          device_wait_time=wait)

    def _synthetic_draws(self, seqs: list[SeqInput]) -> SyntheticDraws:
        """Benchmarks only: synthetic acceptance keyed by the request's prompt and the draft's position,
        so runs of the same requests under different policies or batches see the same acceptance."""
        keys = []
        for s in seqs:
            key = self._synthetic_keys.get(s.seq_id)
            if key is None:
                key = self._synthetic_keys[s.seq_id] = hash(tuple(s.prompt_token_ids))
            keys.append(key)
        first = [s.start_pos + len(s.token_ids) for s in seqs]
        return SyntheticDraws(np.asarray(keys, dtype=np.int64), np.asarray(first, dtype=np.int64))

    def _position_rows(self, seq: SeqInput, n: int, drafts: list[int] | None) -> list[SamplingRow]:
        """Sampling rows for the n+1 verified positions: position j follows the first j drafts."""
        gen = self.target.generator_for(seq)
        params = seq.sampling_params
        if drafts is not None and params.has_penalties:
            return [SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids + drafts[:j], gen)
                    for j in range(n + 1)]
        return [SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, gen, num_pending=j)
                for j in range(n + 1)]

    def _logprobs(self, raw: torch.Tensor, emitted: list[list[int]], seqs: list[SeqInput],
                  grid_r: np.ndarray, grid_j: np.ndarray) -> list[list | None] | None:
        """Raw-logit logprobs of each emitted token, at the position that emitted it (None: none asked)."""
        wanted = [s.sampling_params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return None
        grid_r, grid_j = grid_r.tolist(), grid_j.tolist()
        keep = [n for n, (r, j) in enumerate(zip(grid_r, grid_j)) if j < len(emitted[r])]
        tokens = to_device([emitted[grid_r[n]][grid_j[n]] for n in keep], raw.device)
        ids, lps, ranks = gather_logprobs(raw[to_device(keep, raw.device)], tokens,
                                          max(w for w in wanted if w is not None))
        dicts = logprob_dicts(SamplerOutput(tokens, ids, lps, ranks), [wanted[grid_r[n]] for n in keep])
        per_seq: list[list | None] = [[] if w is not None else None for w in wanted]
        for n, d in zip(keep, dicts):
            if d is not None:
                per_seq[grid_r[n]].append(d)
        return per_seq


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class _Observation:
    """What the policy learns from once a step is read: its shape, the drafts asked, when it began,
    and whether it speculated (ran to completion at launch: an n-gram proposer may find no drafts)."""

    shape: StepShape
    asked: list[int]
    start: float
    engine_host_time: float
    speculative: bool
    caught_up: bool   # the proposer fed tokens it had missed before proposing


class _SpecStep(StepHandle):
    """A step of the speculative worker: the target's (or the verifier's) handle, plus the step's
    statistics and the policy's observation when its outputs are read."""

    def __init__(self, worker: SpecDecodeWorker, inner: StepHandle, timer: StepTimer, obs: _Observation):
        self.one_token_per_seq = inner.one_token_per_seq
        self._worker, self._inner, self._timer, self._obs = worker, inner, timer, obs
        self._output: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._output is None:
            # Kept before the observation: should that raise, a second read must not observe twice.
            self._output = self._inner.result()
            self._worker._observe(self._output, self._timer, self._obs)
        return self._output
