"""A simulated engine for the adaptive policy's tests: steps of a policy run on a cost model shaped like
measured runs (the draft and target passes, host time, the first step of each kind, the draft's catch-up),
and benchmark_policy.py's protocol over batch sizes."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from vllm_spec.spec_decode.policy import StepShape, pads_verification, ragged_verification_tokens
from vllm_spec.spec_decode.step_cost import Charge, StepCharges
from vllm_spec.worker.batch import SpecStepStats


@dataclass
class Costs:
    """Seconds of the parts of a step."""

    target: callable                         # query tokens -> target pass
    draft: callable                          # sequences -> one draft forward
    host: callable = lambda batch: 0.1e-3    # sequences -> host work the device does not overlap
    catch_up_per_token: float = 0.0          # draft forward over tokens it missed
    first_step_factor: float = 1.0           # the first step of each kind is this much slower
    spec_host: callable = lambda batch: 0.0  # sequences -> host work a speculative step adds
    # Async scheduling: a plain step's host work overlaps the previous plain step's device time,
    # except after a speculative step, when the device waits for it (the pipeline refills).
    pipelined: bool = False
    outlier_rate: float = 0.0                # share of steps that take 2.2x (host hiccups)
    # The first steps after one with prefill chunks take longer: (plain, speculative) factors of the
    # first, second, ... such step.
    after_prefill: tuple[tuple[float, float], ...] = ()


H200_68M = Costs(lambda q: 4.4e-3 + 0.017e-3 * q, lambda n: 0.19e-3 + 0.0017e-3 * n,
                 lambda b: 0.5e-3 + 0.015e-3 * b, 0.0002e-3, 1.25)
H200_1B = Costs(H200_68M.target, lambda n: 0.8e-3 + 0.017e-3 * n, H200_68M.host, 0.003e-3, 1.25)
_PREFILL_CHUNK = 2048   # prompt tokens of other requests in a step with prefill chunks


@dataclass
class SimEngine:
    """Runs steps of a policy on a cost model; acceptance is sampled per draft token (rates < 1)."""

    costs: Costs
    seed: int = 0
    max_k: int = 4
    # An n-gram-like proposer finds drafts for a sequence at a step with this chance (else none).
    find_rate: float = 1.0
    graphs: bool = True   # verification padded as where a CUDA graph replays it (else ragged, as on a CPU)
    ragged_graphs: bool = False   # ragged verification replays a graph (of its token bucket's tokens)
    rng: random.Random = field(init=False)
    seen: set = field(default_factory=set)   # step kinds already run (the first is slow)
    lag: dict = field(default_factory=dict)  # seq id -> tokens the draft has not seen
    next_id: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _first(self, kind) -> float:
        new = kind not in self.seen
        self.seen.add(kind)
        return self.costs.first_step_factor if new else 1.0

    def run(self, policy, alphas: list[float], steps: int, prefill_steps: int = 0) -> float:
        """Decode tokens/s of `steps` steps of fresh requests with these per-token acceptance rates; the
        first prefill_steps carry chunks of other requests' prompts (as a batch's start does, under
        chunked prefill) and are not counted."""
        B, c = len(alphas), self.costs
        ids = list(range(self.next_id, self.next_id + B))
        self.next_id += B
        tokens = elapsed = 0.0
        charges, now, previous_spec = StepCharges(c.pipelined), 1.0, True
        lesson = None   # as the worker: a step is learned from while the next one runs
        for step_index in range(steps):
            other = _PREFILL_CHUNK if step_index < prefill_steps else 0
            shape = StepShape(ids, [self.max_k] * B, other, self.ragged_graphs and not other)
            chosen = policy.choose(shape)
            if lesson is not None:
                policy.observe(*lesson)
            policy.prepare(shape)
            found = chosen if self.find_rate == 1.0 else [k if self.rng.random() < self.find_rate else 0
                                                           for k in chosen]
            accepted = []
            for k, a in zip(found, alphas):
                n = 0
                while n < k and self.rng.random() < a:
                    n += 1
                accepted.append(n)
            K = max(found)
            if K == 0:
                verify = c.target(B + other) * self._first((0, B))
                stats = SpecStepStats(0, 0, 0, [], 0.0, verify)
                for i in ids:
                    self.lag[i] = self.lag.get(i, 1) + 1
            else:
                real = B + other + sum(found)
                if shape.ragged_graphs:
                    q = ragged_verification_tokens(B, K, real, self.max_k + 1)
                else:
                    q = B * (K + 1) if not other and pads_verification(B, K, real, self.graphs) else real
                # (The draft runs for the sequences that draft: those that catch up, and what it missed.)
                behind = sum(max(self.lag.get(i, 1) - 2, 0) for i, k in zip(ids, found) if k)
                lagging = sum(1 for i, k in zip(ids, found) if k and self.lag.get(i, 1) > 2)
                catch_up = c.draft(lagging) + c.catch_up_per_token * behind if behind else 0.0
                draft = K * c.draft(sum(1 for k in found if k)) * self._first((K, B))
                verify = c.target(q)
                stats = SpecStepStats(1, sum(found), sum(accepted), [], catch_up + draft, verify,
                                      num_verified_tokens=q, catch_up_time=catch_up, catch_up_tokens=behind)
                for i, a, k in zip(ids, accepted, found):
                    self.lag[i] = (2 if a == k else 1) if k else self.lag.get(i, 1) + 1
            device = stats.draft_time - stats.catch_up_time + stats.verify_time
            overlapped = c.pipelined and K == 0 and not previous_spec and not other
            step = device + (0.0 if overlapped else c.host(B)) + (c.spec_host(B) if K else 0.0)
            if c.outlier_rate and self.rng.random() < c.outlier_rate:
                step *= 2.2
            settling = step_index - prefill_steps
            if prefill_steps and 0 <= settling < len(c.after_prefill):
                step *= c.after_prefill[settling][K > 0]
            if c.pipelined:   # the worker's accounting: what each step cost the timeline, read to read
                start = now - 1e-6 if overlapped else now + c.host(B)
                now += step + stats.catch_up_time
                charge = charges.read(now, start, K > 0)
                charge.seconds -= stats.catch_up_time
            else:
                charge = Charge(step)
            lesson = (shape, chosen, accepted, stats, charge, None if found is chosen else found)
            previous_spec = K > 0 or other > 0
            if not other:
                # Scored on expected tokens (the policy learns from the sampled ones): comparisons of
                # policies over short windows are then not decided by the luck of the draws.
                tokens += B + sum((a - a ** (k + 1)) / (1 - a) for a, k in zip(alphas, found))
                elapsed += step + stats.catch_up_time
        if lesson is not None:
            policy.observe(*lesson)
        policy.release(ids)
        return tokens / elapsed


WORKLOADS = {"A=0.5": lambda B: [0.5] * B, "A=0.8": lambda B: [0.8] * B,
             "mixed": lambda B: [0.9 if i % 2 else 0.3 for i in range(B)]}


BENCH_BATCHES = (1, 8, 32, 64, 128, 256)


def protocol(make_policy, workload: str, costs: Costs, seeds: int = 3, rounds: int = 1,
              prefill_steps: int = 0, batches: tuple[int, ...] = BENCH_BATCHES,
              ragged_graphs: bool = False) -> np.ndarray:
    """benchmark_policy.py's protocol: per batch size a short warm-up and a 32-step window (each after
    prefill_steps steps with prompt chunks), one policy across batch sizes (and across rounds over them);
    tokens/s per round and batch size (per batch size for one round), averaged over seeds."""
    runs = []
    for seed in range(seeds):
        engine, policy = SimEngine(costs, seed, ragged_graphs=ragged_graphs), make_policy()
        per_batch = []
        for _ in range(rounds):
            for B in batches:
                alphas = WORKLOADS[workload](B)
                engine.run(policy, alphas, 6 + prefill_steps, prefill_steps)
                per_batch.append(engine.run(policy, alphas, 32 + prefill_steps, prefill_steps))
        runs.append(per_batch)
    out = np.mean(runs, axis=0)
    return out if rounds == 1 else out.reshape(rounds, len(batches))
