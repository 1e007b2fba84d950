"""The speculative decoding settings, end to end: vLLM's forms of them (flags, the speculative_config
dict, n-gram spellings and lookup bounds), the invalid and conflicting ones refused and named, drafts
that cannot serve (missing, other vocabulary), and a draft's shorter context bounding where it speculates.

The model pair comes from --target-model/--draft-model (or VLLM_SPEC_TEST_TARGET/_DRAFT); by
default a tiny random target and a noisy copy of it as draft (partial acceptance).
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from conftest import FIXED, GREEDY, copy_with_config, make_prompts, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, EngineArgs, SamplingParams


def test_speculative_config_dict_form(spec_pair, greedy_reference):
    # With vLLM's keys that set nothing here at their neutral values (and the draft's length >= the target's).
    llm = LLM(spec_pair[0], max_model_len=128, speculative_config={
        "model": spec_pair[1], "num_speculative_tokens": 2, "method": "draft_model", "policy": "fixed",
        "quantization": None, "revision": None, "max_model_len": 128, "disable_logprobs": False,
        "speculative_token_tree": None, "disable_padded_drafter_batch": True, "enforce_eager": True,
        "parallel_drafting": False, "draft_sample_method": "probabilistic", "rejection_sample_method": "standard",
        "kv_cache_dtype": "auto", "moe_backend": None, "attention_backend": None, "use_local_argmax_reduction": True,
        "disable_eagle_block_drop": False, "use_heterogeneous_vocab": False}, **KV)
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
    ({"speculative_config": {"num_speculative_tokens": 2, "disable_padded_drafter_batch": 1}},
     "disable_padded_drafter_batch"),
    ({"speculative_config": {"model": "x", "num_speculative_tokens": 2, "tensor_parallel_size": 2}},
     "'draft_tensor_parallel_size'"),
    ({"speculative_config": {"num_speculative_tokens": 2, "max_model_len": 1 << 20}}, "max_model_len"),
    ({"num_speculative_tokens": 2, "speculative_policy": "greedy"}, "speculative_policy"),
    ({"speculative_config": {"num_speculative_tokens": 2, "parallel_drafting": True}}, "parallel_drafting"),
    ({"speculative_config": {"num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}},
     r"rejection_sample_method'\] must be one of \['standard'\]"),
    ({"speculative_config": {"num_speculative_tokens": 2, "draft_sample_method": "top_k"}},
     r"draft_sample_method'\] must be one of \['greedy', 'probabilistic'\]"),
    ({"speculative_config": {"num_speculative_tokens": 2, "enforce_eager": "yes"}}, "enforce_eager"),
    ({"speculative_config": {"num_speculative_tokens": 2, "kv_cache_dtype": "fp8"}}, "kv_cache_dtype"),
    ({"speculative_config": {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 2]]}},
     "must start at batch size 1"),
    ({"speculative_config": {"num_speculative_tokens": 2,
                             "num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 1]]}}, "must not overlap"),
    ({"speculative_config": {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]}},
     "k must be >= 0"),
    ({"speculative_config": {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []}},
     "non-empty list"),
    ({"speculative_config": {"num_speculative_tokens": 2,
                             "num_speculative_tokens_per_batch_size": [[1, 4, 1, 100, 2]]}}, "context length"),
    ({"speculative_config": {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, "2"]]}},
     "integers"),
    ({"num_speculative_tokens": 2, "speculative_policy": "fixed",
      "speculative_config": {"num_speculative_tokens_per_batch_size": [[1, 4, 2]]}}, "conflicts with"),
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
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"]}')
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


@pytest.mark.parametrize("limit_by", ["draft_config", "speculative_max_model_len", "speculative_config"])
def test_a_draft_of_a_shorter_context_speculates_only_inside_it(tmp_path, spec_pair, baseline, limit_by):
    """As vLLM's: the draft's context (what it supports, or the speculative max_model_len asked for)
    bounds where sequences speculate, never the target's max_model_len: prompts and outputs past it
    are the target's own, the draft is never fed a position past it (prompts, catch-ups, draft
    steps; seeded rows too), and drafts reach right up to it."""
    limit = 40
    if limit_by == "draft_config":
        spec = dict(speculative_model=copy_with_config(spec_pair[1], tmp_path / "short", max_position_embeddings=limit))
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
    short = copy_with_config(spec_pair[1], tmp_path / "short", max_position_embeddings=40)
    with pytest.raises(ValueError, match="speculative_max_model_len=60 cannot be larger than the draft's"):
        LLM(spec_pair[0], speculative_model=short, num_speculative_tokens=2, speculative_max_model_len=60, **KV)


@pytest.mark.parametrize("speculative_model, catches_up", [("[ngram]", False), (None, True)])
def test_the_adaptive_policy_knows_whether_the_proposer_catches_up(spec_pair, speculative_model, catches_up):
    """A draft model feeds the tokens it missed over plain steps when it speculates again, which the
    policy models until it measures it; an n-gram lookup has nothing to catch up: no such cost."""
    llm = LLM(spec_pair[0], speculative_model=speculative_model or spec_pair[1], num_speculative_tokens=2, **KV)
    policy = llm.llm_engine.executor.worker.policy
    llm.generate(make_prompts(2), GREEDY, use_tqdm=False)
    assert policy.catches_up is catches_up
    if not catches_up:
        assert policy._costs.catch_up_token(2) == 0.0 and policy._costs.catch_up_per_token == 0.0


def test_ngram_lookup_takes_the_earliest_match_of_the_longest_ngram():
    """As vLLM's proposer: the longest tail n-gram in [n_min, n_max] that occurred before, and the tokens
    after its earliest occurrence (a repeating run then drafts k tokens, not one)."""
    import numpy as np

    from vllm_spec.spec_decode.ngram_proposer import ngram_lookup

    def lookup(tokens, n_max, n_min, k):
        return ngram_lookup(np.array(tokens), n_max, n_min, k).tolist()

    assert lookup([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 3) == [3, 1, 2]
    assert lookup([7, 7, 7, 7, 7], 2, 1, 4) == [7, 7, 7]
    assert lookup([5, 1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 3, 1, 2) == [9, 2]   # the 3-gram beats earlier 2-grams
    assert lookup([1, 2, 3, 4], 3, 1, 2) == []


def test_vllm_batch_size_schedule_sets_k_by_batch(spec_pair, greedy_reference):
    """vLLM's num_speculative_tokens_per_batch_size: k by the step's scheduled sequences (prompt chunks
    included; capped at num_speculative_tokens), for every request, seeded ones too; outputs stay the target's."""
    schedule = [[1, 2, 3], [3, 100, 0]]
    llm = LLM(spec_pair[0], speculative_config={"model": spec_pair[1], "num_speculative_tokens": 2,
                                                 "num_speculative_tokens_per_batch_size": schedule}, **KV)
    spec = llm.llm_engine.vllm_config.speculative_config
    assert (spec.policy, spec.num_speculative_tokens_per_batch_size) == ("table", [(1, 2, 3), (3, 100, 0)])
    assert output_ids(llm.generate(make_prompts(2), GREEDY, use_tqdm=False)) == greedy_reference[:2]
    two = metric_values(llm)
    assert two["vllm:spec_decode_num_draft_tokens"] == 2 * two["vllm:spec_decode_num_drafts"] > 0   # k = min(3, 2)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    assert metric_values(llm)["vllm:spec_decode_num_drafts"] == two["vllm:spec_decode_num_drafts"]   # none at 16
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    llm.generate(make_prompts(3), seeded, use_tqdm=False)   # 3 at once: k = 0, seeded or not
    assert metric_values(llm)["vllm:spec_decode_num_drafts"] == two["vllm:spec_decode_num_drafts"]
    none_at_one = LLM(spec_pair[0], speculative_config={"model": spec_pair[1], "num_speculative_tokens": 2,
                                                         "num_speculative_tokens_per_batch_size": [[1, 1, 0],
                                                                                                   [2, 9, 2]]}, **KV)
    none_at_one.generate(make_prompts(1), seeded, use_tqdm=False)
    assert metric_values(none_at_one)["vllm:spec_decode_num_drafts"] == 0


@pytest.mark.parametrize("speculative_model", ["draft", "[ngram]"])
def test_speculative_config_under_vllms_attribute_names(spec_pair, speculative_model):
    draft = spec_pair[1] if speculative_model == "draft" else speculative_model
    config = LLM(spec_pair[0], speculative_model=draft, num_speculative_tokens=2, async_scheduling=False,
                 **KV).llm_engine.vllm_config
    spec = config.speculative_config
    assert spec.model == (str(spec_pair[1]) if speculative_model == "draft" else "ngram")
    assert spec.draft_model_config is spec.draft
    assert (spec.draft_model_config is None) is (speculative_model == "[ngram]")
    assert spec.draft_parallel_config.tensor_parallel_size == 1
    assert config.scheduler_config.async_scheduling is False
    assert config.scheduler_config.enable_chunked_prefill is True
    assert LLM(spec_pair[0], **KV).llm_engine.vllm_config.scheduler_config.async_scheduling is False   # (CPU)


def test_greedy_drafts_keep_the_targets_distribution(spec_pair, baseline):
    """vLLM's draft_sample_method "greedy": every draft is the draft's argmax, verified as a one-hot q
    (accepted with probability p(x), else a token from p without x): sampled outputs keep the target's
    distribution. The 3rd token over 1500 unseeded runs, chi-square two-sample test (p > 1e-3)."""
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 17, 42, 99, 5]}
    vocab = baseline.llm_engine.config.model.arch.vocab_size

    def histogram(llm):
        outs = llm.generate([prompt] * 1500, params, use_tqdm=False)
        return torch.bincount(torch.tensor([o.outputs[0].token_ids[2] for o in outs]), minlength=vocab)

    llm = LLM(spec_pair[0], seed=7, speculative_config={"model": spec_pair[1], "num_speculative_tokens": 2,
                                                         "draft_sample_method": "greedy", "policy": "fixed"}, **KV)
    assert llm.llm_engine.executor.worker.draft_proposer.greedy_drafts
    ref, got = histogram(baseline), histogram(llm)
    assert metric_values(llm)["vllm:spec_decode_num_accepted_tokens"] > 0
    keep = (ref + got) >= 10
    table = torch.stack([torch.cat([ref[keep], ref[~keep].sum().view(1)]),
                         torch.cat([got[keep], got[~keep].sum().view(1)])]).numpy()
    assert stats.chi2_contingency(table[:, table.sum(0) > 0]).pvalue > 1e-3
    assert output_ids(llm.generate(make_prompts(4), GREEDY, use_tqdm=False)) == \
        output_ids(baseline.generate(make_prompts(4), GREEDY, use_tqdm=False))
