"""Building a request's RequestOutput after a step, per its output kind."""

from __future__ import annotations

from vllm_spec.core.sequence import Request
from vllm_spec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm_spec.sampling_params import RequestOutputKind

_DELTA = RequestOutputKind.DELTA   # a module name: reading a member off its class runs Python code (3.11)


def make_request_output(request: Request, finished: bool, now: float) -> RequestOutput:
    """A request's RequestOutput after a step: everything so far, or (DELTA) what is new since the last."""
    # Built per streamed request per step: positional arguments (keywords cost twice as much).
    delta = request.sampling_params.output_kind is _DELTA
    completions = []
    for seq in request.seqs:
        tok, chars = (seq.num_reported_tokens, seq.num_reported_chars) if delta else (0, 0)
        params, text = seq.sampling_params, seq.output_text
        hold = params.output_text_buffer_length
        if hold and not seq.is_finished:
            text = text[:max(len(text) - hold, chars)]
        lps = seq.output_logprobs[tok:] if params.logprobs is not None else None
        completions.append(CompletionOutput(seq.index, text[chars:], seq.output_token_ids[tok:],
                                            None if lps is None else seq.cumulative_logprob, lps,
                                            seq.status.finish_reason, seq.stop_reason))
        if delta:
            seq.num_reported_tokens, seq.num_reported_chars = len(seq.output_token_ids), len(text)
    first = min((s.first_token_time for s in request.seqs if s.first_token_time is not None), default=None)
    metrics = RequestMetrics(request.arrival_time, first, now, now if finished else None)
    prompt_logprobs = request.seqs[0].prompt_logprobs
    if delta:
        prompt_logprobs = None if request.prompt_logprobs_reported else prompt_logprobs
        request.prompt_logprobs_reported = True
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                         prompt_logprobs, None, metrics, request.seqs[0].num_cached_tokens)
