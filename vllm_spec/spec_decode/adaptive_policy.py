"""The adaptive speculation policy: picks the k in 0..num_speculative_tokens that
maximises expected goodput

    sum_i E_i(k_i) / step_time,   E_i(k) = (1 - a_i^(k+1)) / (1 - a_i)

with a_i the sequence's per-token acceptance: its own decayed counts shrunk
towards a global rate, a new request's prior (Beta beliefs), learned on the drafts the proposer found. A proposer
that may find none (n-gram lookup) weighs E_i - 1 by the sequence's chance of finding drafts
when asked, a belief of the same kind, and step costs are those of asking k. When every
sequence of the step is decoding, verification is padded to one query length where a CUDA
graph replays it (else it is ragged: mqa_scorer), and all sequences get the same k, chosen
on measured step times per (batch-size bucket, k) - end to end, host work included, since
that is what tokens/s pays - with a linear model of device time in the query tokens for
what is not measured yet (decode_costs.py); where a ragged graph replays verification of k
per sequence (ragged_graph.py), sequences whose beliefs differ may draft 1..K each where that
pays more. Choices near the best are re-measured now and then (a k never measured at a batch
size: next to the best k only), plain steps however far from it (spaced as probes: their cost
may have been measured while the machine ran slower); when the mean belief says not to
speculate, a draw of the global rate (Thompson sampling) may
still say to, and speculation is probed ever more rarely where it keeps not paying.
A switch between speculating and not (the draft's catch-up, the plain step
that cannot overlap a speculative one) is charged to the choice that makes it,
except an exploring excursion's way back (its spacing accounts for it). The steps right after one
with prefill chunks teach a step cost only where nothing better is known (they pay one-off costs),
and a kind measured only on them is measured again on the next steady step it is worth one.
With prefill chunks in the step, k is chosen per sequence (Dinkelbach) on the
model. Each choice is prepared while the device runs the step before (prepare);
a step of the same shape takes it, with its bookkeeping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_spec.spec_decode.acceptance import AcceptanceBeliefs, expected_drafts
from vllm_spec.spec_decode.policy import StepShape, ragged_verification_tokens
from vllm_spec.spec_decode.ragged_choice import choose_per_cap, choose_ragged
from vllm_spec.spec_decode.decode_costs import DecodeCosts
from vllm_spec.spec_decode.step_cost import MIN_SAMPLES, BucketState, Charge
from vllm_spec.worker.batch import PolicyEstimates, SpecStepStats

# Choices whose expected rate is within this factor of the best one are kept measured.
_NEAR_BEST = 0.9
# A switch between speculating and not is charged to the choice that makes it, spread over this
# many steps (how long a choice is expected to last): noise in the estimates near break-even
# then does not flip the choice at every step, each flip paying a catch-up and a refill.
_SWITCH_HORIZON = 16
# Probes of speculation that does not pay are spaced so that what they lose (the probe's step
# and both switches, against plain steps) stays within this share of the time.
_PROBE_BUDGET = 0.01
# Checks of plain steps while speculation pays are spaced within this share of the time.
_PLAIN_CHECK_BUDGET = 0.005
_MAX_PROBE_EVERY = 800
# Drafts per sequence are taken over min(K, cap) for all where the model says they pay this much more,
# and weighed only where the sequences' beliefs span this much at least. (On an H100 a ragged pass cost
# 7-9% more than a padded one of as many tokens, which the model does not see; a 10% margin lost the
# mixed workload's gain at batch 32 in simulation, and the 2% one measured 1.08-1.12x the best fixed k.)
_PER_SEQ_MARGIN = 1.02
_ALIKE = 0.1


@dataclass
class _Choice:
    """Drafts per sequence and what choosing them changes in the policy, applied when a step takes
    them: a choice prepared for a step that then looks different leaves no trace."""

    drafts: list[int]
    speculating: bool                  # the best choice speculates (the policy holds to speculation)
    bucket: BucketState | None = None  # all-decoding steps: their batch size's bookkeeping,
    explored: BucketState | None = None   # and a copy as this choice's exploration leaves it


@dataclass
class DecodeBelief:
    """What the adaptive policy weighs when it chooses k for all-decoding steps of n sequences."""

    step_seconds: dict[int, float]   # k -> a step's cost (measured, else modelled)
    round_trip: float                # a switch to speculation and back
    acceptance: float                # the global per-token rate
    speculating: bool                # holding to speculation (a switch away is charged)


@dataclass
class AdaptivePolicy:
    """Goodput-maximising k from online acceptance beliefs and measured step costs (see the module doc).

    draft_cost_ratio: prior draft forward cost / target forward cost (e.g. the parameter ratio),
    replaced by measurements after the first speculative steps. catches_up: whether the proposer
    feeds tokens it missed after plain steps (a draft model; an n-gram lookup has no state to catch up).
    """

    max_k: int
    draft_cost_ratio: float = 0.05
    prior_acceptance: float = 0.6
    prior_strength: float = 4.0
    decay: float = 0.9
    # Re-measure a near-best choice after this many steps at its batch size; probe speculation
    # that does not pay after as many (doubling each time it still does not pay).
    explore_every: int = 50
    catches_up: bool = True
    _acceptance: AcceptanceBeliefs = field(init=False)
    # Whether a sequence's proposer finds drafts when asked: kept from the first step whose proposer
    # found fewer than asked (an n-gram lookup without a match; a draft model always finds them).
    _found: AcceptanceBeliefs | None = None
    _costs: DecodeCosts = field(init=False)   # what steps cost
    _rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    # Whether the policy holds to speculating: the best choice of the last all-decoding step (not an
    # exploring excursion's: the way back is part of the excursion); after a step with prefill
    # chunks, whether it drafted.
    _speculating: bool = False
    # The choice prepared for the next step, and the shape it was made for.
    _ahead: tuple[StepShape, _Choice] | None = None

    def __post_init__(self) -> None:
        self._costs = DecodeCosts(self.draft_cost_ratio, self.explore_every,
                                  catch_up_per_token=None if self.catches_up else 0.0)
        self._acceptance = AcceptanceBeliefs(self.prior_acceptance, self.prior_strength, self.decay)

    def prepare(self, shape: StepShape) -> None:
        # The choice for the next step, made while the device runs this one: the next step of an
        # unchanged batch takes it. (On the step's critical path a choice cost 45-80 us on an H200
        # host, cold caches, about 1% of a step at batch 1-8; one step later in what it knows.)
        self._ahead = (shape, self._choose(shape))

    def choose(self, shape: StepShape) -> list[int]:
        ahead, self._ahead = self._ahead, None
        choice = ahead[1] if ahead is not None and ahead[0] == shape else self._choose(shape)
        self._speculating = choice.speculating
        if choice.bucket is not None:
            choice.bucket.speculates = choice.speculating
            choice.bucket.take_exploration(choice.explored)
        return choice.drafts

    def _choose(self, shape: StepShape) -> _Choice:
        # Plain Python on the decoding path: where a choice cannot be prepared ahead (the batch
        # changed) it runs on the step's critical path with its caches cold (the engine's other work
        # evicts them), where each numpy call on these tiny arrays cost several microseconds.
        n = len(shape.seq_ids)
        if n == 0:
            return _Choice([], self._speculating)
        beliefs = self._acceptance.rates(shape.seq_ids)
        found = self._found.rates(shape.seq_ids) if self._found is not None else None

        def drawn() -> list[float]:
            # The beliefs under a draw of the global rate (Thompson sampling), which every sequence's
            # belief is shrunk towards, shifting them all: an estimate that argues against
            # speculating is tested again as often as it is uncertain. (Per-sequence draws stay wide
            # while a sequence has few trials of its own, and kept speculating where it did not
            # pay; without draws, stopping after unlucky trials froze the estimates low.)
            ga, gb = self._acceptance.global_belief()
            shift = float(self._rng.beta(ga, gb)) - ga / (ga + gb)
            return [r + shift for r in beliefs]

        if shape.num_other_tokens == 0:
            return self._choose_decoding(beliefs, found, drawn, shape.caps, shape.ragged_graphs)
        # Drafting here pays for its switch where all-decoding steps of as many sequences do not speculate
        # (unless the policy holds to speculation already: that switch is made), and must beat plain
        # decoding of them where that is measured. (On an H100 at batch 256, a 68M draft's k = 1-2 in the
        # eager step finishing the prompts cost 4-14 ms, about what plain decoding takes for their tokens,
        # and a 4-6 ms refill of the plain step after it: 0.96-0.97x plain decoding over 32 steps.)
        plain = self._costs.measurement(n, 0)
        chosen = choose_ragged(self._gains(drawn(), found), np.array(shape.caps), shape.num_other_tokens,
                               self._costs.target, self._costs.draft_forward(n),
                               0.0 if self._speculating or self._costs.decoding_speculates(n)
                               else self._costs.round_trip(n),
                               n / plain.seconds if plain is not None and plain.established else 0.0).tolist()
        return _Choice(chosen, any(chosen))

    def _choose_decoding(self, beliefs: list[float], found: list[float] | None, drawn: Callable[[], list[float]],
                         caps: list[int], ragged: bool) -> _Choice:
        """Every sequence decoding: verification is padded to K+1 tokens per sequence where a CUDA
        graph replays it, so each sequence drafts min(K, cap) and K is chosen on the measured costs of
        such steps; where a ragged graph replays k per sequence (`ragged`), each sequence may draft
        fewer than K where that pays (_per_sequence). The choice's speculating is whether the best choice
        speculates (the step itself may explore another)."""
        n = len(caps)
        choices = range(min(self.max_k, max(caps)) + 1)

        bucket = self._costs.bucket_state(n)
        state = dataclasses.replace(bucket)   # the exploration bookkeeping, as this choice would leave it
        round_trip = self._costs.round_trip(n)
        switch = round_trip / _SWITCH_HORIZON
        cost = {K: self._costs.step_cost(n, K) for K in choices}

        def tokens(beliefs: list[float]) -> dict[int, float]:
            drafts = expected_drafts(beliefs, caps, self.max_k, found)
            return {K: n + drafts[K] for K in choices}

        def goodput(tokens: dict[int, float], cost: dict[int, float]) -> dict[int, float]:
            return {K: t / (cost[K] + (switch if (K > 0) != self._speculating else 0.0)) for K, t in tokens.items()}

        expected = tokens(beliefs)
        # Rates of K drafts for all: what decides which kinds of step are worth measuring (drafts per
        # sequence are measured as the step of K for all they stand for: decode_costs).
        uniform_rates = rates = goodput(expected, cost)
        uniform_expected, uniform_cost = expected, cost
        # (Sequences that believe alike draft alike: nothing to weigh per sequence.)
        alike = max(beliefs) - min(beliefs) < _ALIKE and (found is None or max(found) - min(found) < _ALIKE)
        per_seq = self._per_sequence(n, beliefs, found, caps, cost, expected) if ragged and not alike else {}
        if per_seq:
            expected, cost = dict(expected), dict(cost)
            for K, (_, t, seconds) in per_seq.items():
                expected[K], cost[K] = t, seconds
            rates = goodput(expected, cost)
        best = max(rates, key=rates.__getitem__)
        if best == 0:
            # The mean belief says do not speculate; the drawn one may say otherwise (exploration).
            per_seq, expected, cost = {}, uniform_expected, uniform_cost
            uniform_rates = rates = goodput(tokens(drawn()), cost)
            best = max(rates, key=rates.__getitem__)
        state.visits += 1
        if self._costs.plain_samples(n) < MIN_SAMPLES:
            # Plain steps are measured at each batch size before the model's guess of them is trusted.
            K = best = 0
        else:
            # A choice within reach of the best whose measurement is old (or missing) is measured
            # again: step costs drift, and an unlucky first measurement must not stick. Measured
            # ones are re-measured one at a time, at most one step in explore_every / 2: with
            # every k near the best (costs that hardly depend on k), exploring them all in turn
            # would cost up to (max_k + 1) steps in explore_every.
            may_remeasure = 2 * (state.visits - state.last_remeasure) >= self.explore_every

            def worth_measuring(K: int) -> bool:
                at = self._costs.measured_at(n, K)
                if uniform_rates[K] < _NEAR_BEST * rates[best] or state.visits - at < self.explore_every:
                    return False
                if at == -np.inf:
                    # A kind new here is measured next to the best only (the rate rises to one k and falls
                    # past it: a measured neighbour that is not the best says the kinds beyond it lose too;
                    # probes test them from plain decoding). (On an H100 whose host made k = 1 break even at
                    # batch 128, a window's first step measured k = 3 where k = 1 and 2 had not paid: 18.7 ms,
                    # and the plain step after it 11.6 ms, against 7.4 ms plain steps.)
                    return abs(K - best) <= 1
                if not may_remeasure:
                    return False
                # Speculating to re-measure while plain decoding is best is a probe, and spaced as one.
                return best > 0 or K == 0 or state.visits - state.last_spec >= self._probe_spacing(
                    n, K, cost[0], expected[K] / n)

            stale = [K for K in rates if worth_measuring(K)]
            K = min(stale, key=lambda K: self._costs.measured_at(n, K)) if stale else best
            # (The spacing is explore_every at least: most speculative steps need not compute it.)
            plain_age = state.visits - self._costs.measured_at(n, 0)
            if K == best > 0 and (state.visits <= state.plain_until or plain_age >= self.explore_every and plain_age
                                  >= self._plain_check_spacing(n, cost[0], cost[best], expected[best])):
                # Plain steps far from the best are measured again too, spaced as probes: a plain cost
                # measured while the machine ran slower (other work on it: a CPU's clock, a shared
                # host) held the policy to speculation that no longer paid. Where plain steps overlap
                # the host's work, the first after speculation measures the refill: a check takes two.
                if state.visits > state.plain_until:
                    state.plain_until = state.visits + self._plain_check_steps(n) - 1
                K = 0
            if K != best:
                state.last_remeasure = state.visits
            probe = max(range(1, len(rates)), key=rates.__getitem__) if len(rates) > 1 else 0
            if K == 0 and probe and state.visits - state.last_spec >= max(
                    state.probe_every, self._probe_spacing(n, probe, cost[0], expected[probe] / n)):
                # Speculation that does not pay here is still probed, ever more rarely (each probe
                # also feeds the draft every token it missed): acceptance may change.
                K = probe
                state.probe_every = min(2 * state.probe_every, _MAX_PROBE_EVERY)
            elif best > 0:
                state.probe_every = self.explore_every
        if K > 0:
            state.last_spec = state.visits
        drafts = per_seq[K][0] if K in per_seq else [cap if cap < K else K for cap in caps]
        return _Choice(drafts, best > 0, bucket, state)

    def _per_sequence(self, n: int, beliefs: list[float], found: list[float] | None, caps: list[int],
                      cost: dict[int, float], expected: dict[int, float]) -> dict[int, tuple[list[int], float, float]]:
        """K -> (drafts of 1..K per sequence, their expected tokens, the step's seconds) where they beat
        every sequence drafting min(K, cap): a ragged graph verifies k per sequence at the cost of the
        tokens it runs. Such a step costs what drafting K for all does (measured: the draft's K forwards,
        the host's work) with the target's pass modelled at its own tokens instead. Every sequence
        drafts one at least: one that drafted none would fall behind the draft, and its belief (no
        trials) drift back to the global rate, so it would draft again and be caught up, over and over."""
        M, target = len(cost) - 1, self._costs.target_at

        def seconds(K: int, drafts: int) -> float:
            q = ragged_verification_tokens(n, K, n + drafts, self.max_k + 1)
            return cost[K] - target(n, n * (K + 1)) + target(n, q)

        uniform_rates = np.array([expected[K] / cost[K] for K in range(1, M + 1)])
        per_token = np.array([target(n, n * (K + 1) + 1) - target(n, n * (K + 1)) for K in range(1, M + 1)])
        drafts, tokens, secs = choose_per_cap(self._gains(beliefs, found)[:, :M], np.array(caps), seconds, per_token, uniform_rates,
                                              at_least_one=True)
        # (A choice whose longest draft is under its cap is a smaller cap's: K draft forwards do not run.)
        better = (tokens / secs > _PER_SEQ_MARGIN * uniform_rates) & (drafts.max(axis=1) == np.arange(1, M + 1))
        return {K: (drafts[K - 1].tolist(), float(tokens[K - 1]), float(secs[K - 1]))
                for K in range(1, M + 1) if better[K - 1]}

    def _gains(self, rates: list[float], found: list[float] | None) -> np.ndarray:
        """[n, max_k]: each sequence's chance that drafts 1..j all pass (and that its proposer finds them)."""
        gains = np.clip(np.array(rates), 0.0, 0.999)[:, None] ** np.arange(1, self.max_k + 1)[None, :]
        return gains if found is None else gains * np.array(found)[:, None]

    def _probe_spacing(self, n: int, k: int, plain: float, tokens_per_seq: float) -> float:
        """Steps between probes of k from plain decoding that keep what they lose within the budget:
        the probe's step (as last measured: what it will likely cost again) and both switches, less
        the plain steps its expected tokens would take. The draft's catch-up grows with the spacing
        (every sequence misses a token a plain step), as measured per token fed (else modelled): where
        that growth alone takes the budget, probes are as rare as they get."""
        measured = self._costs.measurement(n, k)
        step = measured.seconds if measured is not None else self._costs.step_cost(n, k)
        # The catch-up as it grows per plain step, measured or modelled; until it is measured per token,
        # the switch also counts whatever catch-up was measured at this batch size.
        budget = _PROBE_BUDGET * plain - self._costs.catch_up_token(n) * n
        switches = (self._costs.round_trip(n) if self._costs.catch_up_per_token is None
                    else self._costs.refill(n))
        loss = step + switches - tokens_per_seq * plain
        if budget <= 0.0:
            return _MAX_PROBE_EVERY
        # At most _MAX_PROBE_EVERY steps: one slow measurement must not stop probes for good.
        return min(max(loss, 0.0) / budget, _MAX_PROBE_EVERY)

    def _plain_check_spacing(self, n: int, plain: float, step: float, tokens: float) -> float:
        """Steps between checks of plain steps from speculation (steps of these seconds and expected
        tokens) that keep what they lose within their budget: the check's plain steps against the
        time speculation takes for their tokens, and both switches."""
        loss = self._plain_check_steps(n) * max(plain - n * step / tokens, 0.0) + self._costs.round_trip(n)
        return min(max(loss / (_PLAIN_CHECK_BUDGET * step), self.explore_every), _MAX_PROBE_EVERY)

    def _plain_check_steps(self, n: int) -> int:
        """Plain steps a check takes: two where the first after speculation refills the pipeline."""
        return 2 if self._costs.refill(n) > 0.0 else 1

    def observe(self, shape: StepShape, chosen: list[int], accepted: list[int],
                stats: SpecStepStats, charge: Charge, found: list[int] | None = None) -> None:
        # Acceptance is learned on the drafts the proposer found (one it never proposed is no
        # trial), step costs on what the policy chose (what choosing k costs, finds or not), and how
        # often asking finds drafts apart.
        if found is not None and self._found is None:
            self._found = AcceptanceBeliefs(0.5, self.prior_strength, self.decay)
        found = chosen if found is None else found
        if self._found is not None:
            self._found.observe(shape.seq_ids, [min(k, 1) for k in chosen], [min(k, 1) for k in found])
        drafted = self._acceptance.observe(shape.seq_ids, found, accepted)
        self._costs.observe(shape, chosen, found, drafted, stats, charge)

    def release(self, seq_ids: list[int]) -> None:
        self._acceptance.release(seq_ids)
        if self._found is not None:
            self._found.release(seq_ids)

    def belief(self, n: int) -> DecodeBelief:
        """What a choice for all-decoding steps of n sequences would weigh now (benchmark traces)."""
        return DecodeBelief({k: self._costs.step_cost(n, k) for k in range(self.max_k + 1)},
                            self._costs.round_trip(n), self._acceptance.global_rate(), self._speculating)

    def estimates(self) -> PolicyEstimates:
        return PolicyEstimates(acceptance=self._acceptance.global_rate(),
                               draft_cost_ratio=self._costs.draft_forward(1) / self._costs.target(1))
