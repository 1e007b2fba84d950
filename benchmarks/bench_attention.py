"""Paged attention: the Triton kernel vs the torch reference backend, on one CUDA GPU.

    PYTHONPATH=. python3 benchmarks/bench_attention.py [--sweep] [--prefill]

Shapes: Llama-3-8B attention (32 query heads, 8 kv heads, head_dim 128, bf16, block_size 16),
random non-contiguous block tables; decode (q_len 1) and verification (q_len 5) at batch
1/16/64/256 and context 512/4096 (every sequence at that length). Times are medians of
triton.testing.do_bench (eager launches, L2 flushed between runs); "graph" is the Triton kernel
replayed from a CUDA graph (do_bench_cudagraph, kernel time without Python launch overhead).
KV bandwidth = bytes of K+V the sequences hold / time, next to the device-to-device copy
bandwidth (bytes read + written) measured in the same run. Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from benchmark_spec_decode import require_cuda  # noqa: E402

from vllm_spec.attention import torch_backend  # noqa: E402

if importlib.util.find_spec("triton") is not None:
    import triton.testing

    from vllm_spec.attention import triton_backend
else:   # CPU-only installs: main() refuses before any use
    triton = triton_backend = None
from vllm_spec.attention.metadata import AttentionMetadata, compute_slot_mapping  # noqa: E402

H, KVH, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16


def make(batch: int, ctx: int, q_len: int, seed: int = 0):
    """Caches sized to the batch, shuffled block tables, every sequence of length ctx."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = math.ceil(ctx / BS)
    num_blocks = 1 + batch * nb
    k_cache = torch.randn(num_blocks, BS, KVH, D, device="cuda", dtype=DTYPE, generator=g)
    v_cache = torch.randn(num_blocks, BS, KVH, D, device="cuda", dtype=DTYPE, generator=g)
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1).view(batch, nb)
    T = batch * q_len
    q = torch.randn(T, H, D, device="cuda", dtype=DTYPE, generator=g)
    qsl = torch.arange(batch + 1, device="cuda") * q_len
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.long)
    req = torch.arange(batch, device="cuda").repeat_interleave(q_len)
    pos = ctx - q_len + torch.arange(q_len, device="cuda").repeat(batch)
    md = AttentionMetadata(qsl, seq_lens, tables, compute_slot_mapping(tables, req, pos, BS), q_len, ctx, BS)
    torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream that does not wait for these
    return q, k_cache, v_cache, md


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the practical HBM ceiling)."""
    n = 2 << 30  # 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * n / (ms * 1e-3)


def bench_case(batch: int, ctx: int, q_len: int, with_torch: bool, copy_bw: float) -> dict:
    q, kc, vc, md = make(batch, ctx, q_len)
    scale = D ** -0.5
    out = triton_backend.paged_attention(q, kc, vc, md, scale)
    ref = torch_backend.paged_attention(q, kc, vc, md, scale) if with_torch else None
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item() if ref is not None else None
    plan = triton_backend._plan(batch, KVH, H // KVH, D, q_len, ctx, triton_backend._num_sms(q.device))
    t_tri = triton.testing.do_bench(lambda: triton_backend.paged_attention(q, kc, vc, md, scale),
                                    return_mode="median")
    t_graph = triton.testing.do_bench_cudagraph(lambda: triton_backend.paged_attention(q, kc, vc, md, scale),
                                                return_mode="median")
    t_torch = None
    if with_torch:
        t_torch = triton.testing.do_bench(lambda: torch_backend.paged_attention(q, kc, vc, md, scale),
                                          return_mode="median")
    kv_bytes = 2 * batch * ctx * KVH * D * kc.element_size()
    row = dict(kind="decode" if q_len == 1 else f"verify q{q_len}", batch=batch, ctx=ctx, q_len=q_len,
               kv_mb=kv_bytes / 1e6, triton_us=t_tri * 1e3, triton_graph_us=t_graph * 1e3,
               torch_us=t_torch * 1e3 if t_torch else None,
               speedup=t_torch / t_tri if t_torch else None,
               kv_gbps=kv_bytes / (t_tri * 1e-3) / 1e9, kv_gbps_graph=kv_bytes / (t_graph * 1e-3) / 1e9,
               frac_copy_graph=kv_bytes / (t_graph * 1e-3) / copy_bw, rel_err=err,
               plan=dict(zip(["block_q", "group_p", "block_n", "splits", "warps", "stages"], plan)))
    return row


def bench_prefill(q_len: int, ctx: int, with_torch: bool) -> dict:
    """One sequence: q_len new tokens after ctx - q_len cached ones (causal FLOPs counted exactly)."""
    q, kc, vc, md = make(1, ctx, q_len)
    scale = D ** -0.5
    out = triton_backend.paged_attention(q, kc, vc, md, scale)
    ref = torch_backend.paged_attention(q, kc, vc, md, scale) if with_torch else None
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item() if ref is not None else None
    t_tri = triton.testing.do_bench(lambda: triton_backend.paged_attention(q, kc, vc, md, scale),
                                    return_mode="median")
    t_torch = triton.testing.do_bench(lambda: torch_backend.paged_attention(q, kc, vc, md, scale),
                                      return_mode="median") if with_torch else None
    keys = sum(ctx - q_len + i + 1 for i in range(q_len))
    flops = 4 * H * D * keys
    return dict(kind="prefill", q_len=q_len, ctx=ctx, triton_us=t_tri * 1e3,
                torch_us=t_torch * 1e3 if t_torch else None, tflops=flops / (t_tri * 1e-3) / 1e12,
                speedup=t_torch / t_tri if t_torch else None, rel_err=err)


def sweep(copy_bw: float) -> list[dict]:
    """Launch configurations of the small-tile (decode/verification) path."""
    rows = []
    base = dict(triton_backend.CONFIG)
    for block_n, warps, stages in [(64, 4, 3), (128, 4, 3), (128, 8, 3), (32, 4, 3)]:
        triton_backend.CONFIG.update(small_block_n=block_n, small_warps=warps, small_stages=stages)
        for batch, ctx, q_len in [(1, 4096, 1), (64, 4096, 1), (256, 4096, 1), (64, 4096, 5)]:
            q, kc, vc, md = make(batch, ctx, q_len)
            f = lambda: triton_backend.paged_attention(q, kc, vc, md, D ** -0.5)  # noqa: E731
            t = triton.testing.do_bench_cudagraph(f, return_mode="median")
            del q, kc, vc, md, f
            kv = 2 * batch * ctx * KVH * D * 2
            rows.append(dict(block_n=block_n, warps=warps, stages=stages, batch=batch, ctx=ctx, q_len=q_len,
                             us=t * 1e3, frac_copy=kv / (t * 1e-3) / copy_bw))
            print(f"sweep n{block_n} w{warps} s{stages} B{batch} ctx{ctx} q{q_len}: {t*1e3:8.1f} us "
                  f"{rows[-1]['frac_copy']:.2f} of copy", flush=True)
    triton_backend.CONFIG.clear()
    triton_backend.CONFIG.update(base)
    for splits in [4, 8, 16, 32]:
        q, kc, vc, md = make(1, 4096, 1)
        out = torch.empty_like(q)
        f = lambda: triton_backend.paged_attention_out(q, kc, vc, md, D ** -0.5, None, out,  # noqa: E731
                                                       num_splits=splits)
        t = triton.testing.do_bench_cudagraph(f, return_mode="median")
        rows.append(dict(splits=splits, batch=1, ctx=4096, q_len=1, us=t * 1e3))
        print(f"sweep splits={splits} B1 ctx4096: {t*1e3:8.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--q-lens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--no-torch", action="store_true", help="skip the torch reference timings")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode launch configurations")
    ap.add_argument("--prefill", action="store_true", help="also time prefill (TFLOP/s)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    require_cuda("bench_attention.py")
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {copy_bw / 1e9:.0f} GB/s",
          flush=True)
    sweep_rows = sweep(copy_bw) if args.sweep else []
    rows = []
    for q_len in args.q_lens:
        for ctx in args.contexts:
            for batch in args.batches:
                rows.append(bench_case(batch, ctx, q_len, not args.no_torch, copy_bw))
                torch.cuda.empty_cache()
    prefill_rows = []
    if args.prefill:
        for q_len, ctx in [(2048, 2048), (512, 4096), (4096, 4096)]:
            prefill_rows.append(bench_prefill(q_len, ctx, not args.no_torch))

    print(f"\nTriton paged attention vs torch reference, {torch.cuda.get_device_name()}, bf16, "
          f"H={H} KVH={KVH} D={D} block={BS}; copy BW {copy_bw / 1e9:.0f} GB/s (read+write)")
    hdr = (f"{'kind':10} {'B':>4} {'ctx':>5} {'KV MB':>8} {'triton us':>10} {'graph us':>9} {'torch us':>10} "
           f"{'speedup':>8} {'KV GB/s':>8} {'graph GB/s':>10} {'%copy(g)':>8} {'splits':>6} {'rel err':>8}")
    print(hdr)
    for r in rows:
        print(f"{r['kind']:10} {r['batch']:>4} {r['ctx']:>5} {r['kv_mb']:>8.1f} {r['triton_us']:>10.1f} "
              f"{r['triton_graph_us']:>9.1f} {r['torch_us'] or float('nan'):>10.1f} "
              f"{r['speedup'] or float('nan'):>8.1f} {r['kv_gbps']:>8.0f} {r['kv_gbps_graph']:>10.0f} "
              f"{100 * r['frac_copy_graph']:>7.0f}% {r['plan']['splits']:>6} "
              f"{r['rel_err'] if r['rel_err'] is not None else float('nan'):>8.1e}")
    for r in prefill_rows:
        print(f"prefill q_len={r['q_len']} ctx={r['ctx']}: triton {r['triton_us']:.1f} us "
              f"({r['tflops']:.0f} TFLOP/s causal), torch {r['torch_us'] or float('nan'):.1f} us, "
              f"speedup {r['speedup'] or float('nan'):.1f}x, rel err {r['rel_err'] or float('nan'):.1e}")
    out = args.json or ROOT / "benchmarks" / "results" / (
        "attention_" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        shape=dict(heads=H, kv_heads=KVH, head_dim=D, block_size=BS, dtype=str(DTYPE)),
        copy_bw_gbps=copy_bw / 1e9, config=triton_backend.CONFIG, rows=rows, prefill=prefill_rows,
        sweep=sweep_rows, time=time.time()), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
