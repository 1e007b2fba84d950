"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLMEngine.

    python -m vllm_spec.entrypoints.openai.api_server MODEL [--host 127.0.0.1] [--port 8000]
        [--api-key KEY] [--served-model-name NAME ...] [engine flags, e.g. --speculative-model DRAFT]

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with stream=true as SSE),
GET /v1/models, GET /health, GET /metrics (Prometheus text), GET /version.
Bad requests get HTTP 400 with an OpenAI-style body {"error": {message, type, param, code}};
with --api-key every /v1 route needs `Authorization: Bearer <key>` (401 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import secrets
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_spec.engine.async_llm_engine import (
    AsyncLLMEngine,
    AsyncStream,
    EngineDeadError,
    EngineStepError,
    RequestAbortedError,
)
from vllm_spec.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIServingError,
    UsageInfo,
    random_id,
)
from vllm_spec.metrics import Counter, Gauge, Histogram, Vector
from vllm_spec.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_spec.sampling_params import SamplingParams

logger = logging.getLogger("vllm_spec.api_server")

VERSION = "0.1.0"
_MIN_LOGPROB = -9999.0


# Server state ---------------------------------------------------------------------------------------
@dataclass
class ServerState:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    model_path: str
    tokenizer: Any = None
    api_key: str | None = None
    max_model_len: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _error_response(status: int, message: str, err_type: str = "BadRequestError",
                    param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


# Auth (pure ASGI, so streaming and disconnect detection are untouched) ------------------------------
class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        if not secrets.compare_digest(auth, self.expected):
            response = _error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                       "AuthenticationError")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


# Helpers ---------------------------------------------------------------------------------------------
def _check_model(state: ServerState, model: str | None) -> None:
    if model is None or model in state.served_model_names:
        return
    raise OpenAIServingError(f"The model `{model}` does not exist; this server serves "
                             f"{', '.join(repr(n) for n in state.served_model_names)}.", param="model")


def _check_length(state: ServerState, num_prompt_tokens: int, params: SamplingParams) -> None:
    max_len = state.max_model_len
    if num_prompt_tokens == 0:
        raise OpenAIServingError("The prompt cannot be empty.", param="prompt")
    if num_prompt_tokens > max_len or (params.max_tokens is None and num_prompt_tokens >= max_len):
        raise OpenAIServingError(
            f"This model's maximum context length is {max_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens. Please reduce the length of the prompt.", param="prompt")
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_len:
        raise OpenAIServingError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{params.max_tokens} in the completion). Please reduce the length of the prompt or the "
            "completion (max_tokens).", param="max_tokens")


def _need_tokenizer(state: ServerState):
    if state.tokenizer is None:
        raise OpenAIServingError("This server has no tokenizer (skip_tokenizer_init): send token-id prompts.")
    return state.tokenizer


async def _add_all(state: ServerState, base_id: str, prompts: list[dict[str, Any]],
                   params: SamplingParams) -> tuple[list[str], list[AsyncStream]]:
    """Add one engine request per prompt; on any failure abort those already added."""
    ids: list[str] = []
    streams: list[AsyncStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = f"{base_id}-{i}"
            streams.append(await state.engine.add_request(rid, prompt, params))
            ids.append(rid)
    except ValueError as e:
        state.engine.abort(ids)
        raise OpenAIServingError(str(e)) from e
    except EngineDeadError as e:
        state.engine.abort(ids)
        raise OpenAIServingError(str(e), 503, "ServiceUnavailableError") from e
    except BaseException:
        state.engine.abort(ids)
        raise
    return ids, streams


async def _merge(streams: list[AsyncStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _run_unless_disconnected(request: Request, coro) -> Any:
    """Await coro; if the client goes away first, cancel it (the caller's finally aborts)."""
    work = asyncio.ensure_future(coro)
    listener = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        return None
    finally:
        listener.cancel()
        if not work.done():
            work.cancel()


def _usage(prompt_lens: Sequence[int], outputs: Sequence[RequestOutput | None]) -> UsageInfo:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _lp(value: float) -> float:
    return _MIN_LOGPROB if math.isnan(value) else max(value, _MIN_LOGPROB)


def _token_text(state: ServerState, tid: int, lp: Logprob) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    if state.tokenizer is not None:
        return state.tokenizer.decode([tid])
    return f"token_id:{tid}"


def _top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                   -kv[1].logprob))
    return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k] if k else []


def _completion_logprobs(state: ServerState, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                         k: int, offset: int) -> tuple[CompletionLogProbs, int]:
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        text = _token_text(state, tid, lp) if lp is not None else (state.tokenizer.decode([tid])
                                                                   if state.tokenizer else "")
        out.tokens.append(text)
        out.token_logprobs.append(_lp(lp.logprob) if lp is not None else None)
        top = {_token_text(state, t, v): _lp(v.logprob) for t, v in _top_entries(entry, k)}
        if lp is not None:
            top.setdefault(text, _lp(lp.logprob))  # as vLLM: the sampled token is always listed
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def _chat_logprobs(state: ServerState, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                   k: int) -> ChatCompletionLogProbs:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        text = _token_text(state, tid, lp) if lp is not None else ""
        tops = [ChatCompletionLogProb(token=(s := _token_text(state, t, v)), logprob=_lp(v.logprob),
                                      bytes=list(s.encode("utf-8", errors="replace")))
                for t, v in _top_entries(entry, k)]
        content.append(ChatCompletionLogProbsContent(
            token=text, logprob=_lp(lp.logprob) if lp is not None else _MIN_LOGPROB,
            bytes=list(text.encode("utf-8", errors="replace")), top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)


class _ChoiceState:
    """What has been streamed of one choice: text length, token count, logprob text offset."""

    def __init__(self, holdback: int, text_prefix: str = ""):
        self.holdback = holdback
        self.sent_text = 0
        self.sent_tokens = 0
        self.text_offset = len(text_prefix)
        self.done = False

    def advance(self, comp: CompletionOutput) -> tuple[str, int, int]:
        """(new text, first new token index, end token index) to send now."""
        finished = comp.finish_reason is not None
        text = comp.text
        # Hold back what could still become a stop string (it would be cut from the output).
        limit = len(text) if finished else max(self.sent_text, len(text) - self.holdback)
        delta = text[self.sent_text:limit] if limit > self.sent_text else ""
        self.sent_text = max(self.sent_text, limit)
        start, end = self.sent_tokens, len(comp.token_ids)
        self.sent_tokens = end
        self.done = finished
        return delta, start, end


def _holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0


def _sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _stream_error(exc: BaseException) -> str:
    status = 503 if isinstance(exc, (EngineDeadError, RequestAbortedError)) else 500
    body = ErrorResponse(error=ErrorInfo(message=str(exc), type=_ERROR_TYPES[status], code=status))
    return _sse(body)


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so its cleanup (the abort) runs as
    soon as the client is gone rather than whenever the generator is garbage-collected."""

    def __init__(self, content: AsyncIterator[str], on_close=None, **kwargs):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kwargs)
        self._gen = content
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self._gen.aclose()
            if self._on_close is not None:
                self._on_close()  # also covers a generator that never started


# Completions ------------------------------------------------------------------------------------------
def _completion_prompts(state: ServerState, request: CompletionRequest) -> list[dict[str, Any]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif not prompt:
        raise OpenAIServingError("prompt must not be empty.", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    out = []
    for item in items:
        if isinstance(item, str):
            tok = _need_tokenizer(state)
            out.append({"prompt": item, "prompt_token_ids": tok(item).input_ids})
        else:
            text = state.tokenizer.decode(item) if (state.tokenizer is not None and request.echo) else None
            out.append({"prompt": text, "prompt_token_ids": list(item)})
    return out


async def create_completion(request: CompletionRequest, raw_request: Request):
    state = _state(raw_request)
    _check_model(state, request.model)
    params = request.to_sampling_params()
    prompts = _completion_prompts(state, request)
    for p in prompts:
        _check_length(state, len(p["prompt_token_ids"]), params)
    base_id = random_id("cmpl")
    model = request.model or state.model_name
    prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]
    echo = [(p["prompt"] or "") if request.echo else "" for p in prompts]
    ids, streams = await _add_all(state, base_id, prompts, params)
    k = params.logprobs

    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)

        async def events() -> AsyncIterator[str]:
            n = params.n
            states = [_ChoiceState(_holdback(params), echo[i // n]) for i in range(len(prompts) * n)]
            last: list[RequestOutput | None] = [None] * len(prompts)
            created = int(time.time())
            try:
                if request.echo:
                    for idx in range(len(states)):
                        yield _sse(CompletionStreamResponse(id=base_id, created=created, model=model, choices=[
                            CompletionResponseChoice(index=idx, text=echo[idx // n])]))
                async for i, out in _merge(streams):
                    last[i] = out
                    for comp in out.outputs:
                        idx = i * n + comp.index
                        st = states[idx]
                        if st.done:
                            continue
                        delta, start, end = st.advance(comp)
                        if not delta and comp.finish_reason is None and (k is None or start == end):
                            continue
                        lps = None
                        if k is not None and comp.logprobs is not None:
                            lps, st.text_offset = _completion_logprobs(
                                state, comp.token_ids[start:end], comp.logprobs[start:end], k, st.text_offset)
                        chunk = CompletionStreamResponse(id=base_id, created=created, model=model, choices=[
                            CompletionResponseChoice(index=idx, text=delta, logprobs=lps,
                                                     finish_reason=comp.finish_reason,
                                                     stop_reason=comp.stop_reason)])
                        if continuous:
                            chunk.usage = _usage(prompt_lens, last)
                        yield _sse(chunk)
                if include_usage:
                    yield _sse(CompletionStreamResponse(id=base_id, created=created, model=model, choices=[],
                                                        usage=_usage(prompt_lens, last)))
            except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
                yield _stream_error(e)
            finally:
                state.engine.abort(ids)
            yield "data: [DONE]\n\n"

        return _SSEResponse(events(), on_close=lambda: state.engine.abort(ids))

    async def collect() -> list[RequestOutput]:
        final: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in _merge(streams):
            final[i] = out
        return final  # type: ignore[return-value]

    try:
        final = await _run_unless_disconnected(raw_request, collect())
    except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
        status = 500 if isinstance(e, EngineStepError) else 503
        return _error_response(status, str(e), _ERROR_TYPES[status])
    finally:
        state.engine.abort(ids)
    if final is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for i, out in enumerate(final):
        for comp in out.outputs:
            lps = None
            if k is not None and comp.logprobs is not None:
                lps, _ = _completion_logprobs(state, comp.token_ids, comp.logprobs, k, len(echo[i]))
            choices.append(CompletionResponseChoice(index=i * params.n + comp.index, text=echo[i] + comp.text,
                                                    logprobs=lps, finish_reason=comp.finish_reason,
                                                    stop_reason=comp.stop_reason))
    return JSONResponse(CompletionResponse(id=base_id, model=model, choices=choices,
                                           usage=_usage(prompt_lens, final)).model_dump())


# Chat completions -------------------------------------------------------------------------------------
def _chat_prompt(state: ServerState, request: ChatCompletionRequest) -> dict[str, Any]:
    tok = _need_tokenizer(state)
    messages = [m.to_template_dict() for m in request.messages]
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
    if request.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=request.add_generation_prompt,
                                       chat_template=request.chat_template, **kwargs)
    except Exception as e:
        raise OpenAIServingError(f"could not apply the chat template: {e}", param="messages") from e
    if not isinstance(text, str):
        raise OpenAIServingError("the chat template did not render to text.", param="messages")
    return {"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids}


async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
    state = _state(raw_request)
    _check_model(state, request.model)
    params = request.to_sampling_params()
    prompt = _chat_prompt(state, request)
    _check_length(state, len(prompt["prompt_token_ids"]), params)
    base_id = random_id("chatcmpl")
    model = request.model or state.model_name
    prompt_lens = [len(prompt["prompt_token_ids"])]
    ids, streams = await _add_all(state, base_id, [prompt], params)
    k = params.logprobs

    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)

        async def events() -> AsyncIterator[str]:
            states = [_ChoiceState(_holdback(params)) for _ in range(params.n)]
            last: list[RequestOutput | None] = [None]
            created = int(time.time())
            try:
                for idx in range(params.n):
                    yield _sse(ChatCompletionStreamResponse(id=base_id, created=created, model=model, choices=[
                        ChatCompletionResponseStreamChoice(index=idx, delta=DeltaMessage(role="assistant",
                                                                                         content=""))]))
                async for _, out in _merge(streams):
                    last[0] = out
                    for comp in out.outputs:
                        st = states[comp.index]
                        if st.done:
                            continue
                        delta, start, end = st.advance(comp)
                        if not delta and comp.finish_reason is None and (k is None or start == end):
                            continue
                        lps = None
                        if k is not None and comp.logprobs is not None:
                            lps = _chat_logprobs(state, comp.token_ids[start:end], comp.logprobs[start:end], k)
                        chunk = ChatCompletionStreamResponse(id=base_id, created=created, model=model, choices=[
                            ChatCompletionResponseStreamChoice(
                                index=comp.index, delta=DeltaMessage(content=delta) if delta else DeltaMessage(),
                                logprobs=lps, finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)])
                        if continuous:
                            chunk.usage = _usage(prompt_lens, last)
                        yield _sse(chunk)
                if include_usage:
                    yield _sse(ChatCompletionStreamResponse(id=base_id, created=created, model=model, choices=[],
                                                            usage=_usage(prompt_lens, last)))
            except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
                yield _stream_error(e)
            finally:
                state.engine.abort(ids)
            yield "data: [DONE]\n\n"

        return _SSEResponse(events(), on_close=lambda: state.engine.abort(ids))

    async def collect() -> RequestOutput | None:
        final = None
        async for _, out in _merge(streams):
            final = out
        return final

    try:
        final = await _run_unless_disconnected(raw_request, collect())
    except (EngineStepError, EngineDeadError, RequestAbortedError) as e:
        status = 500 if isinstance(e, EngineStepError) else 503
        return _error_response(status, str(e), _ERROR_TYPES[status])
    finally:
        state.engine.abort(ids)
    if final is None:
        return Response(status_code=499)
    choices = [
        ChatCompletionResponseChoice(
            index=comp.index, message=ChatResponseMessage(content=comp.text),
            logprobs=(_chat_logprobs(state, comp.token_ids, comp.logprobs, k)
                      if k is not None and comp.logprobs is not None else None),
            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
        for comp in final.outputs
    ]
    return JSONResponse(ChatCompletionResponse(id=base_id, model=model, choices=choices,
                                               usage=_usage(prompt_lens, [final])).model_dump())


# Metrics ------------------------------------------------------------------------------------------------
_METRIC_HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:num_preemptions": "Cumulative number of preemptions.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:engine_steps": "Number of engine steps run.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of end-to-end request latency in seconds.",
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
    "vllm:spec_decode_acceptance_rate": "Speculative token acceptance rate (accepted / draft tokens).",
    "vllm:spec_decode_mean_accepted_length": "Mean tokens emitted per speculating sequence and step.",
    "vllm:kv_cache_free_blocks": "Free KV-cache blocks.",
    "vllm:kv_cache_total_blocks": "Usable KV-cache blocks (free when idle).",
    "vllm:num_requests_in_flight": "Requests with an open output stream in the server.",
    "vllm:engine_step_errors": "Engine steps that raised (their in-flight requests failed).",
}


class EngineCollector:
    """Prometheus collector: renders the engine's latest metric snapshot at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        metrics, free_blocks = self.engine.get_metrics_nowait()
        metrics = list(metrics) + [
            Gauge("vllm:kv_cache_free_blocks", value=free_blocks),
            Gauge("vllm:kv_cache_total_blocks", value=self.engine.num_usable_blocks),
            Gauge("vllm:num_requests_in_flight", value=self.engine.num_in_flight),
            Counter("vllm:engine_step_errors", value=self.engine.num_step_errors),
        ]
        families: dict[str, Any] = {}
        label_names: dict[str, list[str]] = {}
        for m in metrics:
            extra = sorted(m.labels)
            if isinstance(m, Vector):
                extra = ["position"]
            names = ["model_name", *extra]
            fam = families.get(m.name)
            if fam is None:
                doc = _METRIC_HELP.get(m.name, m.name)
                if isinstance(m, (Counter, Vector)):
                    fam = CounterMetricFamily(m.name, doc, labels=names)
                elif isinstance(m, Gauge):
                    fam = GaugeMetricFamily(m.name, doc, labels=names)
                elif isinstance(m, Histogram):
                    fam = HistogramMetricFamily(m.name, doc, labels=names)
                else:
                    continue
                families[m.name] = fam
                label_names[m.name] = names
            if label_names[m.name] != names:
                continue  # inconsistent labels for one name: keep the first form
            values = [self.model_name, *(m.labels[k] for k in sorted(m.labels))]
            if isinstance(m, Vector):
                for pos, v in enumerate(m.values):
                    fam.add_metric([self.model_name, str(pos)], v)
            elif isinstance(m, Histogram):
                buckets = [(b, v) for b, v in m.buckets.items()]
                if not buckets or buckets[-1][0] != "+Inf":
                    buckets.append(("+Inf", m.count))
                fam.add_metric(values, buckets, m.sum)
            else:
                fam.add_metric(values, float(m.value))
        yield from families.values()


# App ------------------------------------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(EngineCollector(state.engine, state.model_name))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        logger.info("engine loop started; serving %s", ", ".join(state.served_model_names))
        try:
            yield
        finally:
            logger.info("shutting down the engine loop")
            await state.engine.shutdown()

    app = FastAPI(title="vllm_spec OpenAI-compatible server", version=VERSION, lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(OpenAIServingError)
    async def _serving_error(_: Request, exc: OpenAIServingError):
        return JSONResponse(exc.to_response().model_dump(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        parts, param = [], None
        for err in errors[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))} "
                             f"(at character {loc[0] if loc else '?'})")
            else:
                if param is None and loc:
                    param = loc[0]
                where = ".".join(loc) or "body"
                parts.append(f"{where}: {err.get('msg')}")
        return _error_response(400, "; ".join(parts) or "Invalid request.", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail),
                               _ERROR_TYPES.get(exc.status_code, "BadRequestError"))

    @app.get("/health")
    async def health():
        try:
            await state.engine.check_health()
        except EngineDeadError as e:
            return _error_response(503, str(e), "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
                 for name in state.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.post("/v1/completions")(create_completion)
    app.post("/v1/chat/completions")(create_chat_completion)

    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)
    return app


def build_state(engine: AsyncLLMEngine, model: str, served_model_names: Sequence[str] | None = None,
                api_key: str | None = None) -> ServerState:
    """Server state around a built engine; loads the server's own tokenizer copy (the engine's is
    used by the engine thread only)."""
    from vllm_spec.tokenizer import get_tokenizer

    cfg = engine.config.model
    tokenizer = get_tokenizer(cfg) if engine.tokenizer is not None else None
    names = [n for n in (served_model_names or []) if n] or [model]
    return ServerState(engine=engine, served_model_names=names, model_path=str(model), tokenizer=tokenizer,
                       api_key=api_key or None, max_model_len=cfg.max_model_len)


# Running ----------------------------------------------------------------------------------------------------
def _make_uvicorn_server(config):
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown (so the process dies by the
        signal); we shut down cleanly and exit 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if captured:
                    logger.info("graceful shutdown after signal(s) %s", captured)
                    captured.clear()

    return _Server(config)


def run_server(args: argparse.Namespace) -> int:
    """Load the engine from the parsed serve flags and serve until SIGINT/SIGTERM. Returns 0."""
    import uvicorn

    from vllm_spec.engine.arg_utils import EngineArgs

    logging.basicConfig(level=getattr(logging, str(args.uvicorn_log_level).upper(), logging.INFO),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    spec = engine.config.speculative
    logger.info("loaded %s in %.1f s (%s); KV blocks: %d; max_model_len %d", args.model,
                time.perf_counter() - t0,
                f"speculative: {spec.method}, k={spec.num_speculative_tokens}" if spec else "no speculation",
                engine.num_usable_blocks, engine.config.model.max_model_len)
    state = build_state(engine, args.model, args.served_model_name, args.api_key)
    app = build_app(state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on",
                            access_log=not args.disable_log_requests)
    server = _make_uvicorn_server(config)
    server.run()
    if engine.is_running:  # lifespan shutdown did not run (e.g. forced exit)
        engine.shutdown_background_loop()
    if not server.started:
        return 1  # e.g. the port was taken
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from vllm_spec.entrypoints.openai.cli_args import make_arg_parser, serve_main

    parser = make_arg_parser()
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
