"""A prompt's chunking does not change a token's bits on the CPU kernels: the same prompt run whole, in
chunks of a token budget (one that speculation's verification tokens share), or from a prefix-cache hit
gives the same tokens with the same logprobs, in float32 and in bfloat16 (on AVX2 CPUs without bf16
arithmetic, where the kernels serve bfloat16). Before every chunk went through one attention kernel, a
chunk longer than 16 tokens took torch's SDPA, which rounded differently: bf16 ties broke either way, and
speculation changed greedy output where it changed the chunking."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FIXED, make_tiny_model

from vllm_spec import LLM, SamplingParams, cpu_ops
from vllm_spec.model import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no AVX2 CPU kernels here (or not buildable)")

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
KV = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=1 << 24, block_size=16)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """GQA with a sliding window shorter than the prompts (tiles of the kernel start mid-window)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("windowed"), "mistral", seed=26, hidden_size=96, head_dim=32,
                               num_attention_heads=8, num_key_value_heads=4, intermediate_size=200,
                               num_hidden_layers=3, sliding_window=33))


def _prompts() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in (70, 41, 9)]


def _tokens_and_logprobs(outputs) -> list[list[tuple[int, dict]]]:
    return [[(t, {i: lp.logprob for i, lp in step.items()}) for t, step in zip(o.outputs[0].token_ids,
                                                                              o.outputs[0].logprobs)]
            for o in outputs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunking_and_speculation_leave_every_bit(windowed, dtype):
    if dtype not in cpu_linear.dtypes():
        pytest.skip("this CPU multiplies bfloat16 in oneDNN (native bf16): its rounding depends on the rows")
    prompts = _prompts()
    whole = _tokens_and_logprobs(LLM(windowed, dtype=dtype, max_num_batched_tokens=256, **KV)
                                 .generate(prompts, PARAMS, use_tqdm=False))
    for budget in (16, 24, 37):
        chunked = LLM(windowed, dtype=dtype, max_num_batched_tokens=budget, **KV)
        assert _tokens_and_logprobs(chunked.generate(prompts, PARAMS, use_tqdm=False)) == whole, budget
    spec = LLM(windowed, dtype=dtype, max_num_batched_tokens=24, speculative_model=windowed,
               num_speculative_tokens=2, **FIXED, **KV)
    assert _tokens_and_logprobs(spec.generate(prompts, PARAMS, use_tqdm=False)) == whole
    cached = LLM(windowed, dtype=dtype, enable_prefix_caching=True, **KV)
    cached.generate(prompts[:1], PARAMS, use_tqdm=False)
    again = cached.generate(prompts, PARAMS, use_tqdm=False)
    assert again[0].num_cached_tokens > 0   # (its last blocks' worth of tokens recomputed as a short chunk)
    assert _tokens_and_logprobs(again) == whole
