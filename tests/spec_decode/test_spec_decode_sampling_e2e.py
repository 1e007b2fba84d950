"""End-to-end correctness of speculative decoding, sampled: the token distribution equals plain
decoding's; seeded requests draw the same whatever the batch, arrivals, chunking or preemption; synthetic
acceptance (extra_args synthetic_acceptance_rate) is per request and independent of the batch.

The model pair comes from --target-model/--draft-model (or VLLM_SPEC_TEST_TARGET/_DRAFT); by
default a tiny random target and a noisy copy of it as draft (partial acceptance).
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy import stats

from conftest import FIXED, make_prompts, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams


def _token_histogram(llm: LLM, position: int, runs: int, params: SamplingParams, vocab: int) -> torch.Tensor:
    prompt = {"prompt_token_ids": [3, 17, 42, 99, 5]}
    outs = llm.generate([prompt] * runs, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids[position] for o in outs])
    return torch.bincount(tokens, minlength=vocab)


@pytest.mark.parametrize("extra", [{}, {"top_k": 20, "top_p": 0.9},
                                   {"allowed_token_ids": list(range(0, 384, 3)), "logit_bias": {3: 2.0, 6: -1.0}}])
def test_sampled_distribution_matches_non_speculative(spec_pair, baseline, random_draft, extra):
    """The 3rd generated token over 1500 unseeded runs, with and without speculation.

    The draft is an unrelated random model, so a sampler that kept its drafts (or mixed
    up p and q) would emit the draft's distribution, far from the target's.
    Bound: a chi-square two-sample (contingency) test on tokens with enough counts gives
    p-value > 1e-3 at this fixed engine seed.
    """
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, **extra)
    vocab = baseline.llm_engine.config.model.arch.vocab_size
    ref = _token_histogram(baseline, 2, 1500, params, vocab)
    llm = LLM(spec_pair[0], speculative_model=str(random_draft), num_speculative_tokens=2, seed=123, **FIXED, **KV)
    got = _token_histogram(llm, 2, 1500, params, vocab)
    assert metric_values(llm)["vllm:spec_decode_num_accepted_tokens"] > 0
    keep = (ref + got) >= 10
    table = torch.stack([torch.cat([ref[keep], ref[~keep].sum().view(1)]),
                         torch.cat([got[keep], got[~keep].sum().view(1)])]).numpy()
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_seeded_sampling_is_independent_of_batch(spec_pair):
    # Default (adaptive) policy: seeded requests keep a batch-independent k.
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **KV)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)
    prompt = make_prompts(1, seed=8)
    alone = output_ids(llm.generate(prompt, seeded, use_tqdm=False))[0]
    mixed = llm.generate(prompt + make_prompts(6, seed=9), [seeded] + [other] * 6, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    again = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, seed=77, **KV)
    assert output_ids(again.generate(prompt, seeded, use_tqdm=False))[0] == alone


def test_seeded_request_near_max_model_len_is_independent_of_batch(spec_pair):
    """Near max_model_len a seeded row gets fewer drafts than the batch's k: its draft
    generator must draw for its own drafts only, whatever the other rows ask."""
    kw = dict(speculative_model=spec_pair[1], num_speculative_tokens=4, max_model_len=64, seed=5, **FIXED, **KV)
    llm = LLM(spec_pair[0], **kw)
    seeded = SamplingParams(temperature=1.0, seed=99)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    prompt = {"prompt_token_ids": [random.Random(3).randrange(3, 300) for _ in range(52)]}
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0]
    assert alone.finish_reason == "length" and len(alone.token_ids) == 12
    mixed = llm.generate([prompt] + make_prompts(3, seed=15), [seeded] + [other] * 3, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.token_ids


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_seeded_request_arriving_while_others_speculate(spec_pair, method):
    """The seeded request's prefill is verified next to rows with drafts (the batch's k > 0) or not:
    its generator must give the same draws either way."""
    draft = spec_pair[1] if method == "draft" else "[ngram]"
    seeded = SamplingParams(temperature=0.7, seed=417, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.7, seed=1, max_tokens=24, ignore_eos=True)
    prompt, other_prompt = make_prompts(1, seed=11)[0], make_prompts(1, seed=12)[0]

    def run(with_other: bool) -> list[int]:
        engine = LLM(spec_pair[0], speculative_model=draft, num_speculative_tokens=3, **FIXED, **KV).llm_engine
        if with_other:
            engine.add_request("other", other_prompt, other)
            for _ in range(3):
                engine.step()
        engine.add_request("seeded", prompt, seeded)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "seeded" and out.finished:
                    return out.outputs[0].token_ids
        raise AssertionError("the seeded request did not finish")

    assert run(True) == run(False)


@pytest.mark.parametrize("policy", [FIXED, {}], ids=["fixed", "adaptive"])
def test_seeded_request_whose_prompt_ends_in_a_one_token_chunk(spec_pair, policy):
    """A token budget shared with other prompts cuts the seeded prompt so that its last chunk is one
    token: that chunk ends the prompt (no drafts, as when the prompt runs whole), not a decode step."""
    seeded = SamplingParams(temperature=0.8, seed=42, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(11, 21))}
    # Budget 12: the three 4-token prompts fill the first step, their decodes leave 9 tokens of the
    # second for the seeded prompt, whose last token goes alone in the third.
    others = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(3)]
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, max_num_batched_tokens=12,
              **policy, **KV)
    alone = output_ids(llm.generate(prompt, seeded, use_tqdm=False))[0]
    mixed = llm.generate(others + [prompt], [other] * 3 + [seeded], use_tqdm=False)
    assert output_ids(mixed)[-1] == alone


def test_seeded_sampling_is_independent_of_preemption(spec_pair):
    """Preempted seeded requests recompute their tokens; the recompute's last chunk drafts as the step
    it replays did (its drafts placed after the whole chunk), so each output is the unpreempted one."""
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    prompts = make_prompts(6, seed=21)
    kw = dict(speculative_model=spec_pair[1], num_speculative_tokens=3, block_size=4, max_model_len=128, **FIXED)
    reference = output_ids(LLM(spec_pair[0], **kw, **KV).generate(prompts, seeded, use_tqdm=False))
    tight = LLM(spec_pair[0], **kw, num_gpu_blocks_override=34)
    assert output_ids(tight.generate(prompts, seeded, use_tqdm=False)) == reference
    assert metric_values(tight)["vllm:num_preemptions"] > 0
    assert metric_values(tight)["vllm:spec_decode_num_accepted_tokens"] > 0


def test_per_request_synthetic_acceptance_in_one_batch(spec_pair, baseline):
    """extra_args synthetic_acceptance_rate 1.0 keeps every draft, 0.0 none, side by side in one batch."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)
    engine = llm.llm_engine
    prompts = make_prompts(2, seed=6)
    for (rid, rate), prompt in zip((("all", 1.0), ("none", 0.0)), prompts):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=21, ignore_eos=True,
                                                       extra_args={"synthetic_acceptance_rate": rate}))
    growth, tokens = {"all": [], "none": []}, {"all": [], "none": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            growth[out.request_id].append(len(ids) - len(tokens[out.request_id]))
            tokens[out.request_id] = list(ids)
    assert growth["all"] == [1, 5, 5, 5, 5]            # prefill, then 4 drafts + 1 token per step
    assert growth["none"] == [1] * 21
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_accepted_tokens"] == 16
    # Rejecting every draft emits the target's own greedy tokens.
    assert tokens["none"] == output_ids(baseline.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=21,
                                                                             ignore_eos=True), use_tqdm=False))[0]


def test_synthetic_acceptance_is_the_same_whatever_the_batch(spec_pair):
    """Synthetic draws are keyed by request and position (benchmarks compare policies on the same
    acceptance pattern): a request accepts the same drafts alone and in a batch."""
    prompt = make_prompts(1, seed=31)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            extra_args={"synthetic_acceptance_rate": 0.7})

    def run(k: int, others: int) -> list[int]:
        llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=k, **FIXED, **KV)
        out = llm.generate(prompt + make_prompts(others, seed=32), params, use_tqdm=False)
        return out[0].outputs[0].token_ids

    assert run(3, 5) == run(3, 0)


def test_synthetic_draws_are_the_same_on_the_dense_greedy_path(spec_pair):
    """A batch of plain greedy rows verifies on the dense path (no index arrays sent: only the synthetic
    draws); a batch-mate with a logit bias sends it down the general one. The request accepts the same
    drafts either way."""
    prompt = make_prompts(1, seed=41)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            extra_args={"synthetic_acceptance_rate": 0.6})
    biased = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={7: 0.5},
                            extra_args={"synthetic_acceptance_rate": 0.6})

    def run(mates: list[SamplingParams]) -> list[int]:
        llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
        out = llm.generate(prompt + make_prompts(len(mates), seed=42), [params] + mates, use_tqdm=False)
        return out[0].outputs[0].token_ids

    assert run([]) == run([biased]) == run([params])
