"""Beam search: our LLM.beam_search (engines with prefix caching off and on) against HF transformers' beam search
(`generate(num_beams=W)`), same model, same prompts, same run.

    python benchmarks/benchmark_beam_search.py --width 4 --max-tokens 32 --prompts 4

Each system returns the W best beams of each prompt after at most --max-tokens new tokens (ignore_eos,
so all run the full length). The algorithms differ in their scores (vLLM's divide a beam's cumulative
logprob by its whole length, prompt included; HF's by the generated length) and HF stops a prompt's
search once no live beam can beat its finished ones, so the best beams need not agree: `same best` is
the share of prompts whose best beam's tokens equal ours on an engine without prefix caching. Our beam
search runs one-token generate steps over the live beams (2 x W logprobs each) and reads the beams' shared
prefixes from the prefix cache, also on an engine that keeps none (`enable_prefix_caching` off: the
search turns it on for itself). Default model: the embedded SmolLM2-135M-Instruct (GGUF; HF gets
the same dequantized weights). Writes JSON to benchmarks/results/beam_search_<time>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_latency import load_hf_model  # noqa: E402
from benchmark_spec_decode import positive_int  # noqa: E402
from default_pair import write_rows  # noqa: E402
from prompts import PROMPT_TEXTS  # noqa: E402

from vllm_spec.entrypoints.llm import LLM  # noqa: E402
from vllm_spec.sampling_params import BeamSearchParams  # noqa: E402


@dataclass
class Row:
    system: str
    seconds: float
    beam_tokens_per_s: float   # new tokens of all returned beams, per second
    same_best: float | None    # share of prompts whose best beam equals ours (prefix caching off)


def _ours(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> tuple[float, list[list[int]]]:
    llm.beam_search([{"prompt_token_ids": p} for p in prompts[:1]], BeamSearchParams(params.beam_width, 2,
                                                                                     ignore_eos=True))   # warm-up
    start = time.perf_counter()
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, [o.sequences[0].tokens for o in outs]


def _hf(model: str, dtype: torch.dtype, prompts: list[list[int]], width: int,
        max_tokens: int) -> tuple[float, list[list[int]]]:
    hf = load_hf_model(model, dtype)
    kwargs = dict(num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                  min_new_tokens=max_tokens, length_penalty=1.0, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        best = [hf.generate(torch.tensor([p]), **kwargs)[0].tolist() for p in prompts]
    return time.perf_counter() - start, best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded default model)")
    p.add_argument("--width", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--prompts", type=positive_int, default=4, help=f"at most {len(PROMPT_TEXTS)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.model is None:
        from vllm_spec.model.default_model import default_model_path
        args.model = str(default_model_path())
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True)
    results, prompts = {}, None
    for on in (False, True):
        llm = LLM(args.model, dtype=args.dtype, device="cpu", enable_prefix_caching=on)
        prompts = prompts or [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[: args.prompts]]
        results[f"ours, prefix caching {'on' if on else 'off'}"] = _ours(llm, prompts, params)
        del llm
    new_tokens = args.width * args.max_tokens * len(prompts)
    if not args.no_hf:
        results["HF transformers num_beams"] = _hf(args.model, getattr(torch, args.dtype), prompts, args.width,
                                                   args.max_tokens)
    reference = results["ours, prefix caching off"][1]
    rows = [Row(name, seconds, new_tokens / seconds, sum(a == b for a, b in zip(best, reference)) / len(prompts))
            for name, (seconds, best) in results.items()]
    print(f"{len(prompts)} prompts, width {args.width}, {args.max_tokens} tokens, {args.dtype}, CPU")
    print(f"{'system':<30} {'s':>7} {'beam tok/s':>11} {'x HF':>6} {'same best':>10}")
    hf_seconds = results.get("HF transformers num_beams", (None,))[0]
    for r in rows:
        ratio = f"{hf_seconds / r.seconds:6.2f}" if hf_seconds else "     -"
        print(f"{r.system:<30} {r.seconds:7.2f} {r.beam_tokens_per_s:11.1f} {ratio} {r.same_best:10.2f}")
    write_rows(args, "beam_search", args.model, "none", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
