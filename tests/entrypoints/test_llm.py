"""The offline LLM API generating: prompts in every form, n, stop conditions, chat, metrics.

What it refuses (malformed prompts, engine keywords) is tested in test_llm_arguments.py; the shared
`llm` and `reference` fixtures are in conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_spec.entrypoints.llm import LLM
from vllm_spec.metrics import Counter, Gauge, Histogram, Vector
from vllm_spec.sampling_params import SamplingParams

from .offline_llm_helpers import MAX_MODEL_LEN, PROMPT, greedy


# Prompt forms ------------------------------------------------------------------------------------------

def test_token_id_prompts_match_text_prompts(llm, reference):
    ids = llm.get_tokenizer()(PROMPT).input_ids
    outs = llm.generate([{"prompt_token_ids": ids}, ids, PROMPT, {"prompt": PROMPT}],
                        greedy(ignore_eos=True), use_tqdm=False)
    assert all(o.prompt_token_ids == ids for o in outs)
    assert all(o.outputs[0].token_ids == reference.token_ids for o in outs)
    assert outs[0].prompt is None and outs[2].prompt == PROMPT
    single = llm.generate(ids, greedy(ignore_eos=True), use_tqdm=False)  # one prompt as a bare id list
    assert len(single) == 1 and single[0].outputs[0].token_ids == reference.token_ids


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


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(5, 25))
    cut = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=6, truncate_prompt_tokens=4), use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": ids[-4:]}, greedy(max_tokens=6), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # -1: the last max_model_len - 1 tokens (room for one new token).
    long_ids = [5 + i % 300 for i in range(MAX_MODEL_LEN + 7)]
    whole = llm.generate({"prompt_token_ids": long_ids}, greedy(max_tokens=6, ignore_eos=True,
                                                                 truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == long_ids[-(MAX_MODEL_LEN - 1):] and len(whole.outputs[0].token_ids) == 1


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
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 3"):
        greedy(n=3)


# Stop conditions ---------------------------------------------------------------------------------------

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
    # As vLLM: min_tokens holds EOS back with ignore_eos too (the EOS ids are always among the stop ids).
    both = model.generate(PROMPT, greedy(min_tokens=pos + 2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert both.token_ids[: pos + 2] == delayed.token_ids[: pos + 2] and both.finish_reason == "length"


# Chat --------------------------------------------------------------------------------------------------

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


def test_chat_tools_are_the_templates_to_show(llm):
    """As vLLM's offline chat: tools go to the chat template (the model answers in text)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[-1]['content'] }}"
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False, chat_template=template,
                   tools=tools)[0]
    assert out.prompt == "[get_weather]hi"
    assert llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False,
                    chat_template=template)[0].prompt == "hi"


# Metrics and progress bars -----------------------------------------------------------------------------

def test_request_metrics_and_unsupported_methods(llm, tiny_llama):
    out = llm.generate(PROMPT, greedy(max_tokens=4), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time == m.finished_time
    assert (m.first_token_ts, m.last_token_ts) == (m.first_token_time, m.last_token_time)   # vLLM V1's names
    assert m.first_token_latency == m.first_token_time - m.arrival_time >= 0
    for method in ("encode", "embed", "classify", "score", "reward"):
        with pytest.raises(NotImplementedError, match=method):
            getattr(llm, method)(PROMPT)
    tok = llm.get_tokenizer()
    bare = LLM(str(tiny_llama), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, max_model_len=MAX_MODEL_LEN)
    bare.set_tokenizer(tok)
    assert bare.get_tokenizer() is tok and bare.llm_engine.output_processor.tokenizer is tok
    assert tok.eos_token_id in bare.llm_engine.output_processor.eos_token_ids   # its EOS stops requests
    assert bare.generate(PROMPT, greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].text


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


def test_use_tqdm_may_be_the_bars_factory(llm):
    """As vLLM's: use_tqdm=functools.partial(tqdm, ...) makes the progress bar."""
    from tqdm import tqdm

    made = []

    def factory(*args, **kwargs):
        made.append(kwargs)
        return tqdm(*args, **{**kwargs, "disable": True})

    llm.generate([PROMPT, PROMPT], greedy(4), use_tqdm=factory)
    assert made and made[0]["total"] == 2
