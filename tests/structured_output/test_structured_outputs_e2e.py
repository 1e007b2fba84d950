"""Structured outputs end to end: every output matches its constraint, with and without speculation,
and speculation stays lossless under a grammar (greedy ids equal, sampled distribution equal).

The verifier masks each verified position with the grammar's state after the drafts before it; the
draft itself is not constrained, so a draft the grammar refuses has target probability 0 and is
rejected. Model pair: conftest's spec_pair (tiny random target and a noisy copy, or --target-model).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from scipy import stats

from conftest import FIXED, make_prompts, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams
from vllm_spec.sampling_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "size": {"enum": ["S", "M", "L"]}},
          "required": ["name", "ok", "size"]}
REGEX = r"[a-c]{3}-\d{2}"
CHOICES = ["yes", "no", "not sure"]
GRAMMAR = 'root ::= "(" digit digit? digit? ")"\ndigit ::= [0-9]'
CONSTRAINTS = [SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=REGEX), SO(choice=CHOICES), SO(grammar=GRAMMAR),
               SO(json_object=True, disable_any_whitespace=True)]


def _check(constraint: SO, text: str, finish_reason: str) -> None:
    if constraint.json_object:   # may nest past max_tokens: a JSON object when complete
        assert text.startswith("{")
        if finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        return
    assert finish_reason == "stop", (constraint.kind, text)
    if constraint.json is not None:
        value = json.loads(text)
        assert set(value) == {"name", "ok", "size"} and len(value["name"]) <= 6
        assert isinstance(value["ok"], bool) and value["size"] in ("S", "M", "L")
    elif constraint.regex is not None:
        assert re.fullmatch(REGEX, text), text
    elif constraint.choice is not None:
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\(\d{1,3}\)", text), text


# Text prompts: the text of an output that follows random prompt ids may begin with a partial
# character the prompt left open.
PROMPTS = ["The answer is", "def wrap(text, width=70):", "Return a list of wrapped lines.", "x = ",
           "Hello", "import textwrap\n"]


def _requests(temperature: float, **extra) -> tuple[list, list[SamplingParams]]:
    prompts = PROMPTS[: len(CONSTRAINTS) + 1]
    params = [SamplingParams(temperature=temperature, max_tokens=48, seed=i, structured_outputs=c, **extra)
              for i, c in enumerate(CONSTRAINTS)]
    params.append(SamplingParams(temperature=temperature, max_tokens=16, seed=7, ignore_eos=True))   # unconstrained
    return prompts, params


@pytest.fixture(scope="module")
def spec_llm(spec_pair):
    return LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [False, True])
def test_every_output_matches_its_constraint(baseline, spec_llm, speculative, temperature):
    llm = spec_llm if speculative else baseline
    prompts, params = _requests(temperature)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for constraint, out in zip(CONSTRAINTS, outs):
        _check(constraint, out.outputs[0].text, out.outputs[0].finish_reason)
    assert len(outs[-1].outputs[0].token_ids) == 16


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equality_under_grammars(spec_pair, baseline, k, async_scheduling):
    prompts, params = _requests(0.0)
    want = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    plain = LLM(spec_pair[0], async_scheduling=async_scheduling, **KV)
    assert output_ids(plain.generate(prompts, params, use_tqdm=False)) == want
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=k,
              async_scheduling=async_scheduling, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_usable_blocks


def test_greedy_equality_under_grammars_with_ngram_and_preemption(spec_pair, baseline):
    prompts, params = _requests(0.0)
    prompts, params = prompts * 3, params * 3
    want = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    ngram = LLM(spec_pair[0], speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=2, **FIXED, **KV)
    assert output_ids(ngram.generate(prompts, params, use_tqdm=False)) == want
    small = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, block_size=4,
                num_gpu_blocks_override=20, max_model_len=64, **FIXED)
    assert output_ids(small.generate(prompts, params, use_tqdm=False)) == want
    assert metric_values(small)["vllm:num_preemptions"] > 0


def test_constrained_neighbours_leave_other_requests_unchanged(spec_llm):
    prompts, params = _requests(0.0)
    alone = output_ids(spec_llm.generate(prompts[-1:], params[-1:], use_tqdm=False))
    together = output_ids(spec_llm.generate(prompts, params, use_tqdm=False))
    assert together[-1] == alone[0]


def test_n_samples_each_match(spec_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, structured_outputs=SO(regex=REGEX))
    out = spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    texts = [c.text for o in out for c in o.outputs]
    assert len(texts) == 6 and all(re.fullmatch(REGEX, t) for t in texts)


def _char_histograms(llm: LLM, params: SamplingParams, runs: int) -> torch.Tensor:
    outs = llm.generate(["Pick three letters:"] * runs, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch("[a-h]{3}", t) for t in texts)
    return torch.tensor([[sum(t[pos] == c for t in texts) for c in "abcdefgh"] for pos in range(3)])


def test_sampled_distribution_under_a_grammar_matches_non_speculative(spec_pair, baseline, random_draft):
    """Each character of "[a-h]{3}" over 800 unseeded runs, with and without speculation by an unrelated
    random draft (whose proposals the grammar mostly refuses). Bound: a chi-square two-sample
    (contingency) test per character position gives p-value > 1e-3 at this fixed engine seed."""
    params = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=SO(regex="[a-h]{3}"))
    ref = _char_histograms(baseline, params, 800)
    llm = LLM(spec_pair[0], speculative_model=str(random_draft), num_speculative_tokens=2, seed=321, **FIXED, **KV)
    got = _char_histograms(llm, params, 800)
    assert metric_values(llm)["vllm:spec_decode_num_draft_tokens"] > 0
    for pos in range(3):
        table = torch.stack([ref[pos], got[pos]]).numpy()
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > 1e-3, (pos, table)


def test_a_bad_constraint_fails_its_request_alone(spec_llm):
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=CHOICES))
    for bad, named in ((SO(regex="(unclosed"), "structured_outputs.regex"),
                       (SO(json={"type": "no-such-type"}), "structured_outputs.json")):
        with pytest.raises(ValueError, match=named):
            spec_llm.generate(make_prompts(2), [good, SamplingParams(structured_outputs=bad)], use_tqdm=False)
    out = spec_llm.generate(PROMPTS[:1], good, use_tqdm=False)
    assert out[0].outputs[0].text in CHOICES
    engine = spec_llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_structured_outputs_need_a_tokenizer(spec_pair):
    llm = LLM(spec_pair[0], skip_tokenizer_init=True, **KV)
    with pytest.raises(ValueError, match="structured_outputs .* need a tokenizer"):
        llm.generate(make_prompts(1), SamplingParams(structured_outputs=SO(choice=CHOICES)), use_tqdm=False)


def test_logprobs_are_of_the_masked_distribution_with_and_without_speculation(baseline, spec_llm):
    """As vLLM (the grammar's mask applies to the model's logits): every top logprob is of an allowed
    token, the chosen one's included, and speculation reports the same logprobs."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, structured_outputs=SO(choice=CHOICES))
    ref = baseline.generate(PROMPTS[:3], params, use_tqdm=False)
    got = spec_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    tok = baseline.get_tokenizer()
    for a, b in zip(ref, got):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and ca.text in CHOICES
        first = ca.logprobs[0]
        assert len(first) >= 2   # the choices' first tokens, and no other
        for token, lp in first.items():
            if lp.logprob > float("-inf"):
                assert any(c.startswith(tok.decode([token])) for c in CHOICES), tok.decode([token])
        for la, lb in zip(ca.logprobs, cb.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


@pytest.mark.parametrize("extra", [{"min_tokens": 12}, {"allowed_token_ids": [5, 6, 7]}])
def test_bans_that_leave_nothing_the_grammar_allows_give_way_to_it(baseline, spec_llm, extra):
    """min_tokens bans the stop token that a complete choice allows alone; allowed_token_ids may allow
    nothing the grammar does: the grammar decides those steps, so the output stays one of the choices
    (and ends), the same with speculation."""
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(choice=CHOICES), **extra)
    ref = baseline.generate(PROMPTS[:3], params, use_tqdm=False)
    got = spec_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert output_ids(got) == output_ids(ref)
    for out in ref:
        assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"
    sampled = SamplingParams(temperature=1.0, seed=4, max_tokens=16, structured_outputs=SO(choice=CHOICES), **extra)
    for out in spec_llm.generate(PROMPTS[:3], sampled, use_tqdm=False):
        assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"
