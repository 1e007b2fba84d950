"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, n choices of one
assistant message, chat-style logprobs; streamed as SSE deltas with stream=true."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm_spec.entrypoints.chat_utils import text_content
from vllm_spec.entrypoints.openai import serving, submission
from vllm_spec.entrypoints.openai.protocol_chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    tool_call_id,
)
from vllm_spec.entrypoints.openai.tool_calls import read_tool_calls
from vllm_spec.outputs import CompletionOutput, Logprob, RequestOutput


def _chat_logprobs(state: serving.ServerState, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                   k: int, as_ids: bool) -> ChatCompletionLogProbs:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        text = serving.token_text(state, tid, lp, as_ids) if lp is not None or as_ids else ""
        tops = [ChatCompletionLogProb(token=(s := serving.token_text(state, t, v, as_ids)),
                                      logprob=serving.clamp_logprob(v.logprob),
                                      bytes=list(s.encode("utf-8", errors="replace")))
                for t, v in serving.top_entries(entry, k)]
        content.append(ChatCompletionLogProbsContent(
            token=text, logprob=serving.clamp_logprob(lp.logprob) if lp is not None else serving.MIN_LOGPROB,
            bytes=list(text.encode("utf-8", errors="replace")), top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)


async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
    state = serving.server_state(raw_request)
    serving.check_model(state, request.model)
    params = request.to_sampling_params(state.sampling_defaults, state.tool_call_parser is not None,
                                        state.max_logprobs)
    await serving.in_tokenizer_thread(state, serving.compile_constraint, state, request)
    reader = request.tool_call_reader()
    prompt = await serving.in_tokenizer_thread(state, serving.render_messages, state, request,
                                               request.add_special_tokens)
    role = state.response_role if request.add_generation_prompt else request.messages[-1].role
    echo = _echoed_text(request, role)
    sub = await submission.submit(state, "chatcmpl", request.model, [prompt], params, "messages",
                               max_tokens_param="max_completion_tokens" if request.max_completion_tokens is not None
                               else "max_tokens", priority=request.priority,
                               beam=request.beam_search_params(params, state.max_model_len),
                               request_id=serving.client_request_id(raw_request, request))
    k = params.logprobs
    as_ids, with_ids = serving.tokens_as_ids(state, request), bool(request.return_token_ids)

    if request.stream:
        parsers = [reader() for _ in range(params.n)] if reader is not None else None

        def choice(idx: int, out: RequestOutput, comp: CompletionOutput, delta: str, start: int, end: int,
                   st: submission.ChoiceState) -> ChatCompletionResponseStreamChoice | None:
            lps = None
            if k is not None and comp.logprobs is not None:
                lps = _chat_logprobs(state, comp.token_ids[start:end], comp.logprobs[start:end], k, as_ids)
            ids = list(comp.token_ids[start:end]) if with_ids else None
            calls, finish = None, comp.finish_reason
            if parsers is not None:
                parser = parsers[idx]
                delta, found = parser.feed(delta)
                if finish is not None:
                    rest, last = parser.finish()
                    delta, found = delta + rest, found + last
                    finish = _finish_reason(finish, parser.reports_calls and parser.num_calls > 0)
                calls = [DeltaToolCall(index=c.index, function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
                                       **({} if c.name is None else {"id": tool_call_id(), "type": "function"}))
                         for c in found]
                if not delta and not calls and finish is None and lps is None and not ids:
                    return None   # the parser holds this text (a call being written): no empty chunk
            return ChatCompletionResponseStreamChoice(
                index=idx, delta=DeltaMessage(content=delta or None, tool_calls=calls or None),
                logprobs=lps, finish_reason=finish, stop_reason=comp.stop_reason, token_ids=ids)

        # As OpenAI: each choice opens with a delta that carries only the role (as vLLM: and the prompt's
        # token ids where asked); as vLLM, an echo follows.
        ids_field = {"prompt_token_ids": sub.prompt_token_ids[0]} if with_ids else {}
        opening = [submission.Opening(ChatCompletionResponseStreamChoice(
            index=idx, delta=DeltaMessage(role=role, content="")), ids_field) for idx in range(params.n)]
        if echo:
            opening += [submission.Opening(ChatCompletionResponseStreamChoice(
                index=idx, delta=DeltaMessage(content=echo))) for idx in range(params.n)]
        return sub.stream(ChatCompletionStreamResponse, request.stream_options, opening, choice, with_ids)

    final = await sub.collect(raw_request)
    if final is None or final[0] is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for comp in final[0].outputs:
        parser = reader() if reader is not None else None
        content, found = read_tool_calls(parser, comp.text) if parser is not None else (comp.text, [])
        calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in found]
        if echo:
            content = echo + (content or "")
        choices.append(ChatCompletionResponseChoice(
            index=comp.index, message=ChatResponseMessage(role=role, content=content, tool_calls=calls),
            logprobs=(_chat_logprobs(state, comp.token_ids, comp.logprobs, k, as_ids)
                      if k is not None and comp.logprobs is not None else None),
            finish_reason=_finish_reason(comp.finish_reason, bool(calls) and parser.reports_calls),
            stop_reason=comp.stop_reason, token_ids=list(comp.token_ids) if with_ids else None))
    return JSONResponse(ChatCompletionResponse(
        id=sub.base_id, model=sub.model, choices=choices, usage=sub.usage(final),
        prompt_logprobs=serving.prompt_logprobs_info(final[0].prompt_logprobs),
        prompt_token_ids=sub.prompt_token_ids[0] if with_ids else None).model_dump())


def _echoed_text(request: ChatCompletionRequest, role: str) -> str:
    """What echo puts before each choice's content, as vLLM's: the last message's text where it has
    the generated message's role (continuing it), else nothing."""
    if not request.echo or request.messages[-1].role != role:
        return ""
    return text_content(request.messages[-1].content)   # (rendered already: its parts are text)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    # As vLLM: a choice that called tools reports "tool_calls" when it ends, whatever ended it.
    return "tool_calls" if called and reason is not None else reason
