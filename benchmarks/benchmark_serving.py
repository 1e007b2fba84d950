"""Online serving benchmark: replay prompts at a Poisson request rate against the OpenAI-compatible
server, streaming, and report TTFT, TPOT, throughput and the speculative acceptance rate.

Against a running server (loopback):

    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000 \
        --num-prompts 64 --request-rate 4 --max-tokens 64

Compare with and without speculation (launches both servers itself on 127.0.0.1, one after the
other, with the same flags; the second adds --speculative-model/--num-speculative-tokens):

    python benchmarks/benchmark_serving.py --compare --model MODEL --speculative-model DRAFT \
        --num-speculative-tokens 4 --num-prompts 32 --request-rate 2 -- --max-model-len 1024

Per request: TTFT = time to the first streamed token; TPOT = (latency - TTFT) / (output tokens - 1);
latency = end-to-end. Output token counts come from the stream's final `usage`. The acceptance
rate and mean accepted length come from the deltas of the server's /metrics spec-decode counters
over the run. Prints a table; writes JSON to benchmarks/results/serving_<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from launched_server import LaunchedServer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import PROMPT_TEXTS as SHARED_PROMPTS  # noqa: E402

PROMPT_TEXTS = SHARED_PROMPTS + [
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "import numpy as np\n\ndef normalize(x):",
    "What is the capital of France? Answer in one sentence.",
    "Give step-by-step instructions to boil an egg.",
]

SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


# Metrics -----------------------------------------------------------------------------------------------
def scrape(base_url: str) -> dict[str, float]:
    """Sum of each counter over its label sets (one model per server)."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def spec_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    d = {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in SPEC_COUNTERS.items()}
    has_spec = SPEC_COUNTERS["draft_tokens"] in after
    return {
        "num_drafts": d["drafts"] if has_spec else None,
        "num_draft_tokens": d["draft_tokens"] if has_spec else None,
        "num_accepted_tokens": d["accepted"] if has_spec else None,
        "acceptance_rate": (d["accepted"] / d["draft_tokens"]) if has_spec and d["draft_tokens"] else None,
        "mean_accepted_length": (1 + d["accepted"] / d["drafts"]) if has_spec and d["drafts"] else None,
        "server_generation_tokens": d["generation_tokens"],
    }


# One request ----------------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, args, prompt: str, headers: dict) -> RequestResult:
    common = {"model": args.served_model, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {**common, "prompt": prompt}
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta", {}).get("content") if args.endpoint == "chat"
                             else choice.get("text"))
                    if piece:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
        res.latency = time.perf_counter() - t0
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(args, base_url: str, prompts: list[str]) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=max(args.max_concurrency or 0, len(prompts)) + 8,
                          max_keepalive_connections=64)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits) as client:
        async def fire(prompt: str) -> RequestResult:
            if sem is None:
                return await one_request(client, args, prompt, headers)
            async with sem:
                return await one_request(client, args, prompt, headers)

        tasks = []
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(fire(prompt)))
            if i + 1 < len(prompts) and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, spec: dict) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    lat = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = lambda v: None if v is None else v * 1e3
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput_rps": len(ok) / duration if duration else None,
        "output_throughput_tok_s": out_tokens / duration if duration else None,
        "mean_ttft_ms": ms(statistics.fmean(ttft)) if ttft else None,
        "median_ttft_ms": ms(_pct(ttft, 50)),
        "p99_ttft_ms": ms(_pct(ttft, 99)),
        "mean_tpot_ms": ms(statistics.fmean(tpot)) if tpot else None,
        "median_tpot_ms": ms(_pct(tpot, 50)),
        "p99_tpot_ms": ms(_pct(tpot, 99)),
        "mean_latency_ms": ms(statistics.fmean(lat)) if lat else None,
        "p99_latency_ms": ms(_pct(lat, 99)),
        **spec,
    }


def bench_server(args, base_url: str, prompts: list[str], label: str) -> dict:
    if not args.served_model:
        models = httpx.get(base_url + "/v1/models", timeout=10.0,
                           headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
        args.served_model = models["data"][0]["id"]
    if args.warmup:
        print(f"[{label}] warmup: {args.warmup} request(s)", file=sys.stderr)
        warm = argparse.Namespace(**{**vars(args), "request_rate": float("inf")})
        asyncio.run(run_load(warm, base_url, prompts[: args.warmup]))
    before = scrape(base_url)
    print(f"[{label}] {len(prompts)} requests at rate {args.request_rate}/s, max_tokens {args.max_tokens}",
          file=sys.stderr)
    results, duration = asyncio.run(run_load(args, base_url, prompts))
    after = scrape(base_url)
    summary = summarize(results, duration, spec_stats(before, after))
    summary["label"] = label
    summary["base_url"] = base_url
    return summary


# Output ---------------------------------------------------------------------------------------------------
ROWS = [
    ("completed", "Successful requests", "{:.0f}"),
    ("failed", "Failed requests", "{:.0f}"),
    ("duration_s", "Benchmark duration (s)", "{:.2f}"),
    ("total_output_tokens", "Output tokens", "{:.0f}"),
    ("request_throughput_rps", "Request throughput (req/s)", "{:.2f}"),
    ("output_throughput_tok_s", "Output token throughput (tok/s)", "{:.2f}"),
    ("mean_ttft_ms", "Mean TTFT (ms)", "{:.1f}"),
    ("median_ttft_ms", "Median TTFT (ms)", "{:.1f}"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "{:.1f}"),
    ("mean_tpot_ms", "Mean TPOT (ms)", "{:.1f}"),
    ("median_tpot_ms", "Median TPOT (ms)", "{:.1f}"),
    ("p99_tpot_ms", "P99 TPOT (ms)", "{:.1f}"),
    ("mean_latency_ms", "Mean E2E latency (ms)", "{:.1f}"),
    ("acceptance_rate", "Draft acceptance rate", "{:.3f}"),
    ("mean_accepted_length", "Mean accepted length", "{:.2f}"),
]


def print_table(summaries: list[dict]) -> None:
    width = 34
    cols = [s["label"] for s in summaries]
    print("=" * (width + 16 * len(cols)))
    print(f"{'':<{width}}" + "".join(f"{c:>16}" for c in cols))
    print("-" * (width + 16 * len(cols)))
    for key, name, fmt in ROWS:
        cells = []
        for s in summaries:
            v = s.get(key)
            cells.append(f"{fmt.format(v) if v is not None else 'n/a':>16}")
        print(f"{name:<{width}}" + "".join(cells))
    if len(summaries) == 2:
        a, b = summaries
        for key, name in (("output_throughput_tok_s", "Throughput speedup"), ("mean_tpot_ms", "TPOT speedup")):
            if a.get(key) and b.get(key):
                ratio = b[key] / a[key] if key.endswith("tok_s") else a[key] / b[key]
                print(f"{name + ' (' + cols[1] + ' vs ' + cols[0] + ')':<{width + 16}}{ratio:>16.2f}x")
    print("=" * (width + 16 * len(cols)))


def load_prompts(args) -> list[str]:
    if args.prompts_file:
        path = Path(args.prompts_file)
        texts = []
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            if path.suffix == ".jsonl":
                obj = json.loads(line)
                line = obj.get("prompt") or obj.get("text") or ""
            texts.append(line)
    else:
        texts = list(PROMPT_TEXTS)
    if not texts:
        raise SystemExit("error: no prompts")
    rng = random.Random(args.seed)
    return [texts[i % len(texts)] if i < len(texts) else rng.choice(texts) for i in range(args.num_prompts)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_extra: list[str] = []
    if "--" in argv:  # everything after `--` goes to both launched servers
        i = argv.index("--")
        argv, server_extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to benchmark (without --compare)")
    p.add_argument("--served-model", default=None, help="'model' field (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens per request")
    p.add_argument("--prompts-file", default=None, help="one prompt per line, or .jsonl with 'prompt'")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default="", help="suffix for the JSON file name")
    cmp = p.add_argument_group("--compare: launch a server without and one with speculation (args after `--` "
                               "go to both)")
    cmp.add_argument("--compare", action="store_true")
    cmp.add_argument("--model", default=None, help="target model (folder or .gguf) for the launched servers")
    cmp.add_argument("--speculative-model", default=None, help="draft model or '[ngram]'")
    cmp.add_argument("--num-speculative-tokens", type=int, default=4)
    cmp.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)

    prompts = load_prompts(args)
    summaries: list[dict] = []
    launched: list[dict] = []
    if args.compare:
        if not args.model or not args.speculative_model:
            p.error("--compare needs --model and --speculative-model")
        configs = [("baseline", []),
                   (f"spec k={args.num_speculative_tokens}",
                    ["--speculative-model", args.speculative_model,
                     "--num-speculative-tokens", str(args.num_speculative_tokens)])]
        with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
            for label, spec_args in configs:
                srv = LaunchedServer(label.replace(" ", "_").replace("=", ""), args.model,
                                     [*server_extra, *spec_args], args.api_key, Path(tmp), args.startup_timeout)
                try:
                    args.served_model = None
                    summary = bench_server(args, srv.url, prompts, label)
                finally:
                    rc = srv.stop()
                summary["server_cmd"] = srv.cmd
                summary["server_exit_code"] = rc
                summaries.append(summary)
                launched.append({"label": label, "cmd": srv.cmd, "exit_code": rc})
    else:
        summaries.append(bench_server(args, args.base_url.rstrip("/"), prompts, "server"))

    print_table(summaries)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = out_dir / f"serving_{stamp}{'_' + args.tag if args.tag else ''}.json"
    record = {
        "benchmark": "serving",
        "timestamp": stamp,
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "config": {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()},
        "server_extra_args": server_extra,
        "results": summaries,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
