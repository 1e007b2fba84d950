"""k per sequence where verification runs ragged (each sequence feeds its own drafts), with Dinkelbach's
method on the step's cost in its tokens: a sequence keeps a draft while the draft's chance of passing
beats its verification cost at the step's goodput.

With prefill chunks in the step (choose_ragged) every cap K on the drafts is weighed on the linear model;
all-decoding steps whose verification replays a ragged graph weigh each K from its measured cost
(adaptive_policy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_spec.spec_decode.step_cost import LinearFit


def choose_capped(gains: np.ndarray, caps: np.ndarray, seconds: Callable[[int, int], float], per_token: float,
                  rate: float, per_row: float = 0.0) -> tuple[np.ndarray, float, float]:
    """(drafts [n], expected tokens, seconds) of the best choice found of at most K = gains.shape[1]
    drafts per sequence (and its cap): gains [n, K] is each sequence's chance that drafts 1..j all
    pass, seconds(drafts in all, sequences drafting) the step's cost, per_token a verified token's
    share of it and per_row a drafting sequence's (the draft runs only for those), rate the goodput to
    start from (tokens per second of a choice to beat)."""
    n, K = gains.shape
    allowed = np.arange(1, K + 1)[None, :] <= caps[:, None]
    best: tuple[np.ndarray, float, float] | None = None
    for _ in range(3):
        take = np.cumprod((gains >= rate * per_token) & allowed, axis=1)
        k = take.sum(axis=1)
        gain = (take * gains).sum(axis=1)
        if per_row:   # a sequence drafts at all where its drafts pay for its rows of the draft too
            k = np.where(gain >= rate * (per_token * k + per_row), k, 0)
            gain = np.where(k > 0, gain, 0.0)
        tokens, secs = n + float(gain.sum()), seconds(int(k.sum()), int(np.count_nonzero(k)))
        if best is None or tokens / secs > best[1] / best[2]:
            best = (k, tokens, secs)
        if abs(tokens / secs - rate) < 1e-6 * rate:
            break
        rate = tokens / secs
    return best


def choose_ragged(gains: np.ndarray, caps: np.ndarray, num_other_tokens: int, target: LinearFit,
                  draft_forward: float) -> np.ndarray:
    """[n] drafts for a step with prefill chunks: gains [n, max_k] is each sequence's chance that drafts
    1..j all pass, caps [n] the most each may draft, target the fit of a target pass's seconds in its
    query tokens, draft_forward the seconds of one draft forward over the n sequences."""
    n, max_k = gains.shape
    base_q = num_other_tokens + n
    plain_rate = n / target(base_q)
    per_token = target(base_q + 1) - target(base_q)
    best_k, best_rate = np.zeros(n, dtype=int), plain_rate
    for K in range(1, int(min(max_k, caps.max())) + 1):
        k, tokens, secs = choose_capped(gains[:, :K], caps, lambda drafts, _: K * draft_forward + target(base_q + drafts),
                                        per_token, plain_rate)
        if tokens / secs > best_rate and k.max() > 0:
            best_k, best_rate = k, tokens / secs
    return best_k
