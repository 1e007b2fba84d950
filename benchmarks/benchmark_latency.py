"""Decode throughput of our engine vs Hugging Face transformers `generate`, same model, same run.

    python benchmarks/benchmark_latency.py --batch-sizes 1 16 --new-tokens 64

Both sides run greedy, in the same dtype (--dtype, float32 by default) on the same device, generate exactly --new-tokens tokens
per prompt (ignore_eos for us, min_new_tokens = max_new_tokens for HF) from the same
token-id prompts, after a warmup run. Timing covers the whole batch (prefill + decode).
Default model: the embedded default (SmolLM2-135M-Instruct GGUF); HF gets the same
dequantized weights through `vllm_spec.model.gguf_loader.iter_gguf_weights` loaded into a
transformers Llama/Qwen2 model (much faster than transformers' own `gguf_file=` path).
With --speculative-model, our engine is also timed with speculative decoding.
Writes JSON to benchmarks/results/latency_<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_spec.entrypoints.llm import LLM  # noqa: E402
from vllm_spec.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import PROMPT_TEXTS  # noqa: E402



def load_hf_model(model: str, dtype: torch.dtype):
    """An HF transformers model with the same weights as our engine's `model`."""
    import transformers as tf

    path = Path(model)
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").is_file()):
        from vllm_spec.model.gguf_loader import iter_gguf_weights, read_gguf_config

        gguf = path if path.suffix == ".gguf" else next(path.glob("*.gguf"))
        cfg = read_gguf_config(gguf)
        cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
        config_cls, model_cls = cls[cfg["model_type"]]
        config = config_cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
        with torch.device("meta"):
            hf = model_cls(config)
        state = dict(iter_gguf_weights(gguf))
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        hf.load_state_dict(state, strict=False, assign=True)
        hf.tie_weights()
        # Non-persistent buffers (rotary inv_freq) were built on meta: rebuild them for real.
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
        missing = [n for n, p in hf.named_parameters() if p.is_meta]
        if missing:
            raise RuntimeError(f"weights missing from {gguf}: {missing[:5]}")
    else:
        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.to(dtype).eval()


def make_prompts(tokenizer, batch: int) -> list[list[int]]:
    return [tokenizer(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]).input_ids for i in range(batch)]


def time_engine(llm: LLM, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # warmup
    times, tokens = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    return statistics.median(times), tokens


@torch.inference_mode()
def time_hf(hf, prompts: list[list[int]], new_tokens: int, pad_id: int,
            repeats: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])   # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
    hf.generate(ids, **kw)  # warmup
    times, tokens = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        times.append(time.perf_counter() - t0)
        tokens = out[:, width:].tolist()
    return statistics.median(times), tokens


def count(tokens: list[list[int]]) -> int:
    return sum(map(len, tokens))


def same_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of sequences whose greedy outputs are token-for-token identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded default model)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per case after the warmup (median)")
    p.add_argument("--speculative-model", default=None, help="also time our engine with this draft model")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()

    if args.model is None:
        from vllm_spec.model.default_model import default_model_path
        args.model = str(default_model_path())
    dtype = getattr(torch, args.dtype)
    common = dict(dtype=args.dtype, device="cpu", max_model_len=1024, max_num_seqs=max(args.batch_sizes),
                  kv_cache_memory_bytes=512 << 20)

    t0 = time.perf_counter()
    llm = LLM(args.model, **common)
    print(f"engine load {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    tokenizer = llm.get_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    spec_llm = None
    if args.speculative_model:
        spec_llm = LLM(args.model, speculative_model=args.speculative_model,
                       num_speculative_tokens=args.num_speculative_tokens, **common)
    hf = None
    if not args.no_hf:
        t0 = time.perf_counter()
        hf = load_hf_model(args.model, dtype)
        print(f"HF load {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch)
        row = {"batch": batch, "new_tokens": args.new_tokens}
        t, ours = time_engine(llm, prompts, args.new_tokens, args.repeats)
        row.update(engine_s=t, engine_tokens=count(ours), engine_tok_s=count(ours) / t)
        if spec_llm is not None:
            t, spec = time_engine(spec_llm, prompts, args.new_tokens, args.repeats)
            row.update(spec_s=t, spec_tokens=count(spec), spec_tok_s=count(spec) / t,
                       spec_same_as_engine=same_fraction(spec, ours))
        if hf is not None:
            t, theirs = time_hf(hf, prompts, args.new_tokens, pad_id, args.repeats)
            row.update(hf_s=t, hf_tokens=count(theirs), hf_tok_s=count(theirs) / t,
                       ratio=row["engine_tok_s"] / (count(theirs) / t),
                       same_as_hf=same_fraction(ours, theirs))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    header = ["batch", "engine tok/s"] + (["spec tok/s"] if spec_llm else []) + \
             (["HF tok/s", "engine/HF", "outputs = HF"] if hf is not None else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = [str(r["batch"]), f"{r['engine_tok_s']:.1f}"]
        if spec_llm:
            cells.append(f"{r['spec_tok_s']:.1f}")
        if hf is not None:
            cells += [f"{r['hf_tok_s']:.1f}", f"{r['ratio']:.2f}", f"{r['same_as_hf']:.0%}"]
        print("| " + " | ".join(cells) + " |")

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": args.model, "speculative_model": args.speculative_model,
        "num_speculative_tokens": args.num_speculative_tokens if args.speculative_model else None,
        "dtype": args.dtype, "device": "cpu", "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "rows": rows,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"latency_{datetime.now().strftime('%Y%m%d_%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
