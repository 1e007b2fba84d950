"""vLLM's logprobs_mode: what logprobs hold (raw or processed; log-probabilities or logits), on plain and
speculative decoding alike, and prompt positions (never processed)."""

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


def test_prompt_logprobs_are_never_processed(tiny_llama):
    """As vLLM: processed_* equal raw_* at prompt positions; *_logits differ from *_logprobs there by each
    position's logsumexp (one offset for every token of the position)."""
    params = SamplingParams(temperature=0.3, top_k=2, max_tokens=1, prompt_logprobs=3)
    got = {mode: LLM(str(tiny_llama), logprobs_mode=mode, **KV).generate([PROMPT], params, use_tqdm=False)[0]
           for mode in MODES}
    assert got["raw_logits"].prompt_logprobs == got["processed_logits"].prompt_logprobs
    assert got["raw_logprobs"].prompt_logprobs == got["processed_logprobs"].prompt_logprobs
    for logits, logprobs in zip(got["raw_logits"].prompt_logprobs[1:], got["raw_logprobs"].prompt_logprobs[1:]):
        assert logits.keys() == logprobs.keys() and len(logits) >= 3
        offsets = [logits[t].logprob - logprobs[t].logprob for t in logits]
        assert max(offsets) - min(offsets) < 1e-3 and all(lp.logprob <= 0 for lp in logprobs.values())


def test_an_unknown_mode_is_named(tiny_llama):
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \['raw_logprobs', 'raw_logits'"):
        LLM(str(tiny_llama), logprobs_mode="logits", **KV)
