"""Constants and helpers shared by the offline LLM API tests (test_llm.py, test_llm_arguments.py)."""

from __future__ import annotations

from vllm_spec.sampling_params import SamplingParams

PROMPT = "def wrap(text, width=70):"
MAX_MODEL_LEN = 96


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
