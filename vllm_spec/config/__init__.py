"""Resolved engine configuration: typed dataclasses built once by EngineArgs."""

from vllm_spec.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from vllm_spec.config.model import ModelConfig
from vllm_spec.config.speculative import MAX_SPECULATIVE_TOKENS, NGRAM_NAMES, SpeculativeConfig

__all__ = ["CacheConfig", "EngineConfig", "MAX_SPECULATIVE_TOKENS", "ModelConfig", "NGRAM_NAMES", "ParallelConfig",
           "SchedulerConfig", "SpeculativeConfig"]
