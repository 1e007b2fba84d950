"""vLLM's prompt types (`from vllm_spec.inputs import TokensPrompt`). They are typed dicts: plain dicts with
the same keys are the same prompts."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids."""

    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


# A prompt: text, one of the dicts above, or a list of token ids.
PromptType = str | TextPrompt | TokensPrompt | list[int]
