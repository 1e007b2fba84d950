"""Executor for one process: builds the worker, sizes the KV cache, runs steps."""

from __future__ import annotations

from collections.abc import Callable

from vllm_spec.config import EngineConfig
from vllm_spec.executor.base import call_worker
from vllm_spec.spec_decode.spec_decode_worker import SpecDecodeWorker
from vllm_spec.worker.batch import ExecuteModelRequest, StepOutput
from vllm_spec.worker.step_handle import StepHandle
from vllm_spec.worker.worker import Worker


def num_kv_blocks(config: EngineConfig, available_bytes: int, bytes_per_block: int, lookahead: int) -> int:
    """Blocks for the cache: the override, else what fits in memory, capped at what max_num_seqs
    full-length sequences could ever use. Fails if one max_model_len sequence cannot fit."""
    cache, sched = config.cache, config.scheduler
    per_seq = -(-(sched.max_model_len + lookahead) // cache.block_size)
    if cache.num_gpu_blocks_override is not None:
        blocks = cache.num_gpu_blocks_override
    else:
        blocks = min(available_bytes // bytes_per_block, sched.max_num_seqs * per_seq + 1)
    if blocks - 1 < per_seq:
        fix = (f"num_gpu_blocks_override to at least {per_seq + 1}" if cache.num_gpu_blocks_override is not None
               else f"kv_cache_memory_bytes (at least {(per_seq + 1) * bytes_per_block} bytes here) / "
                    "gpu_memory_utilization")
        raise ValueError(
            f"The KV cache holds {max(blocks - 1, 0) * cache.block_size} tokens ({blocks} blocks of "
            f"{cache.block_size}, one of them reserved), fewer than max_model_len ({sched.max_model_len}) + "
            f"{lookahead} lookahead slots. Increase {fix} or decrease max_model_len."
        )
    return blocks


class UniProcExecutor:
    """Runs the worker in the engine's own process."""

    def __init__(self, config: EngineConfig):
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={config.parallel.tensor_parallel_size} needs a multi-process executor; "
                "this build supports tensor_parallel_size=1."
            )
        self.config = config
        self.worker = SpecDecodeWorker(config) if config.speculative else Worker(config)
        self.num_blocks = num_kv_blocks(config, self.worker.available_kv_bytes(),
                                        self.worker.kv_bytes_per_block(), config.num_lookahead_slots)
        try:
            self.worker.init_kv_cache(self.num_blocks)
        except (RuntimeError, MemoryError) as e:   # (torch.OutOfMemoryError is a RuntimeError)
            if config.cache.num_gpu_blocks_override is None:
                raise
            raise ValueError(f"num_gpu_blocks_override={self.num_blocks}: a KV cache of "
                             f"{self.num_blocks * self.worker.kv_bytes_per_block()} bytes cannot be allocated "
                             f"({type(e).__name__}); give fewer blocks.") from None

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        return self.worker.execute_model(req)

    def launch(self, req: ExecuteModelRequest) -> StepHandle:
        return self.worker.launch(req)

    def collective_rpc(self, method: str | Callable, timeout: float | None, args: tuple, kwargs: dict) -> list:
        """The call on this process's worker (timeout: the ranks', none here); what it raises is raised."""
        return [call_worker(self.worker, method, args, kwargs)]

    def shutdown(self) -> None:
        pass
