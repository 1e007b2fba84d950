"""Engine step metrics: the host-side phases of a step are reported separately."""

from __future__ import annotations

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
