"""POST /v1/completions: text or token-id prompts (one or a batch), optional echo (with the prompt's
logprobs when logprobs are asked; with max_tokens 0 the prompt alone), legacy logprobs (tokens,
token_logprobs, top_logprobs, text_offset), vLLM's prompt_logprobs and token ids; streamed as SSE
with stream=true."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm_spec.entrypoints.openai import serving, submission
from vllm_spec.entrypoints.openai.protocol import OpenAIServingError
from vllm_spec.entrypoints.openai.protocol_completion import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm_spec.outputs import CompletionOutput, Logprob, RequestOutput


def _completion_prompts(state: serving.ServerState, request: CompletionRequest) -> list[dict[str, Any]]:
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
            tok = serving.need_tokenizer(state)
            out.append({"prompt": item, "prompt_token_ids": tok(item, add_special_tokens=request.add_special_tokens)
                        .input_ids})
        else:   # (its text, for echo, once the engine has accepted its ids)
            out.append({"prompt": None, "prompt_token_ids": list(item)})
    return out


def _completion_logprobs(state: serving.ServerState, token_ids: Sequence[int],
                         entries: Sequence[dict[int, Logprob] | None], k: int, offset: int,
                         as_ids: bool) -> tuple[CompletionLogProbs, int]:
    """Legacy logprobs of these tokens, their text offsets counted from `offset` (as_ids: tokens named
    "token_id:<id>"); an entry None (a prompt's first token, which nothing predicts) has neither
    logprob nor alternatives, as vLLM's."""
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid) if entry is not None else None
        text = serving.token_text(state, tid, lp, as_ids)
        out.tokens.append(text)
        out.token_logprobs.append(serving.clamp_logprob(lp.logprob) if lp is not None else None)
        if entry is None:
            out.top_logprobs.append(None)
        else:
            top = {serving.token_text(state, t, v, as_ids): serving.clamp_logprob(v.logprob)
                   for t, v in serving.top_entries(entry, k)}
            if lp is not None:
                top.setdefault(text, serving.clamp_logprob(lp.logprob))  # as vLLM: the sampled token is always listed
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def _echoed_logprobs(state: serving.ServerState, out: RequestOutput, k: int,
                     as_ids: bool) -> tuple[CompletionLogProbs, int]:
    """The prompt's logprobs, for echo, and the text offset the completion's continue from (the
    prompt's token texts: a BOS token's too, as vLLM's)."""
    if out.prompt_logprobs is None:
        raise RuntimeError("the engine returned no prompt logprobs for an echo with logprobs")
    return _completion_logprobs(state, out.prompt_token_ids, out.prompt_logprobs, k, 0, as_ids)


def _joined(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


async def create_completion(request: CompletionRequest, raw_request: Request):
    state = serving.server_state(raw_request)
    serving.check_model(state, request.model)
    params = request.to_sampling_params(state.sampling_defaults, state.max_logprobs)
    await serving.in_tokenizer_thread(state, serving.compile_constraint, state, request)
    prompts = await serving.in_tokenizer_thread(state, _completion_prompts, state, request)
    sub = await submission.submit(state, "cmpl", request.model, prompts, params, "prompt", echo_only=request.echo_only,
                                  priority=request.priority,
                                  beam=request.beam_search_params(params, state.max_model_len),
                                  request_id=serving.client_request_id(raw_request, request))
    n, k = params.n, params.logprobs
    as_ids, with_ids = serving.tokens_as_ids(state, request), bool(request.return_token_ids)
    # As vLLM: with return_token_ids the prompt comes back as its ids, so echo adds no text (its logprobs stay).
    echo = ([await serving.in_tokenizer_thread(state, _prompt_text, state, p) for p in prompts]
            if request.echo and not with_ids else [""] * len(prompts))
    # echo with max_tokens 0: the prompt (and its logprobs) alone, not the token generated for it.
    shown = 0 if request.echo_only else None

    def choice_logprobs(out: RequestOutput, comp: CompletionOutput, start: int, end: int,
                        offset: int) -> tuple[CompletionLogProbs, int]:
        """Logprobs of the choice's tokens [start, end) (and, from its first, the echoed prompt's first)."""
        echoed = None
        if request.echo and start == 0:
            echoed, offset = _echoed_logprobs(state, out, k, as_ids)
        lps, offset = _completion_logprobs(state, comp.token_ids[start:end][:shown], comp.logprobs[start:end][:shown],
                                           k, offset, as_ids)
        return (lps if echoed is None else _joined(echoed, lps)), offset

    def token_ids(comp: CompletionOutput, start: int, end: int) -> list[int] | None:
        return list(comp.token_ids[start:end][:shown]) if with_ids else None

    if request.stream:
        opened: set[int] = set()

        def choice(idx: int, out: RequestOutput, comp: CompletionOutput, delta: str, start: int, end: int,
                   st: submission.ChoiceState) -> CompletionResponseStreamChoice:
            # As vLLM: with echo, a choice's first chunk carries the prompt (text and logprobs) before
            # its first tokens.
            first = idx not in opened
            opened.add(idx)
            lps = None
            if k is not None and comp.logprobs is not None:
                lps, st.text_offset = choice_logprobs(out, comp, start, end, st.text_offset)
            return CompletionResponseStreamChoice(
                index=idx, text=(echo[idx // n] if first else "") + (delta if shown is None else ""), logprobs=lps,
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                prompt_token_ids=list(out.prompt_token_ids) if with_ids and first else None,
                token_ids=token_ids(comp, start, end))

        return sub.stream(CompletionStreamResponse, request.stream_options, [], choice, every_token=with_ids)

    final = await sub.collect(raw_request)
    if final is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for i, out in enumerate(final):
        prompt_logprobs = serving.prompt_logprobs_info(out.prompt_logprobs)
        for comp in out.outputs:
            lps = None
            if k is not None and comp.logprobs is not None:
                lps, _ = choice_logprobs(out, comp, 0, len(comp.token_ids), 0)
            choices.append(CompletionResponseChoice(
                index=i * n + comp.index, text=echo[i] + (comp.text if shown is None else ""), logprobs=lps,
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                prompt_logprobs=prompt_logprobs,
                prompt_token_ids=list(out.prompt_token_ids) if with_ids else None,
                token_ids=token_ids(comp, 0, len(comp.token_ids))))
    return JSONResponse(CompletionResponse(id=sub.base_id, model=sub.model, choices=choices,
                                           usage=sub.usage(final)).model_dump())


def _prompt_text(state: serving.ServerState, prompt: dict[str, Any]) -> str:
    """A prompt's text for echo: as sent, or its token ids decoded."""
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    return state.tokenizer.decode(prompt["prompt_token_ids"]) if state.tokenizer is not None else ""
