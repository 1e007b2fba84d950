"""Where a decode step's GPU time goes: torch.profiler over a few steps of the 8B shape (random weights).

    python benchmarks/profile_decode.py --batch 1 [--draft 68m --k 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from benchmark_spec_decode import build, run_decode, write_config
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--draft", default=None, choices=[None, "68m", "1b"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="profile without CUDA graphs (per-kernel detail)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    target = write_config(tmp, "8b", 512)
    draft = write_config(tmp, args.draft, 512) if args.draft else None
    engine = build(target, draft, args.k, 512, max(args.batch, 1))
    if args.eager:
        for r in [engine.executor.worker] + [getattr(engine.executor.worker, "draft_runner", None)]:
            runner = getattr(r, "runner", r)
            if runner is not None:
                runner.cuda_graphs = False
    if draft:
        engine.executor.worker.config.speculative.synthetic_acceptance_rate = 0.8
    run_decode(engine, args.batch, 128, 16, seed=0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_decode(engine, args.batch, 128, 24, seed=1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
