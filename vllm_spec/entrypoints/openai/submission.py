"""Submitting a request's prompts to the engine (`submit`) and delivering the outputs either as one
final result (`Submission.collect`) or as an SSE stream (`Submission.stream`), with usage. The
endpoint modules only turn requests into prompts and outputs into their own response models.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from vllm_spec.beam_search import one_token_params
from vllm_spec.engine.async_llm_engine import AsyncStream, EngineDeadError, EngineStepError, RequestAbortedError
from vllm_spec.engine.async_stream import not_aborted
from vllm_spec.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    OpenAIServingError,
    PromptTokenUsageInfo,
    StreamOptions,
    UsageInfo,
    random_id,
    sampling_field_of,
)
from vllm_spec.entrypoints.openai.serving import ERROR_TYPES, ServerState
from vllm_spec.outputs import CompletionOutput, RequestOutput
from vllm_spec.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("vllm_spec.api_server")

# Engine failures that end a request early; the other exceptions are the server's own bugs.
_ENGINE_ERRORS = (EngineStepError, EngineDeadError, RequestAbortedError)


def _engine_error_status(exc: BaseException) -> int:
    # A failed step is the server's fault (500); a dead engine or an abort means "try again" (503).
    return 500 if isinstance(exc, EngineStepError) else 503


def _check_length(state: ServerState, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                  max_tokens_param: str) -> None:
    max_len = state.max_model_len
    if num_prompt_tokens == 0:
        raise OpenAIServingError("The prompt cannot be empty.", param=prompt_param)
    # vLLM's wording (clients parse it to lower max_tokens and retry); a prompt must leave room for
    # one new token, echo with max_tokens 0 too (the engine still runs one step for it).
    if num_prompt_tokens >= max_len:
        raise OpenAIServingError(
            f"This model's maximum context length is {max_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.", param=prompt_param)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_len:
        raise OpenAIServingError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_len} tokens and your request has {num_prompt_tokens} input tokens ({max_tokens} > "
            f"{max_len} - {num_prompt_tokens}).", param=max_tokens_param)


# Engine requests ------------------------------------------------------------------------------------
async def _add_all(state: ServerState, base_id: str, prompts: list[dict[str, Any]], params: SamplingParams,
                   prompt_param: str, priority: int) -> tuple[list[str], list[AsyncStream]]:
    """Add one engine request per prompt; on any failure abort those already added. The engine
    refuses what is wrong with a prompt (its token ids): prompt_param names the request's field."""
    ids: list[str] = []
    streams: list[AsyncStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = f"{base_id}-{i}"
            if state.log_requests:
                shown = {key: value[:state.max_log_len] if isinstance(value, (str, list)) else value
                         for key, value in prompt.items()}
                logger.info("Received request %s: %s, params: %s", rid, shown, params)
            streams.append(await state.engine.add_request(rid, prompt, params, priority=priority))
            ids.append(rid)
    except ValueError as e:
        state.engine.abort_nowait(ids)
        # The engine's refusals start with the field they are about: a sampling field (stop strings or
        # bad_words without a tokenizer, token ids outside the vocabulary) or priority is named, else the prompt.
        message = str(e)
        param = "priority" if message.startswith("priority") else sampling_field_of(message) or prompt_param
        raise OpenAIServingError(message, param=param) from e
    except EngineDeadError as e:
        state.engine.abort_nowait(ids)
        raise OpenAIServingError(str(e), 503, "ServiceUnavailableError") from e
    except BaseException:
        state.engine.abort_nowait(ids)
        raise
    return ids, streams


async def _not_aborted(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A request's outputs; its last one, when the engine aborted it (a server shutting down), is
    RequestAbortedError: the client gets the server's error for it, not a partial answer."""
    async for out in stream:
        yield not_aborted(out)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (prompt index, output)."""
    streams = [_not_aborted(s) for s in streams]
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
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


# Streaming ------------------------------------------------------------------------------------------
class ChoiceState:
    """What has been streamed of one choice: text length, token count, logprob text offset."""

    def __init__(self):
        self.sent_text = 0
        self.sent_tokens = 0
        self.text_offset = 0
        self.done = False

    def advance(self, comp: CompletionOutput) -> tuple[str, int, int]:
        """(new text, first new token index, end token index) to send now."""
        # The engine's text of an unfinished output holds back what could still become a stop string.
        delta = comp.text[self.sent_text:]
        self.sent_text += len(delta)
        start, end = self.sent_tokens, len(comp.token_ids)
        self.sent_tokens = end
        self.done = comp.finish_reason is not None
        return delta, start, end


def _sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _stream_error(exc: BaseException) -> str:
    status = _engine_error_status(exc)
    body = ErrorResponse(error=ErrorInfo(message=str(exc), type=ERROR_TYPES[status], code=status))
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


@dataclass
class Opening:
    """A chunk a stream sends before any output: one choice, and more of the chunk's fields."""

    choice: Any
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# Builds one streamed choice: (choice index, its request's output, the choice's output, new text, new
# tokens' start and end, its state); None: nothing to send yet (text a tool-call parser holds).
MakeChoice = Callable[[int, RequestOutput, CompletionOutput, str, int, int, ChoiceState], Any]


# Submission -----------------------------------------------------------------------------------------
@dataclass
class Submission:
    """One API request's engine requests (one per prompt, each with params.n choices). collect()
    and stream() abort them all when they end, so a failure or a gone client frees the KV cache."""

    state: ServerState
    base_id: str
    model: str
    params: SamplingParams
    prompt_token_ids: list[list[int]]   # each prompt's, as the engine got them (truncated)
    ids: list[str]
    streams: list[AsyncIterator[RequestOutput]]

    def usage(self, outputs: Sequence[RequestOutput | None]) -> UsageInfo:
        """Token counts over the latest output of each prompt (None: none yet)."""
        prompt = sum(len(ids) for ids in self.prompt_token_ids)
        completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
        details = None
        if self.state.enable_prompt_tokens_details:
            details = PromptTokenUsageInfo(cached_tokens=sum(o.num_cached_tokens for o in outputs if o is not None))
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=details)

    def choice_usage(self, idx: int, completion: int) -> UsageInfo:
        """As vLLM's continuous usage statistics: one choice's prompt and its completion tokens so far."""
        prompt = len(self.prompt_token_ids[idx // self.params.n])
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def abort(self) -> None:
        self.state.engine.abort_nowait(self.ids)

    async def collect(self, raw_request: Request) -> list[RequestOutput | None] | None:
        """Each prompt's final output, or None when the client went away first."""

        async def gather() -> list[RequestOutput | None]:
            final: list[RequestOutput | None] = [None] * len(self.streams)
            async for i, out in _merge(self.streams):
                final[i] = out
            return final

        try:
            return await _run_unless_disconnected(raw_request, gather())
        except _ENGINE_ERRORS as e:
            status = _engine_error_status(e)
            raise OpenAIServingError(str(e), status, ERROR_TYPES[status]) from e
        finally:
            self.abort()

    def stream(self, chunk_type: type, options: StreamOptions | None, opening: Sequence[Opening],
               make_choice: MakeChoice, every_token: bool = False) -> StreamingResponse:
        """The SSE response: the opening chunks, then one per choice that has something new (text,
        tokens with logprobs or with their ids where every_token, or its finish), then the usage chunk
        if asked, then [DONE]. chunk_type is the endpoint's stream response model."""
        events = self._events(chunk_type, options, opening, make_choice,
                              every_token or self.params.logprobs is not None)
        return _SSEResponse(events, on_close=self.abort)

    async def _events(self, chunk_type: type, options: StreamOptions | None, opening: Sequence[Opening],
                      make_choice: MakeChoice, every_token: bool) -> AsyncIterator[str]:
        include_usage = self.state.force_include_usage or bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)   # as vLLM: only with usage on
        n = self.params.n
        states = [ChoiceState() for _ in range(len(self.streams) * n)]
        last: list[RequestOutput | None] = [None] * len(self.streams)
        chunk = functools.partial(chunk_type, id=self.base_id, created=int(time.time()), model=self.model)
        try:
            for first in opening:
                event = chunk(choices=[first.choice], **first.fields)
                if continuous:   # as vLLM: every chunk carries its choice's usage, the opening ones too
                    event.usage = self.choice_usage(first.choice.index, 0)
                yield _sse(event)
            async for i, out in _merge(self.streams):
                last[i] = out
                for comp in out.outputs:
                    idx = i * n + comp.index
                    st = states[idx]
                    if st.done:
                        continue
                    delta, start, end = st.advance(comp)
                    if not delta and comp.finish_reason is None and (not every_token or start == end):
                        continue
                    choice = make_choice(idx, out, comp, delta, start, end, st)
                    if choice is None:
                        continue
                    event = chunk(choices=[choice])
                    if continuous:
                        event.usage = self.choice_usage(idx, len(comp.token_ids))
                    yield _sse(event)
            if include_usage:
                yield _sse(chunk(choices=[], usage=self.usage(last)))
        except _ENGINE_ERRORS as e:
            yield _stream_error(e)
        finally:
            self.abort()
        yield "data: [DONE]\n\n"


async def _beam_stream(state: ServerState, first: AsyncStream, request_id: str,
                       beam: BeamSearchParams) -> AsyncIterator[RequestOutput]:
    """A prompt's beams, searched on from its first step, as its stream's one (final) output."""
    async for out in _not_aborted(first):
        last = out
    yield await state.engine.continue_beam_search(last, request_id, beam)


async def submit(state: ServerState, id_prefix: str, model: str | None, prompts: list[dict[str, Any]],
                 params: SamplingParams, prompt_param: str, echo_only: bool = False,
                 max_tokens_param: str = "max_tokens", priority: int = 0,
                 beam: BeamSearchParams | None = None, request_id: str | None = None) -> Submission:
    """Check each prompt's length, then add them all to the engine as one Submission (prompt_param:
    the request field the prompts came from, which errors about them name; echo_only: the prompts
    are answered alone, so a prompt as long as the context fits though a token is generated; beam:
    beam search instead of sampling, each prompt's first step added as the other requests are;
    request_id: the client's id for the response, "<id_prefix>-<request_id>", its engine requests named
    after it with a random suffix, since clients may reuse an id)."""
    if params.truncate_prompt_tokens is not None:   # left truncation, before the length checks
        try:
            prompts = [{**p, "prompt_token_ids": params.truncate_prompt(p["prompt_token_ids"], state.max_model_len)}
                       for p in prompts]
        except ValueError as e:
            raise OpenAIServingError(str(e), param="truncate_prompt_tokens") from e
    for p in prompts:
        _check_length(state, len(p["prompt_token_ids"]), 0 if echo_only else params.max_tokens, prompt_param,
                      max_tokens_param)
    cap = state.sampling_defaults.get("max_tokens")
    if cap is not None and (params.max_tokens is None or params.max_tokens > cap):
        # As vLLM: the generation config's max_new_tokens bounds every completion (one left unbounded
        # stops at the context's end, before that bound where the context is shorter).
        try:
            params = dataclasses.replace(params, max_tokens=cap)
        except ValueError as e:   # e.g. min_tokens above the cap: the request's field is named
            raise OpenAIServingError(str(e), param=sampling_field_of(str(e))) from e
    response_id = random_id(id_prefix) if request_id is None else f"{id_prefix}-{request_id}"
    base_id = response_id if request_id is None else random_id(response_id)
    if beam is None:
        ids, streams = await _add_all(state, base_id, prompts, params, prompt_param, priority)
    else:
        try:
            one_token = one_token_params(beam, state.max_logprobs)
        except ValueError as e:
            raise OpenAIServingError(str(e).replace("beam_width", "n (the beam width)", 1), param="n") from e
        ids, firsts = await _add_all(state, base_id, prompts, one_token, prompt_param, priority)
        streams = [_beam_stream(state, first, rid, beam) for first, rid in zip(firsts, ids)]
    return Submission(state, response_id, model or state.model_name, params,
                      [list(p["prompt_token_ids"]) for p in prompts], ids, streams)
