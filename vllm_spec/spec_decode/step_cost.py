"""What steps cost, learned online: a linear fit of device time, measured costs per step kind,
and per batch-size bucket the host time and how far measurements sit from the fit. The adaptive
speculation policy (adaptive_policy.py) decides on these."""

from __future__ import annotations

from dataclasses import dataclass


# Weight of the newest measurement in the per-(batch bucket, k) step costs: step times are noisy
# upwards (a cold first step, other work on the machine), so a faster step counts more than a slower one.
_COST_EMA_FASTER, _COST_EMA_SLOWER = 0.7, 0.3
# Past the first samples, one step counts as at most this factor off the estimate: a single 2x step
# (a host hiccup, a step that absorbed a request's completion) raised a plain step's cost by a third
# on the H200, and the policy then held to speculation it believed cheaper, never re-measuring the
# plain step it believed too slow. A real change still shows within a few steps.
_COST_OUTLIER = 1.25
# A step kind's cost is the minimum of its first samples, then an average; plain steps are
# measured this often at a batch size before anything else is tried there.
MIN_SAMPLES = 3


class LinearFit:
    """Recursive least squares for y = w0 + w1 * x with exponential forgetting.

    The prior fixes only the shape (w1 / w0); the first observation sets the scale,
    so priors need no units. Plain floats, not 2x2 arrays: the policy updates its fits at
    every step, and numpy's per-call cost on such small arrays was most of the update's.
    """

    def __init__(self, w0: float, w1: float, forget: float = 0.98):
        self.forget = forget
        self.w0, self.w1 = float(w0), float(w1)
        self.p00 = self.p01 = self.p11 = 0.0   # the symmetric covariance [[p00, p01], [p01, p11]]
        self._max_trace = 0.0
        self.count = 0

    def update(self, x: float, y: float) -> None:
        x, y = float(x), float(y)
        if self.count == 0:
            if y <= 0:   # nothing to scale the prior by (a step too short for the clock)
                return
            scale = y / (self.w0 + self.w1 * x)
            self.w0 *= scale
            self.w1 *= scale
            # Prior spread: w0 within ~50%, w1 within ~200%, against 5% noise on y.
            noise = (0.05 * y) ** 2
            self.p00, self.p01, self.p11 = (0.5 * self.w0) ** 2 / noise, 0.0, (2.0 * self.w1) ** 2 / noise
            self._max_trace = self.p00 + self.p11
        else:
            f = self.forget
            q0, q1 = self.p00 + self.p01 * x, self.p01 + self.p11 * x   # P phi, phi = (1, x)
            denom = f + q0 + q1 * x
            g0, g1 = q0 / denom, q1 / denom
            err = y - (self.w0 + self.w1 * x)
            self.w0 += g0 * err
            self.w1 += g1 * err
            self.p00, self.p01, self.p11 = (self.p00 - g0 * q0) / f, (self.p01 - g0 * q1) / f, (self.p11 - g1 * q1) / f
            # Forgetting inflates P along directions the data never spans (x constant: one batch
            # size for hours) until the fit stops listening, then overflows; never past the prior.
            trace = self.p00 + self.p11
            if trace > self._max_trace:
                shrink = self._max_trace / trace
                self.p00, self.p01, self.p11 = self.p00 * shrink, self.p01 * shrink, self.p11 * shrink
        self.count += 1

    def __call__(self, x: float) -> float:
        # More tokens never cost less: a negative fitted slope (noise, odd kernels) predicts nothing.
        return max(self.w0 + max(self.w1, 0.0) * x, 1e-9)


@dataclass
class StepCost:
    """Measured seconds of one kind of step, how many steps were measured, and the visit of its
    bucket at which it was last measured. Unsettled: measured only on steps that paid one-off costs
    (right after a step with prefill chunks), a stand-in until a step of the steady state is measured."""

    seconds: float
    at: int
    samples: int = 1
    settled: bool = True

    @property
    def established(self) -> bool:
        """Measured on enough steady steps to stand for the kind's cost on its own."""
        return self.settled and self.samples >= MIN_SAMPLES

    def update(self, seconds: float, at: int, settled: bool = True) -> None:
        if settled and not self.settled:   # the first steady-state sample replaces the stand-in
            self.seconds, self.at, self.settled = seconds, at, True
            self.samples += 1
            return
        faster = seconds < self.seconds
        # The first samples may include one-off costs (cold caches, a first replay): keep their minimum.
        if self.samples < MIN_SAMPLES:
            w = 1.0 if faster else 0.0
        else:
            w = _COST_EMA_FASTER if faster else _COST_EMA_SLOWER
            if self.seconds > 0.0:   # (a 0 estimate bounds nothing: it must be able to grow)
                seconds = min(max(seconds, self.seconds / _COST_OUTLIER), self.seconds * _COST_OUTLIER)
        self.seconds += w * (seconds - self.seconds)
        self.samples += 1
        self.at = at


def average(current: float, value: float, first: bool) -> float:
    """A running average: the first sample as is, then weighted 0.3 towards each new one."""
    return value if first else current + 0.3 * (value - current)


@dataclass
class BucketState:
    """Exploration bookkeeping of all-decoding steps at one batch-size bucket."""

    probe_every: int       # steps without speculation before it is probed again
    visits: int = 0
    last_spec: int = 0     # the visit of the last speculative step
    last_remeasure: int = 0   # the visit of the last step that re-measured a choice other than the best
    plain_until: int = 0   # a check of plain steps from speculation runs through this visit
    speculates: bool = False   # whether the latest choice here held to speculation (its best choice did)
    host: float = 0.0      # average seconds of a plain step's host work the device does not overlap
    calibration: float = 1.0   # measured / modelled seconds of the steps measured here
    observed: int = 0      # plain steps measured here
    calibrated: int = 0    # steps of any kind measured here
    # Seconds a switch costs beyond the steps' own: the draft's catch-up on the tokens it missed
    # (plain -> speculative) and the plain step that waited for the host (speculative -> plain).
    # None until measured here (a measured 0 is a free switch, not a missing measurement).
    catch_up: float | None = None
    refill: float | None = None

    def take_exploration(self, other: "BucketState") -> None:
        """Take another state's exploration bookkeeping (a choice's, made on a copy of this one)."""
        self.visits, self.last_spec, self.last_remeasure, self.probe_every, self.plain_until = (
            other.visits, other.last_spec, other.last_remeasure, other.probe_every, other.plain_until)

    def observe_switch(self, catch_up: float | None = None, refill: float | None = None) -> None:
        if catch_up is not None:
            self.catch_up = average(self.catch_up or 0.0, catch_up, first=self.catch_up is None)
        if refill is not None:
            self.refill = average(self.refill or 0.0, refill, first=self.refill is None)

    def observe(self, host: float, calibration: float, plain: bool = True) -> None:
        self.calibration = average(self.calibration, calibration, first=not self.calibrated)
        self.calibrated += 1
        if plain:
            self.host = average(self.host, host, first=not self.observed)
            self.observed += 1


@dataclass
class Charge:
    """What a step cost the timeline, and whether it was a plain step refilling the pipeline
    after a speculative one (a cost of switching, not what plain steps cost)."""

    seconds: float
    refill: bool = False


class StepCharges:
    """What each step costs, from when the steps' outputs are read.

    A step costs the time since the previous step was read, less the time the engine waited (no
    request, or none it could run): with async scheduling, a plain step launched before the previous one
    was read costs one pipelined cycle, and a speculative step (never overlapped: the next step
    needs its accepted counts) its whole time, with the host work since that read (output
    processing, the caller's between steps, scheduling, input preparation; the policy's choice too,
    unless the step followed one still in flight, which the choice then overlapped). A plain step
    that could not overlap the step before it (a speculative one) waited for the host while the
    pipeline refilled: marked as a refill.
    """

    def __init__(self, async_scheduling: bool):
        self.async_scheduling = async_scheduling
        self._last_read: float | None = None
        self._idle = 0.0

    def add_idle(self, seconds: float) -> None:
        """Time the engine waited since its last request (ExecuteModelRequest.engine_idle_time)."""
        self._idle += seconds

    def read(self, now: float, start: float, speculative: bool) -> Charge:
        refilling = False
        if self._last_read is None:   # the first step: from its own start
            cost = now - start
        else:
            cost = max(now - self._last_read - self._idle, 0.0)
            refilling = self.async_scheduling and not speculative and start > self._last_read
        self._last_read, self._idle = now, 0.0
        return Charge(cost, refilling)
