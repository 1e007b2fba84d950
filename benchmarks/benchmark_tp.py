"""Tensor parallelism with speculation: the draft on one rank (draft TP=1) vs on all the target's ranks.

For each target TP size (--tp, default 2 4 8) and each draft TP in {1, target TP}, one engine
(MultiprocExecutor: one process per rank; gloo on CPU, NCCL on GPUs) generates the same greedy
batch; reported per row:

* proposal ms/token: the draft phase's wall time on rank 0 (the draft's forwards and, for ranks
  outside the draft's group, the broadcast of its proposals) per proposed draft token;
* verify ms/step: the target's scoring + rejection sampling per step;
* tokens/s: generated tokens over the wall time of the batch (engine built and warmed up before);
* the target alone at the same TP (draft_tp "-"); with real verification (--acceptance -1) whether
  the ids equal its ids (they must; synthetic acceptance keeps drafts whatever the target says).

Models: by default a tiny random Llama target (8 heads, so it splits 8 ways) and a smaller random
draft with 8 heads, written to a temporary folder; the acceptance rate is pinned with
`synthetic_acceptance_rate` (random models agree on nothing), so the rows compare the cost of
proposing, not the draft's quality. `--target/--draft` take real checkpoints instead.

On CPU the numbers prove that it works, not how fast it is: every rank is a process on the same
cores. On GPUs pass --device cuda and real models.

    python benchmarks/benchmark_tp.py                          # CPU, tiny models, TP 2/4/8
    python benchmarks/benchmark_tp.py --tp 2 --batch 1 8 --max-tokens 64
    python benchmarks/benchmark_tp.py --device cuda --target T --draft D --tp 2 4 8
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmark_spec_decode import positive_int  # noqa: E402

from vllm_spec import LLM, SamplingParams  # noqa: E402
from vllm_spec.spec_decode.metrics import SpecDecodeMetrics  # noqa: E402


@dataclass
class Row:
    tp: int
    draft_tp: int | None          # None: the target alone
    batch: int
    tokens: int
    seconds: float
    tokens_per_s: float
    proposal_ms_per_token: float | None = None
    verify_ms_per_step: float | None = None
    acceptance_rate: float | None = None
    identical_to_plain: bool | None = None
    start_s: float = 0.0


def make_model(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, seed: int) -> str:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return str(folder)


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(rng.randrange(8, 48))]} for _ in range(n)]


def run(target: str, draft: str | None, tp: int, draft_tp: int | None, batch: int, args) -> tuple[Row, list]:
    spec = {}
    if draft_tp is not None:
        spec = dict(speculative_config={"model": draft, "num_speculative_tokens": args.k, "policy": "fixed",
                                        "draft_tensor_parallel_size": draft_tp,
                                        "synthetic_acceptance_rate": args.acceptance if args.acceptance >= 0
                                        else None})
    t0 = time.perf_counter()
    llm = LLM(target, tensor_parallel_size=tp, device=args.device, skip_tokenizer_init=True,
              max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_mb << 20, **spec)
    start = time.perf_counter() - t0
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        batch_prompts = prompts(batch)
        llm.generate(batch_prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)                                                    # warm-up
        engine = llm.llm_engine
        if engine.spec_metrics is not None:
            engine.spec_metrics = SpecDecodeMetrics(engine.spec_metrics.num_speculative_tokens)
        t = time.perf_counter()
        ids = [o.outputs[0].token_ids for o in llm.generate(batch_prompts, params, use_tqdm=False)]
        secs = time.perf_counter() - t
        tokens = sum(len(x) for x in ids)
        row = Row(tp, draft_tp, batch, tokens, secs, tokens / secs, start_s=start)
        m = engine.spec_metrics
        if m is not None and m.num_draft_tokens:
            row.proposal_ms_per_token = 1e3 * m.draft_time / m.num_draft_tokens
            row.verify_ms_per_step = 1e3 * m.verify_time / max(m.num_steps, 1)
            row.acceptance_rate = m.acceptance_rate
        return row, ids
    finally:
        llm.llm_engine.executor.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=positive_int, nargs="+", default=[2, 4, 8], help="target TP sizes")
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=positive_int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.7,
                    help="synthetic acceptance rate; < 0: real verification (then ids must equal plain's)")
    ap.add_argument("--max-tokens", type=positive_int, default=32)
    ap.add_argument("--max-model-len", type=positive_int, default=256)
    ap.add_argument("--kv-cache-mb", type=positive_int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", help="target checkpoint (default: a tiny random Llama)")
    ap.add_argument("--draft", help="draft checkpoint (default: a smaller tiny random Llama)")
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="bench_tp_")
    target = args.target or make_model(Path(tmp.name) / "target", 256, 4, 8, 8, 1024, seed=0)
    draft = args.draft or make_model(Path(tmp.name) / "draft", 128, 1, 8, 8, 256, seed=1)

    rows: list[Row] = []
    print(f"{'tp':>3} {'draft_tp':>8} {'batch':>5} {'tok/s':>8} {'proposal ms/tok':>15} {'verify ms/step':>14} "
          f"{'accept':>6} {'same':>5} {'start s':>7}", flush=True)
    for tp in args.tp:
        for batch in args.batch:
            plain, plain_ids = run(target, None, tp, None, batch, args)
            rows.append(plain)
            results = [plain]
            for draft_tp in sorted({1, tp}):
                row, ids = run(target, draft, tp, draft_tp, batch, args)
                row.identical_to_plain = ids == plain_ids if args.acceptance < 0 else None
                rows.append(row)
                results.append(row)
            for r in results:
                fmt = (lambda v, f: "-" if v is None else format(v, f))
                print(f"{r.tp:>3} {fmt(r.draft_tp, 'd'):>8} {r.batch:>5} {r.tokens_per_s:>8.1f} "
                      f"{fmt(r.proposal_ms_per_token, '.2f'):>15} {fmt(r.verify_ms_per_step, '.2f'):>14} "
                      f"{fmt(r.acceptance_rate, '.2f'):>6} {fmt(r.identical_to_plain, ''):>5} {r.start_s:>7.1f}",
                      flush=True)
    if args.json:
        meta = dict(device=args.device, machine=platform.platform(), torch=torch.__version__, k=args.k,
                    synthetic_acceptance_rate=args.acceptance, max_tokens=args.max_tokens,
                    target=args.target or "tiny random (hidden 256, 4 layers, 8 heads)",
                    draft=args.draft or "tiny random (hidden 128, 1 layer, 8 heads)")
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=[asdict(r) for r in rows]), indent=2))
    tmp.cleanup()


if __name__ == "__main__":
    main()
