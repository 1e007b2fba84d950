"""vLLM's start_profile / stop_profile: a trace written to $VLLM_TORCH_PROFILER_DIR, offline, on the async
engine and through the server's endpoints (which exist only with that directory set)."""

from __future__ import annotations

import asyncio

import pytest

from vllm_spec import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams

KV = dict(kv_cache_memory_bytes=1 << 24)
SHORT = SamplingParams(temperature=0, max_tokens=3)


def _traces(folder) -> list:
    return sorted(folder.glob("*.pt.trace.json*"))


def test_a_trace_of_the_calls_between_start_and_stop(tiny_llama, tmp_path, monkeypatch):
    llm = LLM(str(tiny_llama), **KV)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate("hello world", SHORT, use_tqdm=False)
    llm.stop_profile()
    assert len(_traces(tmp_path)) == 1
    monkeypatch.setenv("VLLM_TORCH_PROFILER_WITH_STACK", "yes")
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_WITH_STACK must be 0 or 1"):
        llm.start_profile()


def test_the_async_engine_and_the_servers_endpoints(tiny_llama, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from vllm_spec.entrypoints.openai.api_server import build_app, build_state

    def app():
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_llama), enable_prefix_caching=True,
                                                                 **KV))
        return build_app(build_state(engine, str(tiny_llama), ["m"]))

    with TestClient(app()) as client:   # no directory, no development mode: no such endpoints
        assert client.post("/start_profile").status_code == 404
        assert client.post("/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with TestClient(app()) as client:
        r = client.post("/stop_profile")
        assert r.status_code == 400 and "not running" in r.json()["error"]["message"]
        assert client.post("/start_profile").status_code == 200
        assert client.post("/start_profile").status_code == 400   # already running
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200
        assert client.post("/stop_profile").status_code == 200
        assert client.post("/reset_prefix_cache").status_code == 200
    assert len(_traces(tmp_path)) == 1

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_llama), **KV))

    async def main():
        await engine.start_profile()
        async for _ in engine.generate("hello", SHORT, "a"):
            pass
        await engine.stop_profile()
        await engine.shutdown()
        with pytest.raises(Exception, match="shut down"):
            await engine.start_profile()

    asyncio.run(asyncio.wait_for(main(), 120.0))
    assert len(_traces(tmp_path)) == 2
