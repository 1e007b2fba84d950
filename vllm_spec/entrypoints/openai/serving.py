"""What the endpoints share: the server state, OpenAI-style errors, request checks, the tokenizer
thread and the logprob values both wire formats use (submitting prompts and delivering outputs:
submission.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm_spec.engine.async_llm_engine import AsyncLLMEngine
from vllm_spec.entrypoints.chat_utils import render_chat
from vllm_spec.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    LogprobInfo,
    OpenAIServingError,
    PromptLogprobs,
)
from vllm_spec.outputs import Logprob
from vllm_spec.sampling_params import DEFAULT_MAX_LOGPROBS
from vllm_spec.structured_output.grammar import compiler_for

MIN_LOGPROB = -9999.0



# Server state ---------------------------------------------------------------------------------------
@dataclass
class ServerState:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    model_path: str
    tokenizer: Any = None
    api_keys: list[str] = field(default_factory=list)   # any of them (none: no key needed)
    force_include_usage: bool = False   # --enable-force-include-usage: every stream ends with its usage
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)   # under a request's own
    max_model_len: int = 0
    max_logprobs: int = DEFAULT_MAX_LOGPROBS   # the engine's (-1: the whole vocabulary)
    chat_template: str | None = None   # --chat-template: for requests that bring none
    chat_template_content_format: str = "auto"   # --chat-template-content-format
    response_role: str = "assistant"   # --response-role: the role of generated chat messages
    enable_prompt_tokens_details: bool = False   # usage.prompt_tokens_details.cached_tokens
    return_tokens_as_token_ids: bool = False   # --return-tokens-as-token-ids: requests' default
    trust_request_chat_template: bool = False   # else a request's own chat template is refused (as vLLM)
    tool_call_parser: str | None = None   # --enable-auto-tool-choice --tool-call-parser NAME
    log_requests: bool = False   # --enable-log-requests
    max_log_len: int | None = None   # --max-log-len: of the prompt in the request log
    # Tokenizing and chat templates run here, one at a time, never on the event loop: a long prompt
    # or a slow template must not stall every other client's stream.
    tokenizer_thread: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))
    # Sampling fields a request leaves unset take these (the model's generation config).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def in_tokenizer_thread(state: ServerState, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in the server's tokenizer thread."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_thread, functools.partial(fn, *args))


# Errors ---------------------------------------------------------------------------------------------
def error_response(status: int, message: str, err_type: str = "BadRequestError",
                   param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


# Request checks -------------------------------------------------------------------------------------
def client_request_id(raw_request: Request, request: Any) -> str | None:
    """The id a client gave its request (as vLLM: the X-Request-Id header, else the body's request_id),
    which the response's id carries; None: the server makes one up."""
    header = raw_request.headers.get("X-Request-Id")
    if header:
        return header
    body = (request.model_extra or {}).get("request_id")
    if body is not None and not isinstance(body, str):
        raise OpenAIServingError(f"request_id must be a string, got {body!r}.", param="request_id")
    return body or None


def check_model(state: ServerState, model: str | None) -> None:
    if model is None or model in state.served_model_names:
        return
    raise OpenAIServingError(f"The model `{model}` does not exist; this server serves "
                             f"{', '.join(repr(n) for n in state.served_model_names)}.", 404, "NotFoundError",
                             param="model")


def request_chat_template(state: ServerState, template: str | None, kwargs: dict[str, Any] | None) -> str | None:
    """The chat template to render with: the request's own where the server trusts requests' templates
    (a template is code: a slow one holds the tokenizer thread), else the server's."""
    if (template is not None or "chat_template" in (kwargs or {})) and not state.trust_request_chat_template:
        raise OpenAIServingError("this server does not take chat templates from requests (start it with "
                                 "--trust-request-chat-template to allow them).", param="chat_template")
    return template or state.chat_template


def render_messages(state: ServerState, request: Any, add_special_tokens: bool) -> dict[str, Any]:
    """{"prompt", "prompt_token_ids"} of a request's messages (a chat completion's or /tokenize's) under
    the chat template it may use; a 400 naming messages where they cannot be rendered."""
    tok = need_tokenizer(state)
    template = request_chat_template(state, request.chat_template, request.chat_template_kwargs)
    template_kwargs = {**state.default_chat_template_kwargs, **(request.chat_template_kwargs or {})}
    try:
        return render_chat(tok, [m.model_dump(exclude_none=True) for m in request.messages],
                           request.add_generation_prompt, request.continue_final_message, template,
                           add_special_tokens, template_kwargs, request.tools,
                           state.chat_template_content_format)
    except Exception as e:
        raise OpenAIServingError(f"could not apply the chat template: {e}", param="messages") from e


def compile_constraint(state: ServerState, request: Any) -> None:
    """Compile the request's structured-output constraint (it is cached for the engine), so that one
    that does not compile is a 400 naming the field it came in, and the engine's thread does not spend
    the compilation time while others' requests wait."""
    constraint = request.constraint
    if constraint is None or state.tokenizer is None:
        return   # (the engine refuses structured outputs without a tokenizer, naming them)
    params, sent_in = constraint
    try:
        compiler_for(state.engine.engine.config.model, state.tokenizer).compile(params)
    except ValueError as e:
        # A forced tool choice's schema is made of the tools' parameters: the tools are at fault.
        param = "tools" if sent_in == "tool_choice" else sent_in
        message = str(e)
        if param != "structured_outputs":
            message = message.replace(f"structured_outputs.{params.kind}", f"{param} ({params.kind})", 1)
        raise OpenAIServingError(message, param=param) from e


def need_tokenizer(state: ServerState):
    if state.tokenizer is None:
        raise OpenAIServingError("This server has no tokenizer (skip_tokenizer_init): send token-id prompts.")
    return state.tokenizer


# Logprob values (both wire formats) -----------------------------------------------------------------
def clamp_logprob(value: float) -> float:
    # JSON has no -inf/NaN; OpenAI clients expect a large negative number instead.
    return MIN_LOGPROB if math.isnan(value) else max(value, MIN_LOGPROB)


def tokens_as_ids(state: ServerState, request: Any) -> bool:
    """Whether the request's logprobs name tokens "token_id:<id>" (its field, else the server's flag)."""
    asked = request.return_tokens_as_token_ids
    return state.return_tokens_as_token_ids if asked is None else asked


def token_text(state: ServerState, tid: int, lp: Logprob | None, as_id: bool = False) -> str:
    """How logprobs name a token: its text, or "token_id:<id>" (asked for, or no tokenizer)."""
    if as_id:
        return f"token_id:{tid}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if state.tokenizer is not None:
        return state.tokenizer.decode([tid])
    return f"token_id:{tid}"


def prompt_logprobs_info(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """A prompt's logprobs as vLLM's responses carry them (logprobs clamped for JSON)."""
    if entries is None:
        return None
    return [None if entry is None else
            {tid: LogprobInfo(logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in entry.items()} for entry in entries]


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                   -kv[1].logprob))
    return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k] if k else []
