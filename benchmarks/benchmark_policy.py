"""Dynamic speculation (issue #7): which k policy gives the most tokens/s at each batch size.

8B-shape target with random weights (load_format="dummy"), bf16, draft shapes 68m and 1b. For
each draft, synthetic acceptance A (the verifier accepts each draft token with probability A;
both models still run their real forward passes) and batch size, in the same run: no
speculation (a plain engine; measured once per batch size, its work depends on neither the
draft nor A), fixed k=2, fixed k=4, a static batch-size table (TABLE) and the adaptive policy.
The "mixed" workload gives half the requests A=0.9 and half A=0.3 (SamplingParams.extra_args
synthetic_acceptance_rate), where per-sequence choices should pay. One speculative engine per
draft (num_speculative_tokens = --max-k, 8 by default: the adaptive policy's largest k; the
fixed ones keep theirs); policies are swapped in place. Every policy gets the same warm-up run before each
timed run; the adaptive policy is fresh per (draft, workload) and keeps what it learned across
batch sizes. Reports decode tokens/s per policy, adaptive/plain and adaptive/best-fixed, writes
JSON (--out) and a plot of tokens/s vs batch size (--plot), then prints the table. --trace adds
every step the adaptive policy observed (k, step time, catch-up) to the JSON (first round).
--repeats R measures R rounds per batch size, the policies interleaved in each, and reports
medians: one 32-step window is noisy (the same static policy measured 3434 and 3963 tokens/s
in two runs on the H200), and small batches time at least --min-seq-steps sequence-steps per run
(runs before session 18 timed 32 steps at every batch size). Synthetic acceptance draws are keyed
by request and position, so every policy meets the same acceptance at the same positions (runs
before session 6's last commits drew them from the engine's generator).

    PYTHONPATH=. python benchmarks/benchmark_policy.py --out policy.json --plot policy.png
    PYTHONPATH=. python benchmarks/benchmark_policy.py --tiny --batch-sizes 1 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from benchmark_spec_decode import VOCAB, build, positive_int, run_decode, window_gen_len, write_config

from vllm_spec import LLMEngine
from vllm_spec.spec_decode.adaptive_policy import AdaptivePolicy
from vllm_spec.spec_decode.policy import BatchSizeTablePolicy, FixedPolicy

# Room above the fixed policies' k: on an H100 (session 36) the adaptive policy allowed k <= 8 beat every
# fixed k by 1.12-1.43x at batch 1-8 and cost nothing measurable at batch 32-256 against k <= 4.
MAX_K = 8
TABLE = [(4, 4), (16, 3), (64, 2), (128, 1)]   # k for batches of at most N sequences, 0 above 128
FIXED_KS = (2, 4)
MIXED_RATES = (0.9, 0.3)
POLICIES = ("plain", *(f"fixed-{k}" for k in FIXED_KS), "table", "adaptive")
# --tiny: CPU-sized shapes under the same names, for a smoke test of the whole sweep.
TINY_VOCAB = 512
TINY_TARGET = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128)
TINY_SHAPES = {"8b": TINY_TARGET, "1b": {**TINY_TARGET, "num_hidden_layers": 1},
               "68m": {**TINY_TARGET, "num_hidden_layers": 1, "intermediate_size": 32}}
TINY_ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 26)


@dataclass
class Row:
    """One timed decode run."""

    draft: str | None      # None: the plain engine
    workload: str | None   # "A=0.5", ..., "mixed"; None: the plain engine (it ignores acceptance)
    batch: int
    policy: str
    tokens_per_s: float
    ms_per_step: float
    mean_accepted_length: float = 0.0
    repeat: int = 0        # which of the --repeats rounds
    host_ms_per_step: float = 0.0     # the engine's host work (schedule, worker, outputs), overlapped or not
    device_ms_per_step: float = 0.0


@dataclass
class TracedStep:
    """One step the adaptive policy observed (--trace): what it chose and what the step cost."""

    draft: str
    workload: str
    batch: int
    k: int                 # drafts of the step's longest row (0: a plain step)
    mean_k: float          # drafts per row (under k: drafts chosen per sequence, or capped)
    step_ms: float         # what the policy was charged: end to end, catch-up excluded
    refill: bool           # a plain step that waited for the host after a speculative one
    catch_up_ms: float
    draft_ms: float        # device time of the proposal (catch-up included)
    verify_ms: float
    accepted: int
    prefill_tokens: int    # other tokens in the step (prefill chunks): not an all-decoding step
    # What the policy believed as it observed this step, before learning from it (a step is learned
    # from while the next runs, and choices are prepared a step ahead): cost per k and the switch
    # round trip; and whether it holds to speculation after its latest choice.
    believed_ms: list[float]
    round_trip_ms: float
    speculating: bool


def traced(policy: AdaptivePolicy, into: list[TracedStep], draft: str, workload: str, batch: int) -> None:
    """Record every step the policy observes from now on (replaces its observe; the last call wins)."""
    observe = type(policy).observe

    def record(shape, chosen, accepted, stats, charge, found=None):
        belief = policy.belief(len(shape.seq_ids))
        into.append(TracedStep(draft, workload, batch, max(chosen, default=0),
                               sum(chosen) / max(len(chosen), 1), charge.seconds * 1e3, charge.refill,
                               stats.catch_up_time * 1e3, stats.draft_time * 1e3, stats.verify_time * 1e3,
                               sum(accepted), shape.num_other_tokens,
                               [belief.step_seconds[k] * 1e3 for k in sorted(belief.step_seconds)],
                               belief.round_trip * 1e3, belief.speculating))
        observe(policy, shape, chosen, accepted, stats, charge, found)

    policy.observe = record


@dataclass
class Summary:
    """The policies side by side for one (draft, workload, batch)."""

    draft: str
    workload: str
    batch: int
    tokens_per_s: dict[str, float]   # policy -> tokens/s, plain included
    best_fixed: str
    adaptive_over_plain: float
    adaptive_over_best_fixed: float


@dataclass
class Sweep:
    """What every run shares."""

    batch_sizes: list[int]
    prompt_len: int
    gen_len: int
    warmup_len: int
    vocab: int
    window: int
    repeats: int = 1
    min_seq_steps: int = 0
    max_k: int = MAX_K   # the speculative engine's num_speculative_tokens: the adaptive policy's largest k

    def window_for(self, batch: int) -> int:
        """Timed steps at this batch size: at least `window`, and at least min_seq_steps sequence-steps
        (a small batch's few tokens per window otherwise leave the policies' ratios to the luck of
        the acceptance draws: one 32-step window at batch 1 holds 60-140 tokens)."""
        return max(self.window, -(-self.min_seq_steps // batch))

    def gen_len_for(self, batch: int) -> int:
        """Tokens per request: enough that none finishes inside the window whatever it accepts."""
        return window_gen_len(self.gen_len, self.window_for(batch), self.max_k)

    def measure(self, engine: LLMEngine, batch: int, extra_args: list[dict] | None = None) -> dict:
        """The warm-up run every policy gets, then the timed steps with all `batch` requests running."""
        run_decode(engine, batch, self.prompt_len, self.warmup_len, 0, extra_args, self.vocab)
        return run_decode(engine, batch, self.prompt_len, self.gen_len_for(batch), 1, extra_args, self.vocab,
                          self.window_for(batch))


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n items (a Williams design) in which every item follows every other item equally
    often: n orders for even n, 2n for odd n."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(i + r) % n for i in first] for r in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def plain_rows(sweep: Sweep, target: str, max_len: int, engine_kw: dict) -> list[Row]:
    engine = build(target, None, 1, max_len, max(sweep.batch_sizes), **engine_kw)
    rows = []
    for b in sweep.batch_sizes:
        for rep in range(sweep.repeats):
            r = sweep.measure(engine, b)
            rows.append(Row(None, None, b, "plain", r["tokens_per_s"], r["ms_per_step"], repeat=rep,
                            host_ms_per_step=r["host_ms_per_step"], device_ms_per_step=r["device_ms_per_step"]))
            print(asdict(rows[-1]), flush=True)
    return rows


def spec_rows(sweep: Sweep, target: str, draft_shape: str, draft: str, acceptance: list[float],
              max_len: int, engine_kw: dict, trace: list[TracedStep] | None = None) -> list[Row]:
    engine = build(target, draft, sweep.max_k, max_len, max(sweep.batch_sizes), **engine_kw)
    worker = engine.executor.worker
    rows = []
    for name, rate in [(f"A={a}", a) for a in acceptance] + [("mixed", None)]:
        worker.config.speculative.synthetic_acceptance_rate = rate
        policies = {**{f"fixed-{k}": FixedPolicy(k) for k in FIXED_KS}, "table": BatchSizeTablePolicy(TABLE),
                    "adaptive": AdaptivePolicy(sweep.max_k, draft_cost_ratio=worker.draft_cost_ratio)}
        for b in sweep.batch_sizes:
            # Mixed: every request brings its own rate; the engine-wide one (None) applies to nobody.
            extra_args = [{"synthetic_acceptance_rate": MIXED_RATES[i % 2]} for i in range(b)] if rate is None else None
            # Rounds interleave the policies, so the machine's drift falls on all of them alike, in
            # balanced orders: over each cycle of rounds (as many as policies, twice that for an odd
            # count) each policy runs right after each other equally often.
            names, orders = list(policies), balanced_orders(len(policies))
            for rep in range(sweep.repeats):
                for policy_name in (names[i] for i in orders[rep % len(orders)]):
                    policy = policies[policy_name]
                    if trace is not None and policy_name == "adaptive" and rep == 0:
                        traced(policy, trace, draft_shape, name, b)
                    worker.policy = policy
                    r = sweep.measure(engine, b, extra_args)
                    rows.append(Row(draft_shape, name, b, policy_name, r["tokens_per_s"], r["ms_per_step"],
                                    r["mean_accepted_length"], rep, r["host_ms_per_step"], r["device_ms_per_step"]))
                    print(asdict(rows[-1]), flush=True)
    return rows


def summarise(rows: list[Row]) -> list[Summary]:
    """Per (draft, workload, batch): each policy's median tokens/s over the rounds."""
    runs: dict[tuple, list[float]] = {}
    for r in rows:
        runs.setdefault((r.draft, r.workload, r.batch, r.policy), []).append(r.tokens_per_s)
    median = {key: float(np.median(v)) for key, v in runs.items()}
    groups: dict[tuple[str, str, int], dict[str, float]] = {}
    for (draft, workload, batch, policy), tps in median.items():
        if draft is not None:
            groups.setdefault((draft, workload, batch), {"plain": median[(None, None, batch, "plain")]})[policy] = tps
    out = []
    for (draft, workload, batch), tps in groups.items():
        best = max((f"fixed-{k}" for k in FIXED_KS), key=tps.__getitem__)
        out.append(Summary(draft, workload, batch, tps, best, tps["adaptive"] / tps["plain"],
                           tps["adaptive"] / tps[best]))
    return out


def print_table(summary: list[Summary]) -> None:
    print(f"\ntokens/s per policy (decode phase); ratios of the adaptive policy\n"
          f"{'draft':5} {'workload':8} {'B':>4} " + " ".join(f"{p:>9}" for p in POLICIES)
          + f" {'best fixed':>10} {'ad/plain':>8} {'ad/best':>8}")
    for s in summary:
        print(f"{s.draft:5} {s.workload:8} {s.batch:4d} " + " ".join(f"{s.tokens_per_s[p]:9.1f}" for p in POLICIES)
              + f" {s.best_fixed:>10} {s.adaptive_over_plain:8.2f} {s.adaptive_over_best_fixed:8.2f}")


def plot(summary: list[Summary], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = list(dict.fromkeys(s.draft for s in summary))
    workloads = list(dict.fromkeys(s.workload for s in summary))
    fig, axes = plt.subplots(len(drafts), len(workloads), figsize=(4 * len(workloads), 3.5 * len(drafts)),
                             squeeze=False, sharex=True)
    for ax, (draft, workload) in zip(axes.flat, [(d, w) for d in drafts for w in workloads]):
        points = sorted((s.batch, s.tokens_per_s) for s in summary if (s.draft, s.workload) == (draft, workload))
        for policy in POLICIES:
            ax.plot([b for b, _ in points], [tps[policy] for _, tps in points], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(title=f"draft {draft}, {workload}", xlabel="batch size", ylabel="tokens/s")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--drafts", nargs="+", default=["68m", "1b"], choices=["68m", "1b"])
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--prompt-len", type=positive_int, default=64)
    ap.add_argument("--gen-len", type=positive_int, default=192, help="max tokens per request (raised to window * (k + 1) + 32 where that is more)")
    ap.add_argument("--window", type=positive_int, default=32, help="timed steps, every request running throughout")
    ap.add_argument("--min-seq-steps", type=positive_int, default=256,
                    help="small batches time more steps: at least this many sequence-steps per timed run")
    ap.add_argument("--warmup-len", type=positive_int, default=16, help="tokens per request of each warm-up run")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="rounds per batch size (policies interleaved, in orders that balance which policy runs "
                         "after which over each cycle of 4 rounds); the table reports medians")
    ap.add_argument("--max-k", type=positive_int, default=MAX_K,
                    help="num_speculative_tokens of the speculative engine: the adaptive policy chooses k in 0..max-k "
                         f"(the fixed policies keep k = {', '.join(map(str, FIXED_KS))})")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU, float32 (smoke test)")
    ap.add_argument("--trace", action="store_true", help="every step of the adaptive policy into the JSON")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="PNG of tokens/s vs batch size per policy")
    args = ap.parse_args(argv)

    start = time.perf_counter()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_k < max(FIXED_KS):
        ap.error(f"--max-k must be >= {max(FIXED_KS)} (the largest fixed k), got {args.max_k}")
    sweep = Sweep(sorted(set(args.batch_sizes)), args.prompt_len, args.gen_len, args.warmup_len,
                  TINY_VOCAB if args.tiny else VOCAB, args.window, args.repeats, args.min_seq_steps, args.max_k)
    shapes = TINY_SHAPES if args.tiny else {}
    engine_kw = TINY_ENGINE if args.tiny else {}
    tmp = Path(tempfile.mkdtemp())
    max_len = args.prompt_len + max(map(sweep.gen_len_for, sweep.batch_sizes)) + 32
    target = write_config(tmp, "8b", max_len, sweep.vocab, shapes.get("8b"))
    rows = plain_rows(sweep, target, max_len, engine_kw)
    trace: list[TracedStep] | None = [] if args.trace else None
    for draft_shape in args.drafts:
        gc.collect()   # the previous engine's memory, before the next one is built
        torch.cuda.empty_cache()
        draft = write_config(tmp, draft_shape, max_len, sweep.vocab, shapes.get(draft_shape))
        rows += spec_rows(sweep, target, draft_shape, draft, args.acceptance, max_len, engine_kw, trace)
    summary = summarise(rows)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    out = Path(args.out or f"benchmarks/results/policy_{time.strftime('%Y%m%d_%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device, args=vars(args), table=TABLE, seconds=time.perf_counter() - start,
                                   rows=[asdict(r) for r in rows], summary=[asdict(s) for s in summary],
                                   adaptive_trace=[asdict(t) for t in trace or []]), indent=1))
    print(f"wrote {out}")
    if args.plot:
        plot(summary, args.plot)
    print(f"total {time.perf_counter() - start:.0f} s")
    print_table(summary)


if __name__ == "__main__":
    main()
