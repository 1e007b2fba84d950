"""SpecDecodeWorker: propose -> score -> verify -> commit, in the place of a plain Worker.

Every sampled sequence of a step goes through the same verification path: a
sequence with drafts scores k+1 query tokens (its last token and the drafts)
in the target's ONE forward pass; a sequence without drafts (still in prefill,
or not speculating this step) is the k = 0 case of the same thing.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_spec.config import EngineConfig
from vllm_spec.distributed.parallel_state import get_draft_tp_group
from vllm_spec.model.loader import load_model
from vllm_spec.sample.metadata import ReusedMetadata, SamplingMetadata, SamplingRow
from vllm_spec.spec_decode.adaptive_policy import AdaptivePolicy
from vllm_spec.spec_decode import greedy_verify
from vllm_spec.spec_decode.draft_model_proposer import DraftModelProposer
from vllm_spec.spec_decode.mqa_scorer import MQAScorer
from vllm_spec.spec_decode.ngram_proposer import NgramProposer
from vllm_spec.spec_decode.policy import BatchSizeTablePolicy, FixedPolicy, SpeculationPolicy, StepShape
from vllm_spec.spec_decode.proposer import Proposer
from vllm_spec.spec_decode.step_cost import Charge, StepCharges
from vllm_spec.spec_decode.timer import StepTimer
from vllm_spec.spec_decode.tp_proposer import TPProposer
from vllm_spec.utils import KeptForIds
from vllm_spec.worker.batch import ExecuteModelRequest, SpecStepStats, StepOutput
from vllm_spec.worker.model_runner import ModelRunner
from vllm_spec.worker.step_handle import DoneStep, StepHandle
from vllm_spec.worker.worker import Worker

logger = logging.getLogger(__name__)

_seeded = operator.attrgetter("sampling_params.seeded_sampling")


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
            greedy_drafts = spec.draft_sample_method == "greedy"
            proposer, cost_ratio = None, 0.1   # ranks outside the sub-group follow rank 0's policy
            if draft_tp is not None:
                draft = load_model(spec.draft, draft_tp)
                if spec.draft.arch.embeddings_from_target:
                    draft.share_embeddings(self.target.runner.model)
                if spec.draft.arch.draft_vocab is not None:
                    if draft_tp.world_size > 1 and draft_tp.rank == 0:
                        logger.warning("The draft's restricted output vocabulary (vllm_spec_draft_vocab) is not used "
                                       "with its LM head sharded (speculative_draft_tensor_parallel_size %d): it "
                                       "drafts over the whole vocabulary.", draft_tp.world_size)
                    draft.restrict_output_vocab(torch.tensor(spec.draft.arch.draft_vocab, dtype=torch.long))
                eager = config.enforce_eager if spec.enforce_eager is None else spec.enforce_eager
                self.draft_runner = ModelRunner(draft, self.device, config.cache.block_size,
                                                config.model.max_model_len, cuda_graphs=not eager)
                proposer = self.draft_proposer = DraftModelProposer(
                    self.draft_runner, self.target.sampler.generator, spec.max_model_len,
                    config.scheduler.max_num_batched_tokens, self.target.runner.block_tables,
                    greedy_drafts=greedy_drafts)
                cost_ratio = _num_params(draft) / _num_params(self.target.runner.model)   # per-rank shards
            self.proposer = proposer
            if self.tp.world_size > 1:
                self.proposer = TPProposer(proposer, self.tp, draft_tp is self.tp, self.vocab_size, self.device,
                                           greedy_drafts=greedy_drafts)
        k = spec.num_speculative_tokens
        # What a draft forward costs against a target forward, before anything is measured.
        self.draft_cost_ratio = cost_ratio
        self.policy: SpeculationPolicy = (FixedPolicy(k) if spec.policy in ("fixed", "table")
                                          else AdaptivePolicy(k, draft_cost_ratio=cost_ratio,
                                                              catches_up=spec.method != "ngram"))
        # vLLM's static schedule: k by the step's scheduled sequences, for every row (seeded ones too).
        self._schedule = (BatchSizeTablePolicy.from_schedule(spec.num_speculative_tokens_per_batch_size, k)
                          if spec.policy == "table" else None)
        self._charges = StepCharges(config.uses_async_scheduling)   # what each step cost, for the policy
        self.scorer = MQAScorer(config, self.target, self.proposer)
        self._unread: _SpecStep | None = None   # a launched step that the next may overlap
        # Steps read and sequences finished since the policy last learned: it learns from them while
        # the device runs the next step, off the host's critical path (_policy_work).
        self._lessons: list[_Lesson] = []
        self._finished: list[int] = []
        self._reused_draft_md = ReusedMetadata()
        self._draft_rows: dict[int, SamplingRow] = {}   # seq id -> its row of the draft's metadata
        self._seeded: KeptForIds[np.ndarray] = KeptForIds()   # which of the sampled rows are seeded

    # KV cache: one block manager, two caches of the same number of blocks ----------------
    def kv_bytes_per_block(self) -> int:
        draft = self.draft_runner.kv_bytes_per_block(self.config.model.dtype) if self.draft_runner else 0
        return self.target.kv_bytes_per_block() + draft

    def get_model(self) -> torch.nn.Module:
        """The target model (vLLM's worker method)."""
        return self.target.get_model()

    def available_kv_bytes(self) -> int:
        return self.target.available_kv_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.target.init_kv_cache(num_blocks)
        max_batch = self.config.scheduler.max_num_seqs
        # Plain decode, and verification of any k up to the configured one (the policy varies it).
        k = self.config.speculative.num_speculative_tokens
        self.target.runner.capture_graphs(list(range(1, k + 2)), max_batch)
        self.target.runner.capture_ragged(k + 1, max_batch)   # verification with k per sequence
        greedy_verify.warm_up(k, self.device)
        self.target.runner.warm_logits(min(max_batch * (k + 1), self.config.scheduler.max_num_batched_tokens))
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(num_blocks, self.config.model.dtype)
            # Draft steps (1 token) and the catch-up after a fully accepted step (2 tokens).
            self.draft_runner.capture_graphs([1, 2], max_batch)
            self.draft_proposer.capture_graphs(k, max_batch)
            self.draft_runner.warm_logits(max_batch)   # its catch-ups' rows

    # Steps ------------------------------------------------------------------------------
    def num_drafts(self, req: ExecuteModelRequest) -> tuple[list[int], StepShape, list[int]]:
        """k per sequence, the policy's shape and the rows of its sequences: decoding sequences
        speculate as the policy says, never past the draft's limit (speculative max_model_len, at
        most the target's), and not at all while the batch holds speculative_disable_by_batch_size
        sequences or more.

        Otherwise seeded sampled requests draft the full k (up to the draft's limit) at every step
        that samples past their prompt, and never at the prompt's end: which positions are drafted
        (and so the draws from their generators) then follows from their seed and tokens alone, not
        from the batch they share (which steers the policy), how their prompt was chunked (a last
        chunk of one token is no decode), or a preemption (the recompute's last chunk drafts as the
        step it replays).
        """
        spec = self.config.speculative
        lookahead, max_len = req.num_lookahead_slots, spec.max_model_len
        if spec.disable_by_batch_size is not None and len(req.seqs) >= spec.disable_by_batch_size:
            lookahead = 0   # no drafts at all (the policy still sees the step: it keeps track of what ran)
        if self._schedule is not None:
            lookahead = min(lookahead, self._schedule.k_for_batch(len(req.seqs)))
        cols = req.columns
        room = np.maximum(np.minimum(lookahead, max_len - cols.seq_len), 0)   # drafts inside the draft's limit
        asked = np.zeros(len(req.seqs), dtype=np.int64)
        sampled = np.flatnonzero(cols.sample)
        seeded = sampled[self._seeded_rows(req, sampled)].tolist()
        for i in seeded:
            if cols.seq_len[i] > len(req.seqs[i].prompt_token_ids):
                asked[i] = room[i]
        decoding = cols.sample & (cols.num_new == 1)
        decoding[seeded] = False
        rows = np.flatnonzero(decoding)
        # Tokens the policy does not choose: prefill chunks, and seeded rows with their full drafts
        # (so a step with them is not costed as an all-decoding step of the policy's own k).
        other_tokens = int(cols.num_new.sum()) - len(rows) + int(asked.sum())
        row_list = rows.tolist()
        ragged = not other_tokens and self.target.runner.ragged_for(len(rows), spec.num_speculative_tokens + 1) \
            is not None
        shape = StepShape(cols.ids_of(row_list), room[rows].tolist(), other_tokens, ragged)
        asked[rows] = self.policy.choose(shape)
        return asked.tolist(), shape, row_list

    def _seeded_rows(self, req: ExecuteModelRequest, sampled: np.ndarray) -> np.ndarray:
        """bool [len(sampled)]: which sampled rows sample with their request's own seed. A sequence's
        parameters never change, so the same sampled sequences as the last step's (most steps) read
        none of them."""
        return self._seeded.get(req.columns.ids_of(sampled), lambda: np.fromiter(
            map(_seeded, req.seqs_of(sampled)), dtype=bool, count=len(sampled)))

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        return self.launch(req).result()

    @torch.inference_mode()
    def launch(self, req: ExecuteModelRequest) -> StepHandle:
        """Queue the step. A step that speculates runs to completion here (its outputs decide what
        comes next); one that does not is the target's plain step, which may overlap the next."""
        self._charges.add_idle(req.engine_idle_time)
        self.target.release(req.finished_seq_ids)
        self.proposer.release(req.finished_seq_ids)
        self._finished += req.finished_seq_ids   # the policy's, after its lessons about them
        self.scorer.release(req.finished_seq_ids)
        for sid in req.finished_seq_ids:
            self._draft_rows.pop(sid, None)
        if not req.seqs:
            self._policy_work(None)
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
        caught_up = self.proposer.catch_up(req, asked)
        timer.mark(queued=caught_up > 0)
        draft_md = self._draft_metadata(req, spec_idx)
        proposals = self.proposer.propose(req, asked, draft_md)
        timer.mark()
        if spec_idx:
            step: StepHandle = DoneStep(self.scorer.score_and_verify(req, spec_idx, proposals, draft_md, timer.mark,
                                                                     lambda: self._policy_work(shape)))
        else:
            step = self.target.launch(req, on_pass=timer.mark)
            timer.mark()
            self._policy_work(shape)
        # What the proposer found (an n-gram proposer may find fewer drafts than asked, or none): a
        # draft never proposed is no trial of the acceptance, and the verification did not score it.
        drafted = list(asked)
        for i, n in zip(spec_idx, proposals.num_drafts):
            drafted[i] = n
        asked_rows, found_rows = [asked[i] for i in rows], [drafted[i] for i in rows]
        found = None if found_rows == asked_rows else found_rows
        handle = _SpecStep(self, step, timer, _Observation(shape, asked_rows, found, start, bool(spec_idx), caught_up))
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
        stats.catch_up_tokens = obs.caught_up
        stats.draft_time = stats.catch_up_time + draft_time
        if timer.cuda:
            result.device_time = stats.draft_time + prepare_time + stats.verify_time
        if obs.shape.seq_ids == result.seq_ids:   # every sequence decoding (most steps): row for row
            accepted = [n - 1 for n in map(len, result.token_ids)]
        else:
            by_id = {sid: len(toks) - 1 for sid, toks in zip(result.seq_ids, result.token_ids)}
            accepted = [by_id.get(sid, 0) for sid in obs.shape.seq_ids]
        charge = self._charges.read(time.perf_counter(), obs.start, obs.speculative)
        charge.seconds = max(charge.seconds - stats.catch_up_time, 1e-6)
        self._lessons.append(_Lesson(obs.shape, obs.asked, accepted, stats, charge, obs.found))
        stats.policy = replace(self.policy.estimates(), mean_k=sum(obs.asked) / len(obs.asked) if obs.asked else 0.0)

    def _policy_work(self, shape: StepShape | None) -> None:
        """While the device runs a step of this shape (None: no step): the policy learns from the
        steps read since it last did, in order, forgets the sequences that finished (after the
        lessons about them), and prepares its next choice. Advisory: a failure here is logged, and
        the step already queued runs and is read as any other."""
        lessons, self._lessons = self._lessons, []
        finished, self._finished = self._finished, []
        for lesson in lessons:
            self._advisory(self.policy.observe, lesson.shape, lesson.chosen, lesson.accepted, lesson.stats,
                           lesson.charge, lesson.found)
        self._advisory(self.policy.release, finished)
        if shape is not None:
            self._advisory(self.policy.prepare, shape)

    @staticmethod
    def _advisory(call, *args) -> None:
        """One piece of the policy's work: a failure is logged, and the rest goes on."""
        try:
            call(*args)
        except Exception:
            logger.exception("The speculation policy failed in %s; serving goes on.", getattr(call, "__name__", call))

    def _draft_metadata(self, req: ExecuteModelRequest, spec_idx: list[int]) -> SamplingMetadata | None:
        """The speculating rows' proposal metadata: for a draft it never follows tokens (no penalties,
        no min_tokens), so it is built once while the same sequences speculate, and from rows kept per
        sequence when the batch changed (every few steps under continuous batching)."""
        if not spec_idx:
            return None
        seq_ids = req.columns.ids_of(spec_idx)

        def build() -> SamplingMetadata:
            rows = self._draft_rows
            for i, sid in zip(spec_idx, seq_ids):
                if sid not in rows:
                    rows[sid] = self.target.sampling_row(req.seqs[i], for_draft=True)
            return SamplingMetadata.build(list(map(rows.__getitem__, seq_ids)), self.target.vocab_size,
                                          self.device, for_draft=True)
        return self._reused_draft_md.get(seq_ids, build)


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class _Observation:
    """What the policy learns from once a step is read: its shape, the drafts asked and found, when it began,
    and whether it speculated (ran to completion at launch: an n-gram proposer may find no drafts)."""

    shape: StepShape
    asked: list[int]
    found: list[int] | None   # what the proposer found of those (None: all)
    start: float
    speculative: bool
    caught_up: int   # tokens the proposer fed before proposing (ones it had missed)


@dataclass
class _Lesson:
    """A read step's observation, for the policy to learn from while the device runs a later one."""

    shape: StepShape
    chosen: list[int]
    accepted: list[int]
    stats: SpecStepStats
    charge: Charge
    found: list[int] | None


class _SpecStep(StepHandle):
    """A step of the speculative worker: the target's (or the verifier's) handle, plus the step's
    statistics and the policy's lesson (learned while a later step runs) when its outputs are read."""

    def __init__(self, worker: SpecDecodeWorker, inner: StepHandle, timer: StepTimer, obs: _Observation):
        self.one_token_per_seq = inner.one_token_per_seq
        self._worker, self._inner, self._timer, self._obs = worker, inner, timer, obs
        self._output: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._output is None:
            # Kept before the lesson is taken: should that raise, a second read must not take it twice.
            self._output = self._inner.result()
            self._worker._observe(self._output, self._timer, self._obs)
        return self._output
