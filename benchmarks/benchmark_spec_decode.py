"""Speculative vs plain decoding at real shapes with random weights (load_format="dummy").

Per batch size, in the same run: our plain decode, our speculative decode for each
draft shape, k and synthetic acceptance rate A (the verifier accepts each draft token
with probability A; both models still run their real forward passes), and optionally
HF transformers greedy `generate` on the same target. Reports ms/step, tokens/s,
the memory-bandwidth floor (weights + KV read per step over a copy bandwidth measured
in this run), speedup over plain, and the ratio to the theoretical speedup
E / (k*c + V) with E = (1 - A^(k+1)) / (1 - A), c = draft step / target step and
V = verify step / target step, all measured here (the draft and the verification are their
device spans; 'idle ms' is the rest of the step's device span, where the device waits for the
host to prepare the target pass). Host time per step (scheduling, the worker's input
preparation and launches, output processing; not the time spent waiting for the device) is
reported separately: its mean ('host ms') and its median over the engine's calls ('host md', which
a few steps slowed by other work on the host do not move).

    python benchmarks/benchmark_spec_decode.py --batch-sizes 1 4 16 64 256 --ks 1 2 4 8 \\
        --acceptance 0.5 0.7 0.9 --drafts 68m 1b --hf

Each request decodes --gen-len tokens and every step of the run is timed, the last ones (where
requests that accepted more have finished) with fewer sequences than the batch size; --window N
times N steps during which all of them run (the policy benchmark's protocol).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_spec import LLMEngine, SamplingParams
from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.sampling_params import RequestOutputKind
from vllm_spec.spec_decode.policy import FixedPolicy

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192),
    "68m": dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=12,
                intermediate_size=3072),
}
VOCAB = 128256
# Tokens per request of the warm-up run before each timed one (after 8, the first timed run was the slowest).
WARMUP_TOKENS = 24


def write_config(folder: Path, shape: str, max_len: int, vocab: int = VOCAB, dims: dict | None = None) -> str:
    """config.json of a Llama of the named shape (or of `dims`) in folder/shape."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=max_len, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
               torch_dtype="bfloat16", **(dims or SHAPES[shape]))
    path = folder / shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@dataclass
class Row:
    system: str
    batch: int
    k: int
    acceptance: float | None
    ms_per_step: float
    tokens_per_s: float
    ms_per_token_per_seq: float
    host_ms_per_step: float
    host_ms_median: float = 0.0       # median over the engine's calls: robust to the host's hiccups
    device_ms_per_step: float = 0.0   # the step's span on the device's clock
    draft_ms_per_step: float = 0.0
    verify_ms_per_step: float = 0.0
    mean_accepted_length: float = 0.0
    speedup: float = 0.0
    theoretical: float = 0.0
    floor_ms: float = 0.0


def require_cuda(script: str) -> None:
    """GPU-only benchmarks refuse in one line where there is no CUDA device (or no Triton)."""
    if importlib.util.find_spec("triton") is None:
        raise SystemExit(f"{script}: needs Triton and a CUDA GPU (Triton is not installed).")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (none found). On CPU: benchmark_spec_cpu.py, "
                         "compare_plain_steps.py --tiny, benchmark_policy.py --tiny, benchmark_tp.py, "
                         "bench_engine_host.py.")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def copy_bandwidth() -> float:
    """Bytes read + written per second for a large device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 20 / (start.elapsed_time(end) / 1e3)


def sync() -> None:
    """Wait for the device (no-op on CPU), so wall-clock times cover the work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def metric(engine: LLMEngine, name: str) -> float:
    m = next((m for m in engine.get_metrics() if m.name == name), None)
    return 0.0 if m is None else float(getattr(m, "value"))


def window_gen_len(gen_len: int, window: int, max_k: int) -> int:
    """Tokens per request for a timed window of `window` steps: enough that none finishes inside it,
    whatever it accepts (at most max_k + 1 tokens a step)."""
    return max(gen_len, window * (max_k + 1) + 32)


def run_decode(engine: LLMEngine, batch: int, prompt_len: int, gen_len: int, seed: int,
               extra_args: list[dict | None] | None = None, vocab: int = VOCAB, window: int | None = None) -> dict:
    """Time the decode phase: from the step after every prompt is prefilled to the end.

    extra_args: per request (SamplingParams.extra_args), e.g. a synthetic acceptance rate each.
    window: time only this many steps, during which every request is still running (gen_len must
    be long enough), then abort them: throughput at exactly `batch` concurrent requests, without
    the tail where requests that accept more have finished and the batch has shrunk.
    """
    rng = random.Random(seed)
    for i in range(batch):
        # FINAL_ONLY, as LLM.generate: no per-step outputs in the host time.
        params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY,
                                extra_args=extra_args[i] if extra_args else None)
        engine.add_request(f"r{seed}-{i}", [rng.randrange(2, vocab) for _ in range(prompt_len)], params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    sync()
    before = {n: metric(engine, n) for n in (
        "vllm:engine_steps", "vllm:engine_host_schedule_seconds", "vllm:engine_host_output_seconds",
        "vllm:engine_host_worker_seconds", "vllm:engine_device_seconds",
        "vllm:generation_tokens", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    spec = engine.spec_metrics
    d0, v0, s0 = (spec.draft_time, spec.verify_time, spec.num_steps) if spec else (0, 0, 0)
    t0 = time.perf_counter()
    # Steps read, not calls: with async scheduling one call may read two steps.
    stats = engine.stats
    last_step = stats.num_steps + window if window is not None else float("inf")
    host_per_call = []   # each call's host seconds per step it read
    while engine.has_unfinished_requests() and stats.num_steps < last_step:
        host, steps_before = stats.schedule_time + stats.worker_host_time + stats.output_time, stats.num_steps
        engine.step()
        if stats.num_steps > steps_before:
            host_per_call.append((stats.schedule_time + stats.worker_host_time + stats.output_time - host)
                                 / (stats.num_steps - steps_before))
    sync()
    elapsed = time.perf_counter() - t0
    delta = {n: metric(engine, n) - v for n, v in before.items()}
    if window is not None:
        if len(engine.scheduler.running) != batch:
            raise RuntimeError(f"a request finished inside the {window}-step window: raise gen_len ({gen_len}).")
        engine.abort_request([f"r{seed}-{i}" for i in range(batch)])
    steps = max(delta["vllm:engine_steps"], 1)
    # (A short run may generate everything before the timed part: one call can read two steps.)
    generated = max(delta["vllm:generation_tokens"], 1)
    out = dict(
        ms_per_step=elapsed / steps * 1e3,
        tokens_per_s=delta["vllm:generation_tokens"] / elapsed,
        ms_per_token_per_seq=elapsed / (generated / batch) * 1e3,
        host_ms_per_step=(delta["vllm:engine_host_schedule_seconds"] + delta["vllm:engine_host_worker_seconds"]
                          + delta["vllm:engine_host_output_seconds"]) / steps * 1e3,
        host_ms_median=statistics.median(host_per_call) * 1e3 if host_per_call else 0.0,
        device_ms_per_step=delta["vllm:engine_device_seconds"] / steps * 1e3,
    )
    if spec:
        n = max(spec.num_steps - s0, 1)
        drafts = max(delta["vllm:spec_decode_num_drafts"], 1)
        out.update(draft_ms_per_step=(spec.draft_time - d0) / n * 1e3,
                   verify_ms_per_step=(spec.verify_time - v0) / n * 1e3,
                   mean_accepted_length=1 + delta["vllm:spec_decode_num_accepted_tokens"] / drafts)
    return out


def floor_ms(engine: LLMEngine, batch: int, context: int, bandwidth: float) -> float:
    model = engine.executor.worker
    target = getattr(model, "target", model).runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    kv_bytes = batch * context * getattr(model, "target", model).runner.kv_bytes_per_block(torch.bfloat16) \
        / engine.config.cache.block_size
    return (weight_bytes + kv_bytes) / bandwidth * 1e3


def build(target: str, draft: str | None, k: int, max_len: int, max_seqs: int, **overrides) -> LLMEngine:
    """A dummy-weight engine, speculative with fixed k when draft is given; overrides: other EngineArgs."""
    spec = dict(speculative_config={"model": draft, "num_speculative_tokens": k, "policy": "fixed",
                                    "synthetic_acceptance_rate": 0.0}) if draft else {}
    args = dict(model=target, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.85, **spec)
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **overrides}))


def hf_generate(target_dir: str, batch: int, prompt_len: int, gen_len: int) -> float:
    """HF transformers greedy generate, ms per decode step (random weights, same shape)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(target_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(2, VOCAB, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=gen_len, max_new_tokens=gen_len, pad_token_id=0)
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / gen_len * 1e3
    del model
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--drafts", nargs="*", default=["68m", "1b"], choices=["68m", "1b"],
                    help="draft shapes (none: plain decode only)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--window", type=int, default=None,
                    help="time only this many steps, every request running throughout (steps at exactly the batch "
                         "size, without the tail where finished requests shrink it; --gen-len raised to fit)")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate (batch 1)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="PNG of speedup vs batch size")
    args = ap.parse_args()
    require_cuda("benchmark_spec_decode.py")
    if args.window is not None and args.window < 1:
        ap.error(f"--window must be >= 1, got {args.window}")
    gen_len = args.gen_len if args.window is None else window_gen_len(args.gen_len, args.window, max(args.ks))
    timed_len = gen_len if args.window is None else args.window   # tokens a plain request decodes while timed

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    tmp = Path(tempfile.mkdtemp())
    max_len = args.prompt_len + gen_len + 32
    target = write_config(tmp, "8b", max_len)
    rows: list[Row] = []
    plain: dict[int, Row] = {}
    engine = build(target, None, 1, max_len, max(args.batch_sizes))
    for b in args.batch_sizes:
        run_decode(engine, b, args.prompt_len, WARMUP_TOKENS, seed=0)
        r = run_decode(engine, b, args.prompt_len, gen_len, seed=1, window=args.window)
        plain[b] = Row("plain", b, 0, None, floor_ms=floor_ms(engine, b, args.prompt_len + timed_len // 2,
                                                                  bandwidth), **r)
        rows.append(plain[b])
        print(asdict(plain[b]), flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()

    for draft_shape in args.drafts:
        draft = write_config(tmp, draft_shape, max_len)
        engine = build(target, draft, max(args.ks), max_len, max(args.batch_sizes))
        worker = engine.executor.worker
        for b in args.batch_sizes:
            for k in args.ks:
                worker.policy = FixedPolicy(k)
                for a in args.acceptance:
                    worker.config.speculative.synthetic_acceptance_rate = a
                    run_decode(engine, b, args.prompt_len, WARMUP_TOKENS, seed=0)
                    r = run_decode(engine, b, args.prompt_len, gen_len, seed=1, window=args.window)
                    base = plain[b]
                    c = r["draft_ms_per_step"] / k / base.ms_per_step
                    v = r["verify_ms_per_step"] / base.ms_per_step
                    e = (1 - a ** (k + 1)) / (1 - a)
                    row = Row(f"spec-{draft_shape}", b, k, a, **r, floor_ms=base.floor_ms)
                    row.speedup = base.ms_per_token_per_seq / row.ms_per_token_per_seq
                    row.theoretical = e / (k * c + v)
                    rows.append(row)
                    print(asdict(row), flush=True)
        del engine, worker
        gc.collect()
        torch.cuda.empty_cache()

    hf = {}
    if args.hf:
        hf[1] = hf_generate(target, 1, args.prompt_len, min(args.gen_len, 64))

    print(f"\n{'system':10} {'B':>4} {'k':>2} {'A':>4} {'ms/step':>8} {'dev ms':>7} {'idle ms':>7} {'tok/s':>9} "
          f"{'host ms':>7} {'host md':>7} {'c':>5} {'V':>5} {'speedup':>7} {'theory':>6} {'%theory':>7} {'floor':>6}")
    for r in rows:
        base = plain[r.batch]
        c = r.draft_ms_per_step / max(r.k, 1) / base.ms_per_step if r.k else 0
        v = r.verify_ms_per_step / base.ms_per_step if r.k else 0
        pct = 100 * r.speedup / r.theoretical if r.theoretical else 0
        idle = r.device_ms_per_step - r.draft_ms_per_step - r.verify_ms_per_step if r.k else 0
        print(f"{r.system:10} {r.batch:4d} {r.k:2d} {r.acceptance or 0:4.2f} {r.ms_per_step:8.3f} "
              f"{r.device_ms_per_step:7.3f} {idle:7.3f} "
              f"{r.tokens_per_s:9.1f} {r.host_ms_per_step:7.3f} {r.host_ms_median:7.3f} {c:5.3f} {v:5.3f} {r.speedup:7.2f} "
              f"{r.theoretical:6.2f} {pct:7.1f} {r.floor_ms:6.2f}")
    for b, ms in hf.items():
        print(f"HF transformers generate, batch {b}: {ms:.2f} ms/step "
              f"(ours plain: {plain[b].ms_per_step:.2f} ms/step, {ms / plain[b].ms_per_step:.1f}x)")
    out = Path(args.out or f"benchmarks/results/spec_decode_{time.strftime('%Y%m%d_%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bandwidth,
                                   rows=[asdict(r) for r in rows], hf_ms_per_step=hf), indent=1))
    print(f"wrote {out}")
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r.system, r.k, r.acceptance) for r in rows if r.k})
    for system, k, a in keys:
        pts = sorted((r.batch, r.speedup) for r in rows if (r.system, r.k, r.acceptance) == (system, k, a))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{system} k={k} A={a}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over plain decode")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
