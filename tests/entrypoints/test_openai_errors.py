"""Error paths: 400 on bad inputs, 401 without the key, JSON 404s; AsyncLLMEngine's failing step, bad request, abort."""

from __future__ import annotations

import asyncio

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from vllm_spec.sampling_params import SamplingParams

from .openai_server_helpers import AUTH, MAX_TOKENS, MESSAGES, MODEL_NAME, PROMPTS, _post, _wait_all_blocks_free


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


# Errors -------------------------------------------------------------------------------------------------
def test_bad_inputs_get_400_and_server_keeps_serving(server):
    good = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat_good = {"model": MODEL_NAME, "messages": MESSAGES[0], "max_tokens": 3}
    cases = [
        ("/v1/completions", b'{"prompt": "hi", ', "raw", None),
        ("/v1/completions", b"not json at all", "raw", None),
        ("/v1/chat/completions", b'{"messages": [', "raw", None),
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
        ("/v1/completions", {**good, "stop_token_ids": [100000]}, "json", "stop_token_ids"),
        ("/v1/completions", {**good, "n": 2}, "json", "n"),   # greedy (temperature 0) takes n = 1, as vLLM
        ("/v1/chat/completions", {**chat_good, "n": 2, "temperature": 0}, "json", "n"),
        ("/v1/completions", {**good, "temperature": 2.5}, "json", "temperature"),
        ("/v1/completions", {**good, "seed": 1 << 63}, "json", "seed"),
        ("/v1/completions", {**good, "seed": -(1 << 63) - 1}, "json", "seed"),
        ("/v1/completions", {**good, "prompt_embeds": "AAAA"}, "json", "prompt_embeds"),
        ("/v1/chat/completions", {**chat_good, "logprobs": True, "top_logprobs": 21}, "json", "top_logprobs"),
        ("/v1/completions", {**good, "temperature": "hot"}, "json", "temperature"),
        ("/v1/completions", {**good, "prompt": "hello " * 600}, "json", "prompt"),
        ("/v1/completions", {**good, "max_tokens": 510}, "json", "max_tokens"),
        ("/v1/completions", {**good, "prompt": [1, 2, 100000]}, "json", "prompt"),
        ("/v1/completions", {**good, "n": 1_000_000_000}, "json", "n"),   # held up the engine's thread
        ("/v1/completions", {**good, "logit_bias": {"100000": 5}}, "json", "logit_bias"),
        ("/v1/completions", {**good, "logit_bias": {"x": 5}}, "json", "logit_bias"),
        ("/v1/completions", {**good, "allowed_token_ids": [1, 100000]}, "json", "allowed_token_ids"),
        ("/v1/completions", {**good, "allowed_token_ids": [True]}, "json", "allowed_token_ids"),
        ("/v1/completions", {**good, "allowed_token_ids": ["60"]}, "json", "allowed_token_ids"),
        ("/v1/completions", {**good, "logit_bias": {"5": True}}, "json", "logit_bias"),
        ("/v1/completions", {**good, "logit_bias": {"5": "100"}}, "json", "logit_bias"),
        ("/v1/chat/completions", {**chat_good, "allowed_token_ids": []}, "json", "allowed_token_ids"),
        ("/v1/chat/completions", {**chat_good, "logprobs": True, "top_logprobs": 50}, "json", "top_logprobs"),
        ("/v1/chat/completions", {**chat_good, "max_completion_tokens": 0}, "json", "max_completion_tokens"),
        ("/v1/completions", {**good, "prompt": ""}, "json", "prompt"),
        ("/v1/completions", {"model": MODEL_NAME}, "json", "prompt"),
        ("/v1/chat/completions", {**chat_good, "messages": []}, "json", "messages"),
        ("/v1/chat/completions", {**chat_good, "top_logprobs": 2}, "json", "top_logprobs"),
        ("/v1/completions", {**good, "vllm_xargs": {"synthetic_acceptance_rate": 2}}, "json", "vllm_xargs"),
        ("/v1/chat/completions", {**chat_good, "messages": [{"role": "user", "content": "x " * 600}]}, "json",
         "messages"),
        # vLLM's extras that would change the output and are not implemented: named, never ignored.
        # Structured outputs: a bad constraint is named by the field it came in.
        ("/v1/completions", {**good, "guided_json": "{not json"}, "json", "guided_json"),
        ("/v1/completions", {**good, "response_format": {"type": "xml"}}, "json", "response_format"),
        ("/v1/completions", {**good, "response_format": {"type": "json_schema"}}, "json", "response_format"),
        ("/v1/completions", {**good, "response_format": {"type": "json_object"}, "guided_regex": "a"}, "json",
         "guided_regex"),
        ("/v1/completions", {**good, "structured_outputs": {"regex": "(unclosed"}}, "json", "structured_outputs"),
        ("/v1/completions", {**good, "structured_outputs": {"json": {"type": "no-such-type"}}}, "json",
         "structured_outputs"),
        ("/v1/completions", {**good, "structured_outputs": {"choice": []}}, "json", "structured_outputs"),
        ("/v1/completions", {**good, "structured_outputs": {"pattern": "a"}}, "json", "structured_outputs"),
        ("/v1/completions", {**good, "guided_regex": "(unclosed"}, "json", "guided_regex"),
        ("/v1/chat/completions", {**chat_good, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}}, "json", "response_format"),
        ("/v1/chat/completions", {**chat_good, "tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "no-such-type"}}}]}, "json", "tools"),
        ("/v1/completions", {**good, "response_format": {}}, "json", "response_format"),
        ("/v1/completions", {**good, "response_format": {"json_schema": {"name": "x", "schema": {}}}}, "json",
         "response_format"),
        ("/v1/completions", {**good, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "json", "response_format"),
        ("/v1/completions", {**good, "structured_outputs": {"disable_any_whitespace": True}}, "json",
         "structured_outputs"),
        ("/v1/completions", {**good, "guided_json": {"type": "array", "uniqueItems": True}}, "json", "guided_json"),
        ("/v1/completions", {**good, "prompt_logprobs": 1, "stream": True}, "json", "prompt_logprobs"),
        ("/v1/completions", {**good, "truncate_prompt_tokens": 100000}, "json", "truncate_prompt_tokens"),
        ("/v1/chat/completions", {**chat_good, "prompt_logprobs": 99}, "json", "prompt_logprobs"),
        ("/v1/completions", {**good, "bad_words": [" "]}, "json", "bad_words"),
        ("/v1/chat/completions", {**chat_good, "use_beam_search": True, "response_format": {"type": "json_object"}},
         "json", "use_beam_search"),
        ("/v1/chat/completions", {**chat_good, "structured_outputs": {"choice": ["a"], "regex": "a"}}, "json",
         "structured_outputs"),
        ("/v1/completions", {**good, "model": "no-such-model"}, "json", "model"),
        ("/v1/chat/completions", {**chat_good, "model": "no-such-model"}, "json", "model"),
    ]
    for path, body, kind, param in cases:
        if kind == "raw":
            r = httpx.post(server.url + path, content=body, timeout=30.0,
                           headers={**AUTH, "Content-Type": "application/json"})
        else:
            r = _post(server, path, body)
        # As vLLM: a model this server does not serve is not found (404), the rest is a bad request.
        _assert_error(r, 404 if param == "model" else 400, param)
        # ... and the next request is served.
        ok = _post(server, "/v1/completions", {**good, "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1, (body, ok.text)
    # Extras at values that change nothing, and unknown fields, are accepted.
    # As vLLM: the seed's 400 names pydantic's check; top_logprobs 0 without logprobs asks for nothing.
    r = _post(server, "/v1/completions", {**good, "seed": 1 << 63})
    assert "less_than_equal" in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/chat/completions", {**chat_good, "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = _post(server, "/v1/chat/completions", {**chat_good, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    for extra in ({"use_beam_search": False}, {"response_format": {"type": "text"}}, {"length_penalty": 1.0},
                  {"spaces_between_special_tokens": False}, {"some_future_field": 1}):
        assert _post(server, "/v1/completions", {**good, **extra}).status_code == 200, extra
    # truncate_prompt_tokens keeps the prompt's last tokens, before the length check.
    r = _post(server, "/v1/completions", {**good, "prompt": "hello " * 600, "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text
    # -1: the last max_model_len - 1 tokens, which leave no room for 4 more: as vLLM, a 400 naming
    # max_tokens (not the prompt), in vLLM's words, which clients parse.
    r = _post(server, "/v1/completions", {**good, "prompt": "hello " * 600, "truncate_prompt_tokens": -1,
                                          "max_tokens": 4})
    max_len = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert r.json()["error"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 4. This model's maximum context length is {max_len} "
        f"tokens and your request has {max_len - 1} input tokens (4 > {max_len} - {max_len - 1})."), r.text
    r = _post(server, "/v1/completions", {**good, "prompt": [5] * max_len, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["message"] == (
        f"This model's maximum context length is {max_len} tokens. However, your request has {max_len} input "
        "tokens. Please reduce the length of the input messages."), r.text
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
    from vllm_spec.engine.async_llm_engine import AsyncLLMEngine, EngineStepError

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
            real = engine.executor.launch

            def boom(*args, **kwargs):
                raise RuntimeError("injected failure")

            engine.executor.launch = boom
            try:
                async def consume(rid):
                    async for _ in aeng.generate(PROMPTS[0], params, rid):
                        pass

                results = await asyncio.gather(consume("f1"), consume("f2"), return_exceptions=True)
            finally:
                engine.executor.launch = real
            assert all(isinstance(r, EngineStepError) and "injected failure" in str(r) for r in results), results
            assert not engine.has_unfinished_requests()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
            last = None
            async for last in aeng.generate(PROMPTS[0], params, "ok"):
                pass
            assert last.finished and last.outputs[0].text == server.ref_text[PROMPTS[0]]
            # abort(): as vLLM's, the stream ends with a last output, finished "abort"; the blocks come back.
            long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
            stream = await aeng.add_request("ab", PROMPTS[1], long)
            got = []
            async for out in stream:
                got.append(out)
                await aeng.abort("ab")
            assert len(got) >= 2 and not got[-2].finished and got[-1].finished
            assert got[-1].outputs[0].finish_reason == "abort" and len(got[-1].outputs[0].token_ids) < 300
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
