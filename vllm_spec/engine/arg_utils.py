"""EngineArgs: the one flag set shared by LLM(), `vllm-spec generate` and `vllm-spec serve`."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from vllm_spec.config import (
    NGRAM_NAMES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_spec.engine.arg_parser import human_readable_int, json_object
from vllm_spec.sampling_params import DEFAULT_MAX_LOGPROBS, LOGPROBS_MODES
from vllm_spec.utils import is_int, is_number


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Engine options with vLLM's names. Every field is also a `--kebab-case` CLI flag."""

    model: str = _opt("", "HF model folder (config.json + safetensors) or a .gguf file.")
    tokenizer: str | None = _opt(None, "Tokenizer folder (default: the model's own).")
    skip_tokenizer_init: bool = _opt(False, "Do not load a tokenizer; prompts must be token ids.")
    dtype: str = _opt("auto", "auto, float32, float16 or bfloat16 (auto: float32 on CPU, bfloat16 on GPU).")
    seed: int | None = _opt(0, "Seed for requests without their own seed and for dummy weights (vllm-spec "
                              "generate: for each request too).")
    max_model_len: int | None = _opt(None, "Context length (default: the model's max_position_embeddings).")
    load_format: str = _opt("auto", "auto, safetensors, gguf or dummy (random weights).")
    device: str = _opt("auto", "auto, cpu or cuda.")
    tensor_parallel_size: int = _opt(1, "Tensor-parallel size of the target model.")
    distributed_executor_backend: str | None = _opt(
        None, "mp (one process per rank on this machine) or ray (Ray actors, multi-node); default mp when "
              "tensor_parallel_size > 1.")
    block_size: int | None = _opt(16, "Tokens per KV-cache block (None: 16).")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of GPU memory for weights, activations and KV cache.")
    kv_cache_memory_bytes: int | None = _opt(None, "KV cache size in bytes (overrides gpu_memory_utilization).")
    num_gpu_blocks_override: int | None = _opt(None, "Exact number of KV-cache blocks (testing).")
    max_num_seqs: int | None = _opt(256, "Maximum number of sequences per step (None: 256).")
    scheduling_policy: str = _opt("fcfs", "fcfs (arrival order) or priority (requests' priority, lower first, then "
                                          "arrival; preemption takes the last in that order).")
    max_num_batched_tokens: int | None = _opt(None, "Token budget per step (default 2048; prompts are chunked).")
    enforce_eager: bool = _opt(False, "Disable CUDA graphs.")
    async_scheduling: bool | None = _opt(
        None, "Schedule each step while the previous one runs on the device, when that step emits one token "
              "per sequence (default: on for CUDA with tensor_parallel_size 1).")
    enable_chunked_prefill: bool | None = _opt(
        True, "Split prompts over steps to fit max_num_batched_tokens (None: on); False: a prompt is prefilled "
              "whole, in a step with room for all of it (max_num_batched_tokens then defaults to max(2048, "
              "max_model_len)).")
    enable_prefix_caching: bool | None = _opt(False, "Share the KV blocks of prompt prefixes computed before: a "
                                                     "prompt starting with them computes only the rest (None: off).")
    # vLLM's names for what this engine does one way only, accepted at that way (checked in
    # create_engine_config): configurations written for vLLM run unchanged where they mean the same.
    trust_remote_code: bool = _opt(False, "Accepted for vLLM compatibility: no remote code is ever run "
                                          "(the built-in Llama-family architectures only).")
    tokenizer_mode: str = _opt("auto", "auto (the only mode: a fast tokenizer where the model has one).")
    revision: str | None = _opt(None, "Not supported (models are local folders or files): None.")
    tokenizer_revision: str | None = _opt(None, "Not supported (models are local folders or files): None.")
    download_dir: str | None = _opt(None, "Accepted for vLLM compatibility: nothing is downloaded here.")
    quantization: str | None = _opt(None, "Not supported: None (GGUF weights are dequantized on load).")
    kv_cache_dtype: str = _opt("auto", "auto (the only choice: the model's dtype).")
    swap_space: float = _opt(4.0, "Accepted for vLLM compatibility: preemption recomputes, it never swaps.")
    disable_log_stats: bool = _opt(False, "No statistics lines in the log (else one every 10 s while requests run, "
                                          "as vLLM's: throughput, queues, KV cache, speculative acceptance).")
    max_logprobs: int = _opt(DEFAULT_MAX_LOGPROBS, "Most logprobs / prompt_logprobs a request may ask for "
                             "(-1: the whole vocabulary).")
    logprobs_mode: str = _opt(
        "raw_logprobs", "What logprobs hold: raw_logprobs (of the model's logits, a grammar's mask "
                        "applied), raw_logits, processed_logprobs or processed_logits (after logit_bias, penalties, "
                        "temperature, top-k/top-p/min-p; prompt_logprobs: always log-probabilities).")
    cpu_offload_gb: float = _opt(0.0, "Not supported: 0.")
    hf_overrides: dict | None = _opt(
        None, "JSON object of config.json keys over the model's (the target's), e.g. '{\"max_position_embeddings\": "
              "8192}'; in Python also a callable taking and returning the transformers config.")
    hf_token: str | None = _opt(None, "Accepted for vLLM compatibility: no model hub is contacted.")
    compilation_config: dict | None = _opt(
        None, "Accepted for vLLM compatibility: this engine's CUDA graphs and kernels are its own (enforce_eager "
              "turns the graphs off).")
    max_seq_len_to_capture: int = _opt(8192, "Accepted for vLLM compatibility: graphs serve every sequence length.")
    disable_custom_all_reduce: bool = _opt(False, "Accepted for vLLM compatibility (torch.distributed collectives).")
    disable_async_output_proc: bool = _opt(False, "Accepted for vLLM compatibility (see async_scheduling).")
    served_model_name: str | None = _opt(None, "Accepted for vLLM compatibility (the server's own flag names its "
                                               "models).")
    task: str = _opt("auto", "auto or generate (the only task: text generation).")
    runner: str = _opt("auto", "auto or generate (the only runner: text generation).")
    enable_lora: bool = _opt(False, "Not supported: False.")
    pipeline_parallel_size: int = _opt(1, "Not supported: 1 (tensor_parallel_size shards the model).")
    data_parallel_size: int = _opt(1, "Not supported: 1 (one engine per process).")
    enable_sleep_mode: bool = _opt(False, "Not supported: False.")
    mm_processor_kwargs: dict | None = _opt(None, "Not supported: None (text-only models).")
    allowed_local_media_path: str = _opt("", "Accepted for vLLM compatibility (text-only models).")
    limit_mm_per_prompt: dict | None = _opt(None, "Accepted for vLLM compatibility at None or {} (text-only models).")
    mm_processor_cache_gb: float = _opt(4.0, "Accepted for vLLM compatibility (text-only models).")
    skip_mm_profiling: bool = _opt(False, "Accepted for vLLM compatibility (text-only models).")
    enable_prompt_embeds: bool = _opt(False, "Not supported: False (prompts are text or token ids).")
    disable_sliding_window: bool = _opt(False, "Not supported: False (sliding-window layers attend within their "
                                               "window).")
    model_impl: str = _opt("auto", "auto or vllm (the only implementation: this engine's own).")
    config_format: str = _opt("auto", "auto or hf (config.json; a .gguf file carries its own).")
    code_revision: str | None = _opt(None, "Not supported: None (no remote code).")
    max_parallel_loading_workers: int | None = _opt(None, "Accepted for vLLM compatibility (weights load in one "
                                                          "pass).")
    kv_transfer_config: dict | None = _opt(None, "Not supported: None (no disaggregated prefill).")
    pooler_config: dict | None = _opt(None, "Not supported: None (text generation only).")
    reasoning_parser: str | None = _opt(None, "Not supported: None (no reasoning parser).")
    attention_backend: str | None = _opt(None, "Not supported: None (the backend is chosen by device: Triton on "
                                               "CUDA, torch on CPU).")
    enable_expert_parallel: bool = _opt(False, "Not supported: False (dense models only).")
    calculate_kv_scales: bool = _opt(False, "Not supported: False (the KV cache is in the model's dtype).")
    kv_sharing_fast_prefill: bool = _opt(False, "Not supported: False.")
    disable_cascade_attn: bool = _opt(False, "Accepted for vLLM compatibility (no cascade attention here).")
    max_cudagraph_capture_size: int | None = _opt(
        None, "Accepted for vLLM compatibility: this engine's graphs cover batch buckets up to max_num_seqs.")
    stream_interval: int = _opt(1, "1 (the only interval: every step's new tokens are streamed).")
    structured_outputs_config: dict | None = _opt(
        None, "Accepted for vLLM compatibility as {\"backend\": ...} with any of vLLM's backend names: "
              "structured outputs use this engine's own grammar compiler.")
    generation_config: str = _opt(
        "auto", "auto (sampling fields a request leaves unset take the model's generation_config.json values: "
                "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), vllm (vLLM's "
                "own defaults) or a folder holding a generation_config.json.")
    override_generation_config: dict | None = _opt(
        None, "JSON object of sampling defaults over the generation config's, e.g. '{\"temperature\": 0.5}'.")
    speculative_model: str | None = _opt(None, "Draft model (folder or .gguf), or '[ngram]' for prompt lookup.")
    num_speculative_tokens: int | None = _opt(None, "Draft tokens per step, k in [1, 16].")
    speculative_config: dict | None = _opt(
        None, "vLLM V1 form as JSON: {model, num_speculative_tokens, method, prompt_lookup_max, "
              "prompt_lookup_min, draft_tensor_parallel_size, disable_by_batch_size, max_model_len, policy, "
              "draft_sample_method (probabilistic or greedy), enforce_eager (the draft's), "
              "num_speculative_tokens_per_batch_size ([[first, last batch size, k], ...]), "
              "synthetic_acceptance_rate (benchmarks only)}.")
    ngram_prompt_lookup_max: int | None = _opt(None, "Longest n-gram the [ngram] proposer matches (as vLLM: 5, "
                                                     "or ngram_prompt_lookup_min when only that is given).")
    ngram_prompt_lookup_min: int | None = _opt(None, "Shortest n-gram the [ngram] proposer matches (as vLLM: 5, "
                                                     "or ngram_prompt_lookup_max when only that is given).")
    speculative_draft_tensor_parallel_size: int | None = _opt(
        None, "Tensor-parallel size of the draft: a divisor of tensor_parallel_size (default 1); the draft runs "
              "on the first that many ranks of the target's processes.")
    speculative_disable_by_batch_size: int | None = _opt(
        None, "No speculation while this many or more requests are running (seeded requests included: their "
              "output then also depends on whether such steps occurred).")
    speculative_policy: str | None = _opt(
        None, "adaptive (default: k per sequence and step maximising goodput) or fixed (always k); "
              "speculative_config's num_speculative_tokens_per_batch_size sets a static table instead.")
    # vLLM V0's speculative-decoding flags, at the values that mean what this engine does.
    spec_decoding_acceptance_method: str = _opt("rejection_sampler", "rejection_sampler (the only method: "
                                                                     "lossless).")
    speculative_disable_mqa_scorer: bool = _opt(False, "False (verification always scores the k+1 positions of "
                                                       "every sequence in one multi-query pass).")
    disable_logprobs_during_spec_decoding: bool | None = _opt(
        None, "Accepted for vLLM compatibility: logprobs are the target's, the draft computes none.")
    use_v2_block_manager: bool = _opt(True, "True (the only block manager).")
    speculative_max_model_len: int | None = _opt(
        None, "The draft's context length, at most max_model_len (default: what the draft supports, capped "
              "at max_model_len): a sequence speculates only while its drafts stay inside it.")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flags = ["--" + f.name.replace("_", "-"), *_SHORT_FLAGS.get(f.name, ())]
            kind = hints[f.name]
            if _is_switch(kind):
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=f.metadata["help"])
                continue
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            parser.add_argument(*flags, type=_parser_for(base, f.name), default=f.default, help=f.metadata["help"])
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})

    def create_engine_config(self, usage_context: object = None) -> EngineConfig:
        """The engine's configuration (usage_context: vLLM's usage-statistics label, unused)."""
        if not self.model:
            raise ValueError("model must be given: an HF model folder or a .gguf file.")
        # Accepted under vLLM's names so that vLLM configurations run; only their supported value.
        chunked_prefill = _or_default(self.enable_chunked_prefill, True)
        if not isinstance(chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be True, False or None, got {chunked_prefill!r}.")
        if not isinstance(self.enable_prefix_caching, (bool, type(None))):
            raise ValueError(f"enable_prefix_caching must be True, False or None, got {self.enable_prefix_caching!r}.")
        self._check_fixed_choices()
        if not (is_int(self.max_logprobs) and self.max_logprobs >= -1):
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or an integer >= 0, got "
                             f"{self.max_logprobs!r}.")
        model = ModelConfig.create(self.model, self.tokenizer, self.dtype, self.device, self.max_model_len,
                                   self.load_format, self.seed, self.generation_config, self.override_generation_config,
                                   self.hf_overrides)
        model.max_logprobs = int(self.max_logprobs)
        model.logprobs_mode = self.logprobs_mode
        speculative = self._speculative_config(model)
        return EngineConfig(
            model=model,
            cache=CacheConfig(_or_default(self.block_size, 16), self.gpu_memory_utilization, self.kv_cache_memory_bytes,
                              self.num_gpu_blocks_override, bool(self.enable_prefix_caching)),
            scheduler=SchedulerConfig(_or_default(self.max_num_seqs, 256),
                                      self._token_budget(model.max_model_len, chunked_prefill), model.max_model_len,
                                      self.scheduling_policy, chunked_prefill),
            parallel=ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend),
            speculative=speculative,
            enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
            log_stats=not self.disable_log_stats,
        )

    def _token_budget(self, max_model_len: int, chunked_prefill: bool) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if chunked_prefill else max(2048, max_model_len)

    def _check_fixed_choices(self) -> None:
        for name, allowed in (("tokenizer_mode", ("auto",)), ("revision", (None,)), ("tokenizer_revision", (None,)),
                              ("quantization", (None,)), ("kv_cache_dtype", ("auto",)),
                              ("logprobs_mode", LOGPROBS_MODES), ("cpu_offload_gb", (0,)),
                              ("task", ("auto", "generate")),
                              ("runner", ("auto", "generate")), ("enable_lora", (False,)),
                              ("pipeline_parallel_size", (1,)), ("data_parallel_size", (1,)),
                              ("enable_sleep_mode", (False,)), ("mm_processor_kwargs", (None, {})),
                              ("limit_mm_per_prompt", (None, {})), ("enable_prompt_embeds", (False,)),
                              ("disable_sliding_window", (False,)), ("model_impl", ("auto", "vllm")),
                              ("config_format", ("auto", "hf")), ("code_revision", (None,)),
                              ("kv_transfer_config", (None, {})), ("pooler_config", (None, {})),
                              ("reasoning_parser", (None, "")), ("attention_backend", (None,)),
                              ("enable_expert_parallel", (False,)), ("calculate_kv_scales", (False,)),
                              ("kv_sharing_fast_prefill", (False,)), ("stream_interval", (1,)),
                              ("spec_decoding_acceptance_method", ("rejection_sampler",)),
                              ("speculative_disable_mqa_scorer", (False,)), ("use_v2_block_manager", (True,))):
            value = getattr(self, name)
            # (A bool equals 0 or 1: refused where the choice is not a bool.)
            if value not in allowed or isinstance(value, bool) is not any(isinstance(a, bool) for a in allowed):
                raise ValueError(f"{name} must be one of {list(allowed)} (the only supported choice), got {value!r}.")
        outputs = self.structured_outputs_config
        if outputs is not None and not (isinstance(outputs, dict) and set(outputs) <= {"backend"} and outputs.get(
                "backend", "auto") in ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")):
            raise ValueError("structured_outputs_config must be None or {\"backend\": one of auto, xgrammar, guidance, "
                             "outlines, lm-format-enforcer} (this engine's own compiler serves them all), got "
                             f"{outputs!r}.")
        if not isinstance(self.disable_logprobs_during_spec_decoding, (bool, type(None))):
            raise ValueError(f"disable_logprobs_during_spec_decoding must be True, False or None, got "
                             f"{self.disable_logprobs_during_spec_decoding!r}.")
        if not (is_number(self.swap_space) and self.swap_space >= 0):
            raise ValueError(f"swap_space must be a number >= 0 (GiB), got {self.swap_space!r}.")

    def _speculative_config(self, target: ModelConfig) -> SpeculativeConfig | None:
        """Merge the V0-style flags and the V1 `speculative_config` dict (a setting given both ways must
        agree)."""
        opts = {
            "model": self.speculative_model,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.ngram_prompt_lookup_max,
            "prompt_lookup_min": self.ngram_prompt_lookup_min,
            "draft_tensor_parallel_size": self.speculative_draft_tensor_parallel_size,
            "disable_by_batch_size": self.speculative_disable_by_batch_size,
            "method": None,
            "synthetic_acceptance_rate": None,
            "policy": self.speculative_policy,
            "max_model_len": self.speculative_max_model_len,
            "draft_sample_method": None,
            "enforce_eager": None,
            "num_speculative_tokens_per_batch_size": None,
        }
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, dict):
                raise ValueError("speculative_config must be a dict (JSON object).")
            given = dict(self.speculative_config)
            # vLLM's keys with nothing to set here: accepted at their neutral values, as the engine's own.
            for name, allowed in _SPEC_FIXED_KEYS.items():
                if name in given and given.pop(name) not in allowed:
                    raise ValueError(f"speculative_config['{name}'] must be one of {list(allowed)} (the only "
                                     f"supported values), got {self.speculative_config[name]!r}.")
            for name in _SPEC_BOOL_KEYS:
                if not isinstance(given.pop(name, True), bool):
                    raise ValueError(f"speculative_config['{name}'] must be a bool, got "
                                     f"{self.speculative_config[name]!r}.")
            if "tensor_parallel_size" in given:
                raise ValueError("speculative_config has no 'tensor_parallel_size': the draft's tensor-parallel "
                                 "size is 'draft_tensor_parallel_size'.")
            unknown = set(given) - set(opts)
            if unknown:
                allowed = sorted([*opts, *_SPEC_BOOL_KEYS, *_SPEC_FIXED_KEYS])
                raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; allowed: {allowed}.")
            given = {k: v for k, v in given.items() if v is not None}
            # The same setting given both ways must agree (one would be dropped silently).
            for key, value in given.items():
                if opts[key] is not None and opts[key] != value:
                    raise ValueError(f"speculative_config['{key}'] ({value!r}) conflicts with "
                                     f"{_SPEC_FLAGS[key]} ({opts[key]!r}): give it one way.")
            if given.get("method") not in (None, "draft_model") and opts["model"] not in (None, *NGRAM_NAMES) \
                    and "model" not in given:
                raise ValueError(f"speculative_config['method'] ({given['method']!r}) conflicts with "
                                 f"speculative_model ({opts['model']!r}): give it one way.")
            opts.update(given)
        if opts["model"] is None and opts["method"] is None:
            given = [_SPEC_FLAGS.get(key, f"speculative_config['{key}']") for key, value in opts.items()
                     if value is not None]
            if given:   # (settings of a speculation that is not asked for would be silently dropped)
                raise ValueError(f"{', '.join(given)} given without speculative_model (or speculative_config's "
                                 "model or method): no speculation is configured.")
            return None
        return SpeculativeConfig.create(target, **opts)


# The flags (LLM keywords) that set speculative_config's keys.
_SPEC_FLAGS = {"model": "speculative_model", "num_speculative_tokens": "num_speculative_tokens",
               "prompt_lookup_max": "ngram_prompt_lookup_max", "prompt_lookup_min": "ngram_prompt_lookup_min",
               "draft_tensor_parallel_size": "speculative_draft_tensor_parallel_size",
               "disable_by_batch_size": "speculative_disable_by_batch_size", "policy": "speculative_policy",
               "max_model_len": "speculative_max_model_len"}

# vLLM's speculative_config keys that take one setting here (None: the engine's own), and their values.
_SPEC_FIXED_KEYS = {
    **dict.fromkeys(("quantization", "revision", "code_revision", "speculative_token_tree", "moe_backend",
                     "attention_backend", "index_share_for_mtp_iteration", "draft_load_config",
                     "dspark_draft_topk", "synthetic_acceptance_rates", "synthetic_acceptance_length"), (None,)),
    "kv_cache_dtype": (None, "auto"),
    "rejection_sample_method": ("standard",),
    # (these need a draft trained for them, or another method than a draft model's or n-gram lookup)
    **dict.fromkeys(("parallel_drafting", "use_heterogeneous_vocab", "enable_adaptive_verification"), (False,)),
}
# vLLM's boolean speculative_config keys whose values mean the same here: the draft's logprobs are never
# computed (a request's logprobs are the target's), padded drafter batches and block drops are EAGLE's,
# and an argmax over a vocabulary-parallel LM head is already reduced locally.
_SPEC_BOOL_KEYS = ("disable_logprobs", "disable_padded_drafter_batch", "disable_eagle_block_drop",
                   "use_local_argmax_reduction")

# vLLM's short spellings.
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",)}


def _or_default(value: Any, default: Any) -> Any:
    """vLLM's None for an engine option: its default."""
    return default if value is None else value


def _is_switch(kind: Any) -> bool:
    """An EngineArgs field given as --flag / --no-flag."""
    return kind is bool or kind == bool | None


_HUMAN_READABLE_INTS = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")


def _parser_for(kind: Any, name: str = ""):
    if kind is dict or typing.get_origin(kind) is dict:
        return json_object
    return human_readable_int if name in _HUMAN_READABLE_INTS else kind


class AsyncEngineArgs(EngineArgs):
    """EngineArgs under vLLM's name for AsyncLLMEngine.from_engine_args (the same fields)."""
