"""The decoder's small fused ops (add + RMSNorm, SiLU·mul, rotary) at the row counts of decode and verification.

    python benchmarks/bench_fused_ops.py [--rows 1 16 80 320] [--sweep] [--out fused.json]

8B shapes (hidden 4096, intermediate 14336, 32 q + 8 kv heads of 128). Each case
replays a CUDA graph of 64 calls (bench_gemv.time_graph) over inputs cycling through
copies that together exceed L2, as in a decode step. Reports µs per call next to the
bytes moved over the copy bandwidth measured in the same run; --sweep times the
kernels' launch configs (SiLU·mul BLOCK and warps, the norm's warps) and prints the
best per row count.
"""

from __future__ import annotations

import argparse
import itertools
import json
from unittest import mock

import torch
from bench_gemv import time_graph
from benchmark_spec_decode import copy_bandwidth, require_cuda

from vllm_spec.model import fused

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
DTYPE = torch.bfloat16


def copies(make, nbytes: int) -> list:
    """Enough copies of make()'s inputs to exceed L2 (>= 128 MB)."""
    return [make() for _ in range(max(2, (128 << 20) // max(nbytes, 1)))]


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def ops(rows: int) -> dict[str, tuple]:
    """name -> (fn over one input tuple, input copies, bytes moved per call)."""
    norm_w = torch.rand(HIDDEN, device="cuda", dtype=DTYPE) + 0.5
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    cos, sin = randn(rows, HEAD_DIM), randn(rows, HEAD_DIM)

    def rot(qkv):
        q = qkv[:, :HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
        return fused.rotary(q, k, cos, sin)

    norm_bytes = rows * HIDDEN * 2 * 4
    silu_bytes = rows * INTER * 2 * 3
    rot_bytes = rows * (HEADS + KV_HEADS) * HEAD_DIM * 2 * 2
    return {
        "add_rms_norm": (lambda a: fused.add_rms_norm(a[0], a[1], norm_w, 1e-5),
                         copies(lambda: (randn(rows, HIDDEN), randn(rows, HIDDEN)), norm_bytes), norm_bytes),
        "silu_mul": (lambda a: fused.silu_mul(a[0]), copies(lambda: (randn(rows, 2 * INTER),), silu_bytes),
                     silu_bytes),
        "rotary": (lambda a: rot(a[0]), copies(lambda: (randn(rows, qkv_width),), rot_bytes), rot_bytes),
    }


def sweep(rows: int, cases: dict) -> dict:
    """Every launch config of the SiLU·mul and norm kernels at `rows`; prints the best three of each."""
    out = {}
    fn, inputs, _ = cases["silu_mul"]
    results = []
    for block, warps in itertools.product((256, 512, 1024, 2048, 4096, 8192), (1, 2, 4, 8, 16)):
        if block < warps * 32 * 8:  # fewer than 8 elements (one 16-byte load) per thread
            continue
        with mock.patch.object(fused, "_SILU_CONFIG", (block, warps)):
            results.append((time_graph(fn, inputs), block, warps))
    results.sort()
    out["silu_mul"] = [dict(us=t, block=b, warps=w) for t, b, w in results]
    print(f"  {rows} rows silu_mul: " + ", ".join(f"{b}/{w}w {t:.2f}us" for t, b, w in results[:3]))
    fn, inputs, _ = cases["add_rms_norm"]
    results = []
    for warps in (2, 4, 8, 16, 32):
        with mock.patch.object(fused, "_norm_warps", lambda _n, w=warps: w):
            results.append((time_graph(fn, inputs), warps))
    results.sort()
    out["add_rms_norm"] = [dict(us=t, warps=w) for t, w in results]
    print(f"  {rows} rows add_rms_norm: " + ", ".join(f"{w}w {t:.2f}us" for t, w in results[:3]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 16, 80, 320])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="fused.json")
    args = ap.parse_args()
    require_cuda("bench_fused_ops.py")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'op':<14} {'rows':>5} {'us':>7} {'floor us':>8}")
    results = []
    for rows in args.rows:
        cases = ops(rows)
        for name, (fn, inputs, nbytes) in cases.items():
            t = time_graph(fn, inputs)
            results.append(dict(op=name, rows=rows, us=t, floor_us=nbytes / bw * 1e6))
            print(f"{name:<14} {rows:5d} {t:7.2f} {nbytes / bw * 1e6:8.2f}", flush=True)
        if args.sweep:
            results.append(dict(rows=rows, sweep=sweep(rows, cases)))
        del cases
    with open(args.out, "w") as f:
        json.dump(dict(copy_bandwidth=bw, results=results), f, indent=1)


if __name__ == "__main__":
    main()
