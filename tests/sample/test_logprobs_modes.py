"""vLLM's logprobs_mode: what logprobs hold (raw or processed; log-probabilities or logits), on plain and
speculative decoding alike; prompt logprobs stay log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 5, 17, 42]}
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def _completion(llm: LLM, params: SamplingParams):
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_modes_relate_as_vllm_defines_them(tiny_llama):
    """raw_logprobs = raw_logits - logsumexp; processed: after temperature and top-k (outside it -inf)."""
    vocab = LLM(str(tiny_llama), **KV).llm_engine.config.model.arch.vocab_size
    params = SamplingParams(temperature=0.5, top_k=5, seed=3, max_tokens=4, logprobs=-1, ignore_eos=True)
    outs = {mode: _completion(LLM(str(tiny_llama), logprobs_mode=mode, max_logprobs=-1, **KV), params)
            for mode in MODES}
    assert len({tuple(out.token_ids) for out in outs.values()}) == 1   # the mode changes what is reported only
    got = {mode: out.logprobs for mode, out in outs.items()}
    for step in range(4):
        raw_logits = torch.tensor([got["raw_logits"][step][t].logprob for t in range(vocab)], dtype=torch.float64)
        raw_logprobs = torch.tensor([got["raw_logprobs"][step][t].logprob for t in range(vocab)], dtype=torch.float64)
        assert torch.allclose(raw_logprobs, raw_logits - raw_logits.logsumexp(0), atol=1e-4)
        processed = torch.tensor([got["processed_logits"][step][t].logprob for t in range(vocab)],
                                 dtype=torch.float64)
        kept = processed.isfinite()
        assert int(kept.sum()) == 5 and torch.equal(kept, raw_logits >= raw_logits.topk(5).values[-1])
        assert torch.allclose(processed[kept], raw_logits[kept] / 0.5, atol=1e-4)
        plp = torch.tensor([got["processed_logprobs"][step][t].logprob for t in range(vocab)], dtype=torch.float64)
        assert torch.allclose(plp[kept], processed[kept] - processed[kept].logsumexp(0), atol=1e-4)
        assert torch.isinf(plp[~kept]).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("speculation", ["draft", "ngram"])
def test_speculative_logprobs_equal_plain_in_every_mode(spec_pair, mode, speculation):
    """As vLLM's test_spec_decode_logprobs: per emitted token, the same value and rank with speculation
    (a request with a presence penalty too: its processed values depend on the tokens before it)."""
    target, draft = spec_pair
    prompts = [PROMPT, PROMPT]
    params = [SamplingParams(temperature=0, logprobs=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=3, max_tokens=12, ignore_eos=True, presence_penalty=-1.0)]
    spec = {"model": draft} if speculation == "draft" else {"method": "ngram", "prompt_lookup_min": 2}
    plain = LLM(target, logprobs_mode=mode, **KV).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, logprobs_mode=mode, speculative_config={**spec, "num_speculative_tokens": 3, "policy": "fixed"},
              **KV)
    spec_out = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for t in x:
                assert math.isclose(x[t].logprob, y[t].logprob, rel_tol=1e-3, abs_tol=1e-3) and x[t].rank == y[t].rank
    assert {m.name: getattr(m, "value", None) for m in llm.get_metrics()}["vllm:spec_decode_num_drafts"] > 0


def test_prompt_logprobs_are_log_probabilities_in_every_mode(tiny_llama):
    """As vLLM: logprobs_mode applies to sampled tokens; prompt positions always get the log-softmax of
    the model's logits (nothing samples there)."""
    params = SamplingParams(temperature=0.3, top_k=2, max_tokens=1, prompt_logprobs=3)
    got = {mode: LLM(str(tiny_llama), logprobs_mode=mode, **KV).generate([PROMPT], params, use_tqdm=False)[0]
           for mode in MODES}
    reference = got["raw_logprobs"].prompt_logprobs
    assert len(reference) == len(PROMPT["prompt_token_ids"]) and reference[0] is None
    assert all(lp.logprob <= 0 for position in reference[1:] for lp in position.values())
    for mode in MODES:
        assert got[mode].prompt_logprobs == reference, mode


def test_processed_logprobs_of_sampled_requests_under_speculation(spec_pair):
    """The verifier's processed path: with temperature and top_k=5, a sampled token's 5 logprobs are the
    whole processed distribution (they sum to 1, the sampled token among them), at every position."""
    params = [SamplingParams(temperature=0.7, top_k=5, seed=s, logprobs=5, max_tokens=16, ignore_eos=True)
              for s in range(4)]
    llm = LLM(spec_pair[0], logprobs_mode="processed_logprobs", speculative_config={
        "model": spec_pair[1], "num_speculative_tokens": 3, "policy": "fixed"}, **KV)
    for out in llm.generate([PROMPT] * 4, params, use_tqdm=False):
        completion = out.outputs[0]
        assert len(completion.logprobs) == 16
        for token, entry in zip(completion.token_ids, completion.logprobs):
            finite = [lp.logprob for lp in entry.values() if math.isfinite(lp.logprob)]
            assert token in entry and len(finite) == 5
            assert math.isclose(sum(math.exp(v) for v in finite), 1.0, rel_tol=1e-4)
    assert {m.name: getattr(m, "value", None) for m in llm.get_metrics()}["vllm:spec_decode_num_accepted_tokens"] > 0


def test_an_unknown_mode_is_named(tiny_llama):
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \['raw_logprobs', 'raw_logits'"):
        LLM(str(tiny_llama), logprobs_mode="logits", **KV)
