"""Matmuls of one and a few rows, 8B and 68M shapes: cuBLAS (+ the unfused elementwise op) vs the Triton gemv kernels.

    python benchmarks/bench_gemv.py [--rows 2 5 8 16 20 32] [--sweep] [--out gemv.json]
    python benchmarks/bench_gemv.py --shapes 8b --rows-sweep 20 80   # several-rows blocks vs cuBLAS
    python benchmarks/bench_gemv.py --shapes 8b --rows --gate-up-sweep 16 80   # gate/up with SiLU·mul fused

Each case replays a CUDA graph of 64 calls that cycle over enough weight copies
(>= 512 MB) that no weight stays in L2, as in a decode step that streams the whole
model. Reports µs per call and the weight bytes over that time as a fraction of the
copy bandwidth measured in the same run. --sweep times every (BLOCK_N, BLOCK_K,
num_warps) for the plain kernel and prints the best per shape; --rows-sweep does the same for
the several-rows kernel at the given row counts (tiles up to 128 rows, though only up to
gemv.MAX_ROWS rows are routed to it).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from benchmark_spec_decode import copy_bandwidth, require_cuda

from vllm_spec.model import fused, gemv
from vllm_spec.worker.cuda_graph import capture_graph

# (name, N, K): q/k/v, o, gate/up, down and LM head of each shape
SHAPES = [
    ("8b qkv", 6144, 4096), ("8b o", 4096, 4096), ("8b gate_up", 28672, 4096), ("8b down", 4096, 14336),
    ("8b lm_head", 128256, 4096),
    ("68m qkv", 2304, 768), ("68m o", 768, 768), ("68m gate_up", 6144, 768), ("68m down", 768, 3072),
    ("68m lm_head", 128256, 768),
]
CALLS = 64
WARPS = (2, 4, 8)   # swept by --rows-sweep


def time_graph(fn, weights: list[torch.Tensor]) -> float:
    """µs per call of fn(w), over CALLS calls cycling through `weights`, replayed in a graph."""
    graph, _ = capture_graph(lambda: [fn(weights[i % len(weights)]) for i in range(CALLS)])
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * CALLS)


def cases(n: int, k: int, dtype: torch.dtype, several: list[int]) -> dict[str, tuple]:
    """name -> (cuBLAS-side fn, gemv-side fn), both over a weight argument: one row plain and with
    each fused op, then `several` rows plain."""
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    res = torch.randn(1, k, device="cuda", dtype=dtype)
    norm_w = torch.rand(k, device="cuda", dtype=dtype) + 0.5
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=dtype)
    out = {
        "plain": (lambda w: F.linear(x, w), lambda w: gemv.linear(x, w)),
        "norm": (lambda w: F.linear(fused.add_rms_norm(x, res, norm_w, 1e-5)[0], w),
                 lambda w: gemv.norm_linear(x, res, norm_w, 1e-5, w)),
        "silu": (lambda w: F.linear(fused.silu_mul(gate_up), w), lambda w: gemv.silu_mul_linear(gate_up, w)),
    }
    for m in several:
        xm = torch.randn(m, k, device="cuda", dtype=dtype)
        out[f"{m} rows"] = (lambda w, xm=xm: F.linear(xm, w), lambda w, xm=xm: gemv.linear(xm, w))
    return out


def row_tilings(m: int) -> list[tuple[int, int]]:
    """(block_m, block_m2) tilings of m rows: one tile, and a power of two plus a tile for the rest."""
    one = gemv._rows_tile(m)
    first = max(gemv._ROWS_TILE, 1 << (m.bit_length() - 1))
    rest = m - first
    return [(one, 0)] + ([(first, gemv._rows_tile(rest))] if rest > 0 and first < one else [])


def time_configs(configs, fn_of, weights: list[torch.Tensor]) -> list[tuple[float, "gemv.RowsBlocks"]]:
    """(µs, config) of fn_of(config) for every config whose tiles fit the shared memory and the launch,
    fastest first."""
    results = []
    for c in configs:
        if (c.block_m + c.block_m2 + c.block_n) * c.block_k * 2 * c.stages > 200 << 10 or c.block_n * c.block_k > 16384:
            continue
        try:
            results.append((time_graph(fn_of(c), weights), c))
        except gemv.triton.runtime.errors.OutOfResources:
            continue
    return sorted(results)


def rows_sweep(m: int, n: int, k: int, dtype: torch.dtype, weights: list[torch.Tensor], bw: float) -> dict:
    """cuBLAS and the several-rows kernel's configs for m rows of one weight shape; prints the best four."""
    xm = torch.randn(m, k, device="cuda", dtype=dtype)
    t_ref = time_graph(lambda w: F.linear(xm, w), weights)
    # Every program reads all m rows of x (from L2): at 80 rows of 4096 that is 655 KB a program, more in
    # all than the weights themselves at 64 weight rows a program, hence up to 256.
    results = time_configs(
        (gemv.RowsBlocks(bm, bm2, bn, bk, warps, stages, swap)
         for (bm, bm2), swap, bn, bk, warps, stages in itertools.product(
             row_tilings(m), (False, True), (16, 32, 64, 128, 256), (64, 128, 256), WARPS, (3, 4))
         if warps * 32 * 8 <= (bm + bm2) * bn),
        lambda c: (lambda w: gemv.rows_linear(xm, w, None, c)), weights)
    best = ", ".join(f"{tuple(c)} {t:.2f}us" for t, c in results[:4])
    floor = n * k * 2 / bw * 1e6
    out = dict(cublas_us=t_ref, configs=[dict(us=t, **c._asdict()) for t, c in results])
    in_use = ""
    if m <= gemv.MAX_ROWS:   # past it the engine uses cuBLAS: no config of ours is in use
        current = gemv._rows_blocks(m, n, k)
        out["current"] = dict(us=time_graph(lambda w: gemv.rows_linear(xm, w, None, current), weights),
                              **current._asdict())
        in_use = f", current {tuple(current)} {out['current']['us']:.2f}us"
    print(f"  {m} rows {n}x{k}: cuBLAS {t_ref:.2f}us, floor {floor:.2f}us{in_use}, best {best}", flush=True)
    return out


def gate_up_sweep(m: int, n: int, k: int, dtype: torch.dtype, weights: list[torch.Tensor], bw: float) -> dict:
    """m rows of a merged gate/up weight (n = 2I rows): the product then fused.silu_mul (cuBLAS, or the
    several-rows kernel up to gemv.MAX_ROWS rows: what the engine ran before gate_up_silu) against
    gate_up_silu's configs; prints the best four and the one in use."""
    xm = torch.randn(m, k, device="cuda", dtype=dtype)
    t_ref = time_graph(lambda w: fused.silu_mul(F.linear(xm, w)), weights)
    t_old = time_graph(lambda w: fused.silu_mul(gemv.linear(xm, w)), weights) if m <= gemv.MAX_ROWS else t_ref
    results = time_configs(
        (gemv.RowsBlocks(bm, bm2, bn, bk, warps, stages, True)
         for (bm, bm2), bn, bk, warps, stages in itertools.product(
             row_tilings(m), (16, 32, 64), (64, 128, 256), (4, 8), (3, 4))),
        lambda c: (lambda w: gemv.gate_up_silu(xm, w, None, c)), weights)
    current = gemv._gate_up_blocks(m, n // 2, k)
    t_cur = time_graph(lambda w: gemv.gate_up_silu(xm, w, None, current), weights)
    best = ", ".join(f"{tuple(c)} {t:.2f}us" for t, c in results[:4])
    print(f"  {m} rows {n}x{k} + SiLU·mul: cuBLAS {t_ref:.2f}us, before {t_old:.2f}us, fused {tuple(current)} "
          f"{t_cur:.2f}us, floor {n * k * 2 / bw * 1e6:.2f}us, best {best}", flush=True)
    return dict(cublas_us=t_ref, before_us=t_old, fused_us=t_cur, current=current._asdict(),
                configs=[dict(us=t, **c._asdict()) for t, c in results])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rows", type=int, nargs="*", default=[2, 5, 8, 16, 20, 32],
                    help=f"also time these row counts (2..{gemv.MAX_ROWS}) plain")
    ap.add_argument("--rows-sweep", type=int, nargs="*", default=[],
                    help="time every several-rows block config at these row counts (tiles up to 128 rows) against cuBLAS")
    ap.add_argument("--gate-up-sweep", type=int, nargs="*", default=[],
                    help="row counts at which to sweep gate_up_silu's configs (gate/up shapes only)")
    ap.add_argument("--shapes", default="", help="only the shapes whose name starts with this (e.g. 8b)")
    ap.add_argument("--out", default="gemv.json")
    args = ap.parse_args()
    require_cuda("bench_gemv.py")
    dtype = torch.bfloat16
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    print(f"{'shape':<12} {'op':<6} {'cuBLAS us':>9} {'gemv us':>8} {'speedup':>7} {'cuBLAS %bw':>10} {'gemv %bw':>8}")
    for name, n, k in (s for s in SHAPES if s[0].startswith(args.shapes)):
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(max(2, (512 << 20) // nbytes))]
        for op, (ref_fn, fn) in cases(n, k, dtype, args.rows).items():
            t_ref, t = time_graph(ref_fn, weights), time_graph(fn, weights)
            floor = nbytes / bw * 1e6
            rows.append(dict(shape=name, n=n, k=k, op=op, cublas_us=t_ref, gemv_us=t, floor_us=floor))
            print(f"{name:<12} {op:<6} {t_ref:9.2f} {t:8.2f} {t_ref / t:7.2f} {100 * floor / t_ref:10.1f} "
                  f"{100 * floor / t:8.1f}", flush=True)
        if args.sweep:
            x = torch.randn(1, k, device="cuda", dtype=dtype)
            default, results = gemv._blocks, []
            for bn, bk, warps in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024), (2, 4, 8)):
                if bn * bk > 16384 or bn * bk < 512:
                    continue
                gemv._blocks = lambda _n, _k, cfg=(bn, bk, warps): cfg
                results.append((time_graph(lambda w: gemv.linear(x, w), weights), bn, bk, warps))
            gemv._blocks = default
            results.sort()
            best = ", ".join(f"{bn}x{bk}/{w}w {t:.2f}us" for t, bn, bk, w in results[:4])
            print(f"  sweep {name}: best {best}", flush=True)
            rows.append(dict(shape=name, sweep=[dict(us=t, block_n=bn, block_k=bk, warps=w)
                                                for t, bn, bk, w in results]))
        for m in args.rows_sweep:
            rows.append(dict(shape=name, rows_sweep=m, **rows_sweep(m, n, k, dtype, weights, bw)))
        for m in args.gate_up_sweep if "gate_up" in name else ():
            rows.append(dict(shape=name, gate_up_sweep=m, **gate_up_sweep(m, n, k, dtype, weights, bw)))
        del weights
    with open(args.out, "w") as f:
        json.dump(dict(copy_bandwidth=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
