"""What all-decoding steps cost, as the adaptive policy (adaptive_policy.py) learns it online:
linear fits of the target's and the draft's passes in their tokens (the target's also per batch-size
bucket, once passes of several lengths ran there), measured seconds per
(batch-size bucket, k) - end to end, host work included - and per bucket the host time, the
switching costs and the exploration bookkeeping (BucketState)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_spec.spec_decode.policy import StepShape
from vllm_spec.spec_decode.step_cost import BucketState, Charge, LinearFit, StepCost, average
from vllm_spec.worker.batch import SpecStepStats
from vllm_spec.worker.cuda_graph import bucket_for

# All-decoding steps right after one with prefill chunks are charged one-off costs whatever their k
# (on the H200 at batch 64-128, about 3 ms over the steps around it; on an H100 at batch 128 the first
# two speculative steps 10-20% over the steady state, the first plain step 30%): steps this close to
# one with prefill chunks update a step kind's cost only while it is unmeasured, few-sampled or stale,
# and a kind first measured on them is measured again on a steady step. (A plain step's cost inflated
# by them held the policy to speculation that lost 2.5-3% at break-even; k = 1 measured only on them
# at batch 128, where it beat plain decoding by 10%, kept the policy to plain steps at 0.97x.)
_SETTLE_STEPS = 2


@functools.cache   # asked many times per step, for a handful of batch sizes
def _bucket(n: int) -> int:
    """Batch sizes that cost alike share measurements (the CUDA-graph buckets; exact past them)."""
    return bucket_for(n) or n


@dataclass
class _BucketTarget:
    """The fit of a target pass's seconds in its query tokens over one batch-size bucket's all-decoding
    steps, and whether passes of more than one length taught it (only then has it a slope of its own)."""

    fit: LinearFit
    first_length: int
    lengths_differ: bool = False

    def update(self, q: int, seconds: float) -> None:
        self.fit.update(q, seconds)
        self.lengths_differ = self.lengths_differ or q != self.first_length


@dataclass
class DecodeCosts:
    """Seconds of the steps the adaptive policy weighs: measured where they were run, modelled where
    not yet. draft_cost_ratio: the prior draft forward / target forward cost; explore_every: visits of
    a bucket after which a measurement is stale."""

    draft_cost_ratio: float = 0.05
    explore_every: int = 50
    buckets: dict[int, BucketState] = field(default_factory=dict)
    target: LinearFit = field(init=False)   # seconds of a target pass in its query tokens
    draft: LinearFit = field(init=False)    # seconds of a draft forward in its sequences
    # Host seconds a speculative all-decoding step adds to a plain one's, by batch size (the draft's
    # and the verification's input preparation and bookkeeping, the read of the accepted tokens):
    # a new batch size's plain steps alone do not show it.
    spec_host: LinearFit = field(init=False)
    # Seconds of a target pass in its query tokens at one batch-size bucket (all-decoding steps): the
    # global fit's shape and this bucket's level, used once passes of two lengths or more ran here and
    # so gave it its own slope. A pass's cost is not linear in its tokens over all batch sizes (on an
    # H100: 1.7 ms per 128 tokens from 128 to 512, 2.9 from 512 to 1280, and the attention's share grows
    # with the batch): the global line modelled 384 tokens at batch 128 at 12.5 ms, out of reach (run:
    # 11.1 ms; a fit on that bucket's passes of 128 and 256 tokens: 10.1 ms, so it is tried and measured).
    local_target: dict[int, _BucketTarget] = field(default_factory=dict)
    # Measured seconds of all-decoding steps per (batch bucket, k): real costs
    # need not be linear in the tokens (CPU matrix kernels: 3 query rows measured slower than 5).
    measured: dict[tuple[int, int], StepCost] = field(default_factory=dict)
    # Seconds of the draft's catch-up per token it fed (None: no catch-up seen yet; 0 from the start
    # where the proposer has nothing to catch up, as an n-gram lookup).
    catch_up_per_token: float | None = None
    # All-decoding steps observed since the last step with prefill chunks.
    since_prefill: int = _SETTLE_STEPS

    def __post_init__(self) -> None:
        # Until measured: a target forward costs 1 plus 1/512 per query token, a draft
        # forward draft_cost_ratio plus 1/4096 per sequence (memory-bound decoding).
        self.target = LinearFit(1.0, 1.0 / 512)
        self.draft = LinearFit(max(self.draft_cost_ratio, 0.01), 1.0 / 4096)
        self.spec_host = LinearFit(1.0, 1.0 / 64)

    def bucket_state(self, n: int) -> BucketState:
        """The bookkeeping of all-decoding steps of n sequences' bucket."""
        return self.buckets.setdefault(_bucket(n), BucketState(probe_every=self.explore_every))

    def decoding_speculates(self, n: int) -> bool:
        """Whether the latest choice for all-decoding steps of n sequences' bucket held to speculation."""
        state = self.buckets.get(_bucket(n))
        return state is not None and state.speculates

    def round_trip(self, n: int) -> float:
        """Seconds of a switch to speculation and back at this batch size: the draft's catch-up plus
        the refill."""
        return self.switch_part(n, lambda s: s.catch_up) + self.refill(n)

    def refill(self, n: int) -> float:
        """Seconds of the plain step after a speculative one waiting for the host, at this batch size
        (as switch_part): 0 where plain steps do not overlap the host's work."""
        return self.switch_part(n, lambda s: s.refill)

    def switch_part(self, n: int, part: Callable[[BucketState], float | None]) -> float:
        """A part of a switch's cost as measured at this batch size or, until it is, at the nearest
        batch size where it was (0: nowhere yet)."""
        bucket = _bucket(n)
        measured = [(abs(b - bucket), part(s)) for b, s in self.buckets.items() if part(s) is not None]
        return min(measured)[1] if measured else 0.0

    def measurement(self, n: int, k: int) -> StepCost | None:
        """What all-decoding steps of n sequences drafting k were measured to cost (None: never)."""
        return self.measured.get((_bucket(n), k))

    def measured_at(self, n: int, k: int) -> float:
        """The bucket visit at which steps of n sequences drafting k were last measured (-inf: never, or
        only on settling steps)."""
        cost = self.measurement(n, k)
        return -np.inf if cost is None or not cost.settled else cost.at

    def step_cost(self, n: int, k: int) -> float:
        """Seconds of an all-decoding step of n sequences drafting k: measured, else modelled (device
        time, plus the host time measured at this batch size); while few samples were taken, the
        lower of the two (one slow first step must not rule a choice out before it is measured again)."""
        measured = self.measurement(n, k)
        if measured is not None and measured.established:
            return measured.seconds
        model = self.modelled_cost(n, k, self.buckets.get(_bucket(n)))
        return model if measured is None else min(model, measured.seconds)

    def modelled_cost(self, n: int, k: int, state: BucketState | None) -> float:
        """Device time from the linear fits (the target's at this batch size where it has one) plus the
        host time of plain steps at this batch size (and what speculation adds to it), scaled by how far
        measured steps here were from the model (the draft's fit spans all batch sizes)."""
        device = (k * self.draft_forward(n) if k else 0.0) + self.target_at(n, n * (k + 1))
        if state is None:
            return device
        host = state.host + (self.spec_host(n) if k and self.spec_host.count else 0.0)
        return (device + host) * state.calibration

    def target_at(self, n: int, q: int) -> float:
        """Seconds of a target pass of q query tokens in an all-decoding step of n sequences."""
        local = self.local_target.get(_bucket(n))
        return local.fit(q) if local is not None and local.lengths_differ else self.target(q)

    def plain_samples(self, n: int) -> int:
        cost = self.measurement(n, 0)
        return 0 if cost is None else cost.samples

    def catch_up_token(self, n: int) -> float:
        """Seconds the draft's catch-up takes per token it feeds, at batch size n. Until a catch-up is
        measured, modelled: a catch-up feeds many tokens a sequence, as a verification does, so what
        the target's pass takes per query token, scaled by the draft's cost ratio at this batch size
        (0 while the target's pass is unmeasured). Taken as free, a 1B draft's first probe at batch 128
        came after 60 plain steps and its catch-up took 15 ms, two plain steps (H100, session 42)."""
        if self.catch_up_per_token is not None:
            return self.catch_up_per_token
        if not self.target.count:   # the target's fit has no units yet
            return 0.0
        # (The ratio at most 1: a fit drifting low must not make the draft dearer than the target.)
        return max(self.target.w1, 0.0) * min(self.draft_forward(n) / self.target(n), 1.0)

    def draft_forward(self, n: int) -> float:
        """Cost of one draft forward over n sequences (the prior ratio until measured)."""
        return self.draft(n) if self.draft.count else self.draft_cost_ratio * self.target(n)

    def observe(self, shape: StepShape, chosen: list[int], found: list[int], drafted: int, stats: SpecStepStats,
                charge: Charge) -> None:
        """Learn from a step read back: drafts asked (chosen) and found, the sequences that drafted."""
        draft = stats.draft_time - stats.catch_up_time
        if stats.catch_up_tokens:
            per_token = stats.catch_up_time / stats.catch_up_tokens
            self.catch_up_per_token = average(self.catch_up_per_token or 0.0, per_token,
                                              first=self.catch_up_per_token is None)
        decoding = bool(shape.seq_ids) and not shape.num_other_tokens
        settling = decoding and self.since_prefill < _SETTLE_STEPS
        # The fits first: the calibration below compares a step with a model in seconds (before its
        # first update the target fit holds a prior without units). A settling step's phases run slow
        # too (on an H100 its draft forwards up to 2x, its verification 5%): it teaches the global target
        # fit (which spans steps with prefill chunks anyway) and the draft's only while that has no sample.
        # The pass may have been padded to one query length: fit on what the target really ran.
        q = stats.num_verified_tokens or shape.num_other_tokens + len(shape.seq_ids) + sum(found)
        self.target.update(q, stats.verify_time)
        if decoding and not settling and self.target.count and stats.verify_time > 0:
            bucket = _bucket(len(shape.seq_ids))
            if bucket not in self.local_target:
                self.local_target[bucket] = _BucketTarget(LinearFit(self.target.w0, self.target.w1), q)
            self.local_target[bucket].update(q, stats.verify_time)
        forwards = max(found, default=0)
        if forwards > 0 and (not settling or not self.draft.count):
            self.draft.update(drafted, draft / forwards)
        if shape.num_other_tokens:
            self.since_prefill = 0
        elif decoding:
            self.since_prefill += 1
            self._observe_decoding(shape, chosen, stats, charge, draft, settling)

    def _observe_decoding(self, shape: StepShape, chosen: list[int], stats: SpecStepStats, charge: Charge,
                          draft: float, settling: bool) -> None:
        """Step costs and switching costs of an all-decoding step at its batch-size bucket (a settling
        step's charge only where nothing better is known)."""
        state = self.bucket_state(len(shape.seq_ids))
        n, K = len(shape.seq_ids), max(chosen, default=0)
        key = (_bucket(n), K)
        if stats.catch_up_time > 0:
            state.observe_switch(catch_up=stats.catch_up_time)
        if settling and (state.refill is not None if charge.refill else self._known(n, K, state)):
            return
        if charge.refill:   # not what plain steps cost: what switching back to them cost
            plain = self.measurement(n, 0)
            if plain is not None:
                state.observe_switch(refill=max(charge.seconds - plain.seconds, 0.0))
            return
        step_time = charge.seconds
        host = max(step_time - draft - stats.verify_time, 0.0)
        if any(k != min(cap, K) for k, cap in zip(chosen, shape.caps)):
            # k per sequence (a ragged graph's pass): taken as the step of K for all it stands for, its
            # target pass modelled at that step's tokens instead of its own (as the policy weighs it).
            step_time += self.target_at(n, n * (K + 1)) - self.target_at(n, stats.num_verified_tokens)
        modelled = self.modelled_cost(n, K, None)
        if K and state.observed and key in self.measured:
            # Not from a step kind's first step here: a cold one must not set the fit.
            self.spec_host.update(n, max(host - state.host, 0.0))
        state.observe(host, step_time / (modelled + host), plain=K == 0)
        if key in self.measured:
            self.measured[key].update(step_time, state.visits, settled=not settling)
        else:
            self.measured[key] = StepCost(step_time, state.visits, settled=not settling)

    def _known(self, n: int, k: int, state: BucketState) -> bool:
        """Whether steps of n sequences drafting k were measured enough, and recently enough."""
        cost = self.measurement(n, k)
        return cost is not None and cost.established and state.visits - cost.at < self.explore_every
