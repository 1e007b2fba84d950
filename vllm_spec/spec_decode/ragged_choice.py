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


def choose_per_cap(gains: np.ndarray, caps: np.ndarray, seconds: Callable[[int, int], float],
                   per_token: np.ndarray, rates: np.ndarray, at_least_one: bool = False, iterate: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every cap K = 1..M on the drafts (M = gains.shape[1]) at once, the best choice found of at
    most K drafts per sequence (and its own cap): drafts [M, n], expected tokens [M], seconds [M].
    gains [n, M] is each sequence's chance that drafts 1..j all pass; seconds(K, drafts in all) a
    step's cost; per_token [M] a verified token's share of it; rates [M] the goodput to start from
    (tokens per second of a choice to beat). at_least_one: every sequence its cap allows drafts one
    (all-decoding steps: one that drafts none falls behind the draft, to be caught up later).
    iterate=False: drafts are kept against `rates` as given (what their time earns elsewhere), not against
    the rate the choice itself reaches.
    (All caps in one set of array operations: a choice runs at every step, at batch 256 too.)"""
    n, M = gains.shape
    j = np.arange(1, M + 1)
    allowed = j[None, None, :] <= np.minimum(j[:, None, None], caps[None, :, None])   # [M (K), n, M (j)]
    best_k, best_tokens, best_secs = np.zeros((M, n), dtype=np.int64), np.zeros(M), np.ones(M)
    for _ in range(3 if iterate else 1):
        keep = (gains[None] >= (rates * per_token)[:, None, None]) & allowed
        if at_least_one:
            keep[:, :, 0] = allowed[:, :, 0]
        take = np.cumprod(keep, axis=2)
        k = take.sum(axis=2)
        tokens = n + (take * gains[None]).sum(axis=(1, 2))
        secs = np.array([seconds(int(K), int(d)) for K, d in zip(j, k.sum(axis=1))])
        new = tokens / secs
        better = new > best_tokens / best_secs
        best_k[better], best_tokens[better], best_secs[better] = k[better], tokens[better], secs[better]
        if np.all(np.abs(new - rates) < 1e-6 * rates):
            break
        rates = new
    return best_k, best_tokens, best_secs


def choose_ragged(gains: np.ndarray, caps: np.ndarray, num_other_tokens: int, target: LinearFit,
                  draft_forward: float, switch: float = 0.0, worth: float = 0.0) -> np.ndarray:
    """[n] drafts for a step with prefill chunks: gains [n, max_k] is each sequence's chance that drafts
    1..j all pass, caps [n] the most each may draft, target the fit of a target pass's seconds in its
    query tokens, draft_forward the seconds of one draft forward over the n sequences, switch the seconds
    drafting in this step adds after it (where all-decoding steps do not speculate: the draft's catch-up
    and the refill of the plain step that follows).

    Drafts must bring tokens faster than the step's own plain rate and than `worth`, the tokens per second
    its time earns elsewhere (plain all-decoding steps of these sequences, where measured): a step slow
    with prefill chunks (eager, long) has a low rate of its own, against which any draft looked cheap."""
    n, max_k = gains.shape
    base_q = num_other_tokens + n
    plain_seconds = target(base_q)
    own = worth <= n / plain_seconds   # the step's own rate is the one to beat
    rate = n / plain_seconds if own else worth
    top = int(min(max_k, caps.max()))
    if top < 1:
        return np.zeros(n, dtype=int)
    per_token = target(base_q + 1) - target(base_q)
    k, tokens, secs = choose_per_cap(gains[:, :top], caps,
                                     lambda K, drafts: K * draft_forward + target(base_q + drafts) + switch,
                                     np.full(top, per_token), np.full(top, rate), iterate=own)
    drafting = k.max(axis=1) > 0
    # The best rate of the step (Dinkelbach), else the most tokens beyond the plain step's with the extra
    # time valued at what it earns elsewhere.
    value = np.where(drafting, tokens / secs - rate if own else tokens - n - rate * (secs - plain_seconds), 0.0)
    K = int(np.argmax(value))
    return k[K] if value[K] > 0 else np.zeros(n, dtype=int)
