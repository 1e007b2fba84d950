"""Prefix caching end to end: prompts sharing a prefix compute it once, and every output is the
one computed without the cache, with and without speculation, under preemption."""

from __future__ import annotations

import random

import pytest

from conftest import FIXED, SPEC_KV, ScriptedPolicy, metric_values, output_ids
from vllm_spec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, prefix_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(prefix_len)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]}
            for _ in range(n)]


class Scripted(ScriptedPolicy):
    """Every decoding sequence drafts k (set by the test between rounds)."""

    k = 0

    def choose(self, shape) -> list[int]:
        return [min(cap, self.k) for cap in shape.caps]


def _in_two_rounds(llm: LLM, prompts: list[dict], params: SamplingParams = GREEDY):
    """The first prompt alone, then the rest: they find its prefix registered."""
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    return first + llm.generate(prompts[1:], params, use_tqdm=False)


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return _prompts(6, 37, seed=1)


@pytest.fixture(scope="module")
def reference(spec_pair, prompts) -> list[list[int]]:
    return output_ids(LLM(spec_pair[0], **SPEC_KV).generate(prompts, GREEDY, use_tqdm=False))


def test_plain_decoding_reuses_the_prefix_and_keeps_its_outputs(spec_pair, prompts, reference):
    llm = LLM(spec_pair[0], enable_prefix_caching=True, **SPEC_KV)
    outs = _in_two_rounds(llm, prompts)
    assert output_ids(outs) == reference
    # 37 shared tokens: 2 full blocks of 16 for every prompt after the first.
    assert [o.num_cached_tokens for o in outs] == [0] + [32] * 5
    m = metric_values(llm)
    assert m["vllm:prefix_cache_hits"] == 32 * 5
    assert m["vllm:prefix_cache_queries"] == sum(len(p["prompt_token_ids"]) for p in prompts)
    # The same prompts again: their own blocks are still cached (up to the block before the last token).
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert output_ids(again) == reference
    assert all(o.num_cached_tokens == (len(p["prompt_token_ids"]) - 1) // 16 * 16 for o, p in zip(again, prompts))


@pytest.mark.parametrize("k", [1, 4])
def test_speculation_with_a_noisy_draft(spec_pair, prompts, reference, k):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=k, enable_prefix_caching=True,
              **FIXED, **SPEC_KV)
    assert output_ids(_in_two_rounds(llm, prompts)) == reference
    assert metric_values(llm)["vllm:prefix_cache_hits"] > 0


def test_a_draft_equal_to_the_target_accepts_everything_after_a_cache_hit(spec_pair, prompts, reference):
    """The draft's cache holds the shared prefix too (it recomputes what it has not seen): with
    draft = target every draft token is accepted, so a wrong draft K/V anywhere would show."""
    target = spec_pair[0]
    llm = LLM(target, speculative_model=target, num_speculative_tokens=3, enable_prefix_caching=True,
              **FIXED, **SPEC_KV)
    outs = _in_two_rounds(llm, prompts)
    assert output_ids(outs) == reference
    assert all(o.num_cached_tokens == 32 for o in outs[1:])
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"]


def test_preemption_with_shared_prefixes(spec_pair):
    """A cache too small for the batch: sequences are preempted and recomputed while others share
    their prefix blocks; every output is the one computed alone."""
    prompts = _prompts(10, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = output_ids(LLM(spec_pair[0], **SPEC_KV).generate(prompts, params, use_tqdm=False))
    for extra in ({}, dict(speculative_model=spec_pair[1], num_speculative_tokens=2, **FIXED)):
        llm = LLM(spec_pair[0], enable_prefix_caching=True, num_gpu_blocks_override=14, max_num_seqs=8,
                  max_model_len=128, **extra)
        assert output_ids(_in_two_rounds(llm, prompts, params)) == ref
        m = metric_values(llm)
        assert m["vllm:num_preemptions"] > 0 and m["vllm:prefix_cache_hits"] > 0
        engine = llm.llm_engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_prompt_logprobs_are_computed_not_cached(spec_pair, prompts):
    llm = LLM(spec_pair[0], enable_prefix_caching=True, **SPEC_KV)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    cold = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    warm = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    assert [None if d is None else {t: round(lp.logprob, 5) for t, lp in d.items()} for d in warm.prompt_logprobs] \
        == [None if d is None else {t: round(lp.logprob, 5) for t, lp in d.items()} for d in cold.prompt_logprobs]


def test_reset_prefix_cache(spec_pair, prompts):
    llm = LLM(spec_pair[0], enable_prefix_caching=True, **SPEC_KV)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompts[1:2], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_off_by_default(spec_pair, prompts):
    llm = LLM(spec_pair[0], **SPEC_KV)
    outs = _in_two_rounds(llm, prompts[:2])
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert metric_values(llm)["vllm:prefix_cache_queries"] == 0


@pytest.mark.parametrize("spec", [False, True])
def test_a_conversations_next_turn_reads_the_last_answer_from_the_cache(spec_pair, spec):
    """Output blocks are registered too: a prompt that repeats an earlier prompt and its answer (the next
    turn of a chat) finds both cached, and its output is the one computed without the cache."""
    first = _prompts(1, 20, seed=5)[0]["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    extra = dict(speculative_model=spec_pair[0], num_speculative_tokens=3) if spec else {}
    llm = LLM(spec_pair[0], enable_prefix_caching=True, **extra, **SPEC_KV)
    if spec:   # no drafts while answering: the answer's blocks hold no draft K/V, and the next turn sees that
        policy = llm.llm_engine.executor.worker.policy = Scripted()
    answer = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0].outputs[0].token_ids
    turn = {"prompt_token_ids": first + list(answer) + [7, 8, 9]}
    if spec:
        policy.k = 3
    out = llm.generate([turn], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(first) + len(answer) + 3 - 1) // 16 * 16 > len(first)
    assert out.outputs[0].token_ids == LLM(spec_pair[0], **SPEC_KV).generate([turn], params, use_tqdm=False)[0] \
        .outputs[0].token_ids
    if spec:   # the draft's cache is right too (draft = target accepts every draft token)
        m = metric_values(llm)
        assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] > 0


def test_a_sequence_preempted_with_its_last_token_in_flight(spec_pair):
    """Async scheduling: a sequence preempted while the step sampling its last token is in flight finishes,
    holding no blocks, when that step is read; nothing is registered for it (it raised IndexError)."""
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 290 for j in range(9)]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    settings = dict(async_scheduling=True, block_size=4, max_model_len=32, num_gpu_blocks_override=12, max_num_seqs=8)
    ref = output_ids(LLM(spec_pair[0], **settings).generate(prompts, params, use_tqdm=False))
    llm = LLM(spec_pair[0], enable_prefix_caching=True, **settings)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert metric_values(llm)["vllm:num_preemptions"] > 0


def test_cached_tokens_are_what_the_first_scheduling_found(spec_pair):
    """num_cached_tokens reports the hits of a request's first admission, also after a preemption (whose
    recomputation finds none)."""
    prompts = _prompts(9, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(spec_pair[0], enable_prefix_caching=True, num_gpu_blocks_override=14, max_num_seqs=8, max_model_len=128)
    outs = _in_two_rounds(llm, prompts, params)
    engine = llm.llm_engine
    assert metric_values(llm)["vllm:num_preemptions"] > 0
    assert [o.num_cached_tokens for o in outs] == [0] + [32] * 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


@pytest.mark.parametrize("budget", [31, 64])
def test_the_draft_starts_where_its_cached_kv_ends(spec_pair, budget):
    """A sequence that finds prompt blocks cached finds the draft's K/V there too: the draft is fed from the
    end of the cached prefix, not from 0 (a prompt's 1-token last chunk included: budget 31 splits a 32-token
    prompt so), and with draft = target every draft is still accepted."""
    target = spec_pair[0]
    llm = LLM(target, speculative_model=target, num_speculative_tokens=3, enable_prefix_caching=True,
              max_num_batched_tokens=budget, **SPEC_KV)
    # The first request never speculates: its draft sees only what prompt chunks feed it.
    policy = llm.llm_engine.executor.worker.policy = Scripted()
    starts: dict[int, int] = {}
    runner = llm.llm_engine.executor.worker.proposer.runner
    prepare = runner.prepare

    def recording(seqs, *args, **kwargs):
        for s in seqs:
            starts[s.seq_id] = min(starts.get(s.seq_id, s.start_pos), s.start_pos)
        return prepare(seqs, *args, **kwargs)

    runner.prepare = recording
    shared = list(range(40, 72))   # 32 tokens: two full blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)
    later = [{"prompt_token_ids": shared + [5 + i, 9]} for i in range(3)]
    seen = set(starts)
    policy.k = 3
    outs = llm.generate(later, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [32] * 3
    assert sorted(v for sid, v in starts.items() if sid not in seen) == [32] * 3
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] > 0
    ref = LLM(target, **SPEC_KV).generate([{"prompt_token_ids": shared}] + later, params, use_tqdm=False)
    assert output_ids(first + outs) == output_ids(ref)
