"""Sizing the KV cache: a budget too small for one max_model_len sequence is refused with the
smallest budget that works, and that budget does work (with and without lookahead slots)."""

from __future__ import annotations

import re

import pytest

from vllm_spec import LLM, SamplingParams


@pytest.mark.parametrize("speculative", [False, True])
def test_a_too_small_kv_cache_names_the_budget_that_fits(tiny_llama, speculative):
    spec = dict(speculative_model=str(tiny_llama), num_speculative_tokens=3) if speculative else {}
    with pytest.raises(ValueError, match="kv_cache_memory_bytes") as err:
        LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=4096, **spec)
    message = str(err.value)
    assert "max_model_len (128)" in message and f"{3 if speculative else 0} lookahead slots" in message
    needed = int(re.search(r"at least (\d+) bytes", message).group(1))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=needed - 1, **spec)
    llm = LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=needed, **spec)
    out = llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(temperature=0, max_tokens=28, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 28


def test_a_too_small_block_override_names_the_blocks_that_fit(tiny_llama):
    # 128 + 0 lookahead tokens in blocks of 16: 8 blocks, and one reserved.
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override to at least 9") as err:
        LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks_override=4)
    assert "kv_cache_memory_bytes" not in str(err.value)
    LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks_override=9)


def test_a_budget_below_one_block_reports_no_tokens(tiny_llama):
    with pytest.raises(ValueError, match=r"holds 0 tokens \(0 blocks"):
        LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=1)


def test_a_block_override_too_large_to_allocate_is_named(tiny_llama):
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=100000000000: a KV cache of \d+ bytes cannot be"):
        LLM(str(tiny_llama), num_gpu_blocks_override=10**11)
