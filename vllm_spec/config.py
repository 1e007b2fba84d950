"""Resolved engine configuration: typed dataclasses built once by EngineArgs."""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_spec.generation_config import sampling_defaults
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.model_source import find_model_source
from vllm_spec.model.rotary import rope_type
from vllm_spec.platform import resolve_device, resolve_dtype
from vllm_spec.sampling_params import DEFAULT_MAX_LOGPROBS
from vllm_spec.utils import check_int, is_int, is_number

logger = logging.getLogger(__name__)

@dataclass
class ModelConfig:
    """The model to run and how: architecture, dtype, context length."""

    model: str
    arch: ArchConfig
    source: str                      # "hf" or "gguf"
    path: Path
    tokenizer: str | None
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    load_format: str = "auto"
    seed: int = 0
    # Sampling fields a request leaves unset take these (the model's generation config, vLLM's "auto").
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Most logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary).
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # The model's config as read (config.json, or what a .gguf file's metadata says): hf_config's source.
    hf_dict: dict[str, Any] = field(default_factory=dict, repr=False)
    runner_type: str = "generate"   # (vLLM's: the only runner here)

    @classmethod
    def create(cls, model: str, tokenizer: str | None, dtype: str | torch.dtype, device: str,
               max_model_len: int | None, load_format: str, seed: int | None, generation_config: str = "auto",
               override_generation_config: dict | None = None) -> "ModelConfig":
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a path (a model folder or a .gguf file), got {model!r}.")
        if tokenizer is not None:
            if not isinstance(tokenizer, (str, os.PathLike)):
                raise ValueError(f"tokenizer must be a path (a tokenizer folder), got {tokenizer!r}.")
            if not Path(tokenizer).exists():
                raise ValueError(f"tokenizer {str(tokenizer)!r} not found: give a local tokenizer folder (model hubs "
                                 "are not contacted).")
        if seed is None:
            seed = 0   # vLLM's default; its engine takes None as 0 too
        elif not (is_int(seed) and -(1 << 63) <= seed < 1 << 64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {seed!r}.")
        seed = int(seed)   # torch's generators refuse numpy integers
        source, path = find_model_source(model, load_format)
        if source == "gguf":
            from vllm_spec.model.gguf_loader import read_gguf_config
            hf_cfg = read_gguf_config(path)
        else:
            try:
                hf_cfg = json.loads((path / "config.json").read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from e
        arch = ArchConfig.from_hf_dict(hf_cfg)
        dev = resolve_device(device)
        limit, bound = arch.max_position_embeddings, "max_position_embeddings"
        # (As vLLM: Gemma 3's max_position_embeddings already counts its rope scaling.)
        scaling = rope_type(arch.rope_scaling) if arch.architecture != "Gemma3ForCausalLM" else "default"
        if scaling in ("linear", "dynamic"):
            # As vLLM: linear and dynamic scaling stretch the positions the model was trained on (llama3's
            # max_position_embeddings already counts its scaling).
            limit = int(limit * arch.rope_scaling["factor"])
            bound = f"max_position_embeddings x the {scaling} rope_scaling factor {arch.rope_scaling['factor']}"
        elif scaling == "yarn":   # as vLLM: the original context, stretched by the factor
            limit = int(arch.rope_scaling["original_max_position_embeddings"] * arch.rope_scaling["factor"])
            bound = f"original_max_position_embeddings x the yarn rope_scaling factor {arch.rope_scaling['factor']}"
        if max_model_len is None:
            max_model_len = limit
        elif not (is_int(max_model_len) and 1 <= max_model_len):
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}.")
        elif max_model_len > limit:
            raise ValueError(f"max_model_len ({max_model_len}) must be <= the model's {bound} ({limit}).")
        defaults = sampling_defaults(generation_config, override_generation_config, path if source == "hf" else None)
        return cls(model=model, arch=arch, source=source, path=path, tokenizer=tokenizer,
                   dtype=resolve_dtype(dtype, arch.torch_dtype, dev), device=dev,
                   max_model_len=max_model_len, load_format=load_format, seed=seed, sampling_defaults=defaults,
                   hf_dict=hf_cfg)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """vLLM's name: the sampling defaults from the generation config (a copy)."""
        return dict(self.sampling_defaults)

    # vLLM's ModelConfig readers (scripts call them) ---------------------------------------------------
    @functools.cached_property
    def hf_config(self):
        """The model's transformers config (built from what was read: no hub, no remote code)."""
        from transformers import AutoConfig, PretrainedConfig

        cfg = {k: v for k, v in self.hf_dict.items() if k != "model_type"}
        try:
            return AutoConfig.for_model(self.hf_dict.get("model_type", ""), **cfg)
        except ValueError:   # a model_type transformers does not know
            return PretrainedConfig(**self.hf_dict)

    @property
    def hf_text_config(self):
        return self.hf_config

    def get_vocab_size(self) -> int:
        return self.arch.vocab_size

    def get_hidden_size(self) -> int:
        return self.arch.hidden_size

    def get_head_size(self) -> int:
        return self.arch.head_dim

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self.arch.num_hidden_layers

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        """Per tensor-parallel rank where a ParallelConfig is given, as vLLM's."""
        tp = getattr(parallel_config, "tensor_parallel_size", 1)
        return self.arch.num_attention_heads // tp

    def get_num_kv_heads(self, parallel_config: Any = None) -> int:
        """Per tensor-parallel rank where a ParallelConfig is given (at least one, as vLLM's)."""
        tp = getattr(parallel_config, "tensor_parallel_size", 1)
        return max(1, self.arch.num_key_value_heads // tp)

    def get_sliding_window(self) -> int | None:
        return self.arch.sliding_window


@dataclass
class CacheConfig:
    """Paged KV cache sizing (vLLM names). On CPU `kv_cache_memory_bytes` defaults to 4 GiB."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.block_size) or self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size!r}.")
        util = self.gpu_memory_utilization
        if not (is_number(util) and 0.0 < util <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {util!r}.")
        if isinstance(self.kv_cache_memory_bytes, float) and self.kv_cache_memory_bytes.is_integer():
            self.kv_cache_memory_bytes = int(self.kv_cache_memory_bytes)   # 1e9 bytes, as people write it
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 2, optional=True)


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Continuous batching limits; prompts longer than the token budget are prefilled in chunks (unless
    chunked_prefill is off: then a prompt waits for a step whose budget holds all of it)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # vLLM's scheduling_policy: "fcfs" (arrival order), or "priority" (a request's priority, lower
    # first, then arrival; preemption takes the last in that order).
    policy: str = "fcfs"
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # (A prompt of max_model_len tokens could then never be scheduled.)
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is False.")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}.")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class ParallelConfig:
    """Tensor parallelism: `tensor_parallel_size` ranks, run by the `distributed_executor_backend`
    ("mp": one process per rank on this machine; "ray": Ray actors; None: "mp" when tp > 1)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.distributed_executor_backend not in (None, *DISTRIBUTED_EXECUTOR_BACKENDS):
            raise ValueError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS} or None, "
                f"got {self.distributed_executor_backend!r}."
            )
        if self.distributed_executor_backend is None and self.tensor_parallel_size > 1:
            self.distributed_executor_backend = "mp"


def check_tensor_parallel(arch: ArchConfig, tp: int, what: str, setting: str) -> None:
    """Clear errors, before any process starts, for shapes that cannot be split across tp ranks
    (`setting`: the option that asked for tp)."""
    for name, n in (("num_attention_heads", arch.num_attention_heads),
                    ("intermediate_size", arch.intermediate_size)):
        if n % tp:
            raise ValueError(f"The {what}'s {name} ({n}) must be divisible by {setting} ({tp}).")
    kv = arch.num_key_value_heads
    if (kv % tp) if kv >= tp else (tp % kv):
        raise ValueError(f"The {what}'s num_key_value_heads ({kv}) must be divisible by {setting} ({tp}), "
                         "or divide it.")


SPEC_METHODS = ("draft_model", "ngram")
NGRAM_NAMES = ("ngram", "[ngram]")
SPEC_POLICIES = ("adaptive", "fixed")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """Speculative decoding: the proposer, k, and (for a draft model) its resolved ModelConfig, whose
    max_model_len is the draft's limit: positions past it are never fed to the draft."""

    method: str
    num_speculative_tokens: int
    max_model_len: int   # positions a proposal may reach (the draft's limit): a sequence drafts only up to it
    draft: ModelConfig | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    draft_tensor_parallel_size: int = 1
    disable_by_batch_size: int | None = None
    # Benchmarks only: accept each draft token with this probability whatever the models say.
    synthetic_acceptance_rate: float | None = None
    policy: str = "adaptive"

    @classmethod
    def create(cls, target: ModelConfig, model: str | None, num_speculative_tokens: int | None,
               method: str | None = None, prompt_lookup_max: int | None = None,
               prompt_lookup_min: int | None = None, draft_tensor_parallel_size: int | None = None,
               disable_by_batch_size: int | None = None,
               synthetic_acceptance_rate: float | None = None,
               policy: str | None = None, max_model_len: int | None = None) -> "SpeculativeConfig":
        """max_model_len: the draft's (vLLM's speculative_max_model_len), at most the target's. The
        draft's limit is the least of it, the target's and the positions the draft supports; a
        sequence speculates only while its drafts stay inside it (as vLLM's), so a draft of a shorter
        context never shortens the target's."""
        if model in NGRAM_NAMES or method in NGRAM_NAMES:   # (vLLM's spellings)
            if model not in (None, *NGRAM_NAMES):   # (a draft that would be ignored)
                raise ValueError(f"speculative method 'ngram' takes no draft model, got model {model!r}: give "
                                 "method 'draft_model' for a draft, or no model for prompt lookup.")
            method = "ngram"
        elif method in (None, "draft_model"):
            method = "draft_model"
            if not model or not isinstance(model, (str, os.PathLike)):
                raise ValueError("speculative_model (speculative_config['model']) must be given for a draft model: "
                                 f"a model folder or a .gguf file, got {model!r}.")
        else:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {method!r}.")
        k = num_speculative_tokens
        if not (is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}.")
        # (vLLM's bound: a threshold of 1 would never speculate.)
        check_int("speculative_disable_by_batch_size", disable_by_batch_size, 2, optional=True)
        for name, value in (("speculative_max_model_len", max_model_len),
                            ("ngram_prompt_lookup_max", prompt_lookup_max),
                            ("ngram_prompt_lookup_min", prompt_lookup_min)):
            check_int(name, value, 1, optional=True)
        if method == "draft_model":
            for name, value in (("ngram_prompt_lookup_max", prompt_lookup_max),
                                ("ngram_prompt_lookup_min", prompt_lookup_min)):
                if value is not None:
                    raise ValueError(f"{name} ({value!r}) applies to n-gram speculation (speculative_model="
                                     f"'[ngram]'), not to a draft model ({model!r}).")
        rate = synthetic_acceptance_rate
        if max_model_len is not None and max_model_len > target.max_model_len:
            raise ValueError(f"speculative_max_model_len (speculative_config['max_model_len']) must be <= "
                             f"max_model_len ({target.max_model_len}), got {max_model_len}.")
        if rate is not None and not (is_number(rate) and 0 <= rate <= 1):
            raise ValueError(f"synthetic_acceptance_rate must be a number in [0, 1], got {rate!r}.")
        if rate is not None:
            logger.warning("speculative_config['synthetic_acceptance_rate'] = %s (benchmarks only): draft tokens "
                           "are accepted at random, whatever the models say; outputs are NOT the target's.", rate)
        if policy not in (None, *SPEC_POLICIES):
            raise ValueError(f"speculative_policy must be one of {SPEC_POLICIES}, got {policy!r}.")
        cfg = cls(method, k, max_model_len or target.max_model_len,
                  draft_tensor_parallel_size=1 if draft_tensor_parallel_size is None else draft_tensor_parallel_size,
                  disable_by_batch_size=disable_by_batch_size, synthetic_acceptance_rate=synthetic_acceptance_rate,
                  policy=policy or "adaptive")
        if method == "ngram":
            # As vLLM V1: neither bound given is 5 and 5; one given sets the other to itself.
            hi = prompt_lookup_max or prompt_lookup_min or 5
            lo = prompt_lookup_min or prompt_lookup_max or 5
            if lo > hi:
                raise ValueError(
                    f"ngram_prompt_lookup_min ({lo}) must be <= ngram_prompt_lookup_max ({hi})."
                )
            cfg.prompt_lookup_max, cfg.prompt_lookup_min = hi, lo
            return cfg
        # The draft's sampling defaults are never used: requests sample from the target's distribution.
        try:
            draft = ModelConfig.create(model, None, target.dtype, target.device.type, None, "auto"
                                       if target.load_format != "dummy" else "dummy", target.seed,
                                       generation_config="vllm")
        except (ValueError, FileNotFoundError) as e:   # (which of the two models it was about)
            raise type(e)(f"speculative_model: {e}") from e
        if draft.arch.vocab_size != target.arch.vocab_size:
            raise ValueError(
                f"The draft model's vocabulary ({draft.arch.vocab_size} tokens) differs from the target's "
                f"({target.arch.vocab_size}); speculative decoding needs the same tokenizer."
            )
        if max_model_len is not None and max_model_len > draft.max_model_len:
            raise ValueError(f"speculative_max_model_len={max_model_len} cannot be larger than the draft's "
                             f"max_model_len={draft.max_model_len} (the positions it supports).")
        cfg.max_model_len = draft.max_model_len = min(draft.max_model_len, cfg.max_model_len)
        cfg.draft = draft
        return cfg


@dataclass
class EngineConfig:
    """Everything the engine needs, resolved and validated."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None   # None: see uses_async_scheduling
    log_stats: bool = False   # a statistics line in the log every LOG_STATS_INTERVAL seconds of steps

    # vLLM's VllmConfig names for the parts.
    @property
    def model_config(self) -> ModelConfig:
        return self.model

    @property
    def cache_config(self) -> CacheConfig:
        return self.cache

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.parallel

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return self.speculative

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_parallel_size
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}.")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (automatic), got {self.async_scheduling!r}.")
        if self.async_scheduling and tp > 1:
            raise ValueError(f"async_scheduling=True needs tensor_parallel_size=1 (got {tp}): the ranks' processes "
                             "answer a step only once it has run. Leave async_scheduling unset or False.")
        check_tensor_parallel(self.model.arch, tp, "target model", "tensor_parallel_size")
        if self.speculative is not None:
            draft_tp = self.speculative.draft_tensor_parallel_size
            allowed = [d for d in range(1, tp + 1) if tp % d == 0]
            if not is_int(draft_tp) or draft_tp not in allowed:
                raise ValueError(
                    f"speculative_draft_tensor_parallel_size (speculative_config['draft_tensor_parallel_size']) "
                    f"must divide tensor_parallel_size ({tp}): one of {allowed}, got {draft_tp!r}. The draft runs "
                    "on a sub-group of the target's ranks."
                )
            if self.speculative.draft is not None:
                check_tensor_parallel(self.speculative.draft.arch, draft_tp, "draft model",
                                      "speculative_draft_tensor_parallel_size")
                if self.speculative.draft.arch.embeddings_from_target and draft_tp != tp:
                    raise ValueError(
                        f"This draft borrows the target's embeddings, so speculative_draft_tensor_parallel_size "
                        f"({draft_tp}) must equal tensor_parallel_size ({tp})."
                    )
        if (self.model.device.type == "cuda" and self.parallel.distributed_executor_backend != "ray"
                and tp > torch.cuda.device_count()):
            raise ValueError(
                f"tensor_parallel_size ({tp}) is larger than the number of CUDA devices on this machine "
                f"({torch.cuda.device_count()}); use distributed_executor_backend='ray' for several machines."
            )

    @property
    def uses_async_scheduling(self) -> bool:
        """async_scheduling as asked; unset, on where it overlaps anything (CUDA, the engine's own process)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.model.device.type == "cuda" and self.parallel.tensor_parallel_size == 1

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots reserved past each decoding sequence for its draft tokens."""
        return self.speculative.num_speculative_tokens if self.speculative else 0
