"""The per-sequence k of steps with prefill chunks (Dinkelbach on the linear cost model)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_spec.spec_decode.ragged_choice import choose_per_cap, choose_ragged
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


def test_every_cap_gets_its_own_choice_and_all_decoding_steps_draft_one_at_least():
    """Caps K = 1..3 weighed at once: at K = 3 the sequence at 0.9 drafts all 3 and the one at 0.05 none
    (its chance is below a token's verification cost at the step's rate), or one with at_least_one (a
    sequence that drafts none falls behind the draft). Each cap's tokens and seconds are its choice's."""
    g = gains([0.9, 0.05])[:, :3]

    def seconds(K: int, drafts: int) -> float:
        return 1.0 + 0.1 * K + 0.05 * drafts

    caps, per_token, rates = np.array([4, 4]), np.full(3, 0.05), np.full(3, 2.0)
    k, tokens, secs = choose_per_cap(g, caps, seconds, per_token, rates)
    assert k.tolist() == [[1, 0], [2, 0], [3, 0]]
    assert secs[2] == pytest.approx(seconds(3, 3)) and tokens[2] == pytest.approx(2 + 0.9 + 0.81 + 0.729)
    k = choose_per_cap(g, caps, seconds, per_token, rates, at_least_one=True)[0]
    assert k.tolist() == [[1, 1], [2, 1], [3, 1]]
    # A cap of 0 still drafts nothing.
    assert choose_per_cap(g, np.array([4, 0]), seconds, per_token, rates, at_least_one=True)[0][2].tolist() == [3, 0]


def test_drafting_next_to_prefill_chunks_pays_for_its_switch():
    """Drafts that pay in the step alone are not taken where the switch they cause (the draft's
    catch-up, the refill of the plain step after them) takes what they bring, and are where it does not."""
    target = LinearFit(1.0, 0.01)
    g = gains([0.5] * 8)
    caps = np.array([4] * 8)
    assert choose_ragged(g, caps, 64, target, draft_forward=0.02).max() > 0
    assert choose_ragged(g, caps, 64, target, draft_forward=0.02, switch=0.02).max() > 0
    assert choose_ragged(g, caps, 64, target, draft_forward=0.02, switch=2.0).max() == 0


def test_drafts_next_to_prefill_chunks_beat_what_their_time_earns_elsewhere():
    """A long step (many prefill tokens) has a low rate of its own, against which drafts look cheap;
    where plain decoding of these sequences earns more per second than the drafts would, none are taken."""
    target = LinearFit(1.0, 0.01)
    g, caps = gains([0.5] * 8), np.array([4] * 8)
    # One draft each: 4 tokens expected for 0.02 + 0.08 s, 40 tokens/s; the step alone, 8 tokens in 7.4 s.
    assert choose_ragged(g, caps, 640, target, draft_forward=0.02).max() > 0
    assert choose_ragged(g, caps, 640, target, draft_forward=0.02, worth=20.0).max() > 0
    assert choose_ragged(g, caps, 640, target, draft_forward=0.02, worth=100.0).max() == 0
