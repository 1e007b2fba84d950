"""End to end: the speculation policies (greedy equality under each, different k per sequence,
speculative_disable_by_batch_size, seeded rows drafting whatever the policy) and the draft's catch-up
after steps that did not speculate. What the policies measure and learn: test_policy_learning_e2e.py."""

from __future__ import annotations

import pytest
from conftest import FIXED, GREEDY, BurstsPolicy, ScriptedPolicy, make_prompts, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams


def test_disable_by_batch_size(spec_pair, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2,
              speculative_disable_by_batch_size=4, **FIXED, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    drafts_big_batch = metric_values(llm)["vllm:spec_decode_num_drafts"]
    llm.generate(make_prompts(2), GREEDY, use_tqdm=False)
    assert metric_values(llm)["vllm:spec_decode_num_drafts"] > drafts_big_batch


@pytest.mark.parametrize("policy", [
    {"speculative_policy": "adaptive"},
    {"speculative_policy": "fixed"},
    {"speculative_policy": "adaptive", "speculative_disable_by_batch_size": 6},
    {"speculative_policy": "fixed", "speculative_disable_by_batch_size": 6},
])
def test_greedy_equality_every_policy(spec_pair, greedy_reference, policy):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **policy, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    m = metric_values(llm)
    assert 0.0 <= m["vllm:spec_decode_policy_mean_k"] <= 4.0


class _VaryingK(ScriptedPolicy):
    """A policy giving neighbouring sequences different k (from `least` to 3): exercises padded verification."""

    def __init__(self, least: int = 0):
        self.least = least

    def choose(self, shape):
        return [min(cap, self.least + (i + len(shape.seq_ids)) % (4 - self.least)) for i, cap in enumerate(shape.caps)]


def test_greedy_equality_with_different_k_per_sequence(spec_pair, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **KV)
    llm.llm_engine.executor.worker.policy = _VaryingK()
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


def test_draft_equal_to_target_with_different_k_per_sequence(spec_pair, greedy_reference):
    # Every row drafts (k 1..3, so the whole-proposal loop runs) and rows asking fewer drafts than
    # the step's most keep rewriting their last legal slot: their drafts must still be exact.
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3, **KV)
    llm.llm_engine.executor.worker.policy = _VaryingK(least=1)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    assert metric_values(llm)["vllm:spec_decode_acceptance_rate"] == 1.0


@pytest.mark.parametrize("uniform", [False, True], ids=["ragged", "uniform"])
def test_speculating_after_plain_steps_catches_the_draft_up(spec_pair, greedy_reference, uniform):
    # The draft does not run on steps without speculation; the next speculative step must feed it the
    # missed tokens (greedy equality) and still propose on the whole-proposal path. Uniform: every row
    # feeds one query length, front-padded with tokens the draft has seen (as where graphs run).
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3, **KV)
    worker = llm.llm_engine.executor.worker
    worker.policy = BurstsPolicy(period=4)
    proposer = worker.draft_proposer
    proposer.uniform_catch_up = uniform
    lengths = []
    pick = proposer._uniform_catch_up_length
    proposer._uniform_catch_up_length = lambda behind, starts: lengths.append(pick(behind, starts)) or lengths[-1]
    calls = {"propose": 0, "loop": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    propose, proposer._propose_in_loop = proposer.propose, count("loop", proposer._propose_in_loop)
    proposer.propose = lambda seqs, num_drafts, md: count("propose", propose)(seqs, num_drafts, md) \
        if any(num_drafts) else propose(seqs, num_drafts, md)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    # Draft = target: every draft of every burst is kept, three plain steps in between notwithstanding.
    assert metric_values(llm)["vllm:spec_decode_acceptance_rate"] == 1.0
    assert calls["propose"] > 0 and calls["loop"] == calls["propose"]
    assert (any(lengths) if uniform else not any(lengths)) and lengths


def test_a_long_lag_is_caught_up_in_forwards_within_the_token_budget(spec_pair, greedy_reference):
    """After long runs of plain steps 16 sequences lag the draft by more tokens than a step's budget
    (max_num_batched_tokens, which the activations' memory is sized for): the catch-up feeds them in
    forwards within it, sequences cut between forwards, and nothing is lost (draft = target)."""
    budget = 64
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3,
              max_num_batched_tokens=budget, **KV)
    worker = llm.llm_engine.executor.worker
    worker.policy = BurstsPolicy(period=10)
    proposer = worker.draft_proposer
    proposer.uniform_catch_up = False   # the eager path (a graph replay's activations are the graph's own)
    fed, forwards = [], []
    write, prepare = proposer._write_kv, proposer.runner.prepare
    proposer._write_kv = lambda feed: fed.append(sum(len(s.token_ids) for s in feed)) or write(feed)
    proposer.runner.prepare = lambda seqs, *a, **kw: forwards.append(sum(len(s.token_ids) for s in seqs)) or \
        prepare(seqs, *a, **kw)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    assert metric_values(llm)["vllm:spec_decode_acceptance_rate"] == 1.0
    assert max(fed) > budget and max(forwards) <= budget


def test_uniform_catch_up_of_rows_lagging_by_different_amounts(spec_pair, baseline):
    """Requests arriving at different steps lag the draft by different amounts (up to the padded
    length itself): every row is padded to one query length; draft = target keeps every draft."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3, **KV)
    engine, worker = llm.llm_engine, llm.llm_engine.executor.worker
    worker.policy = BurstsPolicy(period=5)
    proposer = worker.draft_proposer
    proposer.uniform_catch_up = True
    lags = []
    pick = proposer._uniform_catch_up_length

    def recording(behind, starts):
        q = pick(behind, starts)
        lags.append(([s.seq_len - 2 - start for s, start in zip(behind, starts)], q))
        return q

    proposer._uniform_catch_up_length = recording
    prompts = [p["prompt_token_ids"] for p in make_prompts(4, seed=21)]
    expected = output_ids(baseline.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    done = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
        for _ in range(i + 1):   # staggered arrivals
            done.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[str(i)].outputs[0].token_ids for i in range(4)] == expected
    assert metric_values(llm)["vllm:spec_decode_acceptance_rate"] == 1.0
    assert any(q is not None and len(set(row_lags)) > 1 for row_lags, q in lags)
    assert any(q is not None and max(row_lags) == q for row_lags, q in lags)


def test_only_steps_that_catch_the_draft_up_report_a_catch_up(spec_pair):
    """The policy charges a switch to speculation with the catch-up (and spaces probes by its seconds per token
    fed): a step without one must report none, a step with one the tokens it fed."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **KV)
    worker = llm.llm_engine.executor.worker
    policy = worker.policy = BurstsPolicy(period=4)
    seen = []
    policy.observe = lambda shape, chosen, accepted, stats, charge, found=None: seen.append(
        (max(chosen, default=0), len(shape.seq_ids), stats.catch_up_time, stats.catch_up_tokens))
    llm.generate(make_prompts(4), GREEDY, use_tqdm=False)
    assert all(t == 0.0 and n == 0 for k, _, t, n in seen if k == 0)
    bursts = [(seqs, t, n) for k, seqs, t, n in seen if k > 0]
    # after three plain steps the draft lags by three or more: it feeds each speculating sequence one or more
    assert all(t > 0.0 and n >= seqs for seqs, t, n in bursts[1:]), bursts


def test_disable_by_batch_size_stops_seeded_drafts_too(spec_pair):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2,
              speculative_disable_by_batch_size=2, **KV)
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=10, ignore_eos=True) for s in range(3)]
    llm.generate(make_prompts(3), seeded, use_tqdm=False)
    assert metric_values(llm)["vllm:spec_decode_num_drafts"] == 0
    assert llm.llm_engine.executor.worker.policy._speculating is False
    # One entry per draft position, as vLLM's, also before any position was drafted.
    assert metric_values(llm)["vllm:spec_decode_num_accepted_tokens_per_pos"] == [0, 0]


class _NeverDrafts(ScriptedPolicy):
    def choose(self, shape) -> list[int]:
        return [0] * len(shape.caps)


def test_a_seeded_row_drafts_whatever_the_policy_when_it_replaces_an_unseeded_one(spec_pair):
    """Seeded sampled rows draft the full k (their draws must not depend on the batch), also when one
    takes an unseeded row's place in a batch of the same size."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2, **KV)
    engine = llm.llm_engine
    engine.executor.worker.policy = _NeverDrafts()
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p["prompt_token_ids"] for p in make_prompts(3)]
    engine.add_request("g0", prompts[0], greedy)
    engine.add_request("g1", prompts[1], greedy)
    for _ in range(4):
        engine.step()
    assert metric_values(llm)["vllm:spec_decode_num_draft_tokens"] == 0
    engine.abort_request(["g0"])
    engine.add_request("s", prompts[2], SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert metric_values(llm)["vllm:spec_decode_num_draft_tokens"] >= 2 * 2
