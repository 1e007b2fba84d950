"""use_beam_search on the server (vLLM's extra): n beams per prompt as n choices, the offline beam
search's beams, streamed or whole; what beam search cannot honour is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from vllm_spec.sampling_params import BeamSearchParams

from .openai_server_helpers import AUTH, MESSAGES, MODEL_NAME, PROMPTS, _post, _sse_events, _wait_all_blocks_free

BEAM = {"use_beam_search": True, "n": 3, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _offline_texts(server, prompts: list[str]) -> list[str]:
    """Each prompt's beams' new text, best first, from the offline LLM on the same target."""
    llm = server.llm
    tok = llm.get_tokenizer()
    outs = llm.beam_search([{"prompt": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=4,
                                                                               ignore_eos=True))
    return [tok.decode(b.tokens[len(tok(p).input_ids):]) for p, o in zip(prompts, outs) for b in o.sequences]


def test_completions_return_the_beams_as_choices(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[:2], **BEAM}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["text"] for c in choices] == _offline_texts(server, PROMPTS[:2])
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 6 * 4
    # Streamed: one chunk per beam with its whole text, then [DONE].
    with httpx.Client(base_url=server.url, timeout=60.0) as client, \
            client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=AUTH) as s:
        assert s.status_code == 200
        events = _sse_events(s.iter_lines())
    assert events[-1] == "[DONE]"
    streamed = {}
    for event in events[:-1]:
        for c in event["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[i] for i in range(6)] == [c["text"] for c in choices]
    _wait_all_blocks_free(server)


def test_chat_returns_the_beams_as_choices(server):
    r = _post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES[0], **BEAM, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in choices)
    assert choices[0]["message"]["content"] != choices[1]["message"]["content"]
    assert r.json()["usage"]["completion_tokens"] == 2 * 4


@pytest.mark.parametrize("extra, param", [
    ({"n": 11}, "n"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"echo": True, "logprobs": 1}, "use_beam_search"),
])
def test_what_beam_search_cannot_honour_is_named(server, extra, param):
    r = _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPTS[0], **BEAM, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_client_gone_mid_search_frees_its_beams(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES[0], **BEAM, "max_tokens": 300, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60.0) as client, \
            client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as s:
        assert s.status_code == 200
        next(s.iter_lines())   # the opening chunk: the search runs; then the client leaves
    _wait_all_blocks_free(server)


def test_a_non_finite_length_penalty_is_named(server):
    """JSON's NaN (which the server's parser takes) is a 400 naming the field, not an internal error."""
    body = '{"model": "%s", "prompt": "hi", "use_beam_search": true, "n": 2, "max_tokens": 2, "length_penalty": NaN}'
    r = httpx.post(server.url + "/v1/completions", content=body % MODEL_NAME,
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60.0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
