"""Sampling defaults from the model's generation_config.json (vLLM's generation_config="auto"):
the offline API's defaults and the server's fields left unset take them; "vllm" keeps vLLM's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_spec import LLM, SamplingParams
from vllm_spec.generation_config import sampling_defaults

GEN = {"eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 1.0,
       "repetition_penalty": 1.0, "max_new_tokens": 5}
KV = dict(kv_cache_memory_bytes=1 << 24, max_model_len=256)


def _with_generation_config(src: Path, dst: Path, config: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def gen_model(tiny_llama, tmp_path_factory) -> Path:
    return _with_generation_config(tiny_llama, tmp_path_factory.mktemp("gen_llama"), GEN)


def test_fields_at_transformers_defaults_are_not_the_models_choice(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(GEN))
    assert sampling_defaults("auto", None, folder) == {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    assert sampling_defaults("vllm", None, folder) == {}
    assert sampling_defaults("auto", None, None) == {}   # a GGUF or dummy model: no file
    assert sampling_defaults("auto", None, tmp_path) == {}   # a folder without one
    # Another folder's file; the override wins field by field.
    assert sampling_defaults(folder, {"temperature": 0.3, "min_p": 0.1}, tmp_path) == {
        "temperature": 0.3, "top_k": 1, "max_tokens": 5, "min_p": 0.1}


def test_bad_generation_config_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"generation_config must be 'auto', 'vllm' or a folder .*'nope'"):
        sampling_defaults("nope", None, tmp_path)
    with pytest.raises(ValueError, match=r"override_generation_config must be a dict"):
        sampling_defaults("auto", [1], tmp_path)
    # As vLLM: an override's fields that set no sampling default are ignored (with a warning).
    assert sampling_defaults("auto", {"do_sample": False, "temperature": 0.5}, tmp_path) == {"temperature": 0.5}
    with pytest.raises(ValueError, match=r"sampling defaults from override_generation_config: temperature"):
        sampling_defaults("auto", {"temperature": -1}, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p"):
        sampling_defaults("auto", None, tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        sampling_defaults("auto", None, tmp_path)


def test_offline_defaults_follow_the_generation_config(gen_model):
    llm = LLM(str(gen_model), **KV)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.max_tokens) == (0.7, 1, 5)
    assert llm.llm_engine.config.model.get_diff_sampling_param() == {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    greedy = llm.generate(["hello there", "a b c"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    for _ in range(2):   # top_k = 1: the greedy tokens, 5 of them, whatever the draws
        out = llm.generate(["hello there", "a b c"], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [g.outputs[0].token_ids for g in greedy]
    # Parameters given are used as given.
    assert len(llm.generate("hello there", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 9
    plain = LLM(str(gen_model), generation_config="vllm", **KV)
    assert plain.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    assert plain.llm_engine.config.model.get_diff_sampling_param() == {}
    over = LLM(str(gen_model), override_generation_config={"max_new_tokens": 3}, **KV)
    assert over.get_default_sampling_params().max_tokens == 3


def test_server_fields_left_unset_take_the_generation_config(gen_model):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from vllm_spec.engine.arg_utils import EngineArgs
    from vllm_spec.engine.async_llm_engine import AsyncLLMEngine
    from vllm_spec.entrypoints.openai.api_server import build_app, build_state

    offline = LLM(str(gen_model), **KV)
    greedy = offline.generate("hello there", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(gen_model), **KV))
    state = build_state(engine, str(gen_model), ["m"])
    with TestClient(build_app(state)) as client:
        def completion(**fields):
            r = client.post("/v1/completions", json={"model": "m", "prompt": "hello there", **fields})
            assert r.status_code == 200, r.text
            return r.json()

        body = completion(max_tokens=None)   # unbounded: the generation config's 5
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["text"] == greedy.outputs[0].text
        assert completion(max_tokens=100)["usage"]["completion_tokens"] == 5   # vLLM: the config bounds all
        assert completion(max_tokens=2)["usage"]["completion_tokens"] == 2
        # Above the bound:
        for fields in ({"min_tokens": 10, "max_tokens": None}, {"min_tokens": 20, "max_tokens": 50}):
            r = client.post("/v1/completions", json={"model": "m", "prompt": "hello there", **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        # Explicit fields win over the defaults: temperature 0 is greedy too, n: null and echo: null mean
        # their defaults (OpenAI's schema has them nullable).
        body = completion(temperature=0, n=None, echo=None)
        assert [c["text"] for c in body["choices"]] == [greedy.outputs[0].text]
        chat = client.post("/v1/chat/completions", json={"model": "m", "n": None,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 5
