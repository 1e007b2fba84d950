"""The server under load and over time: 64 concurrent streams, disconnects, /metrics, vllm_xargs, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .openai_server_helpers import (
    AUTH,
    MAX_TOKENS,
    MODEL_NAME,
    PROMPTS,
    _metric,
    _metrics_text,
    _post,
    _sse_events,
    _stream_completion,
    _wait_all_blocks_free,
)


def test_64_concurrent_streams(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            events = _sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        return prompt, text, events[-2]["choices"][0]["finish_reason"]

    async def main():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=90.0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 120.0)

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, text, finish in results:
        assert text == server.ref_text[prompt], prompt
        assert finish == "length"
    _wait_all_blocks_free(server)


def test_disconnect_mid_stream_frees_blocks(server):
    with _stream_completion(server, max_tokens=400) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                # Mid-stream: the request holds KV blocks now.
                assert _metric(_metrics_text(server), "vllm:kv_cache_free_blocks") < server.total_blocks
                break  # (dropping httpx's line iterator closes the connection)
    _wait_all_blocks_free(server, timeout=30.0)
    text = _metrics_text(server)
    assert _metric(text, "vllm:num_requests_in_flight") == 0
    # vLLM's cache_config_info: value 1, the configuration in its labels.
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert _metric(text, "vllm:num_requests_in_flight", model_name=MODEL_NAME, engine="0") == 0   # vLLM V1's labels
    assert info.endswith(" 1.0") and f'num_gpu_blocks="{server.total_blocks}"' in info and 'block_size="16"' in info
    # Not run to completion: far fewer than 400 tokens were generated.
    r = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 2})
    assert r.status_code == 200


def test_metrics_spec_decode_counters_move(server):
    names = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total",
             "vllm:prompt_tokens_total"]
    before_text = _metrics_text(server)
    before = {n: _metric(before_text, n, model_name=MODEL_NAME) for n in names}
    r = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPTS[3], "max_tokens": 16,
                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    after_text = _metrics_text(server)
    after = {n: _metric(after_text, n, model_name=MODEL_NAME) for n in names}
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert after["vllm:spec_decode_num_draft_tokens_total"] > before["vllm:spec_decode_num_draft_tokens_total"]
    assert after["vllm:spec_decode_num_accepted_tokens_total"] >= before["vllm:spec_decode_num_accepted_tokens_total"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 16
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"]
    assert accepted > 0  # the noisy draft agrees with the target often
    per_pos = [_metric(after_text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
               for j in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    rate = _metric(after_text, "vllm:spec_decode_acceptance_rate")
    assert rate == pytest.approx(accepted / after["vllm:spec_decode_num_draft_tokens_total"], rel=1e-6)
    assert _metric(after_text, "vllm:spec_decode_draft_acceptance_rate") == rate   # vLLM V0's names
    drafts = after["vllm:spec_decode_num_drafts_total"]
    assert _metric(after_text, "vllm:spec_decode_num_emitted_tokens_total") == accepted + drafts
    assert _metric(after_text, "vllm:spec_decode_efficiency") == pytest.approx(
        (accepted + drafts) / (after["vllm:spec_decode_num_draft_tokens_total"] + drafts), rel=1e-6)
    assert _metric(after_text, "vllm:request_success_total", finished_reason="length") >= 1
    assert _metric(after_text, "vllm:time_to_first_token_seconds_count") >= 1
    assert _metric(after_text, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") >= 1


def test_vllm_xargs_reach_sampling_params(server):
    # vLLM's vllm_xargs become SamplingParams.extra_args: a synthetic acceptance of 1 accepts every draft.
    names = ["vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"]
    before_text = _metrics_text(server)
    before = {n: _metric(before_text, n, model_name=MODEL_NAME) for n in names}
    r = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 13,
                                          "temperature": 0, "ignore_eos": True,
                                          "vllm_xargs": {"synthetic_acceptance_rate": 1.0}})
    assert r.status_code == 200, r.text
    after_text = _metrics_text(server)
    drafted, accepted = (_metric(after_text, n, model_name=MODEL_NAME) - before[n] for n in names)
    assert drafted > 0 and accepted == drafted


# Shutdown (last: it stops the module's server) ------------------------------------------------------
def test_sigterm_graceful_exit_zero(server):
    with _stream_completion(server, max_tokens=24) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)
        events = _sse_events([first, *lines])  # the in-flight stream still ends cleanly
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=30) == 0, server.logs()
