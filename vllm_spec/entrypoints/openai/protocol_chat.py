"""OpenAI-compatible /v1/chat/completions models (pydantic 2), with vLLM's extra fields."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict, Field

from vllm_spec.entrypoints.openai.forced_tool_calls import ForcedToolCalls, check_tool_choice, forced_constraint
from vllm_spec.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    OpenAIRequestModel,
    OpenAIServingError,
    PromptLogprobs,
    SamplingFields,
    StreamedModel,
    UsageInfo,
)
from vllm_spec.entrypoints.openai.tool_calls import ToolCallStream
from vllm_spec.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


class ChatMessage(OpenAIRequestModel):
    model_config = ConfigDict(extra="allow")  # keep tool/name fields for templates that use them

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False   # the template writes them; True adds the tokenizer's too
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: each choice's content starts with the last message's where both have the same role.
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @property
    def parses_tool_calls(self) -> bool:
        """Tools given with tool_choice "auto" (their default): the output's tool calls are parsed."""
        return bool(self.tools) and (self.tool_choice or "auto") == "auto"

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to the calls' JSON."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def tool_call_reader(self) -> Callable[[], ToolCallStream | ForcedToolCalls] | None:
        """A new reader of one choice's tool calls (None: the output is text only)."""
        if self.forces_tool_calls:
            name = None if self.tool_choice == "required" else self.tool_choice["function"]["name"]
            return lambda: ForcedToolCalls(name)
        return ToolCallStream if self.parses_tool_calls else None

    def _forced_constraint(self) -> tuple[Callable[[], StructuredOutputsParams | None], str] | None:
        """tool_choice "required" or a named function forces its calls' JSON."""
        if not self.forces_tool_calls:
            return None
        return (lambda: forced_constraint(self.tool_choice, self.tools)), "tool_choice"

    def to_sampling_params(self, defaults: dict[str, Any] | None = None, auto_tool_choice: bool = False,
                           max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplingParams:
        """auto_tool_choice: the server parses tool calls out of the output (--enable-auto-tool-choice);
        max_logprobs: the engine's (-1: the whole vocabulary)."""
        self._check_unsupported()
        if not self.messages:
            raise OpenAIServingError("messages must not be empty.", param="messages")
        for i, tool in enumerate(self.tools or []):   # as vLLM's ChatCompletionToolsParam
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise OpenAIServingError(f'tools[{i}] must be {{"type": "function", "function": {{"name": <string>, '
                                         f'"parameters": ...}}}}, got {tool!r}.', param="tools")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise OpenAIServingError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if self.tools and self.parses_tool_calls and not auto_tool_choice:
            # As vLLM's server without --enable-auto-tool-choice: tools given default to "auto".
            raise OpenAIServingError(f"tool_choice {self.tool_choice or 'auto'!r} needs tool-call parsing: start the "
                                     "server with --enable-auto-tool-choice --tool-call-parser hermes, or use "
                                     "tool_choice \"none\" (the chat template still shows the tools to the model).",
                                     param="tool_choice")
        try:
            check_tool_choice(self.tool_choice, self.tools)
        except ValueError as e:
            raise OpenAIServingError(str(e), param="tool_choice") from e
        if self.top_logprobs and not self.logprobs:   # (as vLLM: 0 without logprobs asks for nothing)
            raise OpenAIServingError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise OpenAIServingError("add_generation_prompt and continue_final_message cannot both be true.",
                                     param="continue_final_message")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sent_as = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            sent_as["max_tokens"] = "max_completion_tokens"
        # As vLLM: an echo scores the prompt with the request's top_logprobs unless prompt_logprobs says.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs, sent_as["prompt_logprobs"] = self.top_logprobs or 0, "top_logprobs"
        return self._sampling_params(max_tokens, logprobs, defaults or {}, sent_as, prompt_logprobs, max_logprobs)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str   # JSON text, as OpenAI's


def tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=tool_call_id)
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(StreamedModel):
    omitted_when_none = ("name",)

    name: str | None = None
    arguments: str = ""


class DeltaToolCall(StreamedModel):
    """A streamed tool call or a piece of one (clients join a call's pieces by index): a call's first
    piece carries its id, type and function name."""

    omitted_when_none = ("id", "type")

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None   # with return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None   # with return_token_ids


class DeltaMessage(StreamedModel):
    """A streamed chunk's change: only what it sets (the first carries the role; the last may be {}),
    as OpenAI's and vLLM's streams."""

    omitted_when_none = ("role", "content", "tool_calls")

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(StreamedModel):
    omitted_when_none = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None   # with return_token_ids: the chunk's new tokens


class ChatCompletionStreamResponse(StreamedModel):
    omitted_when_none = ("usage", "prompt_token_ids")

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None   # with return_token_ids: in the opening chunks
