"""Tool calls (hermes format) parsed out of generated text, whole and streamed, and served by
/v1/chat/completions with --enable-auto-tool-choice --tool-call-parser hermes."""

from __future__ import annotations

import json
import random

import pytest

from vllm_spec.entrypoints.openai.tool_calls import ParsedCall, ToolCallStream, read_tool_calls


def extract_tool_calls(text: str):
    return read_tool_calls(ToolCallStream(), text)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TIME = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
CALLS = [ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}'), ParsedCall("now", "{}", index=1)]


@pytest.mark.parametrize("text, expected", [
    ("Just text.", ("Just text.", [])),
    (WEATHER, (None, CALLS[:1])),
    ("Let me check. " + WEATHER + "\n" + TIME, ("Let me check.", CALLS)),   # the text outside calls, trimmed
    (WEATHER + "\n" + TIME[:-len("</tool_call>")], (None, CALLS)),        # an unclosed last call
    (WEATHER + '\n<tool_call>\n{"name": "now", "argu', ('\n<tool_call>\n{"name": "now", "argu', CALLS[:1])),
    ("Fine.\n\n", ("Fine.\n\n", [])),                                    # no calls: the text as it is
    ('<tool_call>{"name": broken}</tool_call>', ('<tool_call>{"name": broken}</tool_call>', [])),
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', (None, [ParsedCall("f", '{"x": 1}')])),
])
def test_whole_texts_calls(text, expected):
    assert extract_tool_calls(text) == expected


def _stream(text: str, cuts: list[int]) -> tuple[str, list[ParsedCall]]:
    parser, content, calls = ToolCallStream(), "", []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        got, found = parser.feed(text[a:b])
        content, calls = content + got, calls + found
    rest, last = parser.finish()
    return content + rest, calls + last


@pytest.mark.parametrize("text", [
    "Just text with a < sign and <tool", "Let me check. " + WEATHER + "\n" + TIME,
    WEATHER + '\n<tool_call>\n{"name": "now", "argu',
    WEATHER + " and then " + TIME + " done", WEATHER + "\n" + TIME[:-len("</tool_call>")],
    '<tool_call>{"name": broken}</tool_call> after',
])
def test_streamed_calls_are_the_whole_texts_calls(text):
    """Fed in random pieces (tags split anywhere), the stream finds what extract_tool_calls finds in the whole
    text: the same calls and the same content (a client sees the same answer streamed or not)."""
    rng = random.Random(0)
    whole_content, whole_calls = extract_tool_calls(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
        content, calls = _stream(text, cuts)
        assert calls == whole_calls
        assert (content if content.strip() else None) == whole_content


# The server -----------------------------------------------------------------------------------------
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from vllm_spec.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_spec.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from vllm_spec.engine.async_stream import AsyncStream  # noqa: E402
from vllm_spec.entrypoints.openai.api_server import build_app, build_state  # noqa: E402
from vllm_spec.outputs import CompletionOutput, RequestOutput  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
SCRIPT = "Let me check. " + WEATHER + TIME


@pytest.fixture
def client(tiny_llama, monkeypatch):
    """A server whose engine 'generates' SCRIPT in pieces (a tiny random model cannot write a call)."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))

    async def scripted(request_id, prompt, params, **kwargs):
        stream = AsyncStream(request_id, coalesce=False)   # every piece reaches the server
        cuts = [0, 5, 21, 40, 77, 101, len(SCRIPT)]
        for i, end in enumerate(cuts[1:], 1):
            done = end == len(SCRIPT)
            stream.put(RequestOutput(request_id, None, [1, 2], [CompletionOutput(
                0, SCRIPT[:end], list(range(i)), None, None, "stop" if done else None)], done))
        stream.finish()
        return stream

    monkeypatch.setattr(engine, "add_request", scripted)
    state = build_state(engine, str(tiny_llama), ["m"], tool_call_parser="hermes")
    with TestClient(build_app(state)) as c:
        yield c


def test_server_returns_tool_calls(client):
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "C"}), ("function", "now", {})]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # tool_choice "none": the text as it is.
    plain = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": SCRIPT, "tool_calls": []}
    assert plain["finish_reason"] == "stop"


def test_server_streams_tool_calls(client):
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "stream": True}
    r = client.post("/v1/chat/completions", json=body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "now")]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)   # whole calls
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert r.text.rstrip().endswith("data: [DONE]")


def test_tool_choice_needs_the_parser(tiny_llama):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 1}
    with TestClient(build_app(build_state(engine, str(tiny_llama), ["m"]))) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                        max_model_len=256))
    with TestClient(build_app(build_state(engine, str(tiny_llama), ["m"], tool_call_parser="hermes"))) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200


def test_serve_refuses_auto_tool_choice_without_a_parser(capsys):
    from vllm_spec.entrypoints import cli
    from vllm_spec.entrypoints.openai.cli_args import serve_main

    ns = cli.make_parser().parse_args(["serve", "M", "--enable-auto-tool-choice"])
    assert serve_main(ns) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    ns = cli.make_parser().parse_args(["serve", "M", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser) == (True, "hermes")


@pytest.mark.parametrize("tools", [[{"type": "function"}], [{"type": "retrieval", "function": {"name": "x"}}],
                                   [{"type": "function", "function": {"description": "no name"}}],
                                   [{"type": "function", "function": {"name": 123}}]])
def test_malformed_tools_are_a_400(client, tools):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "tools": tools, "tool_choice": "none"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_tool_call_arguments_in_the_history_reach_the_template_as_objects(tiny_llama):
    """OpenAI sends an assistant message's tool call arguments as JSON text: as vLLM, the template gets
    them parsed (else it renders a quoted string); text that is no JSON is a 400 naming messages."""
    from vllm_spec import LLM, SamplingParams

    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}"
                "{% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24)
    out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                   add_generation_prompt=False)
    assert out[0].prompt == '{"city": "Paris"}'
    bad = [messages[0], {**messages[1], "tool_calls": [{"function": {"name": "w", "arguments": "{not json"}}]}]
    with pytest.raises(ValueError, match="tool call arguments must be JSON"):
        llm.chat(bad, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template)


def test_no_empty_chunks_while_a_call_is_written(client):
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "stream": True}
    r = client.post("/v1/chat/completions", json=body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    # The role chunk, then only chunks that carry something: content, a call, or the finish.
    for e in events[1:]:
        choice = e["choices"][0]
        assert choice["delta"] or choice["finish_reason"], e
