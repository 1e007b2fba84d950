"""Beam search (vLLM's LLM.beam_search): the same beams as a brute-force search over the HF model's
own logprobs, greedy at width 1, end-of-sequence beams completed, unchanged by speculation or by
searching fewer prompts at once; bad parameters named."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import FIXED, SPEC_KV, make_prompts
from vllm_spec import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from vllm_spec.beam_search import BeamSearchSequence, beam_score, beam_search
from vllm_spec.outputs import Logprob
from vllm_spec.sampling_params import BeamSearchParams

PROMPTS = make_prompts(3, seed=5)
# float32 everywhere (bf16 on a GPU by default): beams compared with each other and a float32 reference.
KV = dict(SPEC_KV, dtype="float32")


def _reference(model, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Beam search over the HF model's log-softmax (no end token reached: random weights, ignore_eos)."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, score in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            candidates += [(tokens + [t], score + lp) for lp, t in zip(top.values.tolist(), top.indices.tolist())]
        beams = sorted(candidates, key=lambda b: b[1] / len(b[0]), reverse=True)[:width]
    return beams


@pytest.fixture(scope="module")
def llm(spec_pair):
    return LLM(spec_pair[0], **KV)


def test_the_beams_of_a_brute_force_search(llm, spec_pair):
    model = AutoModelForCausalLM.from_pretrained(spec_pair[0], torch_dtype=torch.float32).eval()
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = _reference(model, prompt["prompt_token_ids"], 3, 5)
        assert [b.tokens for b in out.sequences] == [tokens for tokens, _ in ref]
        for beam, (_, score) in zip(out.sequences, ref):
            assert beam.cum_logprob == pytest.approx(score, abs=1e-3)
            assert len(beam.logprobs) == 5 and beam.finish_reason == "length"
            assert beam.text == llm.get_tokenizer().decode(beam.tokens)   # prompt and beam, as vLLM's
            step_entries = beam.logprobs[0]
            assert all(lp.decoded_token is not None for lp in step_entries.values())


def test_width_one_is_greedy(llm):
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out, ref in zip(PROMPTS, outs, greedy):
        assert out.sequences[0].tokens == prompt["prompt_token_ids"] + list(ref.outputs[0].token_ids)


def test_a_speculative_engine_and_concurrency_limits_do_not_change_the_beams(llm, spec_pair):
    spec = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    want = [[b.tokens for b in o.sequences] for o in llm.beam_search(PROMPTS, params)]
    assert [[b.tokens for b in o.sequences] for o in spec.beam_search(PROMPTS, params)] == want
    assert [[b.tokens for b in o.sequences] for o in llm.beam_search(PROMPTS, params, concurrency_limit=1)] == want


def _step_outputs(prompts, tables):
    """Stand-ins for the engine's one-token outputs: each beam's top logprobs."""
    return [SimpleNamespace(prompt_token_ids=p, outputs=[SimpleNamespace(logprobs=[
        {t: Logprob(math.log(pr)) for t, pr in table.items()}])]) for p, table in zip(prompts, tables)]


def _search(first, params, eos, steps, max_model_len=1000):
    """Drive a search with scripted steps: each step's tables of top logprobs, one per live beam."""
    search = beam_search(first, params, eos, max_model_len)
    try:
        beams = next(search)
        while True:
            beams = search.send(_step_outputs(beams, next(steps)))
    except StopIteration as finished:
        return finished.value


def test_end_of_sequence_completes_a_beam():
    eos = 9
    first = _step_outputs([[5, 6]], [{eos: 0.6, 1: 0.3, 2: 0.1}])
    # After the first step: the two live beams' tables.
    out = _search(first, BeamSearchParams(beam_width=2, max_tokens=2), {eos}, iter([[{1: 0.5, 2: 0.3}, {1: 0.2, 2: 0.1}]]))[0]
    done = out.sequences[0]
    assert done.tokens == [5, 6, eos] and done.finish_reason == "stop" and done.stop_reason == eos
    assert out.sequences[1].tokens == [5, 6, 1, 1] and out.sequences[1].finish_reason == "length"
    # With ignore_eos the end token is one more candidate: the beams go on.
    out = _search(first, BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True), {eos},
                  iter([[{1: 0.5}, {2: 0.4}]]))[0]
    assert [b.tokens for b in out.sequences] == [[5, 6, eos, 1], [5, 6, 1, 2]]
    # One token: the first step decides.
    out = _search(first, BeamSearchParams(beam_width=2, max_tokens=1), {eos}, iter([]))[0]
    assert [b.tokens for b in out.sequences] == [[5, 6, eos], [5, 6, 1]]
    # Beams end at the context's end, whatever max_tokens asks.
    out = _search(first, BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True), {eos}, iter([]),
                  max_model_len=3)[0]
    assert [b.tokens for b in out.sequences] == [[5, 6, eos], [5, 6, 1]]
    assert all(b.finish_reason == "length" for b in out.sequences)


def test_a_final_end_token_is_not_counted_in_the_length_even_with_ignore_eos():
    """As vLLM's score: with ignore_eos an end token is a candidate whose length excludes it."""
    first = _step_outputs([[5]], [{9: math.exp(-0.6), 1: math.exp(-0.95)}])
    out = _search(first, BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), {9}, iter([]))[0]
    assert out.sequences[0].tokens == [5, 1]   # -0.95 / 2 beats -0.6 / 1


def test_the_async_engine_returns_the_beams_as_completions(llm, spec_pair):
    """AsyncLLMEngine.beam_search (what the server calls): one finished RequestOutput, a completion per
    beam with its new tokens and text, the same beams as the offline search."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=spec_pair[0], **KV))
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    want = llm.beam_search(PROMPTS[:1], params)[0].sequences
    start = len(PROMPTS[0]["prompt_token_ids"])

    async def main():
        try:
            return [out async for out in engine.beam_search(PROMPTS[0], "b", params)]
        finally:
            await engine.shutdown()

    outs = asyncio.run(asyncio.wait_for(main(), 120.0))
    assert len(outs) == 1 and outs[0].finished and outs[0].prompt_token_ids == PROMPTS[0]["prompt_token_ids"]
    comps = outs[0].outputs
    assert [c.token_ids for c in comps] == [b.tokens[start:] for b in want]
    assert [c.index for c in comps] == [0, 1, 2] and all(c.finish_reason == "length" for c in comps)
    assert comps[0].text == llm.get_tokenizer().decode(comps[0].token_ids)
    assert comps[0].cumulative_logprob == pytest.approx(want[0].cum_logprob)


def test_scores_divide_by_the_length_to_the_penalty():
    beam = BeamSearchSequence([1, 2, 3, 9], cum_logprob=-6.0, finish_reason="stop")
    assert beam_score(beam, {9}, 1.0) == pytest.approx(-2.0)   # the end token is not counted
    assert beam_score(beam, {9}, 2.0) == pytest.approx(-6.0 / 9)
    assert beam_score(BeamSearchSequence([1, 2, 3, 4], cum_logprob=-6.0), {9}, 0.0) == pytest.approx(-6.0)
    assert beam_score(BeamSearchSequence([1, 2, 3, 9], cum_logprob=-6.0, finish_reason="length"), {9}, 1.0) \
        == pytest.approx(-2.0)


@pytest.mark.parametrize("kwargs, named", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=1.5), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature must be a number >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty="x"), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be true or false"),
])
def test_bad_parameters_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        BeamSearchParams(**kwargs)


def test_bad_calls_are_named(llm):
    with pytest.raises(ValueError, match=r"beam_width must be at most 10"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    with pytest.raises(ValueError, match="prompts must not be empty"):
        llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2))
    changed = BeamSearchParams(beam_width=2, max_tokens=2)
    changed.beam_width = 0
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        llm.beam_search(PROMPTS, changed)
    assert len(llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences) == 2


def test_beams_end_at_the_context_end(spec_pair):
    llm = LLM(spec_pair[0], max_model_len=24, **KV)
    prompt = {"prompt_token_ids": list(range(3, 23))}   # 20 tokens: room for 4 more
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))[0]
    assert [len(b.tokens) for b in out.sequences] == [24, 24]
    assert all(b.finish_reason == "length" for b in out.sequences)


def test_the_progress_bar_ends_full(llm, monkeypatch):
    """use_tqdm: one tick per step, and the steps all beams ended before (here every beam lasts 3 of 5)."""
    bars = []

    class Bar:
        def __init__(self, total, desc, **kwargs):
            self.total, self.n = total, 0
            if desc == "Beam search":   # (not generate()'s own, unshown, bars)
                bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr("vllm_spec.entrypoints.llm.tqdm", Bar)
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True), use_tqdm=True,
                    concurrency_limit=2)
    assert [(b.total, b.n) for b in bars] == [(10, 10)]
    short = LLM(llm.llm_engine.config.model.path, max_model_len=23, **KV)
    short.beam_search([{"prompt_token_ids": list(range(3, 23))}], BeamSearchParams(beam_width=2, max_tokens=5,
                                                                                   ignore_eos=True), use_tqdm=True)
    assert (bars[-1].total, bars[-1].n) == (5, 5)


def test_the_search_caches_its_prefixes_and_forgets_them_after(llm):
    """The beams' shared prefixes are read from the prefix cache during the search even where the engine
    keeps none (vLLM's is on by default); afterwards the engine is as it was."""
    blocks = llm.llm_engine.block_manager
    assert not blocks.enable_caching
    hits = blocks.num_hit_tokens
    llm.beam_search([{"prompt_token_ids": list(range(3, 40))}], BeamSearchParams(beam_width=2, max_tokens=4,
                                                                                 ignore_eos=True))
    assert blocks.num_hit_tokens > hits
    assert not blocks.enable_caching and not blocks.cached and not blocks.block_hash
