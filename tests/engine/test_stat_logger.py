"""vLLM's statistics lines: do_log_stats on demand, every LOG_STATS_INTERVAL seconds of steps unless
disable_log_stats, counts over the interval since the previous line."""

from __future__ import annotations

import logging
import re

import pytest

from vllm_spec import LLM, EngineArgs, LLMEngine, SamplingParams
from vllm_spec.engine import llm_engine

KV = dict(kv_cache_memory_bytes=1 << 24)


def _finish(engine: LLMEngine, n: int, max_tokens: int) -> None:
    for i in range(n):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i, 6, 7, 8]},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm_spec.stats"]


def test_do_log_stats_reports_the_interval(tiny_llama, caplog):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), speculative_model=str(tiny_llama),
                                                   num_speculative_tokens=3, speculative_policy="fixed", **KV))
    _finish(engine, 3, 10)
    spec = {m.name: m for m in engine.get_metrics() if m.name.startswith("vllm:spec_decode_num")}
    with caplog.at_level(logging.INFO, logger="vllm_spec.stats"):
        engine.do_log_stats()
    main, speculative = _lines(caplog)
    assert re.match(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                    r"Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0\.0%, Prefix cache hit rate: 0\.0%$",
                    main), main
    drafts, drafted = spec["vllm:spec_decode_num_drafts"].value, spec["vllm:spec_decode_num_draft_tokens"].value
    accepted = spec["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = ", ".join(f"{n / drafts:.3f}" for n in spec["vllm:spec_decode_num_accepted_tokens_per_pos"].values)
    assert speculative.startswith(
        f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted throughput: ")
    assert (f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%") in speculative
    # Nothing drafted since: the next line has no speculative part and no throughput.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm_spec.stats"):
        engine.do_log_stats()
    (line,) = _lines(caplog)
    assert line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")


@pytest.mark.parametrize("disable", [False, True])
def test_lines_every_interval_unless_disabled(tiny_llama, caplog, monkeypatch, disable):
    monkeypatch.setattr(llm_engine, "LOG_STATS_INTERVAL", 0.0)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), disable_log_stats=disable, **KV))
    with caplog.at_level(logging.INFO, logger="vllm_spec.stats"):
        _finish(engine, 2, 4)
    lines = [line for line in _lines(caplog) if line.startswith("Avg prompt throughput")]
    assert (len(lines) == 0) if disable else (len(lines) >= 4), lines


def test_llm_logs_no_stats_by_default(tiny_llama, caplog, monkeypatch):
    """As vLLM's LLM: disable_log_stats defaults to True offline."""
    monkeypatch.setattr(llm_engine, "LOG_STATS_INTERVAL", 0.0)
    llm = LLM(str(tiny_llama), **KV)
    with caplog.at_level(logging.INFO, logger="vllm_spec.stats"):
        llm.generate("hi", SamplingParams(max_tokens=3), use_tqdm=False)
    assert _lines(caplog) == [] and llm.llm_engine.config.log_stats is False
