"""The adaptive policy's exploration: re-measuring choices near the best, probing speculation that does
not pay, checking plain steps while speculation pays, and what each is charged."""

from __future__ import annotations

import pytest

from vllm_spec.spec_decode.adaptive_policy import AdaptivePolicy
from vllm_spec.spec_decode.policy import StepShape
from vllm_spec.spec_decode.step_cost import Charge, StepCost
from vllm_spec.worker.batch import SpecStepStats


def test_near_best_choices_are_re_measured_one_at_a_time():
    """Nothing is accepted and drafts cost little (overhead-bound steps): plain decoding is best, with
    every k near it. Re-measuring them takes at most one step in explore_every / 2 once each
    has been measured (speculative steps the drawn acceptance asks for come on top: Thompson sampling)."""
    policy = AdaptivePolicy(max_k=4, explore_every=50)
    shape = StepShape([1], [4], 0)
    remeasured = 0
    for step in range(400):
        before = policy._costs.bucket_state(1).last_remeasure
        k = policy.choose(shape)[0]
        remeasured += step >= 200 and policy._costs.bucket_state(1).last_remeasure != before
        stats = SpecStepStats(1, k, 0, [0], 1e-4 * k, 5e-3, num_verified_tokens=k + 1) if k else \
            SpecStepStats(0, 0, 0, [], 0.0, 5e-3)
        policy.observe(shape, [k], [0], stats, Charge(5e-3 + 1e-4 * k))
    assert 1 <= remeasured <= 200 // 25


def test_an_expensive_probe_is_spaced_by_what_it_loses():
    """A draft forward costs five target steps: a probe loses five plain steps, so at 1% of the time
    it comes once in about 500 steps (not every explore_every steps)."""
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=5.0, explore_every=10)
    shape = StepShape([1, 2], [4, 4], 0)
    probes = []
    for step in range(1200):
        chosen = policy.choose(shape)
        if max(chosen):
            probes.append(step)
        draft = 0.05 * max(chosen)
        stats = SpecStepStats(2, sum(chosen), 0, [], draft, 0.01, num_verified_tokens=2 * (max(chosen) + 1))
        policy.observe(shape, chosen, [0, 0], stats, Charge(draft + 0.01))
    assert 1 <= len(probes) <= 3 and probes[0] >= 400, probes


def test_an_excursion_pays_its_way_back():
    """Plain decoding is best by 5% and a switch costs a plain step; k = 1 was last measured long ago
    (and speculation last ran longer ago than probes are spaced), so one step re-measures it, and the
    next returns: the way back belongs to the excursion, not to the choice to return (charged a
    switch, plain would lose to staying at k = 1)."""
    policy = AdaptivePolicy(max_k=1, prior_acceptance=0.5, prior_strength=1e6, explore_every=50)
    shape = StepShape([1], [1], 0)
    state = policy._costs.bucket_state(1)
    state.visits = 200
    state.catch_up, state.refill = 2e-3, 2e-3
    plain, spec = 4.0e-3, 1.5 * 4.0e-3 / 0.95
    policy._costs.measured = {(1, 0): StepCost(plain, at=200, samples=5), (1, 1): StepCost(spec, at=10, samples=5)}
    assert policy.choose(shape) == [1]
    assert not policy._speculating
    stats = SpecStepStats(1, 1, 1, [1], 0.3e-3, spec - 0.3e-3, num_verified_tokens=2)
    policy.observe(shape, [1], [1], stats, Charge(spec))
    assert policy.choose(shape) == [0]


def test_a_new_batch_size_starts_from_the_nearest_switching_cost():
    """Each part of a switch comes from the nearest batch size that measured it: a bucket that has
    only measured its catch-up borrows its neighbour's refill, and a measured 0 is a free switch."""
    policy = AdaptivePolicy(max_k=4)
    assert policy._costs.round_trip(16) == 0.0
    policy._costs.bucket_state(8).observe_switch(catch_up=2e-3, refill=1e-3)
    policy._costs.bucket_state(256).observe_switch(catch_up=9e-3, refill=3e-3)
    assert policy._costs.round_trip(16) == pytest.approx(3e-3)
    assert policy._costs.round_trip(200) == pytest.approx(12e-3)
    policy._costs.bucket_state(16).observe_switch(catch_up=4e-3)
    assert policy._costs.round_trip(16) == pytest.approx(4e-3 + 1e-3)
    policy._costs.bucket_state(200).observe_switch(catch_up=0.0, refill=0.0)
    assert policy._costs.round_trip(200) == 0.0
    policy._costs.bucket_state(200).observe_switch(catch_up=1e-3)
    assert policy._costs.round_trip(200) == pytest.approx(0.3e-3)


def test_re_measuring_speculation_where_it_does_not_pay_is_spaced_as_a_probe():
    """k = 1 was measured once, at five plain steps (the model, without speculation's host work, says
    about one): the lower of the two keeps it near the best, but speculating to re-measure it while
    plain decoding is best loses what a probe loses, so it waits as long as a probe would (1% of the
    time: about 400 steps), not explore_every steps."""
    policy = AdaptivePolicy(max_k=1, prior_acceptance=0.01, prior_strength=1e6, explore_every=50)
    policy._costs.modelled_cost = lambda n, k, state: 4.2e-3 if k else 4.0e-3
    policy._costs.measured = {(1, 0): StepCost(4.0e-3, at=99, samples=5), (1, 1): StepCost(20e-3, at=0, samples=1)}
    state = policy._costs.bucket_state(1)
    state.probe_every = 800   # the probe path stays out of it: this is the re-measurement rule
    shape = StepShape([1], [1], 0)
    state.visits = 100
    assert policy.choose(shape) == [0]
    state.visits = 420
    policy._costs.measured[(1, 0)].at = 419
    assert policy.choose(shape) == [1]
    assert state.last_remeasure == 421


def test_a_new_batch_size_weighs_switching_at_its_neighbours_cost():
    """Speculating wins 3% per step at 16 sequences, where no switch was measured yet; at 8 a switch
    cost 10 ms (over 2x a step, spread over the steps a choice lasts: 0.6 ms each): the policy does
    not switch, where with nothing borrowed the switch would look free."""
    def decide(borrow: bool) -> int:
        policy = AdaptivePolicy(max_k=1, prior_acceptance=0.5, prior_strength=1e6)
        if borrow:
            policy._costs.bucket_state(8).observe_switch(catch_up=6e-3, refill=4e-3)
        policy._costs.bucket_state(16).visits = 10
        policy._costs.measured = {(16, 0): StepCost(4.0e-3, at=10, samples=5),
                            (16, 1): StepCost(1.5 * 4.0e-3 / 1.03, at=10, samples=5)}
        return max(policy.choose(StepShape(list(range(16)), [1] * 16, 0)))

    assert decide(borrow=True) == 0
    assert decide(borrow=False) == 1


@pytest.mark.parametrize("reported", [False, True])
def test_probes_are_spaced_by_the_catch_up_they_grow(reported):
    """Plain decoding is best by about 3%; a probe also feeds the draft every token it missed, 0.3 ms
    a skipped step here (8 sequences), three times the probes' budget (1% of a 10 ms step): probes then
    come as rarely as they get. With the tokens fed unreported (catch-up seconds alone) the cost per
    token is modelled (the target's per query token, scaled by the draft's cost ratio), which here
    takes the budget too; before that model, probes came about every 60 steps, each paying more
    catch-up than the last one measured."""
    policy = AdaptivePolicy(max_k=1, prior_acceptance=0.45, prior_strength=1e6, explore_every=50)
    shape = StepShape(list(range(8)), [1] * 8, 0)
    probes, last = [], 0
    for step in range(3000):
        chosen = policy.choose(shape)
        if max(chosen) == 0:
            policy.observe(shape, chosen, [0] * 8, SpecStepStats(0, 0, 0, [], 0.0, 10e-3), Charge(10e-3))
            continue
        probes.append(step)
        gap, last = step - last, step
        catch_up = 0.3e-3 * gap
        stats = SpecStepStats(8, 8, 4, [4], catch_up + 1e-3, 14e-3, num_verified_tokens=16, catch_up_time=catch_up,
                              catch_up_tokens=8 * gap if reported else 0)
        policy.observe(shape, chosen, [1, 0] * 4, stats, Charge(15e-3))
    assert len(probes) <= 6 and all(b - a >= 400 for a, b in zip(probes[2:], probes[3:])), probes


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_plain_cost_measured_in_a_slow_phase_is_checked_again(pipelined):
    """Plain steps of 8 sequences were measured at 10 ms (the machine busy with other work), then take
    5 ms: speculation at acceptance 0.5 (8.5 ms for 12 tokens) beats the stale cost by far, too far for
    the near-best re-measurements, and loses against the real one. Plain steps are checked again
    (spaced as probes) and the policy goes back to them. Where plain steps pipeline, the first after
    speculation refills the pipeline (it measures the switch, not the plain step): a check takes two."""
    policy = AdaptivePolicy(max_k=1, prior_acceptance=0.5, prior_strength=1e6, explore_every=50)
    shape = StepShape(list(range(8)), [1] * 8, 0)
    plain_steps, previous = [], 1
    for step in range(1500):
        chosen = policy.choose(shape)
        K = max(chosen)
        if K == 0:
            seconds = 10e-3 if step < 5 else 5e-3
            refill = pipelined and previous > 0 and step >= 5
            plain_steps.append(step)
            policy.observe(shape, chosen, [0] * 8, SpecStepStats(0, 0, 0, [], 0.0, seconds),
                           Charge(seconds + (1e-3 if refill else 0.0), refill=refill))
        else:
            stats = SpecStepStats(8, 8, 4, [4], 0.5e-3, 8e-3, num_verified_tokens=16)
            policy.observe(shape, chosen, [1, 0] * 4, stats, Charge(8.5e-3))
        previous = K
    assert len(plain_steps) > 1000, "stayed with speculation on a stale plain cost"
    assert all(step in plain_steps for step in range(1400, 1500))
    if pipelined:   # every check from speculation ran plain twice in a row
        checks = [s for s in plain_steps if s >= 5 and s - 1 not in plain_steps]
        assert checks and all(s + 1 in plain_steps for s in checks)


@pytest.mark.parametrize("catches_up", [True, False])
def test_a_catch_up_not_yet_measured_is_not_taken_as_free(catches_up):
    """Plain decoding is best by 20% at batch 128 (a 1B-like draft: a forward 3 ms of a 14 ms k = 1
    step against 7.4 ms plain steps); the speculative steps so far fed no tokens the draft had missed
    (as right after prefill steps, which feed the draft the prompts). A probe after 60 plain steps
    would feed 128 x 60 tokens: until a catch-up is measured a token fed is taken to cost what the
    target's pass costs per query token, scaled by the draft's cost ratio, and probes come as rarely
    as they get. (Taken as free, the H100's first probe came after 60 plain steps and its catch-up
    took 15 ms, two plain steps.) A proposer with nothing to catch up (an n-gram lookup) is probed as
    its steps alone say: every 50-400 steps."""
    policy = AdaptivePolicy(max_k=1, prior_acceptance=0.5, prior_strength=1e6, explore_every=50,
                            catches_up=catches_up)
    n = 128
    shape = StepShape(list(range(n)), [1] * n, 0)
    speculative = []
    for step in range(1000):
        chosen = policy.choose(shape)
        if max(chosen) == 0:
            policy.observe(shape, chosen, [0] * n, SpecStepStats(0, 0, 0, [], 0.0, 7.4e-3), Charge(7.4e-3))
            continue
        speculative.append(step)
        stats = SpecStepStats(n, n, n // 2, [n // 2], 3e-3, 11e-3, num_verified_tokens=2 * n)
        policy.observe(shape, chosen, [1, 0] * (n // 2), stats, Charge(14e-3))
    assert len(speculative) >= 2 and speculative[0] < 50, speculative
    gaps = [b - a for a, b in zip(speculative, speculative[1:]) if b - a > 1]
    assert all(gap >= 400 for gap in gaps) if catches_up else 50 <= gaps[0] < 400, speculative


@pytest.mark.parametrize("k1_measured", [True, False])
def test_from_plain_decoding_a_new_kind_is_measured_next_to_it_only(k1_measured):
    """Plain decoding is best, k = 2 was measured and did not pay (nor did k = 1, where measured), and
    k = 3 is modelled within reach of the best but never measured at this batch size: a step of k = 3
    would pay both switches for a kind past one that lost, so it waits for a probe. An unmeasured k = 1,
    next to plain decoding, is still measured."""
    policy = AdaptivePolicy(max_k=3, prior_acceptance=0.5, prior_strength=1e6, explore_every=50)
    plain = 4.0e-3
    policy._costs.modelled_cost = lambda n, k, state: (1 - 0.5 ** (k + 1)) / 0.5 * plain / 0.93
    policy._costs.measured = {(1, 0): StepCost(plain, at=99, samples=5),
                              (1, 2): StepCost(1.75 * plain / 0.95, at=99, samples=5)}
    if k1_measured:
        policy._costs.measured[(1, 1)] = StepCost(1.5 * plain / 0.95, at=99, samples=5)
    state = policy._costs.bucket_state(1)
    state.visits, state.last_spec, state.probe_every = 100, 99, 800   # no probe is due
    assert policy.choose(StepShape([1], [3], 0)) == ([0] if k1_measured else [1])


@pytest.mark.parametrize("k3_measured", [True, False])
def test_while_speculating_a_new_kind_is_measured_next_to_the_best_only(k3_measured):
    """k = 2 is best as measured; k = 4 is modelled within reach of it but never measured. Where k = 3,
    between them, was measured and lost to k = 2, k = 4 is not tried (the rate falls past its peak);
    where k = 3 is new too, k = 3 is measured first."""
    policy = AdaptivePolicy(max_k=4, prior_acceptance=0.5, prior_strength=1e6, explore_every=50)
    plain, expected = 4.0e-3, lambda k: (1 - 0.5 ** (k + 1)) / 0.5
    policy._costs.modelled_cost = lambda n, k, state: expected(k) * plain / (1.2 * 0.95)
    policy._costs.measured = {(1, k): StepCost(expected(k) * plain / r, at=99, samples=5)
                              for k, r in [(0, 1.0), (1, 1.1), (2, 1.2)] + ([(3, 1.2 * 0.97)] if k3_measured else [])}
    policy._speculating = True
    state = policy._costs.bucket_state(1)
    state.visits = state.last_spec = 100
    assert policy.choose(StepShape([1], [4], 0)) == ([2] if k3_measured else [3])
