"""Structured outputs through the OpenAI-compatible server: response_format (json_object, json_schema),
vLLM's structured_outputs and its older guided_* fields give what the offline API gives, streamed or not."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from conftest import FIXED  # noqa: E402

from vllm_spec import LLM, SamplingParams  # noqa: E402
from vllm_spec.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_spec.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from vllm_spec.entrypoints.openai.api_server import build_app, build_state  # noqa: E402
from vllm_spec.sampling_params import StructuredOutputsParams as SO  # noqa: E402

OPTS = dict(kv_cache_memory_bytes=1 << 24, max_model_len=256)
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
          "required": ["size", "ok"]}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def client(spec_pair):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=spec_pair[0], speculative_model=spec_pair[1],
                                                        num_speculative_tokens=3, **FIXED, **OPTS))
    with TestClient(build_app(build_state(engine, spec_pair[0], ["m"]))) as c:
        yield c


@pytest.fixture(scope="module")
def offline(spec_pair):
    return LLM(spec_pair[0], **OPTS)


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "temperature": 0,
                                                  "max_tokens": 24, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _offline_chat(offline, constraint: SO) -> str:
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint)
    return offline.chat([MESSAGES], params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("body, constraint", [
    ({"response_format": {"type": "json_object"}}, SO(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA}}}, SO(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     SO(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"regex": "[a-d]{4}"}}, SO(regex="[a-d]{4}")),
    ({"guided_regex": "[a-d]{4}"}, SO(regex="[a-d]{4}")),
    ({"guided_json": SCHEMA}, SO(json=SCHEMA)),
    ({"guided_grammar": 'root ::= "x" [0-9]'}, SO(grammar='root ::= "x" [0-9]')),
    # structured_outputs with options only applies them to response_format's constraint (as vLLM folds them).
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA}},
      "structured_outputs": {"disable_any_whitespace": True}}, SO(json=SCHEMA, disable_any_whitespace=True)),
])
def test_chat_constraints_give_the_offline_output(client, offline, body, constraint):
    choice = _chat(client, **body)
    assert choice["message"]["content"] == _offline_chat(offline, constraint)


def test_compact_json_and_choices_complete(client):
    choice = _chat(client, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}, max_tokens=48)
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"])["size"] in ("S", "M", "L")
    for field in ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, {"guided_choice": ["red", "green"]}):
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Colour:", "max_tokens": 8,
                                                 "temperature": 1.0, "seed": 3, "n": 3, **field})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 3 and all(c["text"] in ("red", "green", "blue") for c in choices)


def test_streamed_output_is_the_whole_output(client):
    body = {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{3}"}, "max_tokens": 16}
    whole = _chat(client, **body)["message"]["content"]
    assert re.fullmatch("[a-z]{3}-[0-9]{3}", whole)
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "temperature": 0,
                                                  "stream": True, **body})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == whole
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
