"""Where a decode step's time goes, 8B shape with random weights.

    python benchmarks/profile_decode.py --batch 1 [--draft 68m --k 4] [--eager]   # torch.profiler table
    python benchmarks/profile_decode.py --batch 16 --draft 68m --trace-steps 20   # per-step times, compiles
    python benchmarks/profile_decode.py --batch 256 --host-profile               # where the host's time goes
    python benchmarks/profile_decode.py --batch 1 --draft 68m --k 8 --draft-graph  # one draft step in the graph
    python benchmarks/profile_decode.py --batch 64 --sync-check                  # host waits for the device
    python benchmarks/profile_decode.py --batch 256 --api-calls                  # CUDA API calls per step

--trace-steps prints every engine step's wall time and draft/verify times, and how
many Triton kernels were compiled during the traced steps (a recompiling kernel in
the steady state shows up there).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from benchmark_spec_decode import build, positive_int, require_cuda, run_decode, sync, write_config
from torch.profiler import ProfilerActivity, profile

from vllm_spec.spec_decode.adaptive_policy import AdaptivePolicy


def triton_compiled_kernels() -> int:
    """Compiled variants over every Triton JIT function of the package (0 where Triton is absent)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    import gc

    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, JITFunction):
            for entry in getattr(obj, "device_caches", {}).values():
                total += len(entry[0])
    return total


def trace_steps(engine, batch: int, steps: int, mixed: bool) -> None:
    """Per step: wall, draft and verify times, drafts per sequence, verified tokens, the draft's path."""
    import random

    from vllm_spec import SamplingParams

    rng = random.Random(2)
    vocab = engine.config.model.arch.vocab_size
    for i in range(batch):
        extra = {"synthetic_acceptance_rate": 0.9 if i % 2 else 0.3} if mixed else None
        params = SamplingParams(temperature=0, max_tokens=steps * 8, ignore_eos=True, extra_args=extra)
        engine.add_request(f"t{i}", [rng.randrange(2, vocab) for _ in range(128)], params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    last: list = [None]
    if engine.spec_metrics:
        add = engine.spec_metrics.add
        engine.spec_metrics.add = lambda s: (last.__setitem__(0, s), add(s))
    proposer = getattr(engine.executor.worker, "draft_proposer", None)
    loop_calls = [0]
    if proposer is not None:
        run_loop = proposer.loop.__call__
        proposer.loop = lambda *a, **k: (loop_calls.__setitem__(0, loop_calls[0] + 1), run_loop(*a, **k))[1]
    compiled = triton_compiled_kernels()
    print(f"{'step':>4} {'wall ms':>8} {'draft ms':>8} {'verify ms':>9} {'drafts':>6} {'verified':>8} "
          f"{'loop':>4} {'mean k':>6} {'compiled':>8}")
    for n in range(steps):
        last[0], calls = None, loop_calls[0]
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
        s = last[0]
        now = triton_compiled_kernels()
        print(f"{n:4d} {wall:8.3f} {s.draft_time * 1e3 if s else 0:8.3f} {s.verify_time * 1e3 if s else 0:9.3f} "
              f"{s.num_draft_tokens if s else 0:6d} {s.num_verified_tokens if s else 0:8d} "
              f"{loop_calls[0] - calls:4d} {s.policy.mean_k if s and s.policy else 0:6.2f} {now - compiled:8d}",
              flush=True)
        compiled = now
    engine.abort_request([f"t{i}" for i in range(batch)])


def sync_check(engine, batch: int, steps: int = 8) -> None:
    """Steady-state steps under torch's sync debug mode: every call that makes the host wait for the
    device, with where it was made. With async scheduling the step's only wait is for the previous
    step's tokens (an event, which the debug mode does not count); anything listed serialises host and device."""
    import collections
    import warnings

    sites: collections.Counter[str] = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        sites[f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"] += 1
    print(f"synchronizing calls in {steps} steps at batch {batch}: {sum(sites.values())}")
    for site, n in sites.most_common(20):
        print(f"{n:4d}  {site}")


def api_calls(engine, batch: int, steps: int = 16) -> None:
    """CUDA runtime/driver calls the host makes per steady-state step, by name, with their host time,
    then the ops that take the host's time: each call that queues device work costs host time, and
    unlike that time the count does not move between runs."""
    import collections

    stats = engine.stats
    before = (stats.num_steps, stats.schedule_time, stats.worker_host_time, stats.output_time)
    for _ in range(steps):
        engine.step()
    n = stats.num_steps - before[0]
    print(f"host us per step without the profiler at batch {batch}: schedule {(stats.schedule_time - before[1]) / n * 1e6:.0f}"
          f", worker {(stats.worker_host_time - before[2]) / n * 1e6:.0f}, outputs {(stats.output_time - before[3]) / n * 1e6:.0f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    calls, host_us = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CPU":
            host_us[e.name] += e.self_cpu_time_total
            if e.name.startswith("cu"):
                calls[e.name] += 1
    print(f"CUDA API calls per step at batch {batch}: {sum(calls.values()) / steps:.1f}, "
          f"{sum(host_us[n] for n in calls) / steps:.0f} us of host time")
    for name, n in calls.most_common():
        print(f"{n / steps:7.1f}  {host_us[name] / steps:8.1f} us  {name}")
    print("host time per step by op (self time, us; the profiler's own cost included):")
    for name, us in host_us.most_common(25):
        print(f"{us / steps:8.1f}  {name}")


def draft_graph_steps(engine, batch: int, max_k: int, context: int = 256, reps: int = 200) -> None:
    """Replay the whole-proposal graph for k = 1..max_k; the slope over k is one draft step inside the graph.

    The rows feed two tokens at positions context-1, context over real (garbage-filled) blocks; the
    intercept is the two-token catch-up forward, its LM head and the graph launch.
    """
    loop = engine.executor.worker.draft_proposer.loop
    blocks = torch.arange(1, loop.block_tables.shape[1] + 1, device=loop.tokens.device)
    rows = slice(0, batch)
    loop.tokens[rows] = 7
    loop.first_pos[rows] = context - 1
    loop.limits[rows] = engine.config.model.max_model_len - 1
    loop.block_tables[rows] = blocks[None, :] + torch.arange(batch, device=blocks.device)[:, None] * len(blocks)
    times = []
    for k in range(1, max_k + 1):
        graph, _ = loop.graphs[(batch, k)]
        for _ in range(10):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    ks = torch.arange(1, max_k + 1, dtype=torch.float64)
    slope, intercept = torch.linalg.lstsq(torch.stack([ks, torch.ones_like(ks)], 1),
                                          torch.tensor(times, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    print("k  ms per proposal (graph replay, batch %d)" % batch)
    for k, t in zip(range(1, max_k + 1), times):
        print(f"{k}  {t:.4f}")
    print(f"draft step inside the graph (slope): {slope:.4f} ms; intercept (catch-up forward + launch) {intercept:.4f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            loop.graphs[(batch, max_k)][0].replay()
        torch.cuda.synchronize()
    print(f"kernels of 20 replays of k = {max_k}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def host_profile(engine, steps: int) -> None:
    """cProfile of `steps` steady decode steps: Python functions by own time, then by cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--draft", default=None, choices=[None, "68m", "1b"])
    ap.add_argument("--k", type=positive_int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--eager", action="store_true", help="profile without CUDA graphs (per-kernel detail)")
    ap.add_argument("--trace-steps", type=int, default=0, help="print per-step timings instead of a profile")
    ap.add_argument("--policy", choices=["fixed", "adaptive"], default="fixed")
    ap.add_argument("--mixed", action="store_true", help="half the requests accept 0.9, half 0.3")
    ap.add_argument("--draft-graph", action="store_true",
                    help="time the whole-proposal graph for k = 1..--k (draft step = slope over k)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative_disable_by_batch_size: 1 runs the speculative engine without speculating")
    ap.add_argument("--sync-check", action="store_true",
                    help="list the calls that make the host wait for the device in steady-state steps")
    ap.add_argument("--api-calls", action="store_true",
                    help="count the CUDA API calls of steady-state steps (per step, by name)")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile of the host side of decode steps (Python functions by own time)")
    ap.add_argument("--chrome-trace", default=None,
                    help="also write the profile's timeline (chrome://tracing JSON) to this path")
    args = ap.parse_args()
    require_cuda("profile_decode.py")   # before building an 8B-shape model
    tmp = Path(tempfile.mkdtemp())
    target = write_config(tmp, "8b", 512)
    draft = write_config(tmp, args.draft, 512) if args.draft else None
    engine = build(target, draft, args.k, 512, max(args.batch, 1), enforce_eager=args.eager)
    if draft:
        worker = engine.executor.worker
        worker.config.speculative.synthetic_acceptance_rate = args.acceptance
        worker.config.speculative.disable_by_batch_size = args.disable_by_batch_size
        if args.policy == "adaptive":
            worker.policy = AdaptivePolicy(args.k, draft_cost_ratio=worker.draft_cost_ratio)
    if args.draft_graph:
        draft_graph_steps(engine, args.batch, args.k)
        return
    mixed = [{"synthetic_acceptance_rate": 0.9 if i % 2 else 0.3} for i in range(args.batch)] if args.mixed else None
    vocab = engine.config.model.arch.vocab_size
    run_decode(engine, args.batch, 128, 16, seed=0, extra_args=mixed, vocab=vocab)
    if args.trace_steps:
        trace_steps(engine, args.batch, args.trace_steps, args.mixed)
        return
    if args.sync_check or args.api_calls or args.host_profile:
        from vllm_spec import SamplingParams
        from vllm_spec.sampling_params import RequestOutputKind

        # FINAL_ONLY, as LLM.generate and the benchmarks: no per-step outputs in the host's time.
        # Long enough that no request finishes in the measured steps, speculative or not.
        params = SamplingParams(temperature=0, max_tokens=320, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        for i in range(args.batch):
            engine.add_request(f"s{i}", [2 + i] * 128, params)
        while any(s.num_output_tokens < 2 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        if args.host_profile:
            host_profile(engine, steps=40)
        else:
            (sync_check if args.sync_check else api_calls)(engine, args.batch)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_decode(engine, args.batch, 128, 24, seed=1, extra_args=mixed, vocab=vocab)
        torch.cuda.synchronize()
    if args.chrome_trace:
        prof.export_chrome_trace(args.chrome_trace)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
