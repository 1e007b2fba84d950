"""LLMEngine.add_request as vLLM users call it: its options, request ids, and parameters changed after
construction, which must be refused for that request alone."""

from __future__ import annotations

import time

import pytest

from vllm_spec import EngineArgs, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24),
                                      usage_context="ENGINE_CONTEXT")


def _finish(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def _params(**changes) -> SamplingParams:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("changes, field", [
    (dict(n=0), "n"), (dict(seed="a"), "seed"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(logprobs=100), "logprobs"),
    (dict(prompt_logprobs=50), "prompt_logprobs"), (dict(stop=5), "stop"),
])
def test_parameters_changed_after_construction_are_checked_again(engine, changes, field):
    assert engine.add_request("ok", "hello world", _params()) == "ok"   # (vLLM returns the id)
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", "hello world", _params(**changes))
    assert engine.get_num_unfinished_requests() == 1   # nothing of the bad one was kept
    done = _finish(engine)
    assert list(done) == ["ok"] and len(done["ok"].outputs[0].token_ids) == 6


def test_a_changed_parameter_takes_effect(engine):
    params = _params()
    params.max_tokens, params.n, params.temperature = 3, 2, 1.0
    engine.add_request("changed", "hello world", params)
    out = _finish(engine)["changed"]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]


@pytest.mark.parametrize("request_id", [None, 5, ("a",)])
def test_request_ids_are_strings(engine, request_id):
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(request_id, "hello", _params())
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("", "hello", _params())
    assert not engine.has_unfinished_requests()


def test_vllm_request_options_at_their_neutral_values(engine):
    arrived = time.time() - 2.0
    engine.add_request("opts", "hello world", _params(), arrival_time=arrived, lora_request=None,
                       tokenization_kwargs=None, trace_headers={}, priority=0)
    out = _finish(engine)["opts"]
    # Arrived two seconds ago: the request's metrics count its time since then.
    assert out.metrics.first_token_time - out.metrics.arrival_time >= 2.0
    for kwargs, field in ((dict(priority=1), "priority"), (dict(lora_request="adapter"), "lora_request"),
                          (dict(tokenization_kwargs={"truncation": True}), "tokenization_kwargs"),
                          (dict(trace_headers={"a": "b"}), "trace_headers"), (dict(arrival_time="now"), "arrival_time"),
                          (dict(arrival_time=float("nan")), "arrival_time")):
        with pytest.raises(ValueError, match=field):
            engine.add_request("x", "hello", _params(), **kwargs)
    assert not engine.has_unfinished_requests()


def test_engine_accessors_and_custom_stat_loggers(engine, tiny_llama):
    assert engine.get_tokenizer() is engine.tokenizer
    assert engine.get_model_config().max_model_len == engine.config.model.max_model_len
    # vLLM's attribute names for the configuration's parts.
    cfg = engine.config
    assert engine.vllm_config is cfg and engine.model_config is cfg.model and engine.cache_config is cfg.cache
    assert engine.scheduler_config is cfg.scheduler and engine.parallel_config is cfg.parallel
    assert engine.speculative_config is cfg.speculative
    with pytest.raises(ValueError, match="stat_loggers"):
        LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama)), stat_loggers={"x": object()})


def test_text_with_a_lone_surrogate_is_refused_naming_the_field(engine):
    """Valid in a Python str (and in JSON), but no Unicode text: tokenizers fail on it with a TypeError."""
    for prompt in ("\ud800 hi", {"prompt": "x\udfff"}):
        with pytest.raises(ValueError, match="prompt is not valid Unicode text"):
            engine.add_request("s", prompt, _params())
    for field in ("stop", "bad_words"):
        with pytest.raises(ValueError, match=f"{field} is not valid Unicode text"):
            SamplingParams(**{field: ["ok", "\ud800"]})
    assert not engine.has_unfinished_requests()


def test_a_checked_copy_forgets_what_changed_fields_no_longer_imply():
    params = SamplingParams(stop=["abcdef"], temperature=0)
    assert params.output_text_buffer_length == 5 and params.batch_fields.greedy
    params.stop, params.temperature = None, 0.7
    copy = params.checked_copy()
    # No stop string to hold text back for, and no stale cached view of the old temperature.
    assert copy.output_text_buffer_length == 0 and not copy.batch_fields.greedy
    params.stop, params.include_stop_str_in_output = ["abcdef"], True
    assert params.checked_copy().output_text_buffer_length == 0


def test_unfinished_count_counts_each_completion_of_a_request(engine):
    """As vLLM V1, where a request of n > 1 runs as n child requests: each unfinished completion counts."""
    engine.add_request("three", "hello", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True))
    engine.add_request("one", "hello", _params(max_tokens=2))
    assert engine.get_num_unfinished_requests() == 4
    engine.step()
    engine.step()
    while "one" in engine.requests:   # (its last token may be read a step later)
        engine.step()
    assert engine.get_num_unfinished_requests() == 3
    _finish(engine)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
