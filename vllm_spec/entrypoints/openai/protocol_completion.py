"""OpenAI-compatible /v1/completions models (pydantic 2), with vLLM's extra fields."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, field_validator

from vllm_spec.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    OpenAIServingError,
    PromptLogprobs,
    SamplingFields,
    StreamedModel,
    UsageInfo,
)
from vllm_spec.sampling_params import DEFAULT_MAX_LOGPROBS, BeamSearchParams, SamplingParams


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("echo", mode="before")
    @classmethod
    def _echo_null_is_false(cls, value: Any) -> Any:
        return False if value is None else value   # OpenAI's schema: nullable, default false

    def to_sampling_params(self, defaults: dict[str, Any] | None = None,
                           max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplingParams:
        """max_logprobs: the engine's (-1: the whole vocabulary)."""
        self._check_unsupported()
        if self.suffix:
            raise OpenAIServingError("suffix is not supported.", param="suffix")
        # As vLLM (and OpenAI): echo with max_tokens 0 answers the prompt alone (its logprobs, the
        # use of it: scoring a text); the engine still runs one step for it.
        max_tokens = 1 if self.echo_only else self.max_tokens
        # As vLLM: an echo scores the prompt with the request's logprobs unless prompt_logprobs says.
        prompt_logprobs, sent_as = self.prompt_logprobs, {}
        if prompt_logprobs is None and self.echo:
            prompt_logprobs, sent_as = self.logprobs, {"prompt_logprobs": "logprobs"}
        return self._sampling_params(max_tokens, self.logprobs, defaults or {}, sent_as, prompt_logprobs,
                                     max_logprobs)

    def beam_search_params(self, params: SamplingParams, max_model_len: int) -> BeamSearchParams | None:
        if self.use_beam_search and self.echo:   # (beam steps score no prompt: nothing to echo its logprobs from)
            raise OpenAIServingError("use_beam_search cannot be combined with echo.", param="use_beam_search")
        return super().beam_search_params(params, max_model_len)

    @property
    def echo_only(self) -> bool:
        """The prompt is answered without the completion (echo with max_tokens 0)."""
        return self.echo and self.max_tokens == 0


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseStreamChoice(StreamedModel):
    omitted_when_none = ("prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None   # with return_token_ids (a stream: in a choice's first chunk)
    token_ids: list[int] | None = None          # with return_token_ids (a stream: the chunk's new tokens)


class CompletionResponseChoice(CompletionResponseStreamChoice):
    omitted_when_none = ()   # (a whole response has every field, as vLLM's)

    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(StreamedModel):
    omitted_when_none = ("usage",)

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
