"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read.

The outputs must be exactly those of the synchronous engine, whatever ends a request (length,
stop token, stop string, abort), under preemption, with seeds, penalties, min_tokens, logprobs,
n > 1, and in the speculative engine (whose steps without drafts overlap the next one).
"""

from __future__ import annotations

import argparse

import pytest

from vllm_spec import LLM, EngineArgs, LLMEngine, SamplingParams
from vllm_spec.sampling_params import RequestOutputKind

PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "one two three four five six seven eight nine",
           "lorem ipsum dolor", "x y"]


def _outputs(llm: LLM, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
             for c in o.outputs] for o in outs]


def _tokens(llm: LLM, prompts, params) -> list:
    """Tokens, text and how each ended, and cumulative logprobs to float noise: a preempted request is
    recomputed in another batch, whose shapes change the logits' last bits (the tokens stay)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.cumulative_logprob is None else pytest.approx(c.cumulative_logprob, rel=1e-5))
             for c in o.outputs] for o in outs]


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _pair(model: str, **kw) -> tuple[LLM, LLM]:
    return LLM(model=model, async_scheduling=False, **kw), LLM(model=model, async_scheduling=True, **kw)


@pytest.fixture(scope="module")
def llms(tiny_llama) -> tuple[LLM, LLM]:
    return _pair(str(tiny_llama), kv_cache_memory_bytes=1 << 24)


def _mixed_params(ref: LLM) -> list[SamplingParams]:
    """One request per prompt, each ended differently; ids of tokens the sync run emits as stops."""
    greedy = ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stop_tok = greedy[1].outputs[0].token_ids[5]
    stop_str = greedy[4].outputs[0].text[6:9]
    return [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.8, seed=7, max_tokens=20, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, max_tokens=15, presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_str] if stop_str.strip() else None),
        SamplingParams(temperature=0.7, seed=11, max_tokens=12, min_tokens=6, n=2, top_k=20),
    ]


def test_outputs_equal_the_synchronous_engine(llms):
    sync, overlapped = llms
    params = _mixed_params(sync)
    assert _outputs(overlapped, PROMPTS, params) == _outputs(sync, PROMPTS, params)


def test_no_step_is_wasted_on_requests_that_end_by_length(llms):
    sync, overlapped = llms
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    before = [_metric(e, "vllm:engine_steps") for e in llms]
    assert _outputs(overlapped, PROMPTS[:3], params) == _outputs(sync, PROMPTS[:3], params)
    after = [_metric(e, "vllm:engine_steps") for e in llms]
    assert after[1] - before[1] == after[0] - before[0]


def test_a_step_stays_in_flight_until_the_next_call(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                   async_scheduling=True))
    engine.add_request("r", "hello world", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                          output_kind=RequestOutputKind.DELTA))
    assert engine.step() == []   # the prefill is on its way; nothing read yet
    seq = engine.requests["r"].seqs[0]
    assert seq.num_in_flight == 1 and seq.num_output_tokens == 0
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert len(tokens) == 4
    assert not engine.has_step_in_flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_an_engine_without_requests_holds_no_step(tiny_llama):
    """A request ending by a stop token leaves a step launched for it; with nothing else to run the
    engine reads it at once, so no idle time is charged to it and nothing is held while idle."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                   async_scheduling=True))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine.add_request("probe", "hello world", params)
    while engine.has_unfinished_requests():
        tokens = [o.outputs[0].token_ids for o in engine.step() if o.finished] or None
    stop = tokens[0][4]
    engine.add_request("r", "hello world", SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]))
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.has_step_in_flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_a_failed_read_keeps_the_step_launched_after_it(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                   async_scheduling=True))
    engine.add_request("r", "hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    engine.step()
    first = engine._in_flight
    first.handle.result = lambda: (_ for _ in ()).throw(RuntimeError("injected read failure"))
    with pytest.raises(RuntimeError, match="injected read failure"):
        engine.step()
    assert engine.has_step_in_flight and engine._in_flight is not first


def test_preemption_gives_the_same_outputs(tiny_llama):
    # 5 usable blocks of 16 tokens for seven sequences of up to ~35 tokens: preempted mid-flight.
    sync, overlapped = _pair(str(tiny_llama), num_gpu_blocks_override=6, max_model_len=64)
    params = _mixed_params(sync)
    assert _tokens(overlapped, PROMPTS, params) == _tokens(sync, PROMPTS, params)
    assert _metric(overlapped, "vllm:num_preemptions") > 0
    engine = overlapped.llm_engine
    assert not engine.has_step_in_flight   # an engine without requests holds no step
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_abort_while_a_step_is_in_flight(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24).generate(PROMPTS[:2], params, use_tqdm=False)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                   async_scheduling=True))
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", PROMPTS[1], params)
    for _ in range(5):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request("drop")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"keep"}
    assert done["keep"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert not engine.has_step_in_flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_aborting_the_last_request_leaves_no_step_in_flight(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                   async_scheduling=True))
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.has_step_in_flight
    engine.abort_request("r")
    assert not engine.has_step_in_flight and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    assert engine.step() == []


@pytest.mark.parametrize("speculating", [False, True], ids=["never-speculating", "adaptive"])
def test_speculative_engine_overlaps_its_steps_without_drafts(spec_pair, speculating):
    target, draft = spec_pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _outputs(LLM(model=target, kv_cache_memory_bytes=1 << 24), PROMPTS, params)

    def engine(async_scheduling: bool) -> LLM:
        llm = LLM(model=target, speculative_model=draft, num_speculative_tokens=3, kv_cache_memory_bytes=1 << 24,
                  async_scheduling=async_scheduling)
        if not speculating:   # (a threshold of 1, below what users may set: no step speculates)
            llm.llm_engine.config.speculative.disable_by_batch_size = 1
        return llm

    llm = engine(True)
    assert _outputs(llm, PROMPTS, params) == ref
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=16)
    assert _outputs(llm, PROMPTS, seeded) == _outputs(engine(False), PROMPTS, seeded)


def test_ngram_steps_that_find_no_drafts_are_costed(spec_pair):
    """The policy asked for drafts, so the step ran to completion at launch: its whole time is
    what choosing to speculate cost, whether or not the n-gram proposer found any."""
    llm = LLM(model=spec_pair[0], speculative_model="[ngram]", num_speculative_tokens=3,
              speculative_policy="fixed", kv_cache_memory_bytes=1 << 24, async_scheduling=True)
    worker = llm.llm_engine.executor.worker
    seen = []
    observe = worker.policy.observe
    worker.policy.observe = lambda shape, chosen, accepted, stats, charge, found=None: (
        seen.append((stats.num_draft_tokens, charge)), observe(shape, chosen, accepted, stats, charge, found))
    prompt = {"prompt_token_ids": list(range(3, 40))}   # no n-gram repeats: nothing to look up at first
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    empty = [t for n, t in seen[1:] if n == 0]   # decoding steps (after the prefill) without drafts
    assert empty and all(not c.refill and c.seconds > 0 for c in empty)


def test_async_scheduling_settings(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama)))
    assert engine.async_scheduling is (engine.config.model.device.type == "cuda")   # off on CPU: nothing to overlap
    args = EngineArgs(model=str(tiny_llama), tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match=r"async_scheduling=True needs tensor_parallel_size=1 \(got 2\)"):
        args.create_engine_config()
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        EngineArgs(model=str(tiny_llama), async_scheduling="yes").create_engine_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args([]).async_scheduling is None


def test_penalties_and_min_tokens_keep_the_overlap(llms):
    """Their in-flight tokens are counted on the device: the host never waits for them."""
    sync, overlapped = llms
    worker = overlapped.llm_engine.executor.worker

    def no_host_wait(req):
        raise AssertionError("a plain step waited on the host for tokens in flight")

    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, frequency_penalty=0.8,
                             presence_penalty=0.6, min_tokens=12, ignore_eos=False),
              SamplingParams(temperature=0.9, seed=5, max_tokens=20, frequency_penalty=1.0, min_tokens=15)]
    prompts = PROMPTS[:2]
    worker.resolve_placeholders = no_host_wait
    try:
        got = _outputs(overlapped, prompts, params)
    finally:
        del worker.resolve_placeholders
    assert got == _outputs(sync, prompts, params)


def _random_params(r) -> SamplingParams:
    """Greedy or seeded (their tokens do not depend on the batch), ended in every way."""
    p = dict(max_tokens=r.randint(1, 30))
    if r.random() < 0.5:
        p["temperature"] = 0
    else:
        p.update(temperature=r.choice([0.7, 1.0]), seed=r.randrange(1000))
    if r.random() < 0.3:
        p["ignore_eos"] = True
    if r.random() < 0.2:
        p["stop_token_ids"] = [r.randrange(2, 300)]
    if r.random() < 0.2:
        p["presence_penalty"] = 0.5
    if r.random() < 0.2:
        p["repetition_penalty"] = 1.3
    if r.random() < 0.3:
        p["min_tokens"] = r.randint(0, p["max_tokens"])
    if r.random() < 0.2 and p["temperature"] > 0:   # (greedy takes n = 1 only, as vLLM)
        p["n"] = r.randint(2, 3)
    if r.random() < 0.2:
        p["stop"] = [r.choice(["e", "th", " a", "in"])]
    return SamplingParams(**p)


def _serve(engine: LLMEngine, arrivals: list, aborts: dict) -> dict:
    """Requests arrive (and some are aborted) between steps; the final output of every request."""
    done, call = {}, 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= call:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for rid, at in aborts.items():
            if at == call and rid in engine.requests:
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
        call += 1
        assert call < 5000, "the engine made no progress"
    assert not engine.has_step_in_flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    return done


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("limits", [dict(kv_cache_memory_bytes=1 << 24),
                                    dict(num_gpu_blocks_override=8, max_model_len=64, max_num_batched_tokens=24)],
                         ids=["roomy", "preempting-chunked"])
def test_random_serving_workloads_match_the_synchronous_engine(tiny_llama, seed, limits):
    import random

    r = random.Random(seed)
    max_prompt = limits.get("max_model_len", 200) - 1
    arrivals = [(r.randint(0, 15), f"r{i}", [r.randrange(2, 300) for _ in range(r.randint(1, min(50, max_prompt)))],
                 _random_params(r)) for i in range(r.randint(2, 8))]
    aborts = {rid: r.randint(0, 30) for _, rid, _, _ in arrivals if r.random() < 0.15}
    results = [_serve(LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), async_scheduling=a, **limits)),
                      arrivals, aborts) for a in (False, True)]
    kept = [{rid: out for rid, out in res.items() if rid not in aborts} for res in results]
    assert len(kept[0]) == len(arrivals) - len(aborts)
    assert kept[1] == kept[0]
