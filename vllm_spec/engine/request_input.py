"""What a request may be given as, checked before the engine keeps anything of it: prompts, request
ids, and vLLM's request options this engine serves only at their neutral values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_spec.utils import is_int, is_unset

# vLLM's prompt dict keys. Those of multi-modal and embedding inputs are refused unless empty (a text-only
# model: an image would be silently dropped), cache_salt is harmless without prefix caching.
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
_UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "prompt_embeds", "token_type_ids")


def check_prompt_keys(prompt: dict) -> None:
    for key, value in prompt.items():
        if key in _UNSUPPORTED_PROMPT_KEYS:
            if not is_unset(value):
                raise ValueError(f"{key} in a prompt is not supported: this engine serves text-only models.")
        elif key not in _PROMPT_KEYS:
            allowed = ", ".join(_PROMPT_KEYS + _UNSUPPORTED_PROMPT_KEYS)
            raise ValueError(f"unknown prompt key {key!r}; allowed: {allowed} "
                             f"(the last {len(_UNSUPPORTED_PROMPT_KEYS)} empty).")


def as_token_ids(ids: Any) -> list[int]:
    """Prompt token ids as Python ints (numpy and torch integer arrays too); anything else is named."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {ids!r}.")
    ids = list(ids)
    bad = next((i for i, t in enumerate(ids) if not is_int(t)), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids must be integers, got {ids[bad]!r} ({type(ids[bad]).__name__}) "
                         f"at position {bad}.")
    return [int(t) for t in ids]


def check_request_id(request_id: object) -> None:
    """As vLLM's engines: a string (an int id could not be aborted by the same value: abort takes lists)."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {type(request_id).__name__}.")
    if not request_id:
        raise ValueError("request_id must be a non-empty string.")


def check_neutral(**values: Any) -> None:
    """vLLM's arguments for what this engine does not do: only their neutral (empty) values."""
    for name, value in values.items():
        if not is_unset(value):
            raise ValueError(f"{name} is not supported: it must be None, got {value!r}.")


def check_request_options(policy: str, lora_request: object = None, tokenization_kwargs: object = None,
                          trace_headers: object = None, priority: object = 0) -> None:
    """vLLM's add_request options: LoRA and tracing at their neutral values only; priority under the
    engine's scheduling policy."""
    check_neutral(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers)
    check_priority(priority, policy)


def check_priority(priority: object, policy: str) -> None:
    """An integer (lower runs first) with scheduling_policy="priority"; 0 otherwise, as vLLM."""
    if not is_int(priority):
        raise ValueError(f"priority must be an integer, got {priority!r}.")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority must be 0, got {priority!r}: requests are scheduled first come, first served "
                         "(start the engine with scheduling_policy='priority' to use priorities).")
