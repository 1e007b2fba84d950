"""/v1/completions and /v1/chat/completions vs the offline greedy references: streaming, usage, stop, logprobs, n."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .openai_server_helpers import AUTH, MAX_TOKENS, MESSAGES, MODEL_NAME, PROMPTS, _post, _sse_events


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
    # continuous_usage_stats: every chunk carries usage, the opening (role) chunk too, as in vLLM.
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES[0], max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    assert chunks[0].usage.completion_tokens == 0 and chunks[0].usage.prompt_tokens > 0
    assert chunks[-1].usage.completion_tokens == 3


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


def _merged_logprobs(chunks) -> dict[str, list]:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            for key in merged:
                merged[key] += getattr(c.choices[0].logprobs, key)
    return merged


@pytest.mark.parametrize("prompt", [PROMPTS[6], "héllo wörld € 😀 done"])
@pytest.mark.parametrize("max_tokens", [0, 5])
def test_echo_with_logprobs_scores_the_prompt(server, max_tokens, prompt):
    """As vLLM (and lm-eval-harness's loglikelihood requests): echo with logprobs returns the prompt's
    token logprobs (the first token has none) before the completion's, text offsets running on
    across both (token texts need not add up to the prompt's: partial multi-byte characters); with
    max_tokens 0, the prompt alone. Streamed, the chunks add up to the same, the first carrying the
    prompt."""
    from vllm_spec import SamplingParams

    client = server.client()
    ids = server.llm.get_tokenizer()(prompt).input_ids
    offline = server.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max(max_tokens, 1),
                                                         prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    ref = offline.prompt_logprobs
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0,
              extra_body={"ignore_eos": True})
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    completion = offline.outputs[0].text if max_tokens else ""
    assert choice.text == prompt + completion and (max_tokens or choice.finish_reason == "length")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([ref[j][ids[j]].logprob for j in range(1, len(ids))],
                                                          abs=1e-4)
    # (Alternatives decoding to one text, as partial multi-byte characters do, share a key.)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]

    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[0].choices[0].text.startswith(prompt) and chunks[0].choices[0].logprobs.tokens[:len(ids)] == \
        lp.tokens[:len(ids)]
    merged = _merged_logprobs(chunks)
    assert merged == {key: getattr(lp, key) for key in merged}

    plain = client.completions.create(**{**kw, "logprobs": None}).choices[0]
    assert plain.text == choice.text and plain.logprobs is None


def test_echo_of_a_whole_context_and_of_bad_token_ids(server):
    """echo with max_tokens 0 asks for no completion: a prompt that fills the context but for one token
    is scored (the length check counts 0 tokens; the engine, as vLLM's, takes prompts shorter than the
    context). A token id the model does not have is a 400 naming the prompt with echo as without (it
    was decoded for the echo first: a 500)."""
    max_len = server.llm.llm_engine.config.model.max_model_len
    ids = [(7 * i) % 300 + 3 for i in range(max_len - 1)]
    resp = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                             "logprobs": 1})
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == max_len - 1 and lp["token_logprobs"][0] is None
    assert resp.json()["choices"][0]["text"] == server.llm.get_tokenizer().decode(ids)
    for echo in (False, True):
        bad = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": [5, -1], "max_tokens": 2, "echo": echo})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text


def test_logit_bias_allowed_token_ids_and_bad_words_match_offline(server):
    """OpenAI's logit_bias (string keys) and vLLM's allowed_token_ids extra reach the sampler as the
    offline API's SamplingParams do (the server speculates; the reference does not)."""
    from vllm_spec import SamplingParams

    client = server.client()
    allowed = list(range(10, 300, 7))
    bias = {"42": 8.0, "43": -100.0}
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                     logit_bias=bias, extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias, allowed_token_ids=allowed)
    ref = server.llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert resp.choices[0].text == ref.text != server.ref_text[PROMPTS[1]]
    assert set(ref.token_ids) <= set(allowed)

    # vLLM's bad_words extra: the words cut out of the reference never come back.
    words = [server.ref_text[PROMPTS[2]][:6]]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, "bad_words": words})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=words)
    assert resp.choices[0].text == server.llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].text
    assert resp.choices[0].text != server.ref_text[PROMPTS[2]]


def test_the_clients_request_id_names_the_response(server):
    """As vLLM: the X-Request-Id header (else the body's request_id) is the response's id after its prefix,
    streamed chunks too; an id reused while in flight still runs; a request_id that is no string is a 400."""
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    r = _post(server, "/v1/completions", body, headers={**AUTH, "X-Request-Id": "abc123"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-abc123"
    chat = {"model": MODEL_NAME, "messages": MESSAGES[0], "max_tokens": 2, "temperature": 0, "request_id": "myid"}
    assert _post(server, "/v1/chat/completions", chat).json()["id"] == "chatcmpl-myid"
    r = _post(server, "/v1/chat/completions", chat, headers={**AUTH, "X-Request-Id": "hdr"})
    assert r.json()["id"] == "chatcmpl-hdr"
    stream = _post(server, "/v1/completions", {**body, "stream": True, "request_id": "s1"})
    events = [e for e in _sse_events(stream.text.splitlines()) if e != "[DONE]"]
    assert events and {e["id"] for e in events} == {"cmpl-s1"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        same = list(pool.map(lambda _: _post(server, "/v1/completions", {**body, "n": 2, "temperature": 1.0},
                                             headers={**AUTH, "X-Request-Id": "dup"}), range(2)))
    assert [(r.status_code, r.json()["id"], len(r.json()["choices"])) for r in same] == [(200, "cmpl-dup", 2)] * 2
    bad = _post(server, "/v1/completions", {**body, "request_id": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    assert _post(server, "/v1/completions", body).json()["id"].startswith("cmpl-")
