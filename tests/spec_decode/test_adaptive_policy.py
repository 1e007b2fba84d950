"""The adaptive speculation policy on synthetic costs and acceptance: the choices a goodput maximiser must make."""

from __future__ import annotations

import pytest

from vllm_spec.spec_decode.acceptance import expected_drafts
from vllm_spec.spec_decode.adaptive_policy import AdaptivePolicy
from vllm_spec.spec_decode.policy import ALWAYS_PAD_BATCH, StepShape, pads_verification, ragged_verification_tokens
from vllm_spec.spec_decode.step_cost import Charge, StepCost
from vllm_spec.worker.batch import SpecStepStats


def _train(policy: AdaptivePolicy, shape: StepShape, alphas: list[float], target_fixed: float,
           target_per_token: float, draft_per_forward: float, steps: int = 60) -> None:
    """Feed observations from a known cost model and per-sequence acceptance (expected values)."""
    for _ in range(steps):
        chosen = policy.choose(shape)
        if max(chosen, default=0) == 0:   # a plain step
            t = target_fixed + target_per_token * (shape.num_other_tokens + len(chosen))
            policy.observe(shape, chosen, [0] * len(chosen), SpecStepStats(0, 0, 0, [], 0.0, t), Charge(t))
            continue
        accepted = [min(k, round(k * a)) for k, a in zip(chosen, alphas)]
        q = shape.num_other_tokens + len(chosen) + sum(chosen)
        if shape.ragged_graphs:   # padded, or a ragged graph's tokens
            q = ragged_verification_tokens(len(chosen), max(chosen), q, policy.max_k + 1)
        elif shape.num_other_tokens == 0 and pads_verification(len(chosen), max(chosen), q, graphs=True):
            q = len(chosen) * (max(chosen) + 1)   # as the worker pads it
        stats = SpecStepStats(len(chosen), sum(chosen), sum(accepted), [], max(chosen) * draft_per_forward,
                              target_fixed + target_per_token * q, num_verified_tokens=q)
        policy.observe(shape, chosen, accepted, stats, Charge(stats.draft_time + stats.verify_time))


def test_cheap_draft_and_high_acceptance_speculate_deeply():
    policy = AdaptivePolicy(max_k=8, draft_cost_ratio=0.02)
    shape = StepShape([1], [8], 0)
    _train(policy, shape, [0.95], target_fixed=5e-3, target_per_token=1e-6, draft_per_forward=1e-4)
    assert policy.choose(shape)[0] >= 5
    assert policy.estimates().acceptance > 0.8


def test_compute_bound_batches_stop_speculating():
    # 256 sequences; every extra query token costs as much as a tenth of a step: verification
    # of drafts at acceptance 0.5 cannot pay for itself.
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.05)
    shape = StepShape(list(range(256)), [4] * 256, 0)
    _train(policy, shape, [0.5] * 256, target_fixed=5e-3, target_per_token=5e-4, draft_per_forward=2e-3)
    assert max(policy.choose(shape)) == 0


def test_memory_bound_batches_speculate():
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.05)
    shape = StepShape(list(range(8)), [4] * 8, 0)
    _train(policy, shape, [0.8] * 8, target_fixed=5e-3, target_per_token=1e-6, draft_per_forward=2e-4)
    assert min(policy.choose(shape)) >= 2


def test_low_acceptance_sequences_get_fewer_drafts():
    # Prefill chunks in the step: verification is ragged, fewer drafts verify fewer tokens.
    policy = AdaptivePolicy(max_k=6, draft_cost_ratio=0.05)
    shape = StepShape(list(range(64)), [6] * 64, 100)
    alphas = [0.95] * 32 + [0.2] * 32
    _train(policy, shape, alphas, target_fixed=5e-3, target_per_token=2e-5, draft_per_forward=3e-4)
    chosen = policy.choose(shape)
    assert min(chosen[:32]) > max(chosen[32:])


@pytest.mark.parametrize("batch", [ALWAYS_PAD_BATCH, 64])
def test_padded_verification_gives_every_sequence_the_same_k(batch):
    # Every sequence decoding: verification runs K+1 tokens per sequence whatever each one
    # drafted, so a draft up to K costs nothing more to verify.
    policy = AdaptivePolicy(max_k=6, draft_cost_ratio=0.05)
    shape = StepShape(list(range(batch)), [6] * batch, 0)
    alphas = [0.95] * (batch - 8) + [0.2] * 8
    _train(policy, shape, alphas, target_fixed=5e-3, target_per_token=2e-5, draft_per_forward=3e-4)
    chosen = policy.choose(shape)
    assert len(set(chosen)) == 1 and chosen[0] > 0


def test_ragged_graphs_give_low_acceptance_sequences_fewer_drafts():
    # Every sequence decoding, and a ragged graph replays verification of k per sequence: the tokens
    # it verifies cost, so the sequences at 0.2 draft fewer than those at 0.95 (one: a sequence that
    # drafts none falls behind the draft).
    policy = AdaptivePolicy(max_k=6, draft_cost_ratio=0.05)
    shape = StepShape(list(range(64)), [6] * 64, 0, ragged_graphs=True)
    alphas = [0.95] * 32 + [0.2] * 32
    _train(policy, shape, alphas, target_fixed=5e-3, target_per_token=2e-5, draft_per_forward=3e-4)
    chosen = policy.choose(shape)
    assert min(chosen[:32]) > max(chosen[32:]) and min(chosen) == 1


def test_a_per_sequence_choice_drafts_its_cap_somewhere():
    # A choice under cap K whose longest draft is shorter is a smaller cap's (K draft forwards would not
    # run, and its step would be measured under its longest draft): every one kept reaches its cap.
    policy = AdaptivePolicy(max_k=6, draft_cost_ratio=0.05)
    shape = StepShape(list(range(64)), [6] * 64, 0, ragged_graphs=True)
    alphas = [0.7] * 32 + [0.3] * 32
    _train(policy, shape, alphas, target_fixed=5e-3, target_per_token=6e-5, draft_per_forward=3e-4)
    n = len(shape.seq_ids)
    cost = {K: policy._costs.step_cost(n, K) for K in range(7)}
    beliefs = policy._acceptance.rates(shape.seq_ids)
    expected = {K: n + e for K, e in enumerate(expected_drafts(beliefs, shape.caps, 6))}
    choices = policy._per_sequence(n, beliefs, None, shape.caps, cost, expected)
    assert all(max(drafts) == K for K, (drafts, _, _) in choices.items()), choices.keys()


def test_policy_explores_after_a_long_pause():
    """Nothing is accepted and a draft forward costs half a target step: speculation never pays, but
    is still probed now and then, spaced so that probes lose about 1% of the time (a probe of k = 1
    loses 0.4-0.5 of a plain step: one in 40-50 steps)."""
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.5, explore_every=10)
    shape = StepShape([1, 2], [4, 4], 0)
    choices = []
    for _ in range(200):
        chosen = policy.choose(shape)
        choices.append(max(chosen))
        draft = 0.005 * max(chosen)
        stats = SpecStepStats(2, sum(chosen), 0, [], draft, 0.01, num_verified_tokens=2 * (max(chosen) + 1))
        policy.observe(shape, chosen, [0, 0], stats, Charge(draft + 0.01))
    probes = [i for i, c in enumerate(choices) if c > 0]
    assert probes and probes[-1] >= 150 and len(probes) <= 10, choices


def test_modelled_costs_are_in_seconds_when_decoding_comes_first():
    # No prefill step before (1-token prompts): the first steps the policy sees are plain decodes.
    # Its model of steps not measured yet must be calibrated against seconds, not the fit's prior.
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.05)
    shape = StepShape(list(range(8)), [4] * 8, 0)
    for _ in range(3):
        chosen = policy.choose(shape)
        assert max(chosen) == 0   # plain steps are measured first
        policy.observe(shape, chosen, [0] * 8, SpecStepStats(0, 0, 0, [], 0.0, 8e-3), Charge(10e-3))
    assert policy._costs.step_cost(8, 0) == pytest.approx(10e-3)
    # Drafting and verifying more tokens never looks cheaper than the measured plain step.
    assert all(policy._costs.step_cost(8, k) >= 10e-3 for k in range(1, 5))


def test_a_refill_teaches_the_switching_cost_not_the_plain_cost():
    """A plain step that could not overlap the speculative step before it (async scheduling): its cost
    must not enter the measured step costs, which decide k; what it cost beyond a plain step is
    what switching back costs."""
    policy = AdaptivePolicy(max_k=4)
    shape = StepShape([1, 2], [4, 4], 0)
    _train(policy, shape, [0.8, 0.8], 0.01, 1e-5, 0.001, steps=20)
    measured = {key: (c.seconds, c.samples) for key, c in policy._costs.measured.items()}
    rate = policy._acceptance.global_rate()
    stats = SpecStepStats(2, 4, 4, [2, 2], 0.002, 0.01, num_verified_tokens=6)
    policy.observe(shape, [2, 2], [2, 2], stats, Charge(0.015))
    measured[(2, 2)] = (policy._costs.measured[(2, 2)].seconds, policy._costs.measured[(2, 2)].samples)
    plain = policy._costs.measured[(2, 0)].seconds
    policy.observe(shape, [0, 0], [0, 0], SpecStepStats(0, 0, 0, [], 0.0, 0.5), Charge(plain + 0.004, refill=True))
    assert {key: (c.seconds, c.samples) for key, c in policy._costs.measured.items()} == measured
    assert policy._costs.buckets[2].refill == pytest.approx(0.004)
    assert policy._acceptance.global_rate() > rate   # two drafts accepted out of two


def test_a_switch_is_charged_to_the_choice_that_makes_it():
    """Speculating wins 2% per step here, less than a catch-up and a refill spread over the steps a
    choice lasts: a policy that speculates keeps speculating, one that does not keeps not (no flip
    at every step on estimates this close); with free switches both speculate."""
    def decide(speculating: bool, round_trip: float) -> int:
        policy = AdaptivePolicy(max_k=1, prior_acceptance=0.5, prior_strength=1e6)
        shape = StepShape([1], [1], 0)
        state = policy._costs.bucket_state(1)
        state.visits, state.probe_every = 10, 1000
        state.catch_up, state.refill = round_trip / 2, round_trip / 2
        # 1.5 expected tokens per speculative step: 1.02x the plain step's rate.
        policy._costs.measured = {(1, 0): StepCost(4.0e-3, at=10, samples=5),
                            (1, 1): StepCost(1.5 * 4.0e-3 / 1.02, at=10, samples=5)}
        policy._speculating = speculating
        return policy.choose(shape)[0]

    assert decide(speculating=True, round_trip=4e-3) == 1
    assert decide(speculating=False, round_trip=4e-3) == 0
    assert decide(speculating=False, round_trip=0.0) == 1


def test_drafts_next_to_prefill_chunks_pay_for_the_switch_back_to_plain_decoding():
    """Drafting in a step with prefill chunks pays there (cheap tokens, acceptance 0.9); where the
    all-decoding steps of as many sequences do not speculate it also costs a catch-up and a refill (here
    0.1 s, more than it brings), and is not taken; where they speculate the switch is theirs anyway, and
    it is. (Whatever steps of another batch size do.)"""
    def decide(decoding_speculates: bool) -> list[int]:
        policy = AdaptivePolicy(max_k=4, prior_acceptance=0.9, prior_strength=1e6)
        state = policy._costs.bucket_state(8)
        state.catch_up, state.refill = 0.05, 0.05
        state.speculates = decoding_speculates
        policy._costs.bucket_state(64).speculates = not decoding_speculates
        policy._costs.target.update(72, 5e-3)   # seconds: a pass of 72 tokens
        return policy.choose(StepShape(list(range(8)), [4] * 8, 64))

    assert min(decide(decoding_speculates=True)) >= 1
    assert decide(decoding_speculates=False) == [0] * 8

    # A choice for all-decoding steps records whether it holds to speculation at its batch size.
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.05)
    decoding = StepShape(list(range(8)), [4] * 8, 0)
    assert max(policy.choose(decoding)) == 0 and not policy._costs.decoding_speculates(8)   # plain steps first
    _train(policy, decoding, [0.8] * 8, target_fixed=5e-3, target_per_token=1e-6, draft_per_forward=2e-4)
    assert policy._costs.decoding_speculates(8) and not policy._costs.decoding_speculates(64)


def test_a_sequence_that_stops_drafting_forgets_its_own_trials():
    policy = AdaptivePolicy(max_k=4)
    shape = StepShape([1], [4], 0)
    stats = SpecStepStats(1, 4, 0, [0], 0.001, 0.01, num_verified_tokens=5)
    for _ in range(5):   # five rejections at the first draft
        policy.observe(shape, [4], [0], stats, Charge(0.012))
    low = policy._acceptance.rates([1])[0]
    for _ in range(40):   # plain steps: its own counts fade, its belief returns to the global one
        policy.observe(shape, [0], [0], SpecStepStats(0, 0, 0, [], 0.0, 0.01), Charge(0.01))
    rate = policy._acceptance.rates([1])[0]
    assert rate > low
    assert rate == pytest.approx(policy._acceptance.global_rate(), abs=0.02)
    for _ in range(60):   # once its trials are negligible they are dropped: the global belief exactly
        policy.observe(shape, [0], [0], SpecStepStats(0, 0, 0, [], 0.0, 0.01), Charge(0.01))
    assert 1 not in policy._acceptance.seqs
    assert policy._acceptance.rates([1, 2]) == [policy._acceptance.global_rate()] * 2


def test_belief_reports_what_a_choice_weighs():
    policy = AdaptivePolicy(max_k=2)
    policy._costs.measured = {(8, 0): StepCost(4.0e-3, at=1, samples=5), (8, 1): StepCost(6.0e-3, at=1, samples=5)}
    policy._costs.bucket_state(8).observe_switch(catch_up=1e-3, refill=2e-3)
    belief = policy.belief(8)
    assert belief.step_seconds[0] == 4.0e-3 and belief.step_seconds[1] == 6.0e-3
    assert sorted(belief.step_seconds) == [0, 1, 2] and belief.step_seconds[2] > 0
    assert belief.round_trip == pytest.approx(3e-3) and not belief.speculating
    assert belief.acceptance == pytest.approx(policy.prior_acceptance)


def test_sequences_near_their_length_limit_draft_no_more_than_their_caps():
    """Decoding sequences whose caps differ (max_model_len close for some): each drafts min(K, cap),
    none past its cap, and a batch whose caps are all 0 drafts nothing."""
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.02)
    shape = StepShape([1, 2, 3, 4], [0, 2, 4, 1], 0)
    _train(policy, shape, [0.9] * 4, target_fixed=5e-3, target_per_token=1e-6, draft_per_forward=1e-4)
    chosen = policy.choose(shape)
    assert chosen == [min(c, max(chosen)) for c in shape.caps] and max(chosen) == 4
    assert policy.choose(StepShape([5, 6], [0, 0], 0)) == [0, 0]


def test_a_prepared_choice_serves_the_next_step_of_the_same_shape_once():
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.02)
    shape = StepShape([1, 2], [4, 4], 0)
    _train(policy, shape, [0.9, 0.9], target_fixed=5e-3, target_per_token=1e-6, draft_per_forward=1e-4)
    made = []
    choose = policy._choose
    policy._choose = lambda s: made.append(s) or choose(s)
    state = policy._costs.bucket_state(2)
    visits = state.visits
    policy.prepare(shape)
    assert state.visits == visits   # prepared, not taken: no bookkeeping yet
    prepared = policy.choose(StepShape([1, 2], [4, 4], 0))   # an equal shape: no second choice
    assert made == [shape] and max(prepared) > 0 and state.visits == visits + 1
    policy.choose(shape)   # used once: the next step chooses again
    assert len(made) == 2 and state.visits == visits + 2
    policy.prepare(shape)
    other = StepShape([1, 2], [4, 1], 0)   # one sequence near its length limit: a new choice
    assert max(policy.choose(other)[1:]) <= 1 and made[-1] == other and len(made) == 4
    assert state.visits == visits + 3   # the dropped choice left no trace


def test_a_dropped_choice_books_no_probe():
    """Where plain decoding pays, speculation is probed ever more rarely: a probe prepared for a step
    that then looked different must not count as run (nor double the spacing)."""
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.5, explore_every=10)
    shape = StepShape(list(range(8)), [4] * 8, 0)
    _train(policy, shape, [0.1] * 8, target_fixed=5e-3, target_per_token=1e-6, draft_per_forward=4e-3, steps=200)
    state = policy._costs.bucket_state(8)
    state.last_spec, state.probe_every = state.visits - 1000, 10   # a probe is due
    before = (state.last_spec, state.probe_every)
    policy.prepare(shape)
    assert max(policy._ahead[1].drafts) > 0   # the prepared choice probes
    # A different step chooses again: the probe is still due, and booked once.
    assert max(policy.choose(StepShape(list(range(8)), [4] * 7 + [3], 0))) > 0
    assert state.last_spec == state.visits and (before[1], state.probe_every) == (10, 20)


def test_the_steps_after_a_prefill_do_not_inflate_a_known_cost():
    """The first all-decoding steps after one with prefill chunks pay one-off costs whatever their k
    (about 3 ms at batch 64-128 on an H200; the first two 10-30% on an H100): they must not raise a
    measured plain cost (a plain cost inflated this way held the policy to speculation that lost), yet
    they are what a still unmeasured or stale cost learns from."""
    policy = AdaptivePolicy(max_k=4, explore_every=50)
    decoding, mixed = StepShape(list(range(8)), [4] * 8, 0), StepShape(list(range(8)), [4] * 8, 64)

    def plain(shape: StepShape, seconds: float) -> None:
        chosen = [0] * len(shape.seq_ids)
        policy.choose(shape)
        policy.observe(shape, chosen, chosen, SpecStepStats(0, 0, 0, [], 0.0, 4e-3), Charge(seconds))

    plain(mixed, 20e-3)
    plain(decoding, 9e-3)   # unmeasured: the first sample counts
    assert policy._costs.measurement(8, 0).seconds == pytest.approx(9e-3)
    for _ in range(5):
        plain(decoding, 5e-3)
    known = policy._costs.measurement(8, 0).seconds
    plain(mixed, 20e-3)
    plain(decoding, 8e-3)   # settling after the prefill: ignored
    plain(decoding, 7e-3)   # and the second one
    assert policy._costs.measurement(8, 0).seconds == pytest.approx(known)
    plain(decoding, 5.5e-3)   # the next one counts
    assert policy._costs.measurement(8, 0).seconds > known
    # A refill right after a prefill step teaches the switching cost only while none is known.
    policy._costs.buckets[8].refill = 1e-3
    plain(mixed, 20e-3)
    policy.choose(decoding)
    policy.observe(decoding, [0] * 8, [0] * 8, SpecStepStats(0, 0, 0, [], 0.0, 4e-3),
                   Charge(policy._costs.measurement(8, 0).seconds + 9e-3, refill=True))
    assert policy._costs.buckets[8].refill == pytest.approx(1e-3)
    # A cost not measured for explore_every visits is stale: a settling step updates it.
    policy._costs.measurement(8, 0).at -= 50
    known = policy._costs.measurement(8, 0).seconds
    plain(mixed, 20e-3)
    plain(decoding, 6e-3)
    assert policy._costs.measurement(8, 0).seconds > known


def test_a_kind_first_measured_after_a_prefill_is_measured_again():
    """k = 1 measured only on the two steps after a prefill (10-20% over its steady cost on an H100 at
    batch 128, where it beat plain decoding by 10%) looked no better than plain steps, and the policy
    kept to them for the rest of the window (0.97x plain): such a measurement stands in until the next
    steady step measures the kind again, which replaces it."""
    policy = AdaptivePolicy(max_k=4, draft_cost_ratio=0.05, explore_every=50)
    n = 8   # (k <= 1: where longer drafts were modelled too dear to try, as there)
    decoding, mixed = StepShape(list(range(n)), [1] * n, 0), StepShape(list(range(n)), [1] * n, 64)

    def step(shape: StepShape, k: int, seconds: float, accepted: int = 0) -> None:
        policy.choose(shape)
        stats = SpecStepStats(n if k else 0, n * k, n * accepted, [], k * 0.3e-3, seconds - k * 0.3e-3,
                              num_verified_tokens=n * (k + 1) + shape.num_other_tokens)
        policy.observe(shape, [k] * n, [accepted] * n, stats, Charge(seconds))

    for _ in range(6):
        step(decoding, 0, 7.7e-3)
    for _ in range(3):   # acceptance about 0.5 per draft
        step(decoding, 1, 10.3e-3, accepted=1)
        step(decoding, 1, 10.3e-3, accepted=0)
    policy._costs.measured.pop((n, 1))
    step(mixed, 0, 20e-3)
    step(decoding, 1, 12.6e-3)   # settling: one-off costs
    step(decoding, 1, 12.2e-3, accepted=1)
    cost = policy._costs.measurement(n, 1)
    assert not cost.settled and policy._costs.measured_at(n, 1) == -float("inf")
    assert policy.choose(decoding) == [1] * n   # measured again at once, though plain looks better
    stats = SpecStepStats(n, n, n // 2, [], 0.3e-3, 10.0e-3, num_verified_tokens=2 * n)
    policy.observe(decoding, [1] * n, [1, 0] * (n // 2), stats, Charge(10.3e-3))
    cost = policy._costs.measurement(n, 1)
    assert cost.settled and cost.seconds == pytest.approx(10.3e-3)
    assert policy.choose(decoding) == [1] * n   # and k = 1 pays
