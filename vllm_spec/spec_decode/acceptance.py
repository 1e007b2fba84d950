"""What the adaptive policy believes about acceptance: a per-token rate per sequence (its own
decayed counts shrunk towards a global rate, Beta beliefs), and the drafts a step of such
sequences expects to keep."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

# A sequence's own decayed trials below this are forgotten (its belief is then the global rate's to
# within this over prior_strength: 0.025% at the default 4): steps whose sequences all hold the
# global belief take a closed form (expected_drafts).
_FORGET_TRIALS = 1e-3
_NO_TRIALS = (0.0, 0.0)


@dataclass
class AcceptanceBeliefs:
    """Decayed counts of accepted draft tokens and of trials (a trial ends at the first rejection)
    per sequence, shrunk towards a global rate with a Beta(prior_acceptance * prior_strength, ...)
    prior. The global rate is what a sequence without trials of its own expects: it counts, per
    drafting sequence and step, whether the first draft was accepted. (Pooling every trial weighs each
    sequence by the trials it yields, many more where drafts are accepted: with half the sequences at
    0.9 and half at 0.3 the pooled rate was about 0.77, and each new batch speculated until its own
    trials said otherwise.) Trials of one draft each make it a belief about any per-sequence chance
    (the adaptive policy's belief that a proposer finds drafts when asked)."""

    prior_acceptance: float = 0.6
    prior_strength: float = 4.0
    decay: float = 0.9   # per step, of a sequence's own counts
    # The global counts: decayed first drafts accepted, of drafting sequence-steps.
    accepted: float = 0.0
    trials: float = 0.0
    seqs: dict[int, tuple[float, float]] = field(default_factory=dict)   # seq id -> (accepted, trials)

    def global_belief(self) -> tuple[float, float]:
        """Beta(a, b) belief about the acceptance rate of a sequence drawn from those seen."""
        return (self.accepted + self.prior_acceptance * self.prior_strength,
                self.trials - self.accepted + (1 - self.prior_acceptance) * self.prior_strength)

    def global_rate(self) -> float:
        a, b = self.global_belief()
        return a / (a + b)

    def rates(self, seq_ids: list[int]) -> list[float]:
        """The sequences' per-token acceptance beliefs (Beta means): their own decayed counts shrunk
        towards the global rate."""
        prior, strength = self.global_rate(), self.prior_strength
        pseudo = prior * strength
        if not any(map(self.seqs.__contains__, seq_ids)):
            # None has trials of its own (as after a stretch of plain steps): the same value as below.
            return [pseudo / strength] * len(seq_ids)
        return [(acc + pseudo) / (trials + strength)
                for acc, trials in map(self.seqs.get, seq_ids, itertools.repeat(_NO_TRIALS))]

    def observe(self, seq_ids: list[int], chosen: list[int], accepted: list[int]) -> int:
        """Count a step's trials; returns how many sequences drafted."""
        decay, first_accepted, drafted = self.decay, 0, 0
        for sid, k, a in zip(seq_ids, chosen, accepted):
            if k == 0 and sid in self.seqs:
                # A sequence that stopped drafting forgets its own trials step by step, back to the
                # global rate: an unlucky run must not stop its drafts (and their correction) for good.
                acc, tr = self.seqs[sid]
                if tr * decay < _FORGET_TRIALS:
                    del self.seqs[sid]
                else:
                    self.seqs[sid] = (acc * decay, tr * decay)
            elif k > 0:
                acc, tr = self.seqs.get(sid, _NO_TRIALS)
                self.seqs[sid] = (acc * decay + a, tr * decay + a + (a < k))
                first_accepted += a > 0
                drafted += 1
        if drafted:   # the global counts decay per speculating sequence
            forget = 0.995 ** drafted
            self.accepted = self.accepted * forget + first_accepted
            self.trials = self.trials * forget + drafted
        return drafted

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)


def expected_drafts(rates: list[float], caps: list[int], max_k: int,
                    found: list[float] | None = None) -> list[float]:
    """[K] for K = 0..max_k: the accepted drafts a step of sequences with these per-token rates
    expects asking K each (min(K, cap) for each; a draft token counts as the chance all before
    it, and it, pass). found: each sequence's chance that its proposer finds drafts when asked
    (None: always, as a draft model does; an n-gram lookup often finds none)."""
    # Position by position over all sequences (one list comprehension each), not sequence by
    # sequence: a choice runs at every step, at batch 256 too, and on the critical path whenever
    # the batch changed.
    capped = min(caps, default=max_k) < max_k   # a sequence near the draft's limit
    if rates and not capped and rates.count(rates[0]) == len(rates) and (
            found is None or found.count(found[0]) == len(found)):
        # One belief for all (every sequence at the global rate, as after a stretch of plain steps).
        rate = min(max(rates[0], 0.0), 0.999)
        scale = len(rates) * (1.0 if found is None else found[0])
        return list(itertools.accumulate((scale * rate ** j for j in range(1, max_k + 1)), initial=0.0))
    clipped = [rate if 0.0 <= rate <= 0.999 else (0.0 if rate < 0.0 else 0.999) for rate in rates]
    power = clipped if found is None else [f * rate for f, rate in zip(found, clipped)]
    per_position = []
    for j in range(max_k):
        per_position.append(sum(v for v, cap in zip(power, caps) if cap > j) if capped else sum(power))
        power = [v * rate for v, rate in zip(power, clipped)]
    return list(itertools.accumulate(per_position, initial=0.0))
