"""/tokenize and /detokenize, as vLLM's server has them."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm_spec.entrypoints.openai import serving
from vllm_spec.entrypoints.openai.protocol import OpenAIBaseModel, OpenAIRequestModel, OpenAIServingError
from vllm_spec.entrypoints.openai.protocol_chat import ChatMessage


class TokenizeRequest(OpenAIRequestModel):
    """A text prompt, or a conversation rendered by the chat template (then special tokens are the
    template's: add_special_tokens defaults to false, as vLLM)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


def _token_ids(state: serving.ServerState, request: TokenizeRequest) -> list[int]:
    if request.messages is not None:
        return serving.render_messages(state, request, bool(request.add_special_tokens))["prompt_token_ids"]
    add = True if request.add_special_tokens is None else request.add_special_tokens
    return serving.need_tokenizer(state)(request.prompt, add_special_tokens=add).input_ids


async def tokenize(request: TokenizeRequest, raw_request: Request):
    state = serving.server_state(raw_request)
    serving.check_model(state, request.model)
    tok = serving.need_tokenizer(state)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIServingError("give exactly one of prompt and messages.", param="prompt")
    ids = await serving.in_tokenizer_thread(state, _token_ids, state, request)
    strs = tok.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                         token_strs=strs).model_dump())


async def detokenize(request: DetokenizeRequest, raw_request: Request):
    state = serving.server_state(raw_request)
    serving.check_model(state, request.model)
    tok = serving.need_tokenizer(state)
    vocab = len(tok)
    bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIServingError(f"token id {bad} is out of the vocabulary range [0, {vocab}).", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=tok.decode(request.tokens)).model_dump())
