"""The adaptive policy against fixed k on a simulated engine (cost surface shaped like an H200 run:
8B target, 68M draft). Checks the issue's goals in simulation: never below plain decoding by more
than 2%, never below the best fixed k by more than 3%, at every batch size and workload (600 steps,
learning from scratch included)."""

from __future__ import annotations

import random

import pytest

from vllm_spec.spec_decode.policy import AdaptivePolicy, FixedPolicy, StepShape, pads_verification
from vllm_spec.worker.batch import SpecStepStats

HOST = 0.1e-3


def target_time(q: int) -> float:
    return 5.5e-3 + 0.027e-3 * q      # flat while memory-bound, then linear in the query tokens


def draft_time(n: int) -> float:
    return 0.2e-3 + 0.004e-3 * n


def tokens_per_s(policy, alphas: list[float], steps: int = 600, seed: int = 0,
                 target_time=target_time, draft_time=draft_time) -> float:
    rng = random.Random(seed)
    B = len(alphas)
    shape = StepShape(list(range(B)), [4] * B, 0)
    tokens = elapsed = 0.0
    for _ in range(steps):
        chosen = policy.choose(shape)
        accepted = []
        for k, a in zip(chosen, alphas):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            accepted.append(n)
        K = max(chosen)
        if K == 0:
            t = target_time(B) + HOST
            policy.observe(shape, chosen, accepted, None, t)
        else:
            real = B + sum(chosen)
            q = B * (K + 1) if pads_verification(B, K, real) else real
            d, v = K * draft_time(sum(1 for k in chosen if k)), target_time(q)
            t = d + v + HOST
            policy.observe(shape, chosen, accepted, SpecStepStats(1, 1, 1, [], d, v, num_verified_tokens=q), t)
        tokens += B + sum(accepted)
        elapsed += t
    return tokens / elapsed


WORKLOADS = {"A=0.5": lambda B: [0.5] * B, "A=0.8": lambda B: [0.8] * B,
             "mixed": lambda B: [0.9 if i % 2 else 0.3 for i in range(B)]}


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_adaptive_tracks_the_best_choice(workload, batch):
    alphas = WORKLOADS[workload](batch)
    plain = tokens_per_s(FixedPolicy(0), alphas)
    best_fixed = max(tokens_per_s(FixedPolicy(k), alphas) for k in (1, 2, 3, 4))
    adaptive = tokens_per_s(AdaptivePolicy(4, draft_cost_ratio=0.01), alphas)
    assert adaptive >= 0.98 * plain
    assert adaptive >= 0.97 * best_fixed


# One sequence on a CPU (SmolLM2-135M, float32, one thread, measured 2026-12-02): verification
# time is not monotone in the query length (3 rows slower than 5), which no linear model fits.
CPU_VERIFY_MS = {1: 62.0, 2: 90.0, 3: 135.0, 4: 100.0, 5: 100.0}


@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_adaptive_on_a_non_monotone_cost_surface(alpha):
    costs = dict(target_time=lambda q: CPU_VERIFY_MS[q] * 1e-3, draft_time=lambda n: 17e-3)
    plain = tokens_per_s(FixedPolicy(0), [alpha], **costs)
    best_fixed = max(tokens_per_s(FixedPolicy(k), [alpha], **costs) for k in (1, 2, 3, 4))
    adaptive = tokens_per_s(AdaptivePolicy(4, draft_cost_ratio=0.2), [alpha], **costs)
    # One sequence: its acceptance estimate (about ten recent trials) is noisy, so k near the
    # optimum (3 vs 4 here) alternates; a linear cost model would sit at the slow k = 2 instead.
    assert adaptive >= 0.94 * max(plain, best_fixed)
