"""The per-sequence k of steps with prefill chunks (Dinkelbach on the linear cost model)."""

from __future__ import annotations

import numpy as np

from vllm_spec.spec_decode.ragged_choice import choose_ragged
from vllm_spec.spec_decode.step_cost import LinearFit

MAX_K = 4


def gains(rates: list[float]) -> np.ndarray:
    return np.array(rates)[:, None] ** np.arange(1, MAX_K + 1)[None, :]


def test_sequences_likely_to_accept_draft_and_the_others_do_not():
    """Verification tokens cost 1% of a pass's fixed cost each and drafts little: the sequence at
    0.95 drafts every token its cap allows, the one at 0.01 none."""
    target = LinearFit(1.0, 0.01)
    k = choose_ragged(gains([0.95, 0.01, 0.95]), np.array([4, 4, 2]), 64, target, draft_forward=0.02)
    assert k.tolist() == [4, 0, 2]


def test_a_draft_token_is_kept_only_while_its_chance_beats_its_verification_cost():
    """Tokens as costly as the whole pass's fixed part: at 2 tokens over 11 s a draft token (1 s) pays
    above 0.18 expected tokens, so the sequence at 0.5 drafts (while its chances, 0.5^j, stay above)
    and the one at 0.15 does not."""
    k = choose_ragged(gains([0.5, 0.15]), np.array([4, 4]), 8, LinearFit(1.0, 1.0), 0.01)
    assert k[1] == 0 and 1 <= k[0] < MAX_K
    # A draft forward that costs more than what any draft can bring: none either.
    assert choose_ragged(gains([0.9, 0.9]), np.array([4, 4]), 8, LinearFit(1.0, 0.001), 10.0).tolist() == [0, 0]


def test_caps_of_zero_draft_nothing():
    target = LinearFit(1.0, 0.001)
    assert choose_ragged(gains([0.99, 0.99]), np.array([0, 0]), 8, target, 0.001).tolist() == [0, 0]
