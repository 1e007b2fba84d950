"""CPU float32 matmuls at decode shapes: csrc's kernel (vllm_spec.model.cpu_linear) vs oneDNN with packed
weights (what the engine used before) vs torch's plain F.linear, same run.

Each case multiplies `--layers` distinct weights of one shape in turn (so they come from memory, as in a
decode step, not from cache) by an activation of R rows. Reported: ms per sweep, the weights' GB/s, and
each method's time relative to its own 1-row time (what a (k+1)-row verification costs over a 1-row step).

    python benchmarks/bench_cpu_linear.py                      # SmolLM2-135M's shapes, 1 and 2 threads
    python benchmarks/bench_cpu_linear.py --rows 1 2 3 5 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_spec.model import cpu_linear
from vllm_spec.model.layers import _reorder_linear_weight

# SmolLM2-135M: qkv, o, gate_up, down (hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _time(fn, weights, x, repeats: int) -> float:
    for w in weights:
        fn(x, w)
    t = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            fn(x, w)
    return (time.perf_counter() - t) / repeats


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--layers", type=int, default=30, help="distinct weights per shape (30: SmolLM2's layers)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/cpu_linear_<time>.json)")
    args = p.parse_args(argv)
    if not cpu_linear.available():
        raise SystemExit("the CPU kernel is not available here (not x86-64 with AVX2, no compiler or ninja, "
                         "or VLLM_SPEC_CPU_KERNELS=0)")
    methods = {"kernel": (lambda w: w, cpu_linear.linear),
               "onednn": (_reorder_linear_weight, lambda x, w: torch.ops.mkldnn._linear_pointwise(
                   x, w, None, "none", [], "")),
               "plain": (lambda w: w, F.linear)}
    if not torch.backends.mkldnn.is_available():
        del methods["onednn"]
    rows_out = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape, (n, k) in SHAPES.items():
            plain = [torch.randn(n, k) for _ in range(args.layers)]
            prepared = {name: [prep(w) for w in plain] for name, (prep, _) in methods.items()}
            base: dict[str, float] = {}
            for r in args.rows:
                x = torch.randn(r, k)
                for name, (_, fn) in methods.items():
                    s = _time(fn, prepared[name], x, args.repeats)
                    base.setdefault(name, s)
                    rows_out.append(dict(threads=threads, shape=shape, n=n, k=k, rows=r, method=name, ms=s * 1e3,
                                         gb_s=args.layers * n * k * 4 / s / 1e9, vs_1_row=s / base[name]))
    print(f"{'thr':>3} {'shape':8} {'rows':>4} | " + " | ".join(f"{m:>6} ms  GB/s  x1row" for m in methods))
    for i in range(0, len(rows_out), len(methods)):
        group = rows_out[i:i + len(methods)]
        g = group[0]
        print(f"{g['threads']:>3} {g['shape']:8} {g['rows']:>4} | "
              + " | ".join(f"{r['ms']:9.2f} {r['gb_s']:5.1f} {r['vs_1_row']:5.2f}" for r in group))
    out = Path(args.out or Path(__file__).parent / "results" / f"cpu_linear_{time.strftime('%Y%m%d_%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "host": platform.node(), "cpu": platform.processor(),
                               "torch": torch.__version__, "rows": rows_out}, indent=1))
    print(f"wrote {out}")
    return rows_out


if __name__ == "__main__":
    main()
