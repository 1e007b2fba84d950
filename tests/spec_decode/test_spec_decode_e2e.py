"""End-to-end correctness of speculative decoding: greedy equality, distribution, seeds, bookkeeping.

The model pair comes from --target-model/--draft-model (or VLLM_SPEC_TEST_TARGET/_DRAFT); by
default a tiny random target and a noisy copy of it as draft (partial acceptance).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from scipy import stats

from conftest import FIXED, GREEDY, make_prompts, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, EngineArgs, SamplingParams, cpu_ops
from vllm_spec.model import cpu_linear


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equality_draft_model(spec_pair, greedy_reference, k):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=k, **FIXED, **KV)
    for batch in (1, 5, 16):
        out = output_ids(llm.generate(make_prompts(16)[:batch], GREEDY, use_tqdm=False))
        assert out == greedy_reference[:batch]
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    assert len(m["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_usable_blocks


@pytest.mark.skipif(not (cpu_ops.available() and torch.bfloat16 in cpu_linear.dtypes()),
                    reason="bfloat16 on the CPU kernels (an AVX2 CPU without bf16 arithmetic)")
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equality_in_bfloat16_on_the_cpu_kernels(spec_pair, k):
    """The CPU kernels give a position the same logits in a (k+1)-token verification as in a 1-token step,
    in bfloat16 too (tests/model/test_cpu_linear.py, tests/attention/test_cpu_backend.py): there greedy
    speculation equals plain decoding, logprobs and all (on GPUs rounding may differ: README)."""
    target, draft = spec_pair
    bf16 = dict(dtype="bfloat16", device="cpu", **KV)
    prompts = make_prompts(16, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)

    def run(llm: LLM) -> list:   # ids, and the logprobs: the logits' very bits show there
        return [(c.token_ids, c.logprobs) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]

    plain = run(LLM(target, **bf16))
    # 4 sequences at a time: prompts are prefilled in steps beside other sequences' verifications.
    llm = LLM(target, speculative_model=draft, num_speculative_tokens=k, max_num_seqs=4, **FIXED, **bf16)
    assert run(llm) == plain
    assert metric_values(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


def test_greedy_equality_with_preemption(spec_pair, greedy_reference):
    # 40 usable blocks of 4 tokens: 16 sequences of up to ~64 tokens cannot all fit.
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3,
              block_size=4, num_gpu_blocks_override=41, max_model_len=128, **FIXED)
    out = output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False))
    assert metric_values(llm)["vllm:num_preemptions"] > 0
    assert out == greedy_reference


def test_greedy_equality_chunked_prefill(spec_pair, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4,
              max_num_batched_tokens=16, **FIXED, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference


def test_greedy_equality_ngram(spec_pair, baseline):
    # Repetitive prompts so that prompt lookup finds matches.
    prompts = [{"prompt_token_ids": ([5, 6, 7, 8, 9] * 6)[: 10 + i]} for i in range(8)]
    ref = output_ids(baseline.generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(spec_pair[0], speculative_model="[ngram]", num_speculative_tokens=4,
              ngram_prompt_lookup_max=3, ngram_prompt_lookup_min=1, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
    assert metric_values(llm)["vllm:spec_decode_num_draft_tokens"] > 0


def test_random_draft_accepts_almost_nothing(spec_pair, random_draft, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=str(random_draft), num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    assert metric_values(llm)["vllm:spec_decode_acceptance_rate"] < 0.2


def test_draft_equal_to_target_accepts_everything(spec_pair, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    m = metric_values(llm)
    assert m["vllm:spec_decode_acceptance_rate"] == 1.0
    assert m["vllm:spec_decode_mean_accepted_length"] == 5.0


def test_greedy_equality_with_penalties_and_min_tokens(spec_pair, baseline):
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.2, min_tokens=5, stop_token_ids=[7, 11])
    prompts = make_prompts(6, seed=3)
    ref = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == ref


def test_greedy_equality_with_logit_bias_and_allowed_token_ids(spec_pair, baseline):
    """The verifier scores drafts against the biased, masked distribution: drafts outside
    allowed_token_ids are rejected, and a biased token wins where the target's argmax would not."""
    allowed = list(range(0, 384, 5))
    rows = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={7: 6.0, 11: -100.0}),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed,
                           logit_bias={10: 4.0})]
    prompts = make_prompts(6, seed=5)
    params = [rows[i % 3] for i in range(6)]
    ref = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    plain = output_ids(baseline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                         use_tqdm=False))
    assert ref != plain and all(set(ref[i]) <= set(allowed) for i in (0, 2, 3, 5))
    assert all(11 not in ref[i] for i in (1, 4))
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert metric_values(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_never_generated_with_or_without_speculation(spec_pair, baseline, async_scheduling):
    """Words cut out of the reference outputs: each is banned (its last token, where the output ends with
    the rest of it), so it never appears in the output; the verifier bans per verified position, after
    the drafts before it, so speculation leaves the output unchanged."""
    tok = baseline.get_tokenizer()
    prompts = make_prompts(4, seed=9)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = output_ids(baseline.generate(prompts, plain, use_tqdm=False))
    words = [tok.decode(ref[0][4:6]), tok.decode(ref[1][10:11]), tok.decode(ref[2][2:5])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    want = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    banned = params.clone()
    banned.update_from_tokenizer(tok)
    assert want != ref and banned.bad_words_token_ids
    for out in want:
        assert not any(_contains(out, word) for word in banned.bad_words_token_ids)
    # Without speculation, async scheduling would overlap each step with the next: a step whose bans
    # follow the last token is read first.
    plain_engine = LLM(spec_pair[0], async_scheduling=async_scheduling, **KV)
    assert output_ids(plain_engine.generate(prompts, params, use_tqdm=False)) == want
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, async_scheduling=async_scheduling,
              **FIXED, **KV)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, bad_words=words)
    for out in output_ids(llm.generate(prompts, sampled, use_tqdm=False)):
        assert not any(_contains(out, word) for word in banned.bad_words_token_ids)


def test_logprobs_match_non_speculative(spec_pair, baseline):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = make_prompts(4, seed=4)
    ref = baseline.generate(prompts, params, use_tqdm=False)
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    out = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(out, ref):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert len(ca.logprobs) == len(ca.token_ids)
        for la, lb in zip(ca.logprobs, cb.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
                assert la[t].rank == lb[t].rank
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)


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


def test_penalised_row_speculating_next_to_a_sampled_prefill(spec_pair, baseline):
    greedy = SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.5, ignore_eos=True)
    prompt = make_prompts(1, seed=13)[0]
    ref = output_ids(baseline.generate([prompt], greedy, use_tqdm=False))[0]
    engine = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV).llm_engine
    engine.add_request("a", prompt, greedy)
    engine.step()
    engine.step()
    engine.add_request("b", make_prompts(1, seed=14)[0], SamplingParams(temperature=0.5, max_tokens=8))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["a"].outputs[0].token_ids == ref
    assert len(done["b"].outputs[0].token_ids) == 8


def test_abort_mid_speculation_frees_blocks(spec_pair):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)
    engine = llm.llm_engine
    for i, p in enumerate(make_prompts(4, seed=5)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_usable_blocks
    engine.abort_request(["0", "1", "2", "3"])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    # The engine keeps working after the abort.
    assert len(llm.generate(make_prompts(2), GREEDY, use_tqdm=False)) == 2


def test_speculative_config_dict_form(spec_pair, greedy_reference):
    # With vLLM's keys that set nothing here at their neutral values (and the draft's length >= the target's).
    llm = LLM(spec_pair[0], max_model_len=128, speculative_config={
        "model": spec_pair[1], "num_speculative_tokens": 2, "method": "draft_model", "policy": "fixed",
        "quantization": None, "revision": None, "max_model_len": 128, "disable_logprobs": False,
        "speculative_token_tree": None}, **KV)
    assert output_ids(llm.generate(make_prompts(4), GREEDY, use_tqdm=False)) == greedy_reference[:4]

@pytest.mark.parametrize("lookup, bounds", [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)),
                                           ({"prompt_lookup_min": 2}, (2, 2)),
                                           ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4))])
def test_ngram_lookup_bounds_default_as_vllm(spec_pair, lookup, bounds):
    """vLLM V1: neither bound given is 5 and 5; one given sets the other to itself."""
    args = EngineArgs(model=str(spec_pair[0]), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                    **lookup})
    spec = args.create_engine_config().speculative
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == bounds


@pytest.mark.parametrize("kwargs, match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"speculative_config": {"model": "x", "num_speculative_tokens": 2, "method": "medusa"}}, "method"),
    ({"speculative_config": {"num_speculative_tokens": 2, "bogus": 1, "model": "x"}}, "bogus"),
    ({"speculative_config": {"num_speculative_tokens": 2, "quantization": "awq"}}, "quantization"),
    ({"speculative_config": {"num_speculative_tokens": 2, "speculative_token_tree": "[(0,)]"}},
     "speculative_token_tree"),
    ({"speculative_config": {"num_speculative_tokens": 2, "disable_logprobs": "yes"}}, "disable_logprobs"),
    ({"speculative_config": {"num_speculative_tokens": 2, "max_model_len": 1 << 20}}, "max_model_len"),
    ({"num_speculative_tokens": 2, "speculative_policy": "greedy"}, "speculative_policy"),
    ({"num_speculative_tokens": 2, "speculative_disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "speculative_disable_by_batch_size": 2.5}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "speculative_disable_by_batch_size": 1}, r"disable_by_batch_size .*>= 2"),
    ({"num_speculative_tokens": 2, "ngram_prompt_lookup_max": 3}, r"ngram_prompt_lookup_max \(3\) applies to n-gram"),
    ({"speculative_config": {"model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 2}},
     "ngram_prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "speculative_draft_tensor_parallel_size": 1.0}, "draft_tensor_parallel_size"),
    ({"speculative_model": "[ngram]", "num_speculative_tokens": 2, "ngram_prompt_lookup_max": 3.5},
     "ngram_prompt_lookup_max"),
    ({"speculative_model": "[ngram]", "num_speculative_tokens": 2, "ngram_prompt_lookup_max": 0},
     "ngram_prompt_lookup_max"),
    ({"speculative_model": "[ngram]", "num_speculative_tokens": 2, "ngram_prompt_lookup_max": -5},
     "ngram_prompt_lookup_max"),
    ({"speculative_model": "[ngram]", "num_speculative_tokens": 2, "ngram_prompt_lookup_min": 0},
     "ngram_prompt_lookup_min"),
    ({"speculative_model": "[ngram]", "num_speculative_tokens": 2, "ngram_prompt_lookup_min": 4,
      "ngram_prompt_lookup_max": 3}, "ngram_prompt_lookup_min"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": "1"}},
     "ngram_prompt_lookup_min"),
    ({"speculative_config": {"method": "ngram", "model": "draft-dir", "num_speculative_tokens": 3}},
     r"method 'ngram' takes no draft model, got model 'draft-dir'"),
])
def test_invalid_speculative_settings(spec_pair, kwargs, match):
    if not {"model", "method"} & set(kwargs.get("speculative_config", {})):
        kwargs.setdefault("speculative_model", spec_pair[1])
    with pytest.raises(ValueError, match=match):
        LLM(spec_pair[0], **kwargs, **KV)


def test_a_draft_that_cannot_be_loaded_is_named(spec_pair, tmp_path):
    with pytest.raises(FileNotFoundError, match="speculative_model: model .*nowhere.* not found"):
        LLM(spec_pair[0], speculative_model=str(tmp_path / "nowhere"), num_speculative_tokens=2, **KV)
    (tmp_path / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"]}')
    with pytest.raises(ValueError, match="speculative_model: Unsupported model architecture"):
        LLM(spec_pair[0], speculative_model=str(tmp_path), num_speculative_tokens=2, **KV)


@pytest.mark.parametrize("kwargs, named", [
    ({"num_speculative_tokens": 2}, "num_speculative_tokens"),
    ({"speculative_policy": "fixed"}, "speculative_policy"),
    ({"speculative_disable_by_batch_size": 4, "ngram_prompt_lookup_max": 3},
     "ngram_prompt_lookup_max, speculative_disable_by_batch_size"),
    ({"speculative_max_model_len": 64}, "speculative_max_model_len"),
    ({"speculative_draft_tensor_parallel_size": 1}, "speculative_draft_tensor_parallel_size"),
    ({"speculative_config": {"num_speculative_tokens": 2, "synthetic_acceptance_rate": 0.5}},
     r"num_speculative_tokens, speculative_config\['synthetic_acceptance_rate'\]"),
])
def test_speculation_settings_without_a_speculative_model_are_refused(spec_pair, kwargs, named):
    """As num_speculative_tokens alone always was: a setting that would be silently dropped is named."""
    with pytest.raises(ValueError, match=f"{named} given without speculative_model"):
        LLM(spec_pair[0], **kwargs, **KV)


def test_synthetic_acceptance_warns_that_outputs_are_not_the_targets(spec_pair, caplog):
    args = EngineArgs(model=str(spec_pair[0]), speculative_config={
        "model": str(spec_pair[1]), "num_speculative_tokens": 2, "synthetic_acceptance_rate": 0.5})
    with caplog.at_level("WARNING", logger="vllm_spec.config"):
        args.create_engine_config()
    assert "NOT the target's" in caplog.text


@pytest.mark.parametrize("spec", [{"speculative_config": {"model": "ngram", "num_speculative_tokens": 2}},
                                  {"speculative_config": {"method": "[ngram]", "num_speculative_tokens": 2}},
                                  {"speculative_model": "[ngram]", "speculative_config": {"method": "ngram"},
                                   "num_speculative_tokens": 2}])
def test_vllms_spellings_of_ngram_lookup(spec_pair, spec):
    llm = LLM(spec_pair[0], **spec, **KV)
    assert llm.llm_engine.config.speculative.method == "ngram"


@pytest.mark.parametrize("kwargs, named", [
    ({"num_speculative_tokens": 3, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "num_speculative_tokens"),
    ({"speculative_config": {"method": "ngram"}, "num_speculative_tokens": 2}, "speculative_model"),
    ({"num_speculative_tokens": 2, "speculative_config": {"model": "elsewhere"}}, "speculative_model"),
])
def test_a_setting_given_both_ways_must_agree(spec_pair, kwargs, named):
    """The V0 flags and the V1 dict together: a conflict is refused (one of them was dropped silently)."""
    with pytest.raises(ValueError, match=f"conflicts with {named}"):
        LLM(spec_pair[0], speculative_model=spec_pair[1], **kwargs, **KV)
    agreeing = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2,
                   speculative_config={"model": spec_pair[1], "num_speculative_tokens": 2}, **KV)
    assert agreeing.llm_engine.config.speculative.num_speculative_tokens == 2


def test_draft_with_other_vocabulary_is_rejected(tmp_path, spec_pair):
    from conftest import make_tiny_model
    other = make_tiny_model(tmp_path / "other_vocab", "llama", vocab_size=500)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(spec_pair[0], speculative_model=str(other), num_speculative_tokens=2, **FIXED, **KV)


def _short_context_copy(draft: str, folder: Path, positions: int) -> str:
    """The draft's checkpoint with a shorter context (max_position_embeddings)."""
    import shutil

    shutil.copytree(draft, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    return str(folder)


@pytest.mark.parametrize("limit_by", ["draft_config", "speculative_max_model_len", "speculative_config"])
def test_a_draft_of_a_shorter_context_speculates_only_inside_it(tmp_path, spec_pair, baseline, limit_by):
    """As vLLM's: the draft's context (what it supports, or the speculative max_model_len asked for)
    bounds where sequences speculate, never the target's max_model_len: prompts and outputs past it
    are the target's own, the draft is never fed a position past it (prompts, catch-ups, draft
    steps; seeded rows too), and drafts reach right up to it."""
    limit = 40
    if limit_by == "draft_config":
        spec = dict(speculative_model=_short_context_copy(spec_pair[1], tmp_path / "short", limit))
    elif limit_by == "speculative_max_model_len":
        spec = dict(speculative_model=spec_pair[1], speculative_max_model_len=limit)
    else:
        spec = dict(speculative_config={"model": spec_pair[1], "max_model_len": limit})
    # Eager: every draft forward runs in Python, where its positions are recorded.
    llm = LLM(spec_pair[0], num_speculative_tokens=3, enforce_eager=True, **spec, **FIXED, **KV)
    assert llm.llm_engine.config.model.max_model_len == baseline.llm_engine.config.model.max_model_len
    assert llm.llm_engine.config.speculative.max_model_len == limit
    proposer = llm.llm_engine.executor.worker.draft_proposer
    rope, fed, drafted = proposer.runner.model.rope, [], []
    cos_sin, propose = rope.cos_sin, proposer.propose

    def recording_cos_sin(positions, dtype):
        fed.append(int(positions.max()))
        return cos_sin(positions, dtype)

    def recording_propose(req, num_drafts, md):
        drafted.extend(s.seq_len + n for s, n in zip(req.seqs, num_drafts) if n)
        return propose(req, num_drafts, md)

    rope.cos_sin, proposer.propose = recording_cos_sin, recording_propose
    prompts = make_prompts(6) + [{"prompt_token_ids": list(range(3, 3 + n))} for n in (limit - 3, limit, 60)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == output_ids(
        baseline.generate(prompts, params, use_tqdm=False))
    assert drafted and max(drafted) == limit   # a row one short of it drafts the one it has room for
    drafted.clear()
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=30, ignore_eos=True) for s in range(len(prompts))]
    llm.generate(prompts, seeded, use_tqdm=False)
    assert drafted and max(drafted) == limit
    assert fed and max(fed) < limit
    assert metric_values(llm)["vllm:spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("kwargs", [{"speculative_max_model_len": 1 << 20}, {"speculative_max_model_len": 0},
                                    {"speculative_config": {"max_model_len": 1 << 20}},
                                    {"speculative_config": {"max_model_len": 2.5}}])
def test_a_speculative_max_model_len_past_the_targets_is_refused(spec_pair, kwargs):
    with pytest.raises(ValueError, match="speculative_max_model_len"):
        LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2, **kwargs, **KV)


def test_a_speculative_max_model_len_past_the_drafts_context_is_refused(tmp_path, spec_pair):
    """As vLLM: the draft's max_model_len asked for may not exceed what the draft supports."""
    short = _short_context_copy(spec_pair[1], tmp_path / "short", 40)
    with pytest.raises(ValueError, match="speculative_max_model_len=60 cannot be larger than the draft's"):
        LLM(spec_pair[0], speculative_model=short, num_speculative_tokens=2, speculative_max_model_len=60, **KV)


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
