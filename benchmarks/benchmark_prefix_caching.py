"""Prefix caching: requests sharing a long system prompt, with the cache off and on, in the same run.

Every request is the same system prompt (--prefix-tokens long) followed by its own question. One
request runs first (it fills the cache when caching is on); the rest follow in waves of --batch.
Per system (plain, and with speculation when there is a draft) and caching off / on, reported:
wall time of the waves, generated tokens/s, mean time to first token, the prompt tokens found in
the cache (vllm:prefix_cache_hits), and whether the token ids equal those with the cache off.

    python benchmarks/benchmark_prefix_caching.py                    # default pair, CPU or GPU
    python benchmarks/benchmark_prefix_caching.py --model M --draft D --prefix-tokens 2048 --batch 8
    python benchmarks/benchmark_prefix_caching.py --draft none       # plain decoding only

A table is printed and JSON is written under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmark_spec_decode import positive_int
from default_pair import add_pair_args, resolve_pair, write_rows

from vllm_spec import LLM, SamplingParams

SYSTEM_TEXT = ("You are a careful assistant for a public library. Answer questions about opening hours, "
               "borrowing rules, events and the catalogue. Be brief, be polite, and say when you do not know. ")
QUESTIONS = ["When does the library open on Sundays?", "How many books can I borrow at once?",
             "Can I renew a loan online?", "Is there a reading group for children?",
             "Do you lend e-readers?", "What happens if I return a book late?",
             "Can I reserve a meeting room?", "Do you have newspapers from last year?"]


@dataclass
class Row:
    system: str
    caching: bool
    requests: int
    batch: int
    prefix_tokens: int
    seconds: float
    tokens_per_s: float
    mean_ttft_ms: float
    cached_tokens: int
    identical_to_uncached: bool | None = None


def build_prompts(llm: LLM, prefix_tokens: int, n: int) -> list[dict]:
    """The system text repeated to prefix_tokens tokens, then each request's question."""
    tok = llm.get_tokenizer()
    unit = tok(SYSTEM_TEXT, add_special_tokens=False).input_ids
    prefix = (unit * (prefix_tokens // len(unit) + 1))[:prefix_tokens]
    return [{"prompt_token_ids": prefix + tok(" " + QUESTIONS[i % len(QUESTIONS)] + f" (request {i})",
                                               add_special_tokens=False).input_ids} for i in range(n)]


def run(system: str, caching: bool, model: str, spec: dict, args) -> tuple[Row, list[list[int]]]:
    llm = LLM(model, enable_prefix_caching=caching, dtype=args.dtype, device=args.device, seed=0,
              max_model_len=args.prefix_tokens + 64 + args.max_tokens, **spec)
    prompts = build_prompts(llm, args.prefix_tokens, args.requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    start = time.perf_counter()
    outs = []
    for i in range(1, len(prompts), args.batch):
        outs += llm.generate(prompts[i:i + args.batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = Row(system, caching, len(outs), args.batch, args.prefix_tokens, seconds, tokens / seconds,
              1e3 * statistics.mean(ttft), sum(o.num_cached_tokens for o in outs))
    return row, [o.outputs[0].token_ids for o in first + outs]


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(p, "prefix_caching")
    p.add_argument("--prefix-tokens", type=positive_int, default=512)
    p.add_argument("--requests", type=positive_int, default=17, help="requests, the first one included")
    p.add_argument("--batch", type=positive_int, default=4, help="requests per wave after the first")
    p.add_argument("--max-tokens", type=positive_int, default=16)
    args = p.parse_args(argv)
    if args.requests < 2:
        p.error("--requests must be at least 2 (one fills the cache, the rest read it)")
    model, draft = resolve_pair(args)
    systems = {"plain": {}}
    if draft != "none":
        systems["speculative"] = dict(speculative_model=draft, num_speculative_tokens=args.k)
    rows = []
    for system, spec in systems.items():
        off, ids_off = run(system, False, model, spec, args)
        on, ids_on = run(system, True, model, spec, args)
        on.identical_to_uncached = ids_on == ids_off
        rows += [off, on]
    print(f"{'system':<12} {'cache':>5} {'requests':>8} {'prefix':>6} {'s':>7} {'tok/s':>8} {'TTFT ms':>8} "
          f"{'cached':>7} {'speedup':>7} {'same':>5}")
    for row in rows:
        base = next(r for r in rows if r.system == row.system and not r.caching)
        print(f"{row.system:<12} {'on' if row.caching else 'off':>5} {row.requests:8d} {row.prefix_tokens:6d} "
              f"{row.seconds:7.2f} {row.tokens_per_s:8.1f} {row.mean_ttft_ms:8.1f} {row.cached_tokens:7d} "
              f"{base.seconds / row.seconds:7.2f} {'' if row.identical_to_uncached is None else row.identical_to_uncached!s:>5}")
    write_rows(args, "prefix_caching", model, draft, rows)
    return rows


if __name__ == "__main__":
    main()
