"""HF transformers assisted generation vs our speculative decoding: default SmolLM2 pair, same prompts, same run.

Target: SmolLM2-135M-Instruct (the offline registry's GGUF, or --gguf); draft: the shipped default draft
(vllm_spec/assets/default_draft, which borrows the target's embeddings; or --draft). Every prompt of
benchmarks/prompts.py (chat template applied) goes, one at a time (batch 1: HF assisted generation
supports no more), through:

* ours   plain      our engine, no speculation;
* ours   fixed      our engine, the draft proposing --k tokens every step;
* ours   adaptive   our engine, the adaptive speculation policy (k chosen per step, at most --k);
* hf     greedy     transformers `generate` on the same dequantized target weights;
* hf     assisted   `generate(..., assistant_model=draft)`, --k candidate tokens per round (constant schedule,
                    no confidence stop): the counterpart of ``ours fixed``;
* hf     assisted-default   the same with transformers' own assistant defaults (up to 20 candidates per round,
                    drafting stops once the draft's confidence falls below 0.4, a threshold transformers retunes
                    online when scikit-learn is installed): the counterpart of ``ours adaptive``.

Greedy; exactly --max-tokens new tokens per prompt (ignore_eos / min_new_tokens); each system is warmed up
once on the first prompt, then timed over all prompts. Reported: tokens/s, acceptance rate (accepted /
proposed draft tokens), mean accepted length (tokens emitted per verification step that had drafts, the
target's own token included), speedup over the system's own plain baseline, ours / HF for the matching
HF row, and the fraction of prompts whose token ids equal HF greedy's. transformers exposes no acceptance
statistics, so for HF they are counted from forward calls: each target forward is one verification round,
each draft forward proposes one candidate, and every round emits its accepted candidates plus one target
token. Before timing, the HF draft's greedy next-token predictions are checked against our engine's draft on
two prompts (every prompt position). Where the draft config restricts the draft's vocabulary
("vllm_spec_draft_vocab", as the default draft does), our engine proposes from that subset only (a cheaper
head) while transformers' assistant keeps the whole vocabulary; the check compares the subset's columns.

    OMP_NUM_THREADS=1 python benchmarks/benchmark_assisted.py --num-prompts 4 --max-tokens 48
    python benchmarks/benchmark_assisted.py --device cuda          # bfloat16 by default on CUDA
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

import torch
import transformers
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_latency import load_hf_model  # noqa: E402
from prompts import PROMPT_TEXTS  # noqa: E402

from vllm_spec.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_spec.entrypoints.cli import default_draft_path  # noqa: E402
from vllm_spec.entrypoints.llm import LLM  # noqa: E402
from vllm_spec.model import offline_models  # noqa: E402
from vllm_spec.sampling_params import SamplingParams  # noqa: E402
from vllm_spec.tokenizer import get_tokenizer  # noqa: E402
from vllm_spec.worker.batch import SeqInput  # noqa: E402

# Below this greedy match between the two drafts the HF draft was built wrongly (embedding, rope, head),
# not merely rounded differently (in float32 on CPU they agree at every position).
DRAFT_CHECK_MIN_MATCH = 0.95
# Each of our rows is compared with the HF row that does the same thing.
HF_COUNTERPART = {"plain": "greedy", "fixed": "assisted", "adaptive": "assisted-default"}


@dataclass
class SpecStats:
    """Draft tokens proposed and accepted, and the verification steps that had drafts."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0


@dataclass
class Row:
    """One system's measurements over all prompts."""

    system: str    # "ours" or "hf"
    method: str    # plain / fixed / adaptive, greedy / assisted / assisted-default
    k: int | None  # draft tokens per step (the cap for adaptive); None: HF's default schedule or no draft
    prompts: int
    tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    speedup: float | None = None              # over the same system's plain row
    vs_hf: float | None = None                # ours tok/s / the matching HF row's tok/s
    same_as_hf_greedy: float | None = None    # fraction of prompts with identical token ids
    proposed: int | None = None
    accepted: int | None = None
    steps: int | None = None


def prompt_texts(n: int) -> list[str]:
    """The first n shared benchmark prompts, cycled."""
    return [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] for i in range(n)]


def chat_prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of the texts as single-turn chats (the tokenizer's chat template, generation prompt added)."""
    out = []
    for text in texts:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(chat, add_special_tokens=False).input_ids)
    return out


def load_hf_draft(draft_dir: str | Path, target, dtype: torch.dtype):
    """The draft folder as a transformers LlamaForCausalLM, with the weights our engine gives its draft.

    A draft whose config has ``vllm_spec_embeddings_from_target`` ships no embedding: like the engine's
    ``LlamaForCausalLM.share_embeddings`` it gets the target's embedding (a copy here), and its head is that
    embedding when the draft is tied, else the target's head.
    """
    draft_dir = Path(draft_dir)
    cfg = json.loads((draft_dir / "config.json").read_text())
    # Every key goes in: transformers 5 reads rope_theta from rope_parameters, and dropping it gives theta 10000.
    config = transformers.LlamaConfig(**cfg)
    draft = transformers.LlamaForCausalLM(config)
    state = load_file(str(draft_dir / "model.safetensors"))
    if cfg.get("vllm_spec_embeddings_from_target"):
        state["model.embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
        if not config.tie_word_embeddings:
            state["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise ValueError(f"draft weights in {draft_dir} do not fit a LlamaForCausalLM: "
                         f"missing {missing}, unexpected {unexpected}")
    draft.tie_weights()
    return draft.to(dtype).eval()


@torch.inference_mode()
def check_draft(llm: LLM, draft_hf, prompts: list[list[int]]) -> dict:
    """Compare the HF draft with the engine's draft: greedy next token and logits at every prompt position.

    The engine's draft prefills each prompt into KV blocks of its own cache; the engine must be idle
    (no request holds blocks), which it is between ``generate`` calls.
    """
    runner = llm.llm_engine.executor.worker.draft_runner
    match = positions = 0
    max_diff = 0.0
    for ids in prompts:
        # Block 0 is the null block; this cache has no prefix sharing, so any other block is free now.
        table = list(range(1, 1 + -(-len(ids) // runner.block_size)))
        # Eager: a graph would be captured for this one prompt length.
        batch = runner.prepare([SeqInput(seq_id=0, token_ids=ids, start_pos=0, block_table=table, sample=False)],
                               use_graph=False)
        ours = runner.run(batch)
        theirs = draft_hf(torch.tensor([ids], device=draft_hf.device)).logits[0].float().to(ours.device)
        if runner.model.output_ids is not None:   # the engine's draft proposes from a vocabulary subset
            theirs = theirs[:, runner.model.output_ids]
        match += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        positions += len(ids)
        max_diff = max(max_diff, float((ours - theirs).abs().max()))
    return {"prompts": len(prompts), "positions": positions, "argmax_match": match / positions,
            "max_abs_logit_diff": max_diff, "passed": match / positions >= DRAFT_CHECK_MIN_MATCH}


class ForwardCounter:
    """Counts HF assisted generation's work from forward calls while in use (``with``).

    Each target forward is one verification round; each draft forward proposes one candidate token.
    """

    def __init__(self, target, draft):
        self.target, self.draft = target, draft
        self.proposed_per_round: list[int] = []
        self._pending = 0

    def __enter__(self) -> Self:
        self._hooks = [self.target.register_forward_pre_hook(self._on_target),
                       self.draft.register_forward_pre_hook(self._on_draft)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()

    def _on_target(self, *_) -> None:
        self.proposed_per_round.append(self._pending)
        self._pending = 0

    def _on_draft(self, *_) -> None:
        self._pending += 1

    def stats(self, emitted: int) -> SpecStats:
        """Given the tokens generated meanwhile: every round emits its accepted candidates plus one target token."""
        rounds = self.proposed_per_round
        return SpecStats(proposed=sum(rounds), accepted=emitted - len(rounds), steps=sum(r > 0 for r in rounds))


def engine_stats(llm: LLM) -> SpecStats:
    """The engine's cumulative speculation counters (zeros without speculation)."""
    m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value") and not x.labels}
    return SpecStats(proposed=m.get("vllm:spec_decode_num_draft_tokens", 0),
                     accepted=m.get("vllm:spec_decode_num_accepted_tokens", 0),
                     steps=m.get("vllm:spec_decode_num_drafts", 0))


def engine_generate(llm: LLM, params: SamplingParams, prompt: list[int]) -> list[int]:
    """Our engine's ids for one prompt."""
    return list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


def timed(generate_one: Callable[[list[int]], list[int]], prompts: list[list[int]],
          device: torch.device) -> tuple[float, list[list[int]]]:
    """Seconds for generating every prompt one after the other, and the generated ids."""
    t0 = time.perf_counter()
    ids = [generate_one(p) for p in prompts]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, ids


def hf_generate(model, prompt: list[int], new_tokens: int, pad_id: int, assistant=None) -> list[int]:
    """Greedy ids of exactly new_tokens tokens from HF `generate`, assisted by `assistant` if given."""
    x = torch.tensor([prompt], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id, temperature=None,
                         top_p=None, top_k=None, assistant_model=assistant)
    return out[0, len(prompt):].tolist()


def set_assistant_schedule(draft_hf, k: int | None) -> None:
    """k candidates every round and no confidence stop; None: transformers' own defaults (filled in by generate)."""
    cfg = draft_hf.generation_config
    cfg.num_assistant_tokens = k
    cfg.num_assistant_tokens_schedule = "constant" if k else None
    cfg.assistant_confidence_threshold = 0.0 if k else None


def make_row(system: str, method: str, k: int | None, seconds: float, ids: list[list[int]],
             stats: SpecStats | None) -> Row:
    tokens = sum(map(len, ids))
    row = Row(system, method, k, len(ids), tokens, seconds, tokens / seconds)
    if stats is not None:
        row.proposed, row.accepted, row.steps = stats.proposed, stats.accepted, stats.steps
        row.acceptance_rate = stats.accepted / stats.proposed if stats.proposed else 0.0
        row.mean_accepted_length = 1.0 + stats.accepted / stats.steps if stats.steps else 1.0
    return row


def run_ours(model: str, draft: str, prompts: list[list[int]], args, device: torch.device,
             hf_draft) -> tuple[list[Row], list[list[list[int]]], dict]:
    """Our engine plain, then with the draft (fixed k and adaptive); one engine at a time.

    Returns the rows, each row's generated ids and the draft check (done on the first speculative engine).
    """
    engine = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, seed=0,
                  kv_cache_memory_bytes=args.kv_cache_mb << 20)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, outputs, check = [], [], {}
    for method in ("plain", "fixed", "adaptive"):
        spec = {} if method == "plain" else dict(speculative_model=draft, num_speculative_tokens=args.k,
                                                 speculative_policy=method)
        llm = LLM(model, **engine, **spec)
        one = functools.partial(engine_generate, llm, params)
        if method == "fixed":
            check = check_draft(llm, hf_draft, prompts[:2])
        one(prompts[0])  # warm-up: allocator, kernels / CUDA graphs, the adaptive policy's cost model
        before = engine_stats(llm)
        secs, ids = timed(one, prompts, device)
        after = engine_stats(llm)
        stats = None if method == "plain" else SpecStats(
            after.proposed - before.proposed, after.accepted - before.accepted, after.steps - before.steps)
        rows.append(make_row("ours", method, args.k if spec else None, secs, ids, stats))
        outputs.append(ids)
        print(f"  ours {method:<9} {rows[-1].tokens_per_s:7.2f} tok/s", file=sys.stderr, flush=True)
        del llm, one
        gc.collect()
    return rows, outputs, check


def run_hf(target_hf, draft_hf, prompts: list[list[int]], pad_id: int, args,
           device: torch.device) -> tuple[list[Row], list[list[list[int]]]]:
    """HF greedy, then assisted with k candidates per round, then assisted with HF's default schedule."""
    rows, outputs = [], []
    for method, k in (("greedy", None), ("assisted", args.k), ("assisted-default", None)):
        assistant = None if method == "greedy" else draft_hf
        if assistant is not None:
            set_assistant_schedule(draft_hf, k)
        one = functools.partial(hf_generate, target_hf, new_tokens=args.max_tokens, pad_id=pad_id,
                                assistant=assistant)
        one(prompts[0])  # warm-up
        with ForwardCounter(target_hf, draft_hf) as counter:
            secs, ids = timed(one, prompts, device)
        stats = None if assistant is None else counter.stats(sum(map(len, ids)))
        rows.append(make_row("hf", method, k, secs, ids, stats))
        outputs.append(ids)
        print(f"  hf   {method:<16} {rows[-1].tokens_per_s:7.2f} tok/s", file=sys.stderr, flush=True)
    return rows, outputs


def compare(ours: list[Row], hf: list[Row], ours_ids: list, hf_ids: list) -> None:
    """Fill in speedups over each system's own plain row, ours / HF, and equality with HF greedy."""
    greedy = hf_ids[0]
    for rows, ids in ((ours, ours_ids), (hf, hf_ids)):  # each list starts with its plain row
        for row, got in zip(rows, ids):
            row.speedup = row.tokens_per_s / rows[0].tokens_per_s
            row.same_as_hf_greedy = sum(a == b for a, b in zip(got, greedy)) / len(greedy)
    by_method = {r.method: r for r in hf}
    for row in ours:
        row.vs_hf = row.tokens_per_s / by_method[HF_COUNTERPART[row.method]].tokens_per_s


def print_table(rows: list[Row]) -> None:
    """A markdown table of the rows."""
    def opt(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    print("| system | method | k | tok/s | acceptance | mean accepted length | speedup vs own plain | "
          "ours / HF | ids = HF greedy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.system} | {r.method} | {r.k or '-'} | {r.tokens_per_s:.2f} | {opt(r.acceptance_rate, '.3f')} | "
              f"{opt(r.mean_accepted_length, '.2f')} | {r.speedup:.2f}x | {opt(r.vs_hf, '.2f')} | "
              f"{r.same_as_hf_greedy:.0%} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None,
                   help="target weights: a local SmolLM2 GGUF file (an HF folder works too; "
                        "default: the offline registry's smollm2-135m, cached after the first fetch)")
    p.add_argument("--draft", default=None, help="draft folder (default: vllm_spec/assets/default_draft)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (always all of them)")
    p.add_argument("--num-prompts", type=int, default=len(PROMPT_TEXTS))
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed), and the adaptive policy's cap")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/assisted_<time>.json)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    model = args.gguf or str(offline_models.fetch_offline_model("smollm2-135m"))
    draft = args.draft or default_draft_path()
    if draft is None:
        p.error("no draft shipped in vllm_spec/assets/default_draft: pass --draft")
    draft = str(draft)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"assisted_{time.strftime('%Y%m%dT%H%M%S')}.json")
    t_start = time.time()

    target_hf = load_hf_model(model, dtype).to(device)
    draft_hf = load_hf_draft(draft, target_hf, dtype).to(device)
    # The engine's tokenizer (for a GGUF: the file's own, with its chat template) makes both sides' prompts.
    tokenizer = get_tokenizer(EngineArgs(model=model).create_engine_config().model)
    texts = prompt_texts(args.num_prompts)
    prompts = chat_prompt_ids(tokenizer, texts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    ours, ours_ids, check = run_ours(model, draft, prompts, args, device, draft_hf)
    print(f"draft check (HF vs engine): {json.dumps(check)}", file=sys.stderr)
    hf, hf_ids = run_hf(target_hf, draft_hf, prompts, pad_id, args, device)
    compare(ours, hf, ours_ids, hf_ids)
    rows = ours + hf

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "benchmark_assisted", "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args), "target": model,
        "draft": draft, "prompts": texts,
        "draft_check": check, "env": {
            "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "wall_s": time.time() - t_start, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    print_table(rows)
    if not check["passed"]:
        print(f"ERROR: the HF draft's greedy predictions match the engine's draft at only "
              f"{check['argmax_match']:.1%} of positions", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
