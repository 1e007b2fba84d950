"""Executors: run the worker(s) of an engine. `create_executor` picks one from the parallel config."""

from __future__ import annotations

from vllm_spec.config import EngineConfig


def create_executor(config: EngineConfig):
    """UniProcExecutor for tp=1 without a backend; MultiprocExecutor ("mp", the default for tp > 1)
    or RayExecutor ("ray") otherwise."""
    backend = config.parallel.distributed_executor_backend
    if backend == "ray":
        from vllm_spec.executor.ray_executor import RayExecutor
        return RayExecutor(config)
    if backend == "mp":
        from vllm_spec.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor(config)
    from vllm_spec.executor.uniproc_executor import UniProcExecutor
    return UniProcExecutor(config)
