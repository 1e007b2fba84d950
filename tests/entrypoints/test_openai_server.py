"""The OpenAI-compatible server end to end: a real subprocess on 127.0.0.1 with speculative decoding
(tiny target + noisy draft, k=3), driven by the official `openai` client and raw httpx.

Also in-process tests of AsyncLLMEngine's error paths (a failing step, a bad request, abort).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
MODEL_NAME = "tiny-spec"
KV_BYTES = "33554432"
MAX_TOKENS = 12
PROMPTS = ["def wrap(text):", "hello world", "The quick brown fox", "import textwrap\n", "width = 70",
           "Return a list of", "class TextWrapper:", "    def __init__(self,"]
MESSAGES = [[{"role": "user", "content": "hello"}],
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "wrap this text"}]]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STARTUP_TIMEOUT = 240.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    total_blocks: int = 0
    ref_text: dict = dataclasses.field(default_factory=dict)   # prompt -> greedy text (offline, no draft)
    ref_chat: list = dataclasses.field(default_factory=list)   # per MESSAGES entry
    llm: LLM | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60.0)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode} during startup:\n{server.logs()}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not healthy after {timeout} s:\n{server.logs()}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(spec_pair, tmp_path_factory):
    target, draft = spec_pair
    port = _free_port()
    log = tmp_path_factory.mktemp("openai_server") / "server.log"
    cmd = [sys.executable, "-m", "vllm_spec.entrypoints.openai.api_server", target,
           "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", MODEL_NAME, "--kv-cache-memory-bytes", KV_BYTES,
           "--speculative-model", draft, "--num-speculative-tokens", "3",
           "--uvicorn-log-level", "warning", "--shutdown-timeout", "20"]
    if any(f.name == "speculative_policy" for f in dataclasses.fields(EngineArgs)):
        cmd += ["--speculative-policy", "fixed"]  # always draft k=3, so the spec counters must move
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(log.parent))
    srv = Server(proc, port, log)
    try:
        # The offline references load while the server starts.
        llm = LLM(target, kv_cache_memory_bytes=int(KV_BYTES))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        srv.ref_text = {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}
        srv.ref_chat = [o.outputs[0].text for o in llm.chat(MESSAGES, params, use_tqdm=False)]
        srv.llm = llm
        _wait_healthy(srv, STARTUP_TIMEOUT)
        srv.total_blocks = int(_metric(_metrics_text(srv), "vllm:kv_cache_total_blocks"))
        yield srv
    finally:
        _stop(proc)


# Helpers --------------------------------------------------------------------------------------------
def _metrics_text(server: Server) -> str:
    r = httpx.get(server.url + "/metrics", timeout=10.0)
    assert r.status_code == 200
    return r.text


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    raise KeyError(f"{name} {labels} not in /metrics")


def _wait_all_blocks_free(server: Server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics_text(server)
        free = _metric(text, "vllm:kv_cache_free_blocks")
        if free == server.total_blocks and _metric(text, "vllm:num_requests_running") == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"KV blocks not freed: {free} of {server.total_blocks} free")
        time.sleep(0.1)


def _assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["code"] == status and err["message"]
    if status == 400:
        assert err["type"] == "BadRequestError"
    if param != "any":
        assert err["param"] == param, err
    return err


def _sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _post(server: Server, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60.0, **kw)


# Completions & chat vs offline ------------------------------------------------------------------------
def test_completions_greedy_match_offline(server):
    client = server.client()
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:4], max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for prompt, choice in zip(PROMPTS[:4], resp.choices):
        assert choice.text == server.ref_text[prompt]
        assert choice.finish_reason == "length"
    prompt_tokens = sum(len(server.llm.get_tokenizer()(p).input_ids) for p in PROMPTS[:4])
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == 4 * MAX_TOKENS
    assert resp.usage.total_tokens == prompt_tokens + 4 * MAX_TOKENS
    assert resp.model == MODEL_NAME and resp.object == "text_completion"

    # Streaming: the concatenated deltas are the same text; usage comes last.
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == server.ref_text[PROMPTS[4]]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_greedy_match_offline(server):
    client = server.client()
    for messages, ref in zip(MESSAGES, server.ref_chat):
        resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == ref
        assert resp.usage.completion_tokens == MAX_TOKENS and resp.object == "chat.completion"
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
        assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_streaming_and_not(server):
    prompt = PROMPTS[0]
    ref = server.ref_text[prompt]
    m = re.search(r"[A-Za-z]{2,}", ref[1:])
    if m is None:
        pytest.skip(f"no ASCII word in the reference text {ref!r}")
    stop = m.group(0)[:2]
    expected = ref[: ref.index(stop)]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop],
            "ignore_eos": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == expected and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60.0) as s:
        events = _sse_events(s.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected  # nothing past the stop leaked


def test_logprobs_and_n(server):
    client = server.client()
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text

    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES[0], max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    # Greedy: the chosen token is the top-1 alternative.
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5) for c in content)

    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, n=3, seed=7,
                                     temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                                     extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2,
                                                 "stop_token_ids": [5], "ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert 3 * 2 <= resp.usage.completion_tokens <= 3 * 6  # min_tokens 2, max_tokens 6, three choices
    assert all(c.finish_reason in ("length", "stop") for c in resp.choices)


# Concurrency, disconnect, metrics -------------------------------------------------------------------
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
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    # Mid-stream: the request holds KV blocks now.
                    assert _metric(_metrics_text(server), "vllm:kv_cache_free_blocks") < server.total_blocks
                    break  # (dropping httpx's line iterator closes the connection)
        # Leaving the block closes the connection mid-stream, if the break did not already.
    _wait_all_blocks_free(server, timeout=30.0)
    text = _metrics_text(server)
    assert _metric(text, "vllm:num_requests_in_flight") == 0
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
    assert _metric(after_text, "vllm:request_success_total", finished_reason="length") >= 1
    assert _metric(after_text, "vllm:time_to_first_token_seconds_count") >= 1
    assert 'vllm:e2e_request_latency_seconds_bucket{le="+Inf"' in after_text


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


# Errors -------------------------------------------------------------------------------------------------
def test_bad_inputs_get_400_and_server_keeps_serving(server):
    good = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat_good = {"model": MODEL_NAME, "messages": MESSAGES[0], "max_tokens": 3}
    cases = [
        ("/v1/completions", b'{"prompt": "hi", ', "raw", None),
        ("/v1/completions", b"not json at all", "raw", None),
        ("/v1/chat/completions", b'{"messages": [', "raw", None),
        ("/v1/completions", {**good, "model": "no-such-model"}, "json", "model"),
        ("/v1/chat/completions", {**chat_good, "model": "no-such-model"}, "json", "model"),
        ("/v1/completions", {**good, "temperature": -1.0}, "json", "temperature"),
        ("/v1/completions", {**good, "top_p": 0.0}, "json", "top_p"),
        ("/v1/completions", {**good, "top_k": -5}, "json", "top_k"),
        ("/v1/completions", {**good, "min_p": 1.5}, "json", "min_p"),
        ("/v1/completions", {**good, "n": 0}, "json", "n"),
        ("/v1/completions", {**good, "max_tokens": 0}, "json", "max_tokens"),
        ("/v1/completions", {**good, "presence_penalty": 3.0}, "json", "presence_penalty"),
        ("/v1/completions", {**good, "repetition_penalty": 0.0}, "json", "repetition_penalty"),
        ("/v1/completions", {**good, "logprobs": 50}, "json", "logprobs"),
        ("/v1/completions", {**good, "min_tokens": 5, "max_tokens": 2}, "json", "min_tokens"),
        ("/v1/completions", {**good, "stop_token_ids": [-1]}, "json", "stop_token_ids"),
        ("/v1/completions", {**good, "temperature": "hot"}, "json", "temperature"),
        ("/v1/completions", {**good, "prompt": "hello " * 600}, "json", "prompt"),
        ("/v1/completions", {**good, "max_tokens": 510}, "json", "max_tokens"),
        ("/v1/completions", {**good, "prompt": [1, 2, 100000]}, "json", None),
        ("/v1/completions", {**good, "prompt": ""}, "json", "prompt"),
        ("/v1/completions", {"model": MODEL_NAME}, "json", "prompt"),
        ("/v1/chat/completions", {**chat_good, "messages": []}, "json", "messages"),
        ("/v1/chat/completions", {**chat_good, "top_logprobs": 2}, "json", "top_logprobs"),
        ("/v1/completions", {**good, "vllm_xargs": {"synthetic_acceptance_rate": 2}}, "json", "vllm_xargs"),
        ("/v1/chat/completions", {**chat_good, "messages": [{"role": "user", "content": "x " * 600}]}, "json",
         "prompt"),
    ]
    for path, body, kind, param in cases:
        if kind == "raw":
            r = httpx.post(server.url + path, content=body, timeout=30.0,
                           headers={**AUTH, "Content-Type": "application/json"})
        else:
            r = _post(server, path, body)
        _assert_error(r, 400, param)
        # ... and the next request is served.
        ok = _post(server, "/v1/completions", {**good, "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1, (body, ok.text)
    # The official client maps it to BadRequestError too.
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL_NAME, prompt="x", temperature=-2)
    # Still serving, with the right output.
    r = _post(server, "/v1/completions", {**good, "max_tokens": MAX_TOKENS, "prompt": PROMPTS[2]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.ref_text[PROMPTS[2]]
    _wait_all_blocks_free(server)


def test_api_key_required(server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    _assert_error(_post(server, "/v1/completions", body, headers={}), 401)
    _assert_error(_post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    _assert_error(_post(server, "/v1/chat/completions", {"messages": MESSAGES[0]}, headers={}), 401)
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # health stays open
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert _post(server, "/v1/completions", body).status_code == 200


def test_unknown_route_is_404_json(server):
    r = httpx.get(server.url + "/v1/nope", headers=AUTH, timeout=10)
    _assert_error(r, 404)


# In-process AsyncLLMEngine ----------------------------------------------------------------------------
def test_async_engine_step_failure_and_abort(server):
    from vllm_spec.engine.async_llm_engine import AsyncLLMEngine, EngineStepError, RequestAbortedError

    engine = server.llm.llm_engine  # the offline references are done; reuse its engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def main():
        aeng = AsyncLLMEngine(engine)
        try:
            # A bad request fails only its caller.
            with pytest.raises(ValueError, match="empty"):
                async for _ in aeng.generate("", params, "bad"):
                    pass
            # A failing step fails every request in flight; the loop keeps serving.
            real = engine.executor.execute_model

            def boom(*args, **kwargs):
                raise RuntimeError("injected failure")

            engine.executor.execute_model = boom
            try:
                async def consume(rid):
                    async for _ in aeng.generate(PROMPTS[0], params, rid):
                        pass

                results = await asyncio.gather(consume("f1"), consume("f2"), return_exceptions=True)
            finally:
                engine.executor.execute_model = real
            assert all(isinstance(r, EngineStepError) and "injected failure" in str(r) for r in results), results
            assert not engine.has_unfinished_requests()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
            last = None
            async for last in aeng.generate(PROMPTS[0], params, "ok"):
                pass
            assert last.finished and last.outputs[0].text == server.ref_text[PROMPTS[0]]
            # abort(): the stream ends with RequestAbortedError and the blocks come back.
            long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
            stream = await aeng.add_request("ab", PROMPTS[1], long)
            got = []
            with pytest.raises(RequestAbortedError):
                async for out in stream:
                    got.append(out)
                    aeng.abort("ab")
            assert got and not got[-1].finished
            for _ in range(200):
                if aeng.num_free_blocks == engine.block_manager.num_usable_blocks:
                    break
                await asyncio.sleep(0.02)
            assert aeng.num_free_blocks == engine.block_manager.num_usable_blocks
            assert not engine.has_unfinished_requests()
        finally:
            await aeng.shutdown()
        assert not aeng.is_running

    asyncio.run(asyncio.wait_for(main(), 120.0))


# Shutdown (last: it stops the module's server) ------------------------------------------------------
def test_sigterm_graceful_exit_zero(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.proc.send_signal(signal.SIGTERM)
            events = _sse_events([first, *lines])  # the in-flight stream still ends cleanly
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=30) == 0, server.logs()
