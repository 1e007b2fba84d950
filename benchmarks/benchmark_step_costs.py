"""What a decode step costs at each k, in the steady state and right after a prefill (issue #7).

8B-shape target with random weights, one draft shape, synthetic acceptance A, one batch size: the
policy benchmark's warm-up and timed window (benchmark_policy.Sweep) under fixed k = 0..--max-k in
the same run, in two rounds (the second in reverse order, so the machine's drift falls on all k
alike). Every step's charge (what the adaptive policy is charged for it: end to end, host work
included) and device phases are recorded as the policy would observe them. Reports per k the
tokens/s, the steady steps' median charge, verification and draft time (and the host time left),
and the median charge of the first steps after the window's prefill over the steady one: the
one-off costs a policy must not take for what a k costs. Writes JSON (--out).

    PYTHONPATH=. python benchmarks/benchmark_step_costs.py --batch 128 --draft 68m --acceptance 0.5
    PYTHONPATH=. python benchmarks/benchmark_step_costs.py --tiny --batch 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from benchmark_policy import TINY_ENGINE, TINY_SHAPES, TINY_VOCAB, Sweep
from benchmark_spec_decode import VOCAB, build, positive_int, write_config

from vllm_spec.spec_decode.policy import FixedPolicy

# Steps after the prefill reported one by one; later ones are the steady state.
SETTLING_REPORTED = 4


@dataclass
class ObservedStep:
    """One step as the policy observed it."""

    k: int
    round: int
    after_prefill: int     # 1 for the first all-decoding step after the last prefill chunk, 0: a prefill step
    charge_ms: float
    verify_ms: float
    draft_ms: float


@dataclass
class KCost:
    """Fixed k at the batch size: throughput and what its steps cost."""

    k: int
    tokens_per_s: list[float]          # per round
    steady_charge_ms: float            # medians over the steady steps of both rounds
    steady_verify_ms: float
    steady_draft_ms: float
    steady_host_ms: float              # charge less the device phases
    settling_over_steady: list[float]  # median charge of step 1, 2, ... after the prefill / steady charge


def observe_into(policy: FixedPolicy, k: int, rnd: int, into: list[ObservedStep]) -> FixedPolicy:
    """Record every step the policy observes (its own observe learns nothing)."""
    since = [0]

    def record(shape, chosen, accepted, stats, charge, found=None):
        if shape.num_other_tokens:
            since[0] = 0
        else:
            since[0] += 1
        if max(chosen, default=0) == k:   # (the previous policy's last step is observed by this one)
            into.append(ObservedStep(k, rnd, since[0], charge.seconds * 1e3, stats.verify_time * 1e3,
                                     stats.draft_time * 1e3))

    policy.observe = record
    return policy


def summarise(k: int, tokens_per_s: list[float], steps: list[ObservedStep]) -> KCost:
    steady = [s for s in steps if s.after_prefill > SETTLING_REPORTED]
    if not steady:
        raise SystemExit(f"k={k}: no step more than {SETTLING_REPORTED} after the prefill: raise --window")
    charge = float(np.median([s.charge_ms for s in steady]))
    verify = float(np.median([s.verify_ms for s in steady]))
    draft = float(np.median([s.draft_ms for s in steady]))
    settling = []
    for i in range(1, SETTLING_REPORTED + 1):
        at = [s.charge_ms for s in steps if s.after_prefill == i]
        settling.append(float(np.median(at)) / charge if at else float("nan"))
    return KCost(k, tokens_per_s, charge, verify, draft, charge - verify - draft, settling)


def print_table(costs: list[KCost], batch: int) -> None:
    print(f"\nbatch {batch}: fixed k, steady steps (medians, ms) and the first steps after a prefill")
    print(f"{'k':>2} {'tokens/s':>18} {'charge':>7} {'verify':>7} {'draft':>6} {'host':>6}  "
          + " ".join(f"step{i}" for i in range(1, SETTLING_REPORTED + 1)))
    for c in costs:
        print(f"{c.k:>2} {' / '.join(f'{t:.0f}' for t in c.tokens_per_s):>18} {c.steady_charge_ms:7.2f} "
              f"{c.steady_verify_ms:7.2f} {c.steady_draft_ms:6.2f} {c.steady_host_ms:6.2f}  "
              + " ".join(f"{r:5.2f}" for r in c.settling_over_steady))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=positive_int, default=128)
    ap.add_argument("--draft", default="68m", choices=["68m", "1b"])
    ap.add_argument("--acceptance", type=float, default=0.5)
    ap.add_argument("--max-k", type=positive_int, default=6)
    ap.add_argument("--prompt-len", type=positive_int, default=64)
    ap.add_argument("--gen-len", type=positive_int, default=192)
    ap.add_argument("--warmup-len", type=positive_int, default=16)
    ap.add_argument("--window", type=positive_int, default=32)
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU, float32 (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not 0.0 <= args.acceptance < 1.0:
        ap.error(f"--acceptance must be in [0, 1), got {args.acceptance}")

    start = time.perf_counter()
    vocab = TINY_VOCAB if args.tiny else VOCAB
    sweep = Sweep([args.batch], args.prompt_len, args.gen_len, args.warmup_len, vocab, args.window,
                  max_k=args.max_k)
    tmp = Path(tempfile.mkdtemp())
    max_len = args.prompt_len + sweep.gen_len_for(args.batch) + 32
    shapes = TINY_SHAPES if args.tiny else {}
    target = write_config(tmp, "8b", max_len, vocab, shapes.get("8b"))
    draft = write_config(tmp, args.draft, max_len, vocab, shapes.get(args.draft))
    engine = build(target, draft, args.max_k, max_len, args.batch, **(TINY_ENGINE if args.tiny else {}))
    worker = engine.executor.worker
    worker.config.speculative.synthetic_acceptance_rate = args.acceptance

    ks = list(range(args.max_k + 1))
    steps: list[ObservedStep] = []
    tokens_per_s: dict[int, list[float]] = {k: [] for k in ks}
    for rnd, order in enumerate([ks, ks[::-1]]):
        for k in order:
            worker.policy = observe_into(FixedPolicy(k), k, rnd, steps)
            tokens_per_s[k].append(sweep.measure(engine, args.batch)["tokens_per_s"])
            print(f"round {rnd} k={k}: {tokens_per_s[k][-1]:.1f} tokens/s", flush=True)
    costs = [summarise(k, tokens_per_s[k], [s for s in steps if s.k == k]) for k in ks]

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    out = Path(args.out or f"benchmarks/results/step_costs_{time.strftime('%Y%m%d_%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device, args=vars(args), seconds=time.perf_counter() - start,
                                   costs=[asdict(c) for c in costs], steps=[asdict(s) for s in steps]), indent=1))
    print(f"wrote {out}")
    print_table(costs, args.batch)


if __name__ == "__main__":
    main()
