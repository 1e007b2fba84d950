"""The engine's own host time per decode step, with the worker stubbed out.

    PYTHONPATH=. python3 benchmarks/bench_engine_host.py [--batch-sizes 1 16 64 256] [--steps 300]

At large batches a decode step's host time is mostly per-sequence Python: the scheduler's pass
over the running sequences, the step's inputs built per sequence, and the outputs applied per
sequence (tokens, stop checks, RequestOutputs). This times exactly that, with an executor whose
launch returns one token per sampled sequence at once (no model, no device), under async
scheduling as on CUDA, for each output kind: FINAL_ONLY (LLM.generate, non-streamed server
requests), CUMULATIVE (LLMEngine's default, streamed server requests) and DELTA. Medians over
the steps; the same Python costs about the same on a GPU machine's host (RESULTS, session 16).
Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_spec_decode import build, positive_int, write_config  # noqa: E402

from vllm_spec import SamplingParams  # noqa: E402
from vllm_spec.sampling_params import RequestOutputKind  # noqa: E402
from vllm_spec.worker.batch import ExecuteModelRequest, StepOutput  # noqa: E402
from vllm_spec.worker.step_handle import DoneStep  # noqa: E402

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
VOCAB = 1000
PHASES = ("schedule", "request", "read")


def stub_launch(req: ExecuteModelRequest) -> DoneStep:
    """Token 7 for every sampled sequence, at once."""
    ids = [s.seq_id for s in req.seqs if s.sample]
    return DoneStep(StepOutput(ids, [[7] for _ in ids]), one_token_per_seq=True)


def time_steps(batch: int, kind: RequestOutputKind, steps: int, prompt_len: int) -> dict:
    """Median microseconds per engine step, whole and by phase, over `steps` steady decode steps."""
    folder = Path(tempfile.mkdtemp())
    engine = build(write_config(folder, "tiny", 4096, vocab=VOCAB, dims=TINY), None, 1, 4096, batch,
                   dtype="float32", device="cpu", async_scheduling=True, kv_cache_memory_bytes=1 << 26)
    engine.executor.launch = stub_launch
    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return run

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine._model_request = timed("request", engine._model_request)
    engine._read = timed("read", engine._read)
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True, output_kind=kind)
    for i in range(batch):
        engine.add_request(str(i), [3 + (i + j) % (VOCAB - 3) for j in range(prompt_len)], params)
    for _ in range(20):   # prefill and warm-up
        engine.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        spent.clear()
        start = time.perf_counter()
        engine.step()
        per_step["step"].append(time.perf_counter() - start)
        for name in PHASES:
            per_step[name].append(spent[name])
    engine.abort_request([str(i) for i in range(batch)])
    return {name: statistics.median(times) * 1e6 for name, times in per_step.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--kinds", nargs="+", default=[k.name for k in RequestOutputKind],
                   choices=[k.name for k in RequestOutputKind])
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    rows = []
    for batch in args.batch_sizes:
        for kind in args.kinds:
            us = time_steps(batch, RequestOutputKind[kind], args.steps, args.prompt_len)
            rows.append(dict(batch=batch, output_kind=kind, **{f"{k}_us": v for k, v in us.items()}))
    print(f"{'batch':>5} {'outputs':>10} {'step us':>8} {'sched':>7} {'request':>8} {'read':>7} {'other':>7} {'us/seq':>7}")
    for r in rows:
        other = r["step_us"] - sum(r[f"{n}_us"] for n in PHASES)
        print(f"{r['batch']:5d} {r['output_kind']:>10} {r['step_us']:8.1f} {r['schedule_us']:7.1f} "
              f"{r['request_us']:8.1f} {r['read_us']:7.1f} {other:7.1f} {r['step_us'] / r['batch']:7.2f}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_host_{datetime.now(timezone.utc):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
