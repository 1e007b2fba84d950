"""The adaptive policy's acceptance beliefs: the drafts a step expects from per-token rates."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_spec.spec_decode.acceptance import AcceptanceBeliefs, expected_drafts


def test_expected_drafts_respect_caps_and_clip_rates():
    """Position j counts the chance that drafts 1..j+1 all pass, only for sequences that may draft j+1
    (cap > j); beliefs outside [0, 0.999] are clipped (a drawn shift can push them out)."""
    expected = expected_drafts([0.5, 0.9, 1.2, -0.1], [1, 4, 2, 4], 4)
    per_position = [0.5 + 0.9 + 0.999, 0.81 + 0.999 ** 2, 0.729, 0.6561]
    assert expected == pytest.approx([0.0] + list(np.cumsum(per_position)))
    assert expected_drafts([], [], 4) == [0.0] * 5


@pytest.mark.parametrize("rate", [0.0, 0.37, 0.999, 1.3, -0.2])
def test_one_belief_for_all_takes_the_closed_form(rate):
    """Every sequence at one rate (the closed form) counts as the sequence-by-sequence sum does: the
    latter checked through a batch whose rates differ by nothing that shows (one rate 1e-15 off, or
    another that clips to the same)."""
    n = 37
    other = {0.0: -0.5, 1.3: 5.0, -0.2: -1.0}.get(rate, rate - 1e-15)
    general = expected_drafts([rate] * (n - 1) + [other], [5] * n, 5)
    assert expected_drafts([rate] * n, [5] * n, 5) == pytest.approx(general, rel=1e-12, abs=1e-12)
    clipped = min(max(rate, 0.0), 0.999)
    assert expected_drafts([rate] * n, [5] * n, 5)[2] == pytest.approx(n * (clipped + clipped ** 2))
    # The closed form never walks the rates sequence by sequence (the general sum does).
    same, mixed = _Watched([rate] * n), _Watched([rate] * (n - 1) + [other])
    expected_drafts(same, [5] * n, 5)
    expected_drafts(mixed, [5] * n, 5)
    assert not same.walked and mixed.walked


class _Watched(list):
    """A list that records whether it was iterated in Python (list.count reads it without that)."""

    walked = False

    def __iter__(self):
        self.walked = True
        return super().__iter__()


def test_drafts_a_proposer_may_not_find_count_by_the_chance_it_finds_them():
    """A sequence whose proposer finds drafts with chance f expects f times the drafts it would keep
    if it always found them: one chance for all scales the closed form, different ones weigh each
    sequence (caps as before)."""
    rates, caps = [0.5, 0.8, 0.8], [4, 4, 1]
    always = expected_drafts(rates, caps, 4)
    assert expected_drafts(rates, caps, 4, [1.0, 1.0, 1.0]) == pytest.approx(always)
    assert expected_drafts(rates, caps, 4, [0.0, 0.0, 0.0]) == [0.0] * 5
    per_position = [0.25 * 0.5 + 0.8 + 0.5 * 0.8, 0.25 * 0.25 + 0.64, 0.25 * 0.125 + 0.512, 0.25 * 0.0625 + 0.4096]
    expected = expected_drafts(rates, caps, 4, [0.25, 1.0, 0.5])
    assert expected == pytest.approx([0.0] + list(np.cumsum(per_position)))
    one = expected_drafts([0.6] * 8, [4] * 8, 4, [0.3] * 8)
    assert one == pytest.approx([0.3 * d for d in expected_drafts([0.6] * 8, [4] * 8, 4)])
    assert one == pytest.approx(expected_drafts([0.6] * 7 + [0.6 - 1e-15], [4] * 8, 4, [0.3] * 7 + [0.3 - 1e-15]))


@pytest.mark.parametrize("k", [1, 4])
def test_a_new_sequence_expects_the_mean_of_the_sequences_rates(k):
    """Half the sequences accept each draft with 0.9, half with 0.3: a sequence without trials of its
    own expects their mean, 0.6, whatever k they drafted (pooled trials, many more from the sequences
    at 0.9, said 0.77 at k = 4, and every new batch speculated until its own trials said otherwise)."""
    rng = np.random.default_rng(0)
    beliefs, rates = AcceptanceBeliefs(prior_acceptance=0.6), np.array([0.9, 0.3] * 64)
    for _ in range(200):
        passed = rng.random((len(rates), k)) < rates[:, None]
        accepted = np.cumprod(passed, axis=1).sum(axis=1)
        beliefs.observe(list(range(len(rates))), [k] * len(rates), accepted.tolist())
    assert beliefs.global_rate() == pytest.approx(0.6, abs=0.05)
    assert beliefs.rates([-1]) == [beliefs.global_rate()]
