"""EngineArgs: the one flag set shared by LLM(), `vllm-spec generate` and `vllm-spec serve`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from vllm_spec.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Engine options with vLLM's names. Every field is also a `--kebab-case` CLI flag."""

    model: str = _opt("", "HF model folder (config.json + safetensors) or a .gguf file.")
    tokenizer: str | None = _opt(None, "Tokenizer folder (default: the model's own).")
    skip_tokenizer_init: bool = _opt(False, "Do not load a tokenizer; prompts must be token ids.")
    dtype: str = _opt("auto", "auto, float32, float16 or bfloat16 (auto: float32 on CPU, bfloat16 on GPU).")
    seed: int = _opt(0, "Seed for requests without their own seed and for dummy weights.")
    max_model_len: int | None = _opt(None, "Context length (default: the model's max_position_embeddings).")
    load_format: str = _opt("auto", "auto, safetensors, gguf or dummy (random weights).")
    device: str = _opt("auto", "auto, cpu or cuda.")
    tensor_parallel_size: int = _opt(1, "Tensor-parallel size of the target model.")
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of GPU memory for weights, activations and KV cache.")
    kv_cache_memory_bytes: int | None = _opt(None, "KV cache size in bytes (overrides gpu_memory_utilization).")
    num_gpu_blocks_override: int | None = _opt(None, "Exact number of KV-cache blocks (testing).")
    max_num_seqs: int = _opt(256, "Maximum number of sequences per step.")
    max_num_batched_tokens: int | None = _opt(None, "Token budget per step (default 2048; prompts are chunked).")
    enforce_eager: bool = _opt(False, "Disable CUDA graphs.")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=f.metadata["help"])
                continue
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            parser.add_argument(flag, type=_parser_for(base), default=f.default, help=f.metadata["help"])
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})

    def create_engine_config(self) -> EngineConfig:
        if not self.model:
            raise ValueError("model must be given: an HF model folder or a .gguf file.")
        model = ModelConfig.create(self.model, self.tokenizer, self.dtype, self.device, self.max_model_len,
                                   self.load_format, self.seed)
        return EngineConfig(
            model=model,
            cache=CacheConfig(self.block_size, self.gpu_memory_utilization, self.kv_cache_memory_bytes,
                              self.num_gpu_blocks_override),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens or 2048, model.max_model_len),
            parallel=ParallelConfig(self.tensor_parallel_size),
            enforce_eager=self.enforce_eager,
        )


def _parser_for(kind: Any):
    if kind is dict or typing.get_origin(kind) is dict:
        return json.loads
    return kind
