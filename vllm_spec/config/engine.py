"""The engine's configuration: KV cache, scheduler and parallelism limits, and the EngineConfig of all parts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from vllm_spec.config.model import ModelConfig
from vllm_spec.config.speculative import SpeculativeConfig
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.utils import check_int, is_int, is_number


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
    # Schedule each step while the previous one runs on the device (EngineConfig resolves what was asked).
    async_scheduling: bool = False

    @property
    def enable_chunked_prefill(self) -> bool:
        """vLLM's name of chunked_prefill."""
        return self.chunked_prefill

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
    moe = arch.moe
    sizes = [(arch.key("num_attention_heads"), arch.num_attention_heads),
             (arch.key("intermediate_size"), arch.intermediate_size)]
    if moe is not None:   # (the experts' sizes: Mixtral's is intermediate_size)
        sizes += [("moe_intermediate_size", moe.intermediate)] if moe.layout != "mixtral" else []
        sizes += [("shared_expert_intermediate_size", moe.shared_intermediate)] if moe.shared_intermediate else []
    for name, n in sizes:
        if n % tp:
            raise ValueError(f"The {what}'s {name} ({n}) must be divisible by {setting} ({tp}).")
    kv = arch.num_key_value_heads
    if (kv % tp) if kv >= tp else (tp % kv):
        raise ValueError(f"The {what}'s num_key_value_heads ({kv}) must be divisible by {setting} ({tp}), "
                         "or divide it.")


@dataclass
class EngineConfig:
    """Everything the engine needs, resolved and validated."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None   # as asked (None: automatic); the resolved choice: scheduler's
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
        asked = self.async_scheduling
        if asked not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (automatic), got {asked!r}.")
        if asked and tp > 1:
            raise ValueError(f"async_scheduling=True needs tensor_parallel_size=1 (got {tp}): the ranks' processes "
                             "answer a step only once it has run. Leave async_scheduling unset or False.")
        # Unset: on where it overlaps anything (CUDA, the engine's own process). The scheduler's config is
        # copied, not changed: another EngineConfig may share it.
        resolved = asked if asked is not None else self.model.device.type == "cuda" and tp == 1
        self.scheduler = dataclasses.replace(self.scheduler, async_scheduling=resolved)
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
        return bool(self.scheduler.async_scheduling)

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots reserved past each decoding sequence for its draft tokens."""
        return self.speculative.num_speculative_tokens if self.speculative else 0
