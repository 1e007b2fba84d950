"""Beam search (vLLM's `LLM.beam_search`): each step asks the engine for one token per live beam with
the top 2 x beam_width logprobs, extends every beam by each of them and keeps the beam_width best per
prompt. Beams that reach an end-of-sequence token are complete; the best beam_width of the complete and
the live ones come back, scored by cumulative logprob over length ** length_penalty (as vLLM's)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Collection, Generator
from dataclasses import dataclass, field
from typing import Any

from vllm_spec.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_spec.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens then the generated ones, with each step's logprobs."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None   # "stop" (an end-of-sequence token) or "length"
    stop_reason: int | None = None     # the end-of-sequence token


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(beam: BeamSearchSequence, eos_token_ids: Collection[int], length_penalty: float) -> float:
    """vLLM's: cumulative logprob over the length (prompt included, a final end token not) ** penalty."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / (length ** length_penalty)


# A search's protocol: it yields the token lists of the live beams (one one-token request each) and is
# sent their outputs, in order, until it returns each prompt's best beams.
BeamSearch = Generator[list[list[int]], list[RequestOutput], list[BeamSearchOutput]]


def beam_search(first: list[RequestOutput], params: BeamSearchParams, eos_token_ids: Collection[int],
                max_model_len: int) -> BeamSearch:
    """Beam search from `first` (each prompt's first one-token step, with its top 2 x beam_width
    logprobs); the caller runs the steps it yields, so the offline and the async engine share it.
    Beams that reach the context's end (max_model_len) end there, finish_reason "length"."""
    width, stops = params.beam_width, () if params.ignore_eos else eos_token_ids
    live = [[BeamSearchSequence(list(out.prompt_token_ids))] for out in first]
    done: list[list[BeamSearchSequence]] = [[] for _ in first]
    outputs = first
    for step_index in range(params.max_tokens):
        at = 0
        for p, prompt_beams in enumerate(live):
            candidates = []
            for beam, out in zip(prompt_beams, outputs[at: at + len(prompt_beams)]):
                top = out.outputs[0].logprobs[0]
                for token, logprob in top.items():
                    grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                               beam.cum_logprob + logprob.logprob)
                    if token in stops:
                        grown.finish_reason, grown.stop_reason = "stop", token
                        done[p].append(grown)
                    else:
                        candidates.append(grown)
            at += len(prompt_beams)
            candidates.sort(key=lambda b: beam_score(b, eos_token_ids, params.length_penalty), reverse=True)
            live[p] = candidates[:width]
            if live[p] and len(live[p][0].tokens) >= max_model_len:   # (a step's beams are one length)
                done[p] += live[p]
                live[p] = []
        beams = [beam for prompt_beams in live for beam in prompt_beams]
        if not beams or step_index == params.max_tokens - 1:
            break
        outputs = yield [beam.tokens for beam in beams]
    results = []
    for finished, unfinished in zip(done, live):
        for beam in finished + unfinished:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(finished + unfinished, key=lambda b: beam_score(b, eos_token_ids, params.length_penalty),
                      reverse=True)
        results.append(BeamSearchOutput(best[:width]))
    return results


def one_token_params(params: BeamSearchParams, max_logprobs: int) -> SamplingParams:
    """What each beam's step asks the engine for (whose max_logprobs is given: -1, the vocabulary);
    ValueError for parameters it cannot ask for."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
    dataclasses.replace(params)   # checked again: fields may have changed since construction
    if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
        raise ValueError(f"beam_width must be at most {max_logprobs // 2} (each step asks for 2 x beam_width "
                         f"logprobs, and max_logprobs is {max_logprobs}), got {params.beam_width}.")
    return SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width)


def as_request_output(request_id: str, first: RequestOutput, result: BeamSearchOutput, tokenizer: Any,
                      eos_token_ids: Collection[int]) -> RequestOutput:
    """A prompt's beams as one finished request with a completion per beam (as vLLM's engine clients
    return them: the beam's new tokens, its text without a final end token)."""
    start = len(first.prompt_token_ids)
    completions = []
    for i, beam in enumerate(result.sequences):
        new = beam.tokens[start:]
        shown = new[:-1] if beam.finish_reason == "stop" and new and new[-1] in eos_token_ids else new
        completions.append(CompletionOutput(i, tokenizer.decode(shown) if tokenizer is not None else "", new,
                                            beam.cum_logprob, beam.logprobs, beam.finish_reason, beam.stop_reason))
    return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids), completions, finished=True,
                         metrics=first.metrics, num_cached_tokens=first.num_cached_tokens)


async def search_async(generate: Callable[[Any, str], Awaitable[RequestOutput]], first: RequestOutput,
                       request_id: str, params: BeamSearchParams, eos_token_ids: Collection[int],
                       max_model_len: int, tokenizer: Any) -> RequestOutput:
    """One prompt's beam search on an async engine, from its first step's output: `generate(prompt,
    request_id)` runs a one-token request; a step's beams run concurrently, and a failure or a
    cancellation cancels the others."""
    ids = itertools.count(1)
    search = beam_search([first], params, eos_token_ids, max_model_len)
    try:
        beams = next(search)
        while True:
            tasks = [asyncio.ensure_future(generate({"prompt_token_ids": t}, f"{request_id}-{next(ids)}"))
                     for t in beams]
            try:
                outputs = await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
            beams = search.send(list(outputs))
    except StopIteration as finished:
        return as_request_output(request_id, first, finished.value[0], tokenizer, eos_token_ids)
