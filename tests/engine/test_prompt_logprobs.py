"""prompt_logprobs (vLLM semantics): each prompt token's logprob given the tokens before it, plus the top-k."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_spec import LLM, EngineArgs, LLMEngine, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 8, 64, 120, 3, 77], [9, 9, 14], [200]]
KV = dict(kv_cache_memory_bytes=1 << 24, dtype="float32")   # the reference is float32 (GPUs default to bf16)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """HF transformers' log-softmax over each prompt (float32)."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in PROMPTS]


def _check(outputs, reference, k):
    for out, prompt, lsm in zip(outputs, PROMPTS, reference):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for j in range(1, len(prompt)):
            entry = got[j]
            want = lsm[j - 1]
            assert math.isclose(entry[prompt[j]].logprob, want[prompt[j]].item(), rel_tol=1e-4, abs_tol=1e-4)
            assert entry[prompt[j]].rank == int((want > want[prompt[j]]).sum()) + 1
            top = want.topk(k).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= k + 1
            assert [entry[t].rank for t in top] == list(range(1, k + 1))


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_match_transformers(tiny_llama, reference, chunk):
    kw = dict(max_num_batched_tokens=chunk) if chunk else {}   # prompts longer than a step are chunked
    llm = LLM(str(tiny_llama), **KV, **kw)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    _check(outputs, reference, 3)
    plain = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=4), use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_with_speculation_and_running_decodes(spec_pair, reference):
    # A request decoding with drafts shares the steps that prefill the scored prompts.
    engine = LLMEngine.from_engine_args(EngineArgs(model=spec_pair[0], speculative_model=spec_pair[1],
                                                   num_speculative_tokens=3, speculative_policy="fixed", **KV))
    engine.add_request("busy", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=2, prompt_logprobs=2, n=2)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.spec_metrics.num_draft_tokens > 0
    _check([done[str(i)] for i in range(len(PROMPTS))], reference, 2)


@pytest.mark.parametrize("value", [-2, 2.5, "3"])
def test_bad_prompt_logprobs(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_bounded_by_max_logprobs(tiny_llama):
    """As vLLM: the engine's max_logprobs (default 20) bounds a request's count when it is added; -1
    asks for the whole vocabulary, which max_logprobs=-1 allows."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), **KV))
    for value in (21, -1):
        with pytest.raises(ValueError, match="prompt_logprobs: requested .* greater than max allowed: 20"):
            engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(prompt_logprobs=value))
    whole = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), max_logprobs=-1, **KV))
    vocab = whole.config.model.arch.vocab_size
    whole.add_request("all", {"prompt_token_ids": PROMPTS[0]},
                      SamplingParams(prompt_logprobs=-1, logprobs=-1, max_tokens=2))
    while whole.has_unfinished_requests():
        outs = whole.step()
    out = outs[0]
    assert [len(p) for p in out.prompt_logprobs[1:]] == [vocab] * (len(PROMPTS[0]) - 1)
    assert [len(p) for p in out.outputs[0].logprobs] == [vocab, vocab]
    first = out.outputs[0].logprobs[0]
    assert sorted(lp.rank for lp in first.values()) == list(range(1, vocab + 1))
    assert abs(sum(math.exp(lp.logprob) for lp in first.values()) - 1.0) < 1e-3


@pytest.mark.parametrize("n", [1, 2])
def test_delta_outputs_carry_prompt_logprobs_once(tiny_llama, reference, n):
    """As vLLM V1: a DELTA stream's first output carries the prompt's logprobs, the later ones none."""
    from vllm_spec.sampling_params import RequestOutputKind

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), max_num_batched_tokens=5, **KV))
    params = SamplingParams(temperature=0 if n == 1 else 1.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, n=n,
                            output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.prompt_logprobs)
    _check([SimpleNamespace(prompt_logprobs=seen[str(i)][0]) for i in range(len(PROMPTS))], reference, 2)
    assert all(len(outs) > 1 and all(p is None for p in outs[1:]) for outs in seen.values())
