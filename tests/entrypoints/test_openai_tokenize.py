"""vLLM's /tokenize, /detokenize and /ping on the server."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .openai_server_helpers import MESSAGES, MODEL_NAME, PROMPTS, _post


def test_tokenize_detokenize_round_trip(server):
    tok = server.llm.get_tokenizer()
    r = _post(server, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPTS[0], "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok(PROMPTS[0]).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    back = _post(server, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tok.decode(body["tokens"])
    # A conversation is tokenized as the chat endpoint renders it.
    chat = _post(server, "/tokenize", {"messages": MESSAGES[1]}).json()
    text = tok.apply_chat_template(MESSAGES[1], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(text, add_special_tokens=False).input_ids


def test_tokenize_errors_and_ping(server):
    assert _post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert _post(server, "/tokenize", {"model": MODEL_NAME}).status_code == 400
    bad = _post(server, "/detokenize", {"tokens": [1, 10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=10).status_code == 200
