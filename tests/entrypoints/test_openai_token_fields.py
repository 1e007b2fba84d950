"""vLLM's token-level request extras on the server, in process: prompt_logprobs, return_token_ids,
return_tokens_as_token_ids (and its server flag), chat echo, and the model cards' permission list."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from vllm_spec.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_spec.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from vllm_spec.entrypoints.llm import LLM  # noqa: E402
from vllm_spec.entrypoints.openai.api_server import build_app, build_state  # noqa: E402
from vllm_spec.sampling_params import SamplingParams  # noqa: E402

PROMPT = "the quick brown fox"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def app(tiny_llama):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    state = build_state(engine, str(tiny_llama), ["m"], chat_template=TEMPLATE)
    with TestClient(build_app(state)) as client:
        yield client, state


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=256)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_prompt_logprobs_match_the_offline_api(app, offline):
    client, state = app
    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
                           use_tqdm=False)[0]
    body = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                "prompt_logprobs": 2}).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for pos, (entry, want) in enumerate(zip(got[1:], ref.prompt_logprobs[1:]), start=1):
        assert {int(t) for t in entry} == set(want), pos
        # The prompt's own token is always there (whatever its rank), with the top 2 besides.
        assert str(ref.prompt_token_ids[pos]) in entry
        assert {v["rank"] for v in entry.values()} >= {1, 2}
        for tid, lp in want.items():
            info = entry[str(tid)]
            assert math.isclose(info["logprob"], max(lp.logprob, -9999.0), rel_tol=1e-5, abs_tol=1e-5)
            assert info["rank"] == lp.rank
            assert info["decoded_token"] == state.tokenizer.decode([tid])
    assert body["choices"][0]["text"] == ref.outputs[0].text
    # Without the field: no prompt logprobs (the key is null, as vLLM's).
    plain = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None

    # Chat: at the response's top level, one entry per rendered prompt token.
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2,
                                                     "prompt_logprobs": 0}).json()
    rendered = state.tokenizer(f"<user>{PROMPT}", add_special_tokens=False).input_ids
    assert len(chat["prompt_logprobs"]) == len(rendered) and chat["prompt_logprobs"][0] is None
    assert all(list(e) == [str(t)] for e, t in zip(chat["prompt_logprobs"][1:], rendered[1:]))


def test_prompt_logprobs_refusals_name_the_field(app):
    client, _ = app
    good = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
    chat_good = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body, param in (
            ("/v1/completions", {**good, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
            ("/v1/chat/completions", {**chat_good, "prompt_logprobs": 3, "stream": True}, "prompt_logprobs"),
            ("/v1/completions", {**good, "prompt_logprobs": 21}, "prompt_logprobs"),
            ("/v1/chat/completions", {**chat_good, "prompt_logprobs": -2}, "prompt_logprobs"),
            ("/v1/completions", {**good, "prompt_logprobs": 1, "use_beam_search": True, "n": 2}, "use_beam_search")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    # prompt_logprobs 0 with a stream is accepted (vLLM's rule): the stream carries none.
    r = client.post("/v1/completions", json={**good, "prompt_logprobs": 0, "stream": True})
    assert r.status_code == 200 and all("prompt_logprobs" not in e["choices"][0] for e in _events(r.text))
    # An echo with logprobs still scores its prompt by logprobs (the field named is logprobs).
    r = client.post("/v1/completions", json={**good, "echo": True, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_return_token_ids_whole_and_streamed(app, offline):
    client, state = app
    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == ref.prompt_token_ids
    assert choice["token_ids"] == list(ref.outputs[0].token_ids)
    # A stream: the prompt's ids in the choice's first chunk, then each chunk's new tokens.
    events = _events(client.post("/v1/completions", json={**body, "stream": True}).text)
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert choices[0]["prompt_token_ids"] == ref.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in choices[1:])   # (as vLLM: unset fields left out)
    assert sum((c["token_ids"] for c in choices), []) == list(ref.outputs[0].token_ids)
    # Tokens that add no text (here a special token, skipped in the text) still stream their ids.
    eos = state.tokenizer.eos_token_id
    events = _events(client.post("/v1/completions", json={**body, "stream": True,
                                                          "logit_bias": {str(eos): 100}}).text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ""
    assert sum((e["choices"][0]["token_ids"] for e in events if e["choices"]), []) == [eos] * 5
    # Two prompts and n=2, streamed: each choice's first chunk has its prompt's ids.
    two = ["one two three", PROMPT]
    events = _events(client.post("/v1/completions", json={**body, "prompt": two, "n": 2, "temperature": 1.0, "stream": True}).text)
    for idx in range(4):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == idx]
        assert mine[0]["prompt_token_ids"] == state.tokenizer(two[idx // 2]).input_ids
        assert all("prompt_token_ids" not in c for c in mine[1:]) and len(sum((c["token_ids"] for c in mine), [])) == 5
    # Not asked: no ids.
    plain = client.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None

    messages = [{"role": "user", "content": PROMPT}]
    rendered = state.tokenizer(f"<user>{PROMPT}", add_special_tokens=False).input_ids
    chat = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True,
            "return_token_ids": True, "n": 2}
    whole = client.post("/v1/chat/completions", json=chat).json()
    assert whole["prompt_token_ids"] == rendered
    assert [len(c["token_ids"]) for c in whole["choices"]] == [4, 4]
    events = _events(client.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    # The role chunks (one per choice) carry the prompt's ids; later chunks do not.
    assert [e["prompt_token_ids"] for e in events[:2]] == [rendered, rendered]
    assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in events[:2])
    assert all("prompt_token_ids" not in e for e in events[2:])   # (as vLLM: unset fields left out)
    assert all("token_ids" not in e["choices"][0] for e in events[:2])
    for idx in (0, 1):
        streamed = sum((c["token_ids"] for e in events for c in e["choices"] if c["index"] == idx
                        and "token_ids" in c), [])
        assert streamed == whole["choices"][idx]["token_ids"]


def test_tokens_as_token_ids_in_both_logprob_formats(app, tiny_llama):
    client, _ = app
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    # As vLLM: the prompt comes back as ids, so echo adds no text before the completion's.
    no_echo = client.post("/v1/completions", json={**body, "echo": False}).json()["choices"][0]
    assert choice["text"] == no_echo["text"] and choice["token_ids"] == no_echo["token_ids"]
    lps = choice["logprobs"]
    assert lps["tokens"] == [f"token_id:{t}" for t in ids]
    # Text offsets count the names as written, as vLLM's.
    assert lps["text_offset"] == [sum(len(f"token_id:{t}") for t in ids[:i]) for i in range(len(ids))]
    assert all(k.startswith("token_id:") for top in lps["top_logprobs"][1:] for k in top)
    chat = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0,
        "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(t["token"].startswith("token_id:") and t["bytes"] == list(t["token"].encode())
               for c in content for t in c["top_logprobs"])

    # The server's flag makes it the default; a request may still turn it off.
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    flagged = build_state(engine, str(tiny_llama), ["m"], return_tokens_as_token_ids=True)
    with TestClient(build_app(flagged)) as other:
        plain = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 1}
        tokens = other.post("/v1/completions", json=plain).json()["choices"][0]["logprobs"]["tokens"]
        assert all(t.startswith("token_id:") for t in tokens)
        off = other.post("/v1/completions", json={**plain, "return_tokens_as_token_ids": False}).json()
        assert not any(t.startswith("token_id:") for t in off["choices"][0]["logprobs"]["tokens"])


def test_chat_echo_prepends_the_continued_message(app, offline):
    client, _ = app
    prefix = "Once upon"
    messages = [{"role": "user", "content": "tell a story"}, {"role": "assistant", "content": prefix}]
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    whole = client.post("/v1/chat/completions", json={**body, "echo": True}).json()
    echoed = whole["choices"][0]["message"]
    # The generated message continues the last one: its role, and with echo its content first.
    assert plain["role"] == echoed["role"] == "assistant"
    assert echoed["content"] == prefix + plain["content"]
    # As vLLM: an echo also scores the prompt (with top_logprobs alternatives, none here).
    assert whole["prompt_logprobs"][0] is None and all(len(e) == 1 for e in whole["prompt_logprobs"][1:])
    r = client.post("/v1/chat/completions", json={**body, "echo": True, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    events = _events(client.post("/v1/chat/completions", json={**body, "echo": True, "stream": True}).text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": prefix}
    assert "".join(d.get("content", "") for d in deltas) == echoed["content"]
    # Text parts join with newlines, as vLLM's.
    parts = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    r = client.post("/v1/chat/completions", json={**body, "messages": parts, "echo": True, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("a\nb"), r.text
    # A new assistant message (the usual request) has nothing of the same role to echo.
    fresh = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
             "ignore_eos": True}
    assert client.post("/v1/chat/completions", json={**fresh, "echo": True}).json()["choices"][0]["message"] == \
        client.post("/v1/chat/completions", json=fresh).json()["choices"][0]["message"]


def test_model_cards_carry_a_permission_list(app):
    client, _ = app
    card = client.get("/v1/models").json()["data"][0]
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert perm["allow_sampling"] and perm["allow_logprobs"] and not perm["allow_fine_tuning"]
    assert perm["organization"] == "*"
