"""Beam search (vLLM's `LLM.beam_search`): each step asks the engine for one token per live beam with
the top 2 x beam_width logprobs, extends every beam by each of them and keeps the beam_width best per
prompt. Beams that reach an end-of-sequence token are complete; the best beam_width of the complete and
the live ones come back, scored by cumulative logprob over length ** length_penalty (as vLLM's)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from vllm_spec.outputs import Logprob, RequestOutput
from vllm_spec.sampling_params import BeamSearchParams


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
    length = len(beam.tokens) - (beam.finish_reason == "stop" and beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / (length ** length_penalty)


def run_beam_search(step: Callable[[list[list[int]]], list[RequestOutput]], first: list[RequestOutput],
                    params: BeamSearchParams, eos_token_ids: Collection[int],
                    on_step: Callable[[], object] = lambda: None) -> list[BeamSearchOutput]:
    """Beam search from `first` (each prompt's first one-token step, with its top 2 x beam_width
    logprobs); `step(token_lists)` runs the next ones, a sequence per live beam."""
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
        on_step()
        beams = [beam for prompt_beams in live for beam in prompt_beams]
        if not beams or step_index == params.max_tokens - 1:
            break
        outputs = step([beam.tokens for beam in beams])
    results = []
    for finished, unfinished in zip(done, live):
        for beam in unfinished:
            beam.finish_reason = "length"
        best = sorted(finished + unfinished, key=lambda b: beam_score(b, eos_token_ids, params.length_penalty),
                      reverse=True)
        results.append(BeamSearchOutput(best[:width]))
    return results
