"""Server-wide options, in process: --chat-template and --response-role."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from vllm_spec.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_spec.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from vllm_spec.entrypoints.openai.api_server import build_app, build_state  # noqa: E402

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def test_chat_template_and_response_role(tiny_llama):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    state = build_state(engine, str(tiny_llama), ["m"], chat_template=TEMPLATE, response_role="bot",
                        trust_request_chat_template=True)
    tok = state.tokenizer
    messages = [{"role": "user", "content": "hello"}]
    with TestClient(build_app(state)) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "bot"
        # The server's template, not the tokenizer's, rendered the prompt.
        assert body["usage"]["prompt_tokens"] == len(tok("<user>hello", add_special_tokens=False).input_ids)
        assert client.post("/tokenize", json={"messages": messages}).json()["tokens"] == \
            tok("<user>hello", add_special_tokens=False).input_ids
        # A request's own template still wins.
        own = client.post("/tokenize", json={"messages": messages, "chat_template": "{{ messages[0]['content'] }}"})
        assert own.json()["tokens"] == tok("hello", add_special_tokens=False).input_ids
        stream = client.post("/v1/chat/completions",
                             json={"model": "m", "messages": messages, "max_tokens": 2, "stream": True})
        assert '"role":"bot"' in stream.text.replace(" ", "")
        # Later deltas carry only what they set (no "role": null), as OpenAI's stream.
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert deltas[0] == {"role": "bot", "content": ""} and all("role" not in d for d in deltas[1:]), deltas


def test_chat_template_content_format(tiny_llama):
    """--chat-template-content-format: auto hands a template that loops over content a list of parts;
    string forces the joined text (such a template then sees characters)."""
    parts = "{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    for content_format, rendered in (("auto", "<user>[hi]"), ("openai", "<user>[hi]"), ("string", "<user>[][]")):
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                            max_model_len=256))   # (an app's exit stops it)
        state = build_state(engine, str(tiny_llama), ["m"], chat_template=parts,
                            chat_template_content_format=content_format)
        with TestClient(build_app(state)) as client:
            tokens = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
            assert tokens["tokens"] == state.tokenizer(rendered, add_special_tokens=False).input_ids, content_format



def test_add_special_tokens(tiny_llama):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    state = build_state(engine, str(tiny_llama), ["m"])
    tok = state.tokenizer
    with TestClient(build_app(state)) as client:
        for add in (True, False):
            r = client.post("/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 1,
                                                     "add_special_tokens": add})
            assert r.json()["usage"]["prompt_tokens"] == len(tok("hello there", add_special_tokens=add).input_ids)


def test_sampling_fields_the_engine_refuses_are_named(tiny_llama):
    """Refusals about a sampling field (stop strings or bad_words without a tokenizer, token ids outside
    the vocabulary) name that field, not the prompt; the server keeps serving."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256, skip_tokenizer_init=True))
    state = build_state(engine, str(tiny_llama), ["m"])
    good = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}
    with TestClient(build_app(state)) as client:
        for extra, param in (({"stop": ["x"]}, "stop"), ({"bad_words": ["x"]}, "bad_words"),
                             ({"logit_bias": {"100000": 1.0}}, "logit_bias"),
                             ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
                             ({"prompt": [5, 100000]}, "prompt")):
            r = client.post("/v1/completions", json={**good, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert client.post("/v1/completions", json=good).status_code == 200


def _server_app(tiny_llama, trust_request_chat_template: bool = False, **options):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    return build_app(build_state(engine, str(tiny_llama), ["m"], api_key="k",
                                 trust_request_chat_template=trust_request_chat_template), **options)


def test_text_that_is_no_unicode_is_a_400_naming_the_field(tiny_llama):
    """A lone surrogate is valid JSON ("\\ud800") but no text a tokenizer takes: a 400 naming the
    field (it was a 500 with a plain-text body), in every body that carries text."""
    auth = {"Authorization": "Bearer k"}
    with TestClient(_server_app(tiny_llama)) as client:
        for path, body, param in (
                ("/v1/completions", {"model": "m", "prompt": "\ud800 hi"}, "prompt"),
                ("/v1/completions", {"model": "m", "prompt": ["ok", "\udfff"], "stream": True}, "prompt"),
                ("/v1/completions", {"model": "m", "prompt": "hi", "bad_words": ["\ud800x"]}, "bad_words"),
                ("/v1/completions", {"model": "m", "prompt": "hi", "stop": ["\ud800"]}, "stop"),
                ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]},
                 "messages"),
                ("/tokenize", {"prompt": "\ud800"}, "prompt")):
            # (Escaped as JSON sends it: the raw character cannot even be encoded as UTF-8.)
            r = client.post(path, content=json.dumps(body), headers={**auth, "Content-Type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param and "lone surrogate" in r.json()["error"]["message"], r.text
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):   # curl -d's form encoding: a 415
            r = client.post(path, content='{"model": "m", "prompt": "hi"}', headers={
                **auth, "Content-Type": "application/x-www-form-urlencoded"})
            assert r.status_code == 415 and r.json()["error"]["type"] == "UnsupportedMediaTypeError", r.text
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, "priority": 3},
                        headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                           headers=auth).status_code == 200


def test_cors_and_internal_errors_as_json(tiny_llama):
    from vllm_spec.entrypoints.openai import api_server

    cors = api_server.CorsOptions(allowed_origins=["https://ui.example"])
    with TestClient(_server_app(tiny_llama, cors=cors), raise_server_exceptions=False) as client:
        # A browser's preflight is answered before the API key is asked for.
        pre = client.options("/v1/chat/completions", headers={
            "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ui.example"
        r = client.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ui.example"
        other = client.get("/health", headers={"Origin": "https://x.example"})
        assert "access-control-allow-origin" not in other.headers
        # An unexpected failure is still an OpenAI-style JSON error.
        def boom():
            raise RuntimeError("boom")

        client.app.add_api_route("/boom", boom)
        r = client.get("/boom")
        assert r.status_code == 500 and r.json()["error"]["message"] == "Internal server error: RuntimeError: boom"


def test_tools_with_tool_choice_none_are_rendered_by_the_template(tiny_llama):
    """As vLLM's server without auto tool choice: tools with tool_choice "none" reach the chat template
    ("required" and a named tool too: structured outputs force their calls); tools without tool_choice
    (vLLM's default "auto"), or tool_choice without tools: 400."""
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[-1]['content'] }}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    auth = {"Authorization": "Bearer k"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": template}
    with TestClient(_server_app(tiny_llama, trust_request_chat_template=True)) as client:
        tok = client.app.state.server.tokenizer
        r = client.post("/v1/chat/completions", json={**chat, "tools": tools, "tool_choice": "none"}, headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok("[f]hi", add_special_tokens=False).input_ids)
        shown = client.post("/tokenize", json={"messages": chat["messages"], "tools": tools,
                                               "chat_template": template}).json()["tokens"]
        assert shown == tok("[f]hi", add_special_tokens=False).input_ids
        for forced in ("required", {"type": "function", "function": {"name": "f"}}):
            r = client.post("/v1/chat/completions", json={**chat, "tools": tools, "tool_choice": forced}, headers=auth)
            assert r.status_code == 200, r.text
        for extra in ({"tools": tools}, {"tool_choice": "auto"}):
            r = client.post("/v1/chat/completions", json={**chat, **extra}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", (extra, r.text)


def test_the_api_key_is_asked_for_under_a_root_path():
    """uvicorn's --root-path prefixes every request's path: /api/v1/models is the /v1 route, and needs the key."""
    import asyncio

    from vllm_spec.entrypoints.openai.api_server import APIKeyMiddleware

    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    middleware = APIKeyMiddleware(app, api_keys=["k"])
    for path, root in (("/api/v1/models", "/api"), ("/v1/models", "")):
        scope = {"type": "http", "method": "GET", "path": path, "root_path": root, "headers": []}
        asyncio.run(middleware(scope, receive, send))
    assert reached == [] and [m["status"] for m in sent if m["type"] == "http.response.start"] == [401, 401]
    asyncio.run(middleware({"type": "http", "method": "GET", "path": "/api/health", "root_path": "/api",
                            "headers": []}, receive, send))
    assert reached == ["/api/health"]


def test_prompt_tokens_details_report_prefix_cache_hits(tiny_llama):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, streamed usage too;
    without it the field is null, as vLLM's."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256, enable_prefix_caching=True))
    prompt = list(range(5, 45))   # 40 tokens: 2 full blocks of 16 before the last token
    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
    with TestClient(build_app(build_state(engine, str(tiny_llama), ["m"], enable_prompt_tokens_details=True))) as client:
        first = client.post("/v1/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        again = client.post("/v1/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        stream = client.post("/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    with TestClient(build_app(build_state(engine, str(tiny_llama), ["m"]))) as client:
        assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"] is None


def test_request_chat_templates_need_the_servers_trust(tiny_llama):
    """As vLLM: a request's own chat template (code the server would run) is refused unless the server
    runs with --trust-request-chat-template; the server's template still serves such requests."""
    auth = {"Authorization": "Bearer k"}
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(_server_app(tiny_llama)) as client:
        for path, extra in (("/v1/chat/completions", {"chat_template": "{{ 1 }}"}),
                            ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
                            ("/tokenize", {"chat_template": "{{ 1 }}"})):
            r = client.post(path, json={"model": "m", "messages": messages, "max_tokens": 1, **extra}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", (path, r.text)
            assert "--trust-request-chat-template" in r.json()["error"]["message"]
        ok = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 1},
                         headers=auth)
        assert ok.status_code == 200, ok.text


def test_tokenizing_runs_off_the_event_loop(tiny_llama, monkeypatch):
    """Prompts are tokenized (and chat templates rendered) in the server's tokenizer thread: a slow one
    leaves /health (and every stream) served meanwhile."""
    import threading
    import time

    from vllm_spec.entrypoints.openai import serving_completion

    slow_started, threads = threading.Event(), []
    real = serving_completion._completion_prompts

    def slow(state, request):
        threads.append(threading.current_thread().name)
        slow_started.set()
        time.sleep(1.5)
        return real(state, request)

    monkeypatch.setattr(serving_completion, "_completion_prompts", slow)
    auth = {"Authorization": "Bearer k"}
    with TestClient(_server_app(tiny_llama)) as client:
        done = {}
        worker = threading.Thread(target=lambda: done.update(r=client.post(
            "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 1}, headers=auth)))
        worker.start()
        assert slow_started.wait(10)
        t = time.perf_counter()
        assert client.get("/health").status_code == 200
        assert time.perf_counter() - t < 1.0
        worker.join(20)
        assert done["r"].status_code == 200
    assert threads == ["tokenizer_0"]


def test_length_errors_name_the_field_sent_and_usage_streams_as_vllm(tiny_llama):
    auth = {"Authorization": "Bearer k"}
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(_server_app(tiny_llama)) as client:
        for field in ("max_tokens", "max_completion_tokens"):
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, field: 10_000},
                            headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert r.json()["error"]["message"].startswith(
                "'max_tokens' or 'max_completion_tokens' is too large: 10000. This model's maximum context length "
                "is 256 tokens and your request has "), r.text
        # As vLLM: stream_options {} asks for no usage (include_usage defaults to false); chunks leave
        # unset fields out (no "usage": null).
        r = client.post("/v1/completions", headers=auth, json={"model": "m", "prompt": "hello", "max_tokens": 3,
                                                               "stream": True, "stream_options": {}})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert chunks and all("usage" not in c and set(c["choices"][0]) == {"index", "text", "logprobs",
                                                                              "finish_reason", "stop_reason"}
                              for c in chunks), chunks
        # As vLLM: continuous usage statistics only with include_usage on.
        for include, expected in ((False, 0), (True, None)):
            r = client.post("/v1/completions", headers=auth, json={
                "model": "m", "prompt": "hello", "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": include, "continuous_usage_stats": True}})
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            with_usage = sum(1 for c in chunks if c.get("usage"))
            assert with_usage == (len(chunks) if expected is None else expected), chunks
        # As vLLM: each chunk's usage is its own choice's (its prompt, its tokens so far); the last, the totals.
        prompts = ["hello", "a somewhat longer prompt"]
        lengths = [len(client.post("/tokenize", json={"model": "m", "prompt": p}, headers=auth).json()["tokens"])
                   for p in prompts]
        r = client.post("/v1/completions", headers=auth, json={
            "model": "m", "prompt": prompts, "n": 2, "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        seen = {}
        for c in chunks[:-1]:
            (choice,), usage = c["choices"], c["usage"]
            assert usage["prompt_tokens"] == lengths[choice["index"] // 2], c
            assert usage["completion_tokens"] >= seen.get(choice["index"], 0), c
            seen[choice["index"]] = usage["completion_tokens"]
        assert seen == {0: 3, 1: 3, 2: 3, 3: 3}
        assert chunks[-1]["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 12,
                                       "total_tokens": sum(lengths) + 12, "prompt_tokens_details": None}


def test_request_priority_with_the_priority_policy(tiny_llama):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256, scheduling_policy="priority"))
    with TestClient(build_app(build_state(engine, str(tiny_llama), ["m"]))) as client:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = client.post(path, json={"model": "m", "max_tokens": 2, "priority": -3, **body})
            assert r.status_code == 200, r.text
            r = client.post(path, json={"model": "m", "max_tokens": 2, "priority": 1.5, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def test_docs_request_id_headers_and_request_log(tiny_llama, caplog):
    """--disable-fastapi-docs, --enable-request-id-headers, --enable-log-requests with --max-log-len."""
    with TestClient(_server_app(tiny_llama)) as client:
        assert client.get("/openapi.json").status_code == 200 and client.get("/docs").status_code == 200
        assert "X-Request-Id" not in client.get("/health").headers
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    state = build_state(engine, str(tiny_llama), ["m"], log_requests=True, max_log_len=4)
    with TestClient(build_app(state, docs=False, request_id_headers=True)) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 404, path
        assert client.get("/health", headers={"X-Request-Id": "abc"}).headers["X-Request-Id"] == "abc"
        with caplog.at_level("INFO", logger="vllm_spec.api_server"):
            r = client.post("/v1/completions", json={"model": "m", "prompt": "hello world", "max_tokens": 2})
        assert r.status_code == 200 and len(r.headers["X-Request-Id"]) == 32
    logged = [rec.getMessage() for rec in caplog.records if "Received request" in rec.getMessage()]
    assert len(logged) == 1 and "'hell'" in logged[0] and "hello" not in logged[0] and "max_tokens=2" in logged[0]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_side_abort_is_the_servers_503_not_a_partial_answer(tiny_llama, stream):
    """The engine ends an aborted request's stream with its last output (finish_reason "abort", as vLLM's);
    the server answers such a request (a shutdown's abort) with its 503, not with what it had so far."""
    import concurrent.futures
    import time

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    body = {"model": "m", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": stream}
    with TestClient(build_app(build_state(engine, str(tiny_llama), ["m"]))) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/v1/completions", json=body)
        for _ in range(500):   # until the request runs in the engine
            if engine.engine.requests:
                break
            time.sleep(0.01)
        assert engine.engine.requests
        engine._loop.call_soon_threadsafe(engine.abort_nowait, list(engine.engine.requests))
        r = pending.result(60)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == 503 and "aborted" in events[-1]["error"]["message"], r.text
        assert all(c["finish_reason"] != "abort" for e in events[:-1] for c in e["choices"])
    else:
        assert r.status_code == 503 and "aborted" in r.json()["error"]["message"], r.text
