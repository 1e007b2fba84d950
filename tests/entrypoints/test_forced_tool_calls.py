"""tool_choice "required" and a named function (vLLM's way: structured outputs constrain the output to
the calls' JSON, read back as tool calls), offline pieces and through the server."""

from __future__ import annotations

import json

import pytest

from vllm_spec.entrypoints.openai.forced_tool_calls import ForcedToolCalls, check_tool_choice, forced_constraint
from vllm_spec.entrypoints.openai.tool_calls import ParsedCall, read_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("name, text, expected", [
    ("get_weather", '{"unit": "C"}', (None, [ParsedCall("get_weather", '{"unit": "C"}')])),
    # cut by max_tokens: still the call's arguments, as vLLM's (streamed as they came)
    ("get_weather", '{"unit": ', (None, [ParsedCall("get_weather", '{"unit": ')])),
    ("get_weather", "", (None, [ParsedCall("get_weather", "")])),
    (None, '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"unit": "F"}}]',
     (None, [ParsedCall("now", "{}"), ParsedCall("get_weather", '{"unit": "F"}', 1)])),
    (None, '[{"parameters": {}}]', ('[{"parameters": {}}]', [])),
])
def test_forced_output_read_back_as_calls(name, text, expected):
    assert read_tool_calls(ForcedToolCalls(name), text) == expected
    streamed = ForcedToolCalls(name)
    pieces = [streamed.feed(text[i:i + 3]) for i in range(0, len(text), 3)]
    content, last = streamed.finish()
    assert all(piece_content == "" for piece_content, _ in pieces)
    found = [p for _, ps in pieces for p in ps] + last
    if name is None:   # "required": each call comes whole once its object closes
        assert (content or None, found) == expected and not last
    else:   # a named function's arguments stream as they come; the first piece names it
        assert [p.name for p in found] == [name] + [None] * (len(found) - 1)
        assert "".join(p.arguments for p in found) == text and {p.index for p in found} == {0}
    assert streamed.num_calls == len(expected[1])


def test_required_streams_each_call_as_its_object_closes():
    """A call of the list streams once its object closes, not when the choice ends; braces, brackets
    and escaped quotes inside strings do not close it; an output cut after a call keeps the call."""
    first = '[{"name": "get_weather", "parameters": {"unit": "C", "note": "a } ] \\" {"}}'
    reader = ForcedToolCalls(None)
    assert reader.feed(first[:-1]) == ("", [])
    assert reader.feed(first[-1]) == ("", [ParsedCall("get_weather", json.dumps(json.loads(first + "]")[0]["parameters"]))])
    assert reader.feed(', {"name": "now", "param') == ("", [])
    assert reader.feed('eters": {}}]') == ("", [ParsedCall("now", "{}", 1)])
    assert reader.finish() == ("", []) and reader.num_calls == 2
    cut = ForcedToolCalls(None)
    assert cut.feed(first + ', {"name": "n') == ("", [ParsedCall("get_weather", json.dumps(
        {"unit": "C", "note": 'a } ] " {'}))])
    assert cut.finish() == ("", []) and cut.num_calls == 1


def test_required_moves_the_tools_defs_to_the_root(tok_compiler):
    """pydantic writes nested models as "#/$defs/..." references: they must resolve in the list's schema."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str

    class Trip(pydantic.BaseModel):
        cities: list[City]

    tools = [{"type": "function", "function": {"name": "plan", "parameters": Trip.model_json_schema()}},
             {"type": "function", "function": {"name": "now", "parameters": {}}}]
    constraint = forced_constraint("required", tools)
    schema = json.loads(constraint.json)
    assert "City" in schema["$defs"] and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    tok, compiler = tok_compiler
    state = compiler.matcher(constraint)
    text = '[{"name": "plan", "parameters": {"cities": [{"name": "Oslo"}]}}]'
    assert all(state.matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
    clash = [tools[0], {"type": "function", "function": {"name": "other", "parameters": {
        "$defs": {"City": {"type": "integer"}}, "type": "object"}}}]
    with pytest.raises(ValueError, match="'City' differently"):
        forced_constraint("required", clash)


@pytest.fixture(scope="module")
def tok_compiler(tiny_llama):
    from transformers import AutoTokenizer

    from vllm_spec.structured_output.grammar import GrammarCompiler
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    return tok, GrammarCompiler(tok, len(tok), [tok.eos_token_id])


def test_constraints_and_choices():
    assert forced_constraint("auto", TOOLS) is None and forced_constraint("none", TOOLS) is None
    named = json.loads(forced_constraint(NAMED, TOOLS).json)
    assert named == WEATHER["function"]["parameters"]
    required = json.loads(forced_constraint("required", TOOLS).json)
    assert required["type"] == "array" and required["minItems"] == 1
    assert [v["properties"]["name"]["enum"] for v in required["items"]["anyOf"]] == [["get_weather"], ["now"]]
    for bad, named_in in (("sometimes", "tool_choice must be"), ({"type": "function"}, "tool_choice must be"),
                          ({"type": "function", "function": {"name": "nope"}}, "'nope', which is not among")):
        with pytest.raises(ValueError, match=named_in):
            check_tool_choice(bad, TOOLS)


# The server -----------------------------------------------------------------------------------------
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from vllm_spec import LLM, SamplingParams  # noqa: E402
from vllm_spec.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_spec.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from vllm_spec.entrypoints.openai.api_server import build_app, build_state  # noqa: E402

OPTS = dict(kv_cache_memory_bytes=1 << 24, max_model_len=256)
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def client(spec_pair):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=spec_pair[0], speculative_model=spec_pair[1],
                                                        num_speculative_tokens=3, **OPTS))
    with TestClient(build_app(build_state(engine, spec_pair[0], ["m"]))) as c:   # no tool-call parser needed
        yield c


@pytest.mark.parametrize("tool_choice, name", [(NAMED, "get_weather"), ("required", None)])
@pytest.mark.parametrize("stream", [False, True])
def test_server_forces_the_calls(client, spec_pair, tool_choice, name, stream):
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0,
            "max_tokens": 40, "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    # What the offline API generates under the same constraint, read back as calls.
    llm = LLM(spec_pair[0], **OPTS)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=forced_constraint(tool_choice, TOOLS))
    output = llm.chat([MESSAGES], params, use_tqdm=False, tools=TOOLS)[0].outputs[0]
    text = output.text
    content, calls = read_tool_calls(ForcedToolCalls(name), text)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events]
        got_content = "".join(d.get("content") or "" for d in deltas) or None
        got_calls = _joined([c for d in deltas for c in d.get("tool_calls", [])])
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        got_content, got_calls, finish = choice["message"]["content"], choice["message"]["tool_calls"], \
            choice["finish_reason"]
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == \
        [(c.name, c.arguments) for c in calls]
    # As vLLM: "required" ends with "tool_calls", a named function with the model's own reason.
    assert finish == ("tool_calls" if calls and name is None else output.finish_reason)


def test_server_refuses_bad_tool_choices(client):
    base = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
    for extra in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, {"tool_choice": "always"},
                  {"tool_choice": "required", "response_format": {"type": "json_object"}}):
        r = client.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


@pytest.fixture
def scripted(tiny_llama, monkeypatch):
    """A server whose engine 'generates' the given text in pieces and records the requests' constraints (a
    tiny random model writes whitespace runs in JSON, rarely a whole call)."""
    from vllm_spec.engine.async_stream import AsyncStream
    from vllm_spec.outputs import CompletionOutput, RequestOutput

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), **OPTS))
    sent = {}

    async def add_request(request_id, prompt, params, **kwargs):
        sent["constraint"] = params.structured_outputs
        text = sent["text"]
        stream = AsyncStream(request_id, coalesce=False)
        for end in range(4, len(text) + 4, 4):
            done = end >= len(text)
            stream.put(RequestOutput(request_id, None, [1, 2], [CompletionOutput(
                0, text[:end], [1] * (end // 4), None, None, "stop" if done else None)], done))
        stream.finish()
        return stream

    monkeypatch.setattr(engine, "add_request", add_request)
    with TestClient(build_app(build_state(engine, str(tiny_llama), ["m"]))) as c:
        yield c, sent


@pytest.mark.parametrize("tool_choice, text, calls", [
    (NAMED, '{"unit": "F"}', [("get_weather", '{"unit": "F"}')]),
    ("required", '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"unit": "C"}}]',
     [("now", "{}"), ("get_weather", '{"unit": "C"}')]),
])
def test_server_returns_the_forced_calls(scripted, tool_choice, text, calls):
    c, sent = scripted
    sent["text"] = text
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
    choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert sent["constraint"] == forced_constraint(tool_choice, TOOLS)
    # As vLLM: "required" ends with "tool_calls", a named function with the model's own reason.
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == ("stop" if tool_choice == NAMED else "tool_calls")
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in choice["message"]["tool_calls"]] == calls
    r = c.post("/v1/chat/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not any(d.get("content") for d in deltas)
    streamed = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in _joined(streamed)] == calls
    if tool_choice == NAMED:   # the arguments stream in pieces; only the first names the call and has its id
        assert len(streamed) > 1 and streamed[0]["id"].startswith("chatcmpl-tool-")
        assert all("id" not in t and "name" not in t["function"] for t in streamed[1:])
    else:   # each call whole, with its id and index, as its object closes
        assert [(t["index"], t["id"][:14]) for t in streamed] == [(0, "chatcmpl-tool-"), (1, "chatcmpl-tool-")]
        assert streamed[0]["id"] != streamed[1]["id"]
    assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def _joined(pieces: list[dict]) -> list[dict]:
    """Streamed tool-call pieces joined by index, as clients join them."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        call = calls.setdefault(piece["index"], {"function": {"name": None, "arguments": ""}})
        call["function"]["name"] = call["function"]["name"] or piece["function"].get("name")
        call["function"]["arguments"] += piece["function"].get("arguments", "")
    return list(calls.values())
