"""The sampler end to end through LLM: seeded generation, penalties and logprobs vs HF, per-sequence generators."""

from __future__ import annotations

import pytest
import torch
from sampler_reference import reference_logits
from transformers import AutoModelForCausalLM

from vllm_spec.entrypoints.llm import LLM
from vllm_spec.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # float32: logprobs are compared with transformers' float32 at 1e-4 (CUDA's default is bfloat16).
    return LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


PROMPT_A = "def wrap(text, width=70):"
OTHERS = ["Hello there", "import sys\nimport os\n", "class TextWrapper:\n    def __init__(self):"]


def test_seeded_generation_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT_A], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPT_A, p, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        [OTHERS[0], PROMPT_A, OTHERS[1], OTHERS[2]],
        [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True), p,
         SamplingParams(temperature=0.7, seed=99, max_tokens=10, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)],
        use_tqdm=False,
    )
    assert alone == again == mixed[1].outputs[0].token_ids
    other_seed = llm.generate(PROMPT_A, SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_generation_penalties_follow_reference(llm, hf):
    """Each greedy token is the argmax of the reference-processed HF logits given the history so far."""
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=0.8,
                       frequency_penalty=0.4, repetition_penalty=1.6)
    out = llm.generate(PROMPT_A, p, use_tqdm=False)[0]
    prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
    logits = _hf_logits(hf, prompt + gen[:-1])[len(prompt) - 1:]
    for i, tok in enumerate(gen):
        assert tok == reference_logits(logits[i], p, prompt, gen[:i]).argmax().item()
    plain = llm.generate(PROMPT_A, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert plain != gen  # the penalties changed something


def test_generation_logprobs_and_cumulative(llm, hf):
    p = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True, logprobs=3, repetition_penalty=1.2)
    out = llm.generate(PROMPT_A, p, use_tqdm=False)[0]
    c = out.outputs[0]
    tok = llm.get_tokenizer()
    assert len(c.logprobs) == len(c.token_ids) == 16
    ref = _hf_logits(hf, out.prompt_token_ids + c.token_ids[:-1])[len(out.prompt_token_ids) - 1:].log_softmax(-1)
    total = 0.0
    for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert t in entry and 3 <= len(entry) <= 4
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[i, tid].item(), abs=1e-4)
            assert lp.rank == 1 + int((ref[i] > ref[i, tid] + 1e-6).sum())
            assert lp.decoded_token == tok.decode([tid])
        assert {tid for tid, lp in entry.items() if lp.rank <= 3} >= set(ref[i].topk(3).indices.tolist())
        total += entry[t].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-6)
    assert any(entry[t].rank > 1 for t, entry in zip(c.token_ids, c.logprobs))  # really sampled


def test_logprobs_without_detokenization_have_no_text(llm):
    p = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1, detokenize=False)
    out = llm.generate(PROMPT_A, p, use_tqdm=False)[0]
    entries = out.outputs[0].logprobs + [e for e in out.prompt_logprobs if e is not None]
    assert entries and all(lp.decoded_token is None for e in entries for lp in e.values())
    assert out.outputs[0].text == ""


def test_no_logprobs_unless_asked(llm):
    c = llm.generate(PROMPT_A, SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


def test_worker_keeps_one_generator_per_seeded_sequence(llm):
    """A seeded sequence draws from one generator for its whole life (so successive tokens use fresh noise)."""
    from vllm_spec.worker.batch import SeqInput

    worker = llm.llm_engine.executor.worker

    def seq_input(seq_id, params):
        return SeqInput(seq_id=seq_id, token_ids=[1], start_pos=0, block_table=[1], sample=True,
                        sampling_params=params)

    a = seq_input(10**9, SamplingParams(seed=3))
    gen = worker.generator_for(a)
    assert gen is not None and gen.initial_seed() == 3
    first = torch.empty(4, device=gen.device).exponential_(generator=gen)   # the worker's device
    assert worker.generator_for(a) is gen                          # kept, and advanced
    assert not torch.equal(torch.empty(4, device=gen.device).exponential_(generator=worker.generator_for(a)), first)
    assert worker.generator_for(seq_input(10**9 + 1, SamplingParams(seed=3))) is not gen
    assert worker.generator_for(seq_input(10**9 + 2, SamplingParams())) is None
    assert worker.generator_for(seq_input(10**9 + 3, SamplingParams(seed=3, temperature=0))) is None
    worker.release([10**9, 10**9 + 1])
    fresh = worker.generator_for(a)
    assert fresh is not gen and torch.equal(torch.empty(4, device=gen.device).exponential_(generator=fresh), first)
    worker.release([10**9])
