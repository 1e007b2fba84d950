"""Drafts proposed for the next step as soon as a verification's tokens are read (draft_ahead.py): used when
the next step is the one they were made for, given back otherwise; outputs never change. (On by
default on CUDA only, where the device drafts while the host works; turned on here for the CPU.)"""

from __future__ import annotations

import pytest
import torch
from conftest import FIXED, GREEDY, BurstsPolicy, ScriptedPolicy, make_prompts, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams
from vllm_spec.config import EngineConfig
from vllm_spec.spec_decode.draft_ahead import DraftsAhead
from vllm_spec.worker.batch import SeqInput


class _Counting:
    """Counts, on a live DraftModelProposer, the proposals made ahead and the ones the next step
    dropped (did not fit)."""

    def __init__(self, proposer, monkeypatch):
        self.made = self.given_back = 0
        propose_ahead, fits = proposer.propose_ahead, DraftsAhead.fits

        def counted_propose(*args):
            self.made += 1
            return propose_ahead(*args)

        def counted_fits(ahead, *args):
            used = fits(ahead, *args)
            self.given_back += not used
            return used

        monkeypatch.setattr(proposer, "propose_ahead", counted_propose)
        monkeypatch.setattr(DraftsAhead, "fits", counted_fits)


@pytest.fixture
def ahead_on_cpu(monkeypatch):
    on = property(lambda self: self.speculative is not None and self.speculative.method == "draft_model")
    monkeypatch.setattr(EngineConfig, "drafts_ahead", on)


def _lengths_that_differ(n: int) -> list[SamplingParams]:
    # Requests finish at different steps: the batch changes under drafts proposed for it.
    return [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(n)]


def test_drafts_ahead_are_used_and_given_back_without_changing_outputs(spec_pair, monkeypatch, ahead_on_cpu):
    prompts, params = make_prompts(6), _lengths_that_differ(6)
    reference = output_ids(LLM(spec_pair[0], **KV).generate(prompts, params, use_tqdm=False))
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    worker = llm.llm_engine.executor.worker
    counts = _Counting(worker.draft_proposer, monkeypatch)
    caught_up = []
    catch_up = worker.draft_proposer.catch_up
    monkeypatch.setattr(worker.draft_proposer, "catch_up", lambda *a: caught_up.append(catch_up(*a)) or caught_up[-1])
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert counts.made > counts.given_back > 0   # most are used; a finished request voids some
    # Drafts used are recorded as fed: a step after dropped ones finds the draft's cache up to date.
    assert caught_up and not any(caught_up)


def test_drafts_ahead_for_a_step_that_does_not_speculate_are_given_back(spec_pair, greedy_reference, monkeypatch,
                                                                        ahead_on_cpu):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    worker = llm.llm_engine.executor.worker
    worker.policy = BurstsPolicy(period=2)   # a speculative step is always followed by a plain one
    counts = _Counting(worker.draft_proposer, monkeypatch)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    # (The last proposal ahead waits for a step that never comes: the requests finished.)
    assert counts.made > 0 and counts.given_back == counts.made - 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_no_drafts_ahead_for_sampled_requests(spec_pair, monkeypatch, ahead_on_cpu, temperature):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    counts = _Counting(llm.llm_engine.executor.worker.draft_proposer, monkeypatch)
    llm.generate(make_prompts(4), SamplingParams(temperature=temperature, seed=1, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    assert (counts.made > 0) == (temperature == 0.0)
    assert llm.llm_engine.config.num_lookahead_slots == 6   # the next step's k slots too


def test_drafts_ahead_only_where_the_device_drafts_while_the_host_works(spec_pair):
    """Off on a CPU (the host would only do the same work earlier) and for the n-gram proposer:
    k lookahead slots."""
    for draft in (spec_pair[1], "[ngram]"):
        config = LLM(spec_pair[0], speculative_model=draft, num_speculative_tokens=3, **FIXED, **KV).llm_engine.config
        assert not config.drafts_ahead and config.num_lookahead_slots == 3


class _Alternating(ScriptedPolicy):
    """k = 3, 2, 3, 2, ... on every step: drafts made ahead with 3 serve a step of 2 (their first
    two), those made with 2 cannot serve a step of 3."""

    def __init__(self):
        self.steps = 0

    def choose(self, shape) -> list[int]:
        self.steps += 1
        return [min(cap, 3 if self.steps % 2 else 2) for cap in shape.caps]


def test_a_step_asking_fewer_drafts_uses_the_first_ones(spec_pair, greedy_reference, monkeypatch, ahead_on_cpu):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    worker = llm.llm_engine.executor.worker
    worker.policy = _Alternating()
    counts = _Counting(worker.draft_proposer, monkeypatch)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    assert 0 < counts.given_back < counts.made


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_ahead_of_the_target_itself_are_all_accepted(spec_pair, async_scheduling, ahead_on_cpu):
    """Draft == target (float32): every draft made ahead must be the target's own greedy token, so
    every one is accepted; a draft K/V written to the wrong position or from the wrong tokens shows."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3,
              async_scheduling=async_scheduling, **FIXED, **KV)
    llm.generate(make_prompts(6), _lengths_that_differ(6), use_tqdm=False)
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] > 0


def test_drafts_fit_only_the_step_they_were_made_for():
    ahead = DraftsAhead([1, 2], [10, 12], torch.zeros(2, 3, dtype=torch.long), None)

    def seq(sid: int, length: int, tokens: int = 1, sample: bool = True) -> SeqInput:
        return SeqInput(sid, [7] * tokens, length - tokens, [0], sample)

    assert ahead.fits([seq(1, 10), seq(2, 12)], [3, 3])
    assert ahead.fits([seq(1, 10), seq(2, 12)], [3, 2])              # the first drafts of a row
    assert not ahead.fits([seq(1, 10), seq(2, 12)], [4, 4])          # more than were made
    assert not ahead.fits([seq(1, 10), seq(2, 12)], [3, 0])          # a row not speculating
    assert not ahead.fits([seq(1, 10)], [3])                          # a sequence left
    assert not ahead.fits([seq(1, 10), seq(2, 12), seq(3, 5)], [3, 3, 3])   # one joined
    assert not ahead.fits([seq(2, 12), seq(1, 10)], [3, 3])          # another order
    assert not ahead.fits([seq(1, 10), seq(2, 11)], [3, 3])          # another length (preempted)
    assert not ahead.fits([seq(1, 10), seq(2, 12, tokens=2)], [3, 3])   # a chunk, not a decoding step


def test_drafts_ahead_are_the_drafts_the_step_would_have_made(spec_pair, monkeypatch, ahead_on_cpu):
    """A noisy draft (rejections: steps keep one to four tokens, so every way the last two tokens are
    found is met): proposing ahead must not change a single draft, so the same drafts are accepted
    as when each step proposes its own."""
    prompts, params = make_prompts(8, seed=3), _lengths_that_differ(8)
    accepted = {}
    for ahead in (True, False):
        llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
        worker = llm.llm_engine.executor.worker
        worker.drafts_ahead = ahead
        counts = _Counting(worker.draft_proposer, monkeypatch)
        llm.generate(prompts, params, use_tqdm=False)
        m = metric_values(llm)
        accepted[ahead] = (m["vllm:spec_decode_num_accepted_tokens"], m["vllm:spec_decode_num_draft_tokens"])
        assert (counts.made > 0) == ahead
    assert accepted[True] == accepted[False]
    assert 0 < accepted[True][0] < accepted[True][1]


def test_drafts_ahead_under_preemption(spec_pair, greedy_reference, monkeypatch, ahead_on_cpu):
    """A tight KV budget (2k lookahead slots per decoding sequence now): sequences are preempted between
    a proposal ahead and the step it was made for; outputs stay the target's, every block comes back."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3,
              block_size=4, num_gpu_blocks_override=45, max_model_len=128, **FIXED)
    counts = _Counting(llm.llm_engine.executor.worker.draft_proposer, monkeypatch)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    assert metric_values(llm)["vllm:num_preemptions"] > 0 and counts.made > counts.given_back > 0
    manager = llm.llm_engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
