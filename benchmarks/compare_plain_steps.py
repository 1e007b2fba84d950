"""The plain engine against the speculative engine's steps, measurements interleaved in one process.

8B-shape target (dummy weights, bf16) twice in one process: a plain engine and a speculative one (--draft
shape, k = 4, synthetic acceptance --acceptance). Rounds alternate, per batch size: the plain engine, with
async scheduling (the default on CUDA) and without it; the speculative engine without speculating (`disable_by_batch_size=1`); the static batch-size table of
benchmark_policy.py; the adaptive policy (one, learning across rounds). Each measurement is the warm-up run
and the timed window of benchmark_policy.py. Interleaving puts the machine's drift on every system alike,
which sequential runs minutes apart do not. Prints medians (tokens/s; per step: wall, device span and host
work in ms, and the device's idle time between steps = wall - device span), writes JSON.

    PYTHONPATH=. python benchmarks/compare_plain_steps.py --draft 68m --out plain_steps.json
    PYTHONPATH=. python benchmarks/compare_plain_steps.py --tiny --batch-sizes 4 --rounds 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmark_policy import TABLE, TINY_ENGINE, TINY_SHAPES, TINY_VOCAB, Sweep
from benchmark_spec_decode import VOCAB, build, write_config

from vllm_spec.spec_decode.adaptive_policy import AdaptivePolicy
from vllm_spec.spec_decode.policy import BatchSizeTablePolicy

SYSTEMS = ("plain", "plain-sync", "no-spec", "table", "adaptive")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="68m", choices=["68m", "1b"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128, 256])
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-gib", type=int, default=24, help="KV cache per engine")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU, float32 (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    vocab = TINY_VOCAB if args.tiny else VOCAB
    target, draft = (write_config(tmp, s, 512, vocab, TINY_SHAPES[s] if args.tiny else None) for s in ("8b", args.draft))
    max_batch = max(args.batch_sizes)
    engine_kw = TINY_ENGINE if args.tiny else dict(kv_cache_memory_bytes=args.kv_gib << 30)
    plain = build(target, None, 1, 512, max_batch, **engine_kw)
    spec = build(target, draft, 4, 512, max_batch, **engine_kw)
    worker = spec.executor.worker
    worker.config.speculative.synthetic_acceptance_rate = args.acceptance
    adaptive = AdaptivePolicy(4, draft_cost_ratio=worker.draft_cost_ratio)
    sweep = Sweep(args.batch_sizes, 64, 192, 16, vocab, 32)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for b in args.batch_sizes:
            for system in SYSTEMS:
                if system.startswith("plain"):
                    plain.async_scheduling = system == "plain" and plain.config.uses_async_scheduling
                    r = sweep.measure(plain, b)
                else:
                    worker.config.speculative.disable_by_batch_size = 1 if system == "no-spec" else None
                    worker.policy = adaptive if system == "adaptive" else BatchSizeTablePolicy(TABLE)
                    r = sweep.measure(spec, b)
                runs.setdefault(f"{system}/{b}", []).append(r)
    print(f"\ndraft {args.draft}, A = {args.acceptance}, medians of {args.rounds} interleaved rounds")
    print(f"{'B':>4} {'system':10} {'tok/s':>8} {'/plain':>7} {'ms/step':>8} {'device':>7} {'idle':>6} {'host ms':>8}")
    for b in args.batch_sizes:
        base = statistics.median(r["tokens_per_s"] for r in runs[f"plain/{b}"])
        for system in SYSTEMS:
            rs = runs[f"{system}/{b}"]
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            host, wall, dev = (statistics.median(r[key] for r in rs)
                               for key in ("host_ms_per_step", "ms_per_step", "device_ms_per_step"))
            print(f"{b:4d} {system:10} {tps:8.0f} {tps / base:7.2f} {wall:8.2f} {dev:7.2f} {wall - dev:6.2f} "
                  f"{host:8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), runs=runs), indent=1))


if __name__ == "__main__":
    main()
