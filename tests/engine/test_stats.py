"""Engine step metrics: the host-side phases of a step are reported separately."""

from __future__ import annotations

import pytest

from vllm_spec import EngineArgs, LLMEngine, SamplingParams


def test_host_time_metrics_cover_every_phase(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24))
    engine.add_request("r", "hello world", SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    m = {x.name: x.value for x in engine.get_metrics() if hasattr(x, "value")}
    phases = ("vllm:engine_host_schedule_seconds", "vllm:engine_host_worker_seconds", "vllm:engine_host_output_seconds")
    assert all(m[p] > 0 for p in phases)
    # On a CPU device the worker's host time includes the model: the phases add up to the step time.
    assert sum(m[p] for p in phases) <= m["vllm:engine_step_seconds"] * 1.0001


def test_per_request_histograms(tiny_llama):
    """vLLM's per-request histograms: prompt and generated tokens, time per output token after the first."""
    from vllm_spec.metrics import Histogram, one_two_five_buckets

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                   max_model_len=256))
    prompts = {"a": [5, 6, 7], "b": [8] * 11, "c": [9, 10]}
    lengths = {"a": 6, "b": 1, "c": 4}
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids},
                           SamplingParams(temperature=0 if rid != "c" else 1.0, max_tokens=lengths[rid],
                                          ignore_eos=True, n=1 + (rid == "c")))
    while engine.has_unfinished_requests():
        engine.step()
    h = {x.name: x for x in engine.get_metrics() if isinstance(x, Histogram)}
    # Per sequence, as vLLM's n > 1 child requests: a, b and c twice.
    assert (h["vllm:request_prompt_tokens"].count, h["vllm:request_prompt_tokens"].sum) == (4, 3 + 11 + 2 * 2)
    assert (h["vllm:request_generation_tokens"].count, h["vllm:request_generation_tokens"].sum) == (4, 6 + 1 + 2 * 4)
    assert h["vllm:request_prompt_tokens"].buckets["10.0"] == 3 and h["vllm:request_prompt_tokens"].buckets["+Inf"] == 4
    # Sequences with more than one token: a (6), both of c (4 each).
    tpot = h["vllm:request_time_per_output_token_seconds"]
    assert tpot.count == 3 and tpot.sum > 0
    # Latency, time to first token and finished requests in the same unit; prompt tokens as prefilled.
    assert h["vllm:e2e_request_latency_seconds"].count == h["vllm:time_to_first_token_seconds"].count == 4
    m = {x.name: x for x in engine.get_metrics() if not isinstance(x, Histogram)}
    assert sum(x.value for x in engine.get_metrics() if x.name == "vllm:request_success") == 4
    assert m["vllm:prompt_tokens"].value == 3 + 11 + 2 * 2
    # vLLM's phases, per sequence: waiting + running (prefill + decode) make up the latency.
    phase = {p: h[f"vllm:request_{p}_time_seconds"] for p in ("queue", "prefill", "decode", "inference")}
    assert all(x.count == 4 for x in phase.values())
    assert phase["inference"].sum == pytest.approx(phase["prefill"].sum + phase["decode"].sum)
    assert h["vllm:e2e_request_latency_seconds"].sum == pytest.approx(phase["queue"].sum + phase["inference"].sum)
    assert one_two_five_buckets(256) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
    # vLLM's request parameter and per-request maximum histograms.
    assert (h["vllm:request_params_n"].count, h["vllm:request_params_n"].sum) == (3, 1 + 1 + 2)
    assert (h["vllm:request_params_max_tokens"].count, h["vllm:request_params_max_tokens"].sum) == (3, 6 + 1 + 4)
    assert h["vllm:request_max_num_generation_tokens"].sum == 6 + 1 + 4


def test_iteration_tokens_and_inter_token_latency(tiny_llama):
    """vLLM's per-step token histogram counts each step's prefill and emitted tokens; inter-token
    latency has one observation per sequence per step after its first token."""
    from vllm_spec.metrics import Histogram

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                   max_num_batched_tokens=16, async_scheduling=False))
    engine.add_request("a", {"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": [6] * 3}, SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    h = {x.name: x for x in engine.get_metrics() if isinstance(x, Histogram)}
    it = h["vllm:iteration_tokens_total"]
    assert it.count == steps
    # Every prompt token is computed once (in chunks of at most 16) and every output token emitted once.
    assert it.sum == 20 + 3 + 5 + 3
    assert set(it.buckets) == {"1.0", "2.0", "5.0", "10.0", "+Inf"}
    itl = h["vllm:inter_token_latency_seconds"]
    assert itl.count == (5 - 1) + (3 - 1) and itl.sum > 0
    assert itl.sum <= h["vllm:e2e_request_latency_seconds"].sum


def test_an_aborted_request_ends_when_it_is_aborted(tiny_llama):
    import time

    from vllm_spec.metrics import Histogram

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24))
    engine.add_request("a", "hello", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    time.sleep(0.2)
    engine.abort_request("a")
    h = {x.name: x for x in engine.get_metrics() if isinstance(x, Histogram)}
    assert h["vllm:e2e_request_latency_seconds"].sum >= 0.2
