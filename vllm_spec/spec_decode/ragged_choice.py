"""k per sequence for a step with prefill chunks in it (the adaptive policy's ragged case).

Verification then runs ragged (eagerly, no padding to one query length), so each sequence may draft
its own k: Dinkelbach's method on the linear cost model keeps a draft token while its expected value
beats its verification cost at the step's current goodput, for each cap K on the drafts.
"""

from __future__ import annotations

import numpy as np

from vllm_spec.spec_decode.step_cost import LinearFit


def choose_ragged(gains: np.ndarray, caps: np.ndarray, num_other_tokens: int, target: LinearFit,
                  draft_forward: float) -> np.ndarray:
    """[n] drafts: gains [n, max_k] is each sequence's chance that drafts 1..j all pass, caps [n] the
    most each may draft, target the fit of a target pass's seconds in its query tokens, draft_forward
    the seconds of one draft forward over the n sequences."""
    n, max_k = gains.shape
    j = np.arange(1, max_k + 1)
    base_q = num_other_tokens + n
    plain_rate = n / target(base_q)
    per_token = target(base_q + 1) - target(base_q)
    best_k, best_rate = np.zeros(n, dtype=int), plain_rate
    for K in range(1, int(min(max_k, caps.max())) + 1):
        draft_time = K * draft_forward
        allowed = j[None, :K] <= caps[:, None]
        rate = plain_rate
        for _ in range(3):
            take = np.cumprod((gains[:, :K] >= rate * per_token) & allowed, axis=1)
            k = take.sum(axis=1)
            rate_new = (n + float((take * gains[:, :K]).sum())) / (draft_time + target(base_q + int(k.sum())))
            if abs(rate_new - rate) < 1e-6 * rate:
                break
            rate = rate_new
        if rate_new > best_rate and k.max() > 0:
            best_k, best_rate = k, rate_new
    return best_k
