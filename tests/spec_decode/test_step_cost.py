"""The online step-cost estimates the adaptive policy decides on."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_spec.spec_decode.step_cost import MIN_SAMPLES, BucketState, Charge, LinearFit, StepCharges, StepCost


def test_first_samples_keep_their_minimum_then_faster_samples_weigh_more():
    cost = StepCost(3.0, at=0)                 # a slow first step (cold caches)
    cost.update(1.0, at=1)
    for at in range(2, MIN_SAMPLES):
        cost.update(2.0, at=at)
    assert cost.seconds == 1.0 and cost.samples == MIN_SAMPLES and cost.at == MIN_SAMPLES - 1
    cost.update(1.2, at=9)                     # slower: weight 0.3
    assert cost.seconds == pytest.approx(1.06)
    cost.update(1.0, at=10)                    # faster: weight 0.7
    assert cost.seconds == pytest.approx(1.018)


def test_one_outlying_step_moves_a_cost_by_at_most_a_quarter_of_its_weight():
    cost = StepCost(8.8e-3, at=0, samples=MIN_SAMPLES)
    cost.update(19.3e-3, at=1)                 # one 2x step counts as 1.25x
    assert cost.seconds == pytest.approx(8.8e-3 * (1 + 0.3 * 0.25))
    cost = StepCost(8.8e-3, at=0, samples=MIN_SAMPLES)
    cost.update(2.2e-3, at=1)                  # nor does an impossibly fast one drop it far
    assert cost.seconds == pytest.approx(8.8e-3 * (1 - 0.7 * 0.2))
    for at in range(2, 30):                    # a real change of the cost still shows
        cost.update(20e-3, at=at)
    assert cost.seconds == pytest.approx(20e-3, rel=0.02)
    zero = StepCost(0.0, at=0, samples=MIN_SAMPLES)   # a clock too coarse for one step
    zero.update(1e-3, at=1)
    assert zero.seconds == pytest.approx(0.3e-3)


def test_bucket_state_averages_host_time_and_calibration():
    state = BucketState(probe_every=50)
    state.observe(host=2e-3, calibration=1.5)   # the first observation is taken as is
    assert (state.host, state.calibration) == (2e-3, 1.5)
    state.observe(host=1e-3, calibration=1.0)
    assert state.host == pytest.approx(1.7e-3) and state.calibration == pytest.approx(1.35)


def test_linear_fit_learns_a_line_and_never_predicts_a_negative_slope():
    fit = LinearFit(1.0, 0.01)
    for x in (1, 50, 100, 200, 400) * 20:
        fit.update(x, 5e-3 + 2e-5 * x)
    assert fit(300) == pytest.approx(5e-3 + 2e-5 * 300, rel=1e-3)
    falling = LinearFit(1.0, 0.01)
    for x in (1, 100) * 20:
        falling.update(x, 5e-3 - 1e-5 * x)
    assert falling(1000) >= falling(1)


def test_fit_stays_responsive_after_long_runs_at_one_x():
    """Forgetting must not inflate the covariance without bound where x never changes (one batch
    size for hours): the fit stays finite and still learns the slope from new batch sizes."""
    rng = np.random.default_rng(0)
    fit = LinearFit(1.0, 1.0 / 64)
    for _ in range(40_000):
        fit.update(1, 1e-3 + rng.normal(0, 0.2e-3))
    assert np.all(np.isfinite([fit.w0, fit.w1, fit.p00, fit.p01, fit.p11]))
    for n in (8, 32, 64):
        for _ in range(20):
            fit.update(n, 1e-3 + 0.01e-3 * n)
    assert abs(fit(256) - (1e-3 + 0.01e-3 * 256)) < 0.1 * (1e-3 + 0.01e-3 * 256)


def test_synchronous_steps_cost_read_to_read_less_the_time_outside_the_engine():
    charges = StepCharges(async_scheduling=False)
    # The first step: from its own start.
    assert charges.read(now=100.0, start=99.0, speculative=False) == Charge(1.0)
    # Read to read: the host work before the step's start (scheduling, the choice) is its cost too.
    assert charges.read(now=102.0, start=100.4, speculative=True) == Charge(2.0)
    # The engine idled (or its caller worked) for 3 s between the steps: not this step's cost.
    charges.add_idle(3.0)
    assert charges.read(now=105.9, start=105.3, speculative=False) == Charge(pytest.approx(0.9))
    # Idle time is forgotten once charged.
    assert charges.read(now=106.9, start=106.2, speculative=False) == Charge(pytest.approx(1.0))


def test_pipelined_plain_steps_cost_one_cycle_and_a_refill_is_marked():
    charges = StepCharges(async_scheduling=True)
    charges.read(now=10.0, start=9.0, speculative=False)
    # Launched at 9.5, before the step before it was read at 10: one cycle since that read.
    assert charges.read(now=11.0, start=9.5, speculative=False) == Charge(1.0)
    assert charges.read(now=13.0, start=11.0, speculative=True) == Charge(2.0)
    # Launched after the speculative step was read: the pipeline was refilling.
    assert charges.read(now=14.4, start=13.2, speculative=False) == Charge(pytest.approx(1.4), refill=True)
    assert charges.read(now=15.4, start=14.1, speculative=False) == Charge(pytest.approx(1.0))


def test_linear_fit_is_the_exponentially_weighted_least_squares_line():
    """Over thousands of steps at mixed batch sizes the recursive fit equals the closed-form
    exponentially weighted least squares with its prior (a drifting, asymmetric covariance would not)."""
    rng = np.random.default_rng(1)
    xs = rng.choice([1, 2, 5, 8, 40, 64, 128, 256, 640, 1280], size=3000)
    ys = 4e-3 + 2e-5 * xs + rng.normal(0, 2e-4, size=xs.size)
    fit = LinearFit(1.0, 1.0 / 512)
    fit.update(xs[0], ys[0])   # scales the prior
    prior_w, prior_precision = np.array([fit.w0, fit.w1]), np.diag([1 / fit.p00, 1 / fit.p11])
    for x, y in zip(xs[1:], ys[1:]):
        fit.update(x, y)
    t = xs.size - 1
    weights = fit.forget ** np.arange(t - 1, -1, -1)
    phi = np.stack([np.ones(t), xs[1:]], axis=1)
    a = (phi * weights[:, None]).T @ phi + fit.forget ** t * prior_precision
    w = np.linalg.solve(a, (phi * weights[:, None]).T @ ys[1:] + fit.forget ** t * prior_precision @ prior_w)
    assert [fit.w0, fit.w1] == pytest.approx(w.tolist(), rel=1e-9)
    assert [fit.p00, fit.p01, fit.p11] == pytest.approx(np.linalg.inv(a)[[0, 0, 1], [0, 1, 1]].tolist(), rel=1e-9)
