"""The offline LLM API: prompts in every form, errors, stop conditions, n, chat, metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.metrics import Counter, Gauge, Histogram, Vector
from vllm_spec.sampling_params import SamplingParams


PROMPT = "def wrap(text, width=70):"
MAX_MODEL_LEN = 96


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference(llm):
    """The greedy continuation of PROMPT with no stop condition."""
    return llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]


# Errors ------------------------------------------------------------------------------------------------

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


def test_prompt_of_exactly_max_model_len_gets_one_token(llm):
    ids = [(i * 7) % 300 + 1 for i in range(MAX_MODEL_LEN)]
    out = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=10), use_tqdm=False)[0].outputs[0]
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


def test_numpy_and_torch_token_ids_are_accepted(llm):
    import numpy as np
    import torch

    ids = [5, 6, 7, 8]
    want = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0]
    for form in (np.array(ids), [np.int64(t) for t in ids], torch.tensor(ids)):
        for prompt in ({"prompt_token_ids": form}, form):   # in a dict, or as the prompt itself
            out = llm.generate(prompt, greedy(), use_tqdm=False)
            assert len(out) == 1 and out[0].prompt_token_ids == ids
            assert all(type(t) is int for t in out[0].prompt_token_ids)
            assert out[0].outputs[0].token_ids == want.outputs[0].token_ids
    rows = llm.generate(np.array([ids, ids]), greedy(), use_tqdm=False)   # 2-D: a prompt per row
    assert [o.outputs[0].token_ids for o in rows] == [want.outputs[0].token_ids] * 2
    for bad in ({"prompt_token_ids": np.array(5)}, {"prompt_token_ids": "5 6"}, torch.tensor(5)):
        with pytest.raises(ValueError, match="must be a"):
            llm.generate(bad, greedy(), use_tqdm=False)


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


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(5, 25))
    cut = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=6, truncate_prompt_tokens=4), use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": ids[-4:]}, greedy(max_tokens=6), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # -1 (vLLM's convention): the last max_model_len tokens (which leave room for one new token).
    long_ids = [5 + i % 300 for i in range(MAX_MODEL_LEN + 7)]
    whole = llm.generate({"prompt_token_ids": long_ids}, greedy(max_tokens=6, ignore_eos=True,
                                                                 truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == long_ids[-MAX_MODEL_LEN:] and len(whole.outputs[0].token_ids) == 1


def test_request_metrics_and_unsupported_methods(llm, tiny_llama):
    out = llm.generate(PROMPT, greedy(max_tokens=4), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time == m.finished_time
    for method in ("encode", "embed", "classify", "score", "reward"):
        with pytest.raises(NotImplementedError, match=method):
            getattr(llm, method)(PROMPT)
    tok = llm.get_tokenizer()
    bare = LLM(str(tiny_llama), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, max_model_len=MAX_MODEL_LEN)
    bare.set_tokenizer(tok)
    assert bare.get_tokenizer() is tok and bare.llm_engine.output_processor.tokenizer is tok
    assert tok.eos_token_id in bare.llm_engine.output_processor.eos_token_ids   # its EOS stops requests
    assert bare.generate(PROMPT, greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].text


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


def test_use_tqdm_may_be_the_bars_factory(llm):
    """As vLLM's: use_tqdm=functools.partial(tqdm, ...) makes the progress bar."""
    from tqdm import tqdm

    made = []

    def factory(*args, **kwargs):
        made.append(kwargs)
        return tqdm(*args, **{**kwargs, "disable": True})

    llm.generate([PROMPT, PROMPT], greedy(4), use_tqdm=factory)
    assert made and made[0]["total"] == 2


def test_mismatched_params_list_rejected(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([PROMPT, PROMPT], [greedy()], use_tqdm=False)


def test_unknown_architecture_named(tmp_path, tiny_llama):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(folder), kv_cache_memory_bytes=1 << 24)


def test_missing_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model") as e:
        LLM(str(missing))
    assert "config.json" in str(e.value)


# Prompt forms --------------------------------------------------------------------------------------------

def test_token_id_prompts_match_text_prompts(llm, reference):
    ids = llm.get_tokenizer()(PROMPT).input_ids
    outs = llm.generate([{"prompt_token_ids": ids}, ids, PROMPT, {"prompt": PROMPT}],
                        greedy(ignore_eos=True), use_tqdm=False)
    assert all(o.prompt_token_ids == ids for o in outs)
    assert all(o.outputs[0].token_ids == reference.token_ids for o in outs)
    assert outs[0].prompt is None and outs[2].prompt == PROMPT
    single = llm.generate(ids, greedy(ignore_eos=True), use_tqdm=False)  # one prompt as a bare id list
    assert len(single) == 1 and single[0].outputs[0].token_ids == reference.token_ids


def test_outputs_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["a", "bb bb", "import os", "x"]
    params = [greedy(max_tokens=m, ignore_eos=True) for m in (5, 1, 9, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 9, 3]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_n_returns_n_completions(llm):
    p = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPT, p, use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs) == 2
    a, b = out[0].outputs
    assert (a.index, b.index) == (0, 1)
    assert len(a.token_ids) == len(b.token_ids) == 12
    assert a.token_ids != b.token_ids
    # Child i uses seed + i, as in vLLM.
    for i, c in enumerate((a, b)):
        solo = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        assert solo.token_ids == c.token_ids
    greedy_n = llm.generate(PROMPT, greedy(n=3, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs
    assert len(greedy_n) == 3 and greedy_n[0].token_ids == greedy_n[1].token_ids == greedy_n[2].token_ids


# Stop conditions -------------------------------------------------------------------------------------------

def _pick_stop_string(text: str) -> str:
    """A short piece of plain text from the middle of the reference output."""
    for start in range(3, len(text) - 6):
        piece = text[start:start + 3]
        if piece.isascii() and piece.strip() and text.find(piece) == start:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_truncates_text(llm, reference):
    stop = _pick_stop_string(reference.text)
    cut = reference.text.index(stop)
    out = llm.generate(PROMPT, greedy(stop=[stop, "never-appears"]), use_tqdm=False)[0].outputs[0]
    assert out.text == reference.text[:cut]
    assert out.stop_reason == stop and out.finish_reason == "stop"
    assert len(out.token_ids) < len(reference.token_ids)
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]
    kept = llm.generate(PROMPT, greedy(stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == reference.text[: cut + len(stop)] and kept.stop_reason == stop


def _plain_stop_position(tok, ids: list[int], start: int) -> int:
    """Index of a token first emitted at step >= start whose text is plain ASCII, and before which the
    text is complete (no dangling piece of a multi-byte character the detokenizer would hold back)."""
    for i in range(start, len(ids)):
        if ids.index(ids[i]) == i and tok.decode([ids[i]]).strip().isascii() \
                and not tok.decode(ids[:i]).endswith("\ufffd"):
            return i
    raise AssertionError(f"no plain token in {ids}")


def llm_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def test_stop_token_ids(llm, reference):
    tok = llm.get_tokenizer()
    pos = _plain_stop_position(tok, reference.token_ids, 3)
    stop_id = reference.token_ids[pos]
    out = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference.token_ids[: pos + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # As vLLM: the stop token stays in token_ids but its text is left out of the output text.
    assert out.text == tok.decode(reference.token_ids[:pos])
    kept = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(reference.token_ids[: pos + 1])
    # min_tokens postpones it past its first occurrence.
    later = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id], min_tokens=pos + 2), use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) > pos + 1 and stop_id not in later.token_ids[: pos + 2]


def test_max_tokens_gives_length(llm, reference):
    out = llm.generate(PROMPT, greedy(max_tokens=7), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == reference.token_ids[:7]


@pytest.fixture(scope="module")
def eos_model(tiny_llama, reference, tmp_path_factory):
    """tiny_llama with an extra EOS id (via generation_config.json): the token it emits greedily at step 4."""
    pos = _plain_stop_position(llm_tokenizer(tiny_llama), reference.token_ids, 4)
    eos = reference.token_ids[pos]
    folder = tmp_path_factory.mktemp("eos_llama")
    for f in tiny_llama.iterdir():
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
        else:
            shutil.copy(f, folder / f.name)
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [0, eos]
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    return LLM(str(folder), kv_cache_memory_bytes=1 << 24, max_model_len=MAX_MODEL_LEN), eos, pos


def test_eos_gives_stop(eos_model, reference, llm):
    model, eos, pos = eos_model
    out = model.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference.token_ids[: pos + 1] and out.token_ids[-1] == eos
    # As vLLM: an EOS id of the generation config other than the tokenizer's is reported as the stop reason.
    assert out.finish_reason == "stop" and out.stop_reason == eos
    assert out.text == llm.get_tokenizer().decode(reference.token_ids[:pos])
    ignored = model.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == reference.token_ids and ignored.finish_reason == "length"
    delayed = model.generate(PROMPT, greedy(min_tokens=pos + 2), use_tqdm=False)[0].outputs[0]
    assert len(delayed.token_ids) > pos + 1 and eos not in delayed.token_ids[: pos + 2]


# Chat ---------------------------------------------------------------------------------------------------------

def test_chat_uses_the_chat_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def wrap"}]
    out = llm.chat(messages, greedy(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1
    expected_text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ndef wrap<|im_end|>\n" \
                    "<|im_start|>assistant\n"
    assert out[0].prompt == expected_text
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert out[0].prompt_token_ids.count(im_start) == 3  # special tokens parsed, not spelled out
    assert out[0].prompt_token_ids == tok(expected_text, add_special_tokens=False).input_ids
    direct = llm.generate({"prompt_token_ids": out[0].prompt_token_ids}, greedy(max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    assert out[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    # A list of conversations gives one output each.
    two = llm.chat([messages, messages[1:]], greedy(max_tokens=2), use_tqdm=False)
    assert len(two) == 2 and "system" not in two[1].prompt



def test_chat_content_parts_and_continue_final_message(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "def"}, {"type": "text", "text": "wrap"}]}]
    plain = [{"role": "user", "content": "def\nwrap"}]
    assert llm.chat(parts, greedy(max_tokens=2), use_tqdm=False)[0].prompt == \
        llm.chat(plain, greedy(max_tokens=2), use_tqdm=False)[0].prompt
    with pytest.raises(ValueError, match="text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    # The assistant's last message is continued: no end-of-turn after it, no new generation prompt.
    partial = plain + [{"role": "assistant", "content": "Sure,"}]
    out = llm.chat(partial, greedy(max_tokens=2), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\nSure,")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, use_tqdm=False, continue_final_message=True)
    for reserved in ("tokenizer", "add_special_tokens"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs.*{reserved}"):
            llm.chat(plain, use_tqdm=False, chat_template_kwargs={reserved: False})
    # As vLLM: chat_template_kwargs apply over the arguments of the same names.
    over = llm.chat(partial, greedy(max_tokens=2), use_tqdm=False,
                    chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True})
    assert over[0].prompt == out[0].prompt
    assert llm.chat(plain, greedy(max_tokens=2), use_tqdm=False, chat_template="x{{ 1 }}",
                    chat_template_kwargs={"chat_template": "y{{ 2 }}"})[0].prompt == "y2"


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
                        ("task", "embed"), ("logprobs_mode", "processed_logprobs"), ("enable_sleep_mode", True),
                        ("hf_overrides", {"rope_theta": 1.0}), ("mm_processor_kwargs", {"x": 1})):
        with pytest.raises(ValueError, match=name):
            LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, **{name: value})
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate(PROMPT, greedy(), use_tqdm=False, lora_request=object())
    for priority, message in (([1], "priority must be 0, got 1"), ([0, 0], r"one per prompt \(1\), got 2")):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPT, greedy(), use_tqdm=False, priority=priority)
    with pytest.raises(ValueError, match="tools must be a list of tool definitions"):
        llm.chat(plain, use_tqdm=False, tools={"type": "function"})
    with pytest.raises(ValueError, match="chat_template_content_format must be 'auto' or 'string'"):
        llm.chat(plain, use_tqdm=False, chat_template_content_format="openai")



def test_chat_tools_are_the_templates_to_show(llm):
    """As vLLM's offline chat: tools go to the chat template (the model answers in text)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[-1]['content'] }}"
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False, chat_template=template,
                   tools=tools)[0]
    assert out.prompt == "[get_weather]hi"
    assert llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False,
                    chat_template=template)[0].prompt == "hi"


# Metrics ------------------------------------------------------------------------------------------------------

EXPECTED_METRICS = {
    "vllm:num_requests_running": Gauge, "vllm:num_requests_waiting": Gauge, "vllm:kv_cache_usage_perc": Gauge,
    "vllm:num_preemptions": Counter, "vllm:prompt_tokens": Counter, "vllm:generation_tokens": Counter,
    "vllm:request_success": Counter, "vllm:time_to_first_token_seconds": Histogram,
    "vllm:e2e_request_latency_seconds": Histogram, "vllm:request_time_per_output_token_seconds": Histogram,
    "vllm:request_prompt_tokens": Histogram,
    "vllm:request_generation_tokens": Histogram,
}


def _metrics(llm: LLM) -> dict:
    out = {}
    for m in llm.get_metrics():
        key = m.name if m.name != "vllm:request_success" else (m.name, m.labels.get("finished_reason"))
        out[key] = m
    return out


def test_get_metrics(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=MAX_MODEL_LEN)
    # Every finish reason is there from the start, at 0 (as vLLM's labelled counter).
    assert {r: _metrics(llm)[("vllm:request_success", r)].value for r in ("stop", "length", "abort")} == \
        {"stop": 0, "length": 0, "abort": 0}
    for m in llm.get_metrics():
        assert isinstance(m.name, str) and m.name.startswith("vllm:")
        if isinstance(m, (Counter, Gauge)):
            assert isinstance(m.value, (int, float))
        elif isinstance(m, Vector):
            assert isinstance(m.values, list)
        else:
            assert isinstance(m, Histogram)
    prompts = [PROMPT, "hello world", "import os"]
    outs = llm.generate(prompts, [greedy(max_tokens=6, ignore_eos=True), greedy(max_tokens=3, ignore_eos=True),
                                  greedy(stop_token_ids=list(range(384)), max_tokens=5)], use_tqdm=False)
    after = _metrics(llm)
    names = {m.name for m in llm.get_metrics()}
    assert set(EXPECTED_METRICS) <= names
    for name, kind in EXPECTED_METRICS.items():
        found = [m for m in llm.get_metrics() if m.name == name]
        assert found and all(isinstance(m, kind) for m in found), name
    assert after["vllm:prompt_tokens"].value == sum(len(o.prompt_token_ids) for o in outs)
    assert after["vllm:generation_tokens"].value == 6 + 3 + 1
    assert after[("vllm:request_success", "length")].value == 2
    assert after[("vllm:request_success", "stop")].value == 1
    assert after["vllm:num_requests_running"].value == 0 and after["vllm:num_requests_waiting"].value == 0
    assert after["vllm:kv_cache_usage_perc"].value == 0.0
    assert after["vllm:num_preemptions"].value == 0
    ttft, e2e = after["vllm:time_to_first_token_seconds"], after["vllm:e2e_request_latency_seconds"]
    assert ttft.count == 3 and e2e.count == 3 and e2e.sum >= ttft.sum > 0
    assert list(e2e.buckets)[-1] == "+Inf" and e2e.buckets["+Inf"] == 3
    assert list(e2e.buckets.values()) == sorted(e2e.buckets.values())  # cumulative
    # Counters accumulate across calls.
    llm.generate(PROMPT, greedy(max_tokens=2, ignore_eos=True), use_tqdm=False)
    again = _metrics(llm)
    assert again["vllm:generation_tokens"].value == 12
    assert again[("vllm:request_success", "length")].value == 3


def test_tqdm_does_not_break_generation(llm, reference, capsys):
    out = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=True)
    assert out[0].outputs[0].token_ids == reference.token_ids


def test_vllm_flags_with_their_supported_values(tiny_llama):
    # vLLM configurations often spell these out; the supported value works, the other is a clear error.
    llm = LLM(str(tiny_llama), str(tiny_llama), enable_chunked_prefill=True, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 24, trust_remote_code=True, tokenizer_mode="auto", swap_space=4,
              quantization=None, revision=None, tokenizer_revision=None, download_dir=None, disable_log_stats=True,
              max_logprobs=20, kv_cache_dtype="auto")
    assert len(llm.generate("hi", greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="enable_prefix_caching must be True, False or None"):
        LLM(str(tiny_llama), enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True"):
        LLM(str(tiny_llama), enable_chunked_prefill=False)
    for name, value in [("quantization", "awq"), ("tokenizer_mode", "slow"), ("revision", "main"),
                        ("max_logprobs", 5), ("kv_cache_dtype", "fp8"), ("swap_space", -1)]:
        with pytest.raises(ValueError, match=name):
            LLM(str(tiny_llama), **{name: value})


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
    with pytest.raises(ValueError, match="multi_modal_data in a prompt is not supported"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": object()}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"unknown prompt key 'promt'; allowed: prompt, prompt_token_ids"):
        llm.generate({"promt": PROMPT}, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("params", [{"temperature": 0}, 5, [SamplingParams(), {"temperature": 0}]])
def test_sampling_params_of_another_type_are_named(llm, params):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, a list of them"):
        llm.generate(["a", "b"], params, use_tqdm=False)


@pytest.mark.parametrize("dtype", [[], {"a": 1}, 16])
def test_a_dtype_of_another_type_is_named(tiny_llama, dtype):
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        EngineArgs(model=str(tiny_llama), dtype=dtype).create_engine_config()


@pytest.mark.parametrize("prompts", [b"hello", bytearray(b"hi"), {5, 6, 7}])
def test_bytes_and_sets_are_no_prompts(llm, prompts):
    with pytest.raises(TypeError, match="prompts must be a string, a dict, token ids or a list of them"):
        llm.generate(prompts, greedy(), use_tqdm=False)
