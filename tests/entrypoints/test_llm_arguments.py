"""The offline LLM API's argument checking: what it refuses, and names (over-long, empty and malformed
prompts, sampling params of another type, missing models and tokenizers, engine keywords of the
wrong type or asking for what the engine does not do), and vLLM's keywords at the values it supports.

Generation itself is tested in test_llm.py; the shared `llm` and `reference` fixtures are in conftest.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import copy_with_config

import vllm_spec
from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.inputs import TextPrompt
from vllm_spec.sampling_params import SamplingParams

from .offline_llm_helpers import MAX_MODEL_LEN, PROMPT, greedy

# Prompts -----------------------------------------------------------------------------------------------

def test_over_long_prompt_rejected_and_llm_keeps_working(llm, reference):
    long_ids = list(range(1, MAX_MODEL_LEN + 2))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": long_ids}, greedy(), use_tqdm=False)
    # A bad prompt in the middle of a batch rejects the batch and leaves nothing queued.
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPT, "x " * 200, PROMPT], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.scheduler.has_unfinished()
    out = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference.token_ids


def test_model_config_under_vllm_names(llm):
    assert llm.model_config is llm.llm_engine.model_config is llm.llm_engine.config.model
    assert llm.llm_engine.model_config.max_model_len == MAX_MODEL_LEN
    cfg = llm.llm_engine.get_model_config()
    raw = json.loads((cfg.path / "config.json").read_text())
    assert cfg.get_vocab_size() == raw["vocab_size"] and cfg.get_hidden_size() == raw["hidden_size"]
    assert cfg.get_num_layers(llm.llm_engine.parallel_config) == raw["num_hidden_layers"]
    assert cfg.get_num_attention_heads() == raw["num_attention_heads"]
    assert cfg.get_num_kv_heads() == raw.get("num_key_value_heads", raw["num_attention_heads"])
    assert cfg.get_head_size() == raw["hidden_size"] // raw["num_attention_heads"]
    assert cfg.get_sliding_window() is None and cfg.max_logprobs == 20 and cfg.runner_type == "generate"
    assert cfg.hf_config.vocab_size == raw["vocab_size"] and cfg.hf_text_config is cfg.hf_config
    assert type(cfg.hf_config).__name__ == "LlamaConfig"
    vllm_config = llm.llm_engine.vllm_config
    assert vllm_config.model_config is cfg and vllm_config.cache_config is llm.llm_engine.cache_config
    assert vllm_config.scheduler_config is llm.llm_engine.scheduler_config
    assert vllm_config.parallel_config is llm.llm_engine.parallel_config and vllm_config.speculative_config is None


def test_one_priority_for_every_prompt(tiny_llama):
    llm = LLM(str(tiny_llama), scheduling_policy="priority", kv_cache_memory_bytes=1 << 24)
    outs = llm.generate(["a", "b c"], greedy(3), priority=1, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert len(llm.generate("a", greedy(3), priority=-2, use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="priority"):
        llm.generate("a", greedy(3), priority=1.5, use_tqdm=False)


def test_vllm_engine_arguments_at_values_that_change_nothing(tiny_llama):
    """vLLM's EngineArgs fields scripts pass at their defaults (or values that mean the same here) are
    accepted; a value this engine cannot honour is a ValueError naming the field."""
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, structured_outputs_config={"backend": "xgrammar"},
              disable_sliding_window=False, enable_prompt_embeds=False, model_impl="auto",
              max_parallel_loading_workers=2, kv_transfer_config=None, limit_mm_per_prompt={}, reasoning_parser=None,
              attention_backend=None, enable_expert_parallel=False, max_cudagraph_capture_size=64,
              config_format="auto", code_revision=None, calculate_kv_scales=False, stream_interval=1,
              mm_processor_cache_gb=0, skip_mm_profiling=True, kv_sharing_fast_prefill=False,
              disable_cascade_attn=True, pooler_config=None)
    assert len(llm.generate("hi", greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    for name, value in [("enable_prompt_embeds", True), ("model_impl", "transformers"), ("stream_interval", 4),
                        ("structured_outputs_config", {"backend": "nope"}), ("attention_backend", "FLASH_ATTN"),
                        ("kv_transfer_config", {"kv_connector": "x"}), ("reasoning_parser", "deepseek_r1")]:
        with pytest.raises(ValueError, match=name):
            LLM(str(tiny_llama), **{name: value})


def test_prompt_of_exactly_max_model_len_is_refused(llm):
    """As vLLM: the prompt and at least one new token must fit in max_model_len; one token less gets one."""
    ids = [(i * 7) % 300 + 1 for i in range(MAX_MODEL_LEN)]
    with pytest.raises(ValueError, match=rf"The decoder prompt \(length {MAX_MODEL_LEN}\) plus the number of "
                                         rf"requested output tokens \(at least 1\) is longer than the maximum model "
                                         rf"length of {MAX_MODEL_LEN}"):
        llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=10), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": ids[1:]}, greedy(max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_max_model_len_caps_generation(llm):
    ids = list(range(1, MAX_MODEL_LEN - 4))
    out = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


def test_empty_prompt_list_rejected(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([], greedy(), use_tqdm=False)


@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}, {"prompt": ""}])
def test_empty_prompt_rejected(llm, prompt):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt, greedy(), use_tqdm=False)


def test_out_of_vocab_token_rejected(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2, 10_000]}, greedy(), use_tqdm=False)


@pytest.mark.parametrize("ids, match", [([1, 2.5], r"integers, got 2\.5 \(float\) at position 1"),
                                        (["1"], r"integers, got '1' \(str\) at position 0"),
                                        ([[1, 2]], r"integers, got \[1, 2\] \(list\)"),
                                        ([True, 3], r"integers, got True \(bool\)")])
def test_token_ids_that_are_no_integers_are_named(llm, ids, match):
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)


def test_stop_strings_without_detokenization_rejected(llm, tiny_llama, reference):
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate(PROMPT, greedy(stop=["a"], detokenize=False), use_tqdm=False)
    bare = LLM(str(tiny_llama), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="stop strings"):
        bare.generate({"prompt_token_ids": [5, 6, 7]}, greedy(stop=["a"]), use_tqdm=False)
    # Nothing was left behind: both engines keep serving.
    assert llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids == reference.token_ids
    assert len(bare.generate({"prompt_token_ids": [5, 6, 7]}, greedy(max_tokens=3), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3


@pytest.mark.parametrize("call, named", [
    (lambda llm: llm.generate(None), "prompts"), (lambda llm: llm.generate(5), "prompts"),
    (lambda llm: llm.chat("hi"), "messages"), (lambda llm: llm.chat([]), "messages"),
    (lambda llm: llm.chat([{"content": "no role"}]), "messages"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}], chat_template="{% if %}"), "chat_template"),
])
def test_bad_prompts_and_messages_are_named(llm, reference, call, named):
    with pytest.raises((TypeError, ValueError), match=named):
        call(llm)
    assert llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids == reference.token_ids


def test_mismatched_params_list_rejected(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([PROMPT, PROMPT], [greedy()], use_tqdm=False)


def test_prompt_dict_keys_as_vllm(llm, reference):
    """vLLM's prompt keys for inputs a text-only model has no use for must be empty (an image must not
    be dropped silently); cache_salt is accepted; unknown keys are named. vLLM's output fields for
    what the engine does not do are there, empty."""
    params = greedy(ignore_eos=True)
    out = llm.generate({"prompt": PROMPT, "cache_salt": "s", "multi_modal_data": None, "mm_processor_kwargs": {}},
                       params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference.token_ids
    assert (out.num_cached_tokens, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids,
            out.kv_transfer_params, out.outputs[0].lora_request) == (0, None, None, None, None, None)
    # vLLM's typed prompt dicts, under both of vLLM's import paths.
    ids = llm.get_tokenizer().encode(PROMPT)
    typed = llm.generate([TextPrompt(prompt=PROMPT), vllm_spec.TokensPrompt(prompt_token_ids=ids)], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in typed] == [reference.token_ids] * 2
    with pytest.raises(ValueError, match="multi_modal_data in a prompt is not supported"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": object()}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"unknown prompt key 'promt'; allowed: prompt, prompt_token_ids"):
        llm.generate({"promt": PROMPT}, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("params", [{"temperature": 0}, 5, [SamplingParams(), {"temperature": 0}]])
def test_sampling_params_of_another_type_are_named(llm, params):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, a list of them"):
        llm.generate(["a", "b"], params, use_tqdm=False)


@pytest.mark.parametrize("prompts", [b"hello", bytearray(b"hi"), {5, 6, 7}])
def test_bytes_and_sets_are_no_prompts(llm, prompts):
    with pytest.raises(TypeError, match="prompts must be a string, a dict, token ids or a list of them"):
        llm.generate(prompts, greedy(), use_tqdm=False)


# Models and engine keywords ----------------------------------------------------------------------------

def test_unknown_architecture_named(tmp_path, tiny_llama):
    folder = copy_with_config(tiny_llama, tmp_path / "falcon", architectures=["FalconForCausalLM"],
                              model_type="falcon")
    with pytest.raises(ValueError, match="Unsupported model architecture.*FalconForCausalLM"):
        LLM(folder, kv_cache_memory_bytes=1 << 24)


def test_missing_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model") as e:
        LLM(str(missing))
    assert "config.json" in str(e.value)


def test_vllm_keywords_at_their_neutral_values(llm, tiny_llama):
    """Scripts written for vLLM pass its keywords at their defaults: accepted; values asking for what
    this engine does not do are refused, named."""
    plain = [{"role": "user", "content": "hi"}]
    neutral = dict(cpu_offload_gb=0, hf_overrides=None, hf_token=None, compilation_config=None,
                   max_seq_len_to_capture=8192, disable_custom_all_reduce=False, allowed_local_media_path="",
                   mm_processor_kwargs=None, task="auto", runner="auto", enable_lora=False, pipeline_parallel_size=1,
                   data_parallel_size=1, served_model_name="m", logprobs_mode="raw_logprobs", enable_sleep_mode=False,
                   disable_async_output_proc=False, enable_prefix_caching=None)
    other = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=MAX_MODEL_LEN, **neutral)
    want = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert other.generate(PROMPT, greedy(), use_tqdm=False, lora_request=None,
                          priority=[0])[0].outputs[0].token_ids == want
    assert other.chat(plain, greedy(), use_tqdm=False, lora_request=None, tools=None, mm_processor_kwargs=None,
                      chat_template_content_format="string")[0].outputs[0].token_ids == \
        llm.chat(plain, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    for name, value in (("enable_lora", True), ("pipeline_parallel_size", 2), ("cpu_offload_gb", 4),
                        ("task", "embed"), ("logprobs_mode", "logits"), ("enable_sleep_mode", True),
                        ("mm_processor_kwargs", {"x": 1})):
        with pytest.raises(ValueError, match=name):
            LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, **{name: value})
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate(PROMPT, greedy(), use_tqdm=False, lora_request=object())
    for priority, message in (([1], "priority must be 0, got 1"), ([0, 0], r"one per prompt \(1\), got 2")):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPT, greedy(), use_tqdm=False, priority=priority)
    with pytest.raises(ValueError, match="tools must be a list of tool definitions"):
        llm.chat(plain, use_tqdm=False, tools={"type": "function"})
    with pytest.raises(ValueError, match=r"chat_template_content_format must be one of \['auto', 'string', 'openai'\]"):
        llm.chat(plain, use_tqdm=False, chat_template_content_format="list")


def test_hf_overrides_as_vllm(llm, tiny_llama, tmp_path):
    """vLLM's hf_overrides: a dict's keys over config.json's, or a callable changing the transformers config;
    the model runs as one whose config.json says the same."""
    changes = {"rms_norm_eps": 0.5, "max_position_embeddings": 100}
    edited = LLM(copy_with_config(tiny_llama, tmp_path / "edited", **changes), kv_cache_memory_bytes=1 << 24)
    want = edited.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert want != llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids   # (the change shows)

    def change(config):
        config.rms_norm_eps, config.max_position_embeddings = 0.5, 100
        return config

    for overrides in (changes, change):
        other = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, hf_overrides=overrides)
        assert other.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids == want
        config = other.llm_engine.model_config
        assert config.max_model_len == 100 and config.hf_config.max_position_embeddings == 100
    # A callable changes what it sets, nothing else (transformers' class defaults, e.g. an eos_token_id the
    # checkpoint does not name, stay out); the typed config's refusals fall back to the untyped one.
    cfg = json.loads((tiny_llama / "config.json").read_text())
    for key in ("eos_token_id", "bos_token_id"):
        cfg.pop(key)
    bare = copy_with_config(tiny_llama, tmp_path / "bare")
    (tmp_path / "bare" / "config.json").write_text(json.dumps(cfg))
    config = LLM(bare, kv_cache_memory_bytes=1 << 24, hf_overrides=lambda c: c).llm_engine.model_config
    assert config.hf_dict == cfg and config.arch.eos_token_ids == []
    config = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, hf_overrides={"rms_norm_eps": 1}).llm_engine.model_config
    assert config.hf_config.rms_norm_eps == 1
    for overrides, message in (([("rms_norm_eps", 0.5)], "hf_overrides must be a dict of config.json keys"),
                               ({1: 2}, r"hf_overrides keys must be config.json keys \(strings\), got \[1\]"),
                               (lambda config: None, r"hf_overrides \(a callable\) must return .* got NoneType"),
                               ({"architectures": ["FalconForCausalLM"]}, "Unsupported model architecture"),
                               ({"max_position_embeddings": 100}, r"max_model_len \(200\) must be <= .*\(100\)")):
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=200, hf_overrides=overrides)


PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% for part in m['content'] %}[{{ part['text'] }}]"
                  "{% endfor %}{% endfor %}")


def test_chat_content_format_follows_the_template(llm):
    """As vLLM: "auto" hands a template that loops over a message's content a list of text parts (a
    string becomes one part), others a string; "string" and "openai" force either."""
    from vllm_spec.entrypoints.chat_utils import detect_content_format, render_chat

    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(tok, messages, False, chat_template=PARTS_TEMPLATE)["prompt"] == "<user>[hi]<user>[a][b]"
    assert render_chat(tok, messages, False, chat_template=PARTS_TEMPLATE,
                       content_format="openai")["prompt"] == "<user>[hi]<user>[a][b]"
    assert render_chat(tok, messages, False, chat_template=PARTS_TEMPLATE,
                       content_format="string")["prompt"] == "<user>[][]<user>[][][]"   # characters of "hi", "a\nb"
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert render_chat(tok, messages, False, chat_template=plain)["prompt"] == "<user>hi<user>a\nb"
    assert detect_content_format(plain) == "string"
    assert detect_content_format("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}"
                                 "{% endfor %}{% endfor %}") == "openai"
    assert detect_content_format("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', "
                                 "'text') %}{{ p.text }}{% endfor %}{% endfor %}") == "openai"
    out = llm.chat(messages[:1], greedy(3), use_tqdm=False, chat_template=PARTS_TEMPLATE)[0]
    assert out.prompt == "<user>[hi]" and len(out.outputs[0].token_ids) == 3


def test_vllm_flags_with_their_supported_values(tiny_llama):
    # vLLM configurations often spell these out; the supported value works, the other is a clear error.
    llm = LLM(str(tiny_llama), str(tiny_llama), enable_chunked_prefill=True, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 24, trust_remote_code=True, tokenizer_mode="auto", swap_space=4,
              quantization=None, revision=None, tokenizer_revision=None, download_dir=None, disable_log_stats=True,
              max_logprobs=20, kv_cache_dtype="auto")
    assert len(llm.generate("hi", greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    # vLLM V0's speculative-decoding flags at the values meaning what this engine does.
    assert LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, spec_decoding_acceptance_method="rejection_sampler",
               speculative_disable_mqa_scorer=False, disable_logprobs_during_spec_decoding=True,
               use_v2_block_manager=True).generate("hi", greedy(2), use_tqdm=False)[0].outputs[0].token_ids
    for name, value in [("spec_decoding_acceptance_method", "typical_acceptance_sampler"),
                        ("speculative_disable_mqa_scorer", True), ("use_v2_block_manager", False),
                        ("disable_logprobs_during_spec_decoding", "yes")]:
        with pytest.raises(ValueError, match=name):
            LLM(str(tiny_llama), **{name: value})
    # vLLM's None for these is the default.
    config = LLM(str(tiny_llama), block_size=None, max_num_seqs=None, enable_chunked_prefill=None,
                 kv_cache_memory_bytes=1 << 24).llm_engine.vllm_config
    assert (config.cache_config.block_size, config.scheduler_config.max_num_seqs,
            config.scheduler_config.enable_chunked_prefill) == (16, 256, True)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True, False or None"):
        LLM(str(tiny_llama), enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True, False or None"):
        LLM(str(tiny_llama), enable_chunked_prefill="no")
    for name, value in [("quantization", "awq"), ("tokenizer_mode", "slow"), ("revision", "main"),
                        ("max_logprobs", -2), ("max_logprobs", 1.5), ("kv_cache_dtype", "fp8"), ("swap_space", -1)]:
        with pytest.raises(ValueError, match=name):
            LLM(str(tiny_llama), **{name: value})


def test_max_logprobs_bounds_requests_as_vllm(tiny_llama):
    """max_logprobs (vLLM's: default 20, -1 the whole vocabulary) bounds logprobs and prompt_logprobs when
    a request is added; a request of -1 gets every token's logprob; beam search's 2 x width too."""
    from vllm_spec.sampling_params import BeamSearchParams

    llm = LLM(str(tiny_llama), max_logprobs=3, kv_cache_memory_bytes=1 << 24)
    out = llm.generate("hi", greedy(2, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 2 and all(len(lp) in (3, 4) for lp in out.logprobs)   # top 3 and the sampled
    for kwargs, name in ((dict(logprobs=4), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs")):
        with pytest.raises(ValueError, match=rf"^{name}: requested .* greater than max allowed: 3"):
            llm.generate("hi", greedy(2, **kwargs), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width must be at most 1"):
        llm.beam_search([{"prompt": "hi"}], BeamSearchParams(beam_width=2, max_tokens=2))
    whole = LLM(str(tiny_llama), max_logprobs=-1, kv_cache_memory_bytes=1 << 24)
    vocab = whole.llm_engine.config.model.arch.vocab_size
    out = whole.generate("hi", greedy(2, logprobs=-1), use_tqdm=False)[0].outputs[0]
    assert [len(lp) for lp in out.logprobs] == [vocab, vocab]
    assert len(whole.beam_search([{"prompt": "hi"}], BeamSearchParams(beam_width=12, max_tokens=2))[0].sequences) == 12


def test_chunked_prefill_off_prefills_prompts_whole(tiny_llama):
    # vLLM scripts for speculative decoding often pass enable_chunked_prefill=False: same tokens, whole prompts.
    prompts = ["a long prompt " * 12, "hi", "another prompt that is somewhat longer " * 3]
    chunked = LLM(str(tiny_llama), max_num_batched_tokens=16, max_model_len=256)
    whole = LLM(str(tiny_llama), speculative_model=str(tiny_llama), num_speculative_tokens=2,
                enable_chunked_prefill=False, max_model_len=256)
    assert whole.llm_engine.config.scheduler.max_num_batched_tokens == 2048   # max(2048, max_model_len)
    expected = [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy(6), use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, greedy(6), use_tqdm=False)] == expected
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_model_len \(256\)"):
        LLM(str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=256)


@pytest.mark.parametrize("name, value", [
    ("gpu_memory_utilization", None), ("gpu_memory_utilization", "0.5"), ("max_num_seqs", "8"),
    ("max_num_seqs", 1.5), ("max_num_seqs", True), ("max_num_batched_tokens", 0), ("max_num_batched_tokens", "64"),
    ("kv_cache_memory_bytes", "1000000"), ("num_gpu_blocks_override", 100.5), ("block_size", 16.0),
    ("block_size", True), ("swap_space", True), ("enforce_eager", "no"), ("seed", 1.5), ("seed", 1 << 64),
    ("tokenizer", 5), ("speculative_model", 5),
])
def test_engine_keywords_of_the_wrong_type_name_the_field(tiny_llama, name, value):
    # A float or bool taken for an integer failed deep in the worker (or silently meant 1); a string
    # number raised a TypeError; 0 batched tokens silently meant the default.
    with pytest.raises(ValueError, match=name):
        LLM(str(tiny_llama), **{name: value})


def test_engine_keywords_as_vllm_users_write_them(tiny_llama):
    llm = LLM(str(tiny_llama), seed=None, kv_cache_memory_bytes=1e7)
    assert llm.llm_engine.config.cache.kv_cache_memory_bytes == 10_000_000
    assert len(llm.generate("hi", greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_speculative_config_values_of_the_wrong_type(tiny_llama):
    with pytest.raises(ValueError, match="speculative_config\\['model'\\]"):
        LLM(str(tiny_llama), speculative_config={"model": 5, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        LLM(str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                  "synthetic_acceptance_rate": "x"})


def test_missing_tokenizer_folder_is_named_without_a_hub_request(tiny_llama, tmp_path, monkeypatch):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("a model hub was contacted")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    with pytest.raises(ValueError, match="tokenizer 'no/such-tokenizer' not found"):
        LLM(str(tiny_llama), tokenizer="no/such-tokenizer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer found in .*empty"):
        LLM(str(tiny_llama), tokenizer=str(tmp_path / "empty"))


def test_numpy_integers_are_integers(tiny_llama):
    import numpy as np

    llm = LLM(str(tiny_llama), seed=np.int64(3), max_num_seqs=np.int64(4), kv_cache_memory_bytes=1 << 24)
    params = SamplingParams(seed=np.int64(5), n=np.int64(2), max_tokens=np.int64(3), temperature=1.0)
    out = llm.generate("hi", params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]


@pytest.mark.parametrize("dtype", [[], {"a": 1}, 16])
def test_a_dtype_of_another_type_is_named(tiny_llama, dtype):
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        EngineArgs(model=str(tiny_llama), dtype=dtype).create_engine_config()
