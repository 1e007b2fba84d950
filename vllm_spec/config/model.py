"""ModelConfig: one model's checkpoint, architecture, dtype, device and context length."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vllm_spec.generation_config import sampling_defaults
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.model_source import find_model_source
from vllm_spec.model.rotary import rope_type
from vllm_spec.platform import resolve_device, resolve_dtype
from vllm_spec.sampling_params import DEFAULT_MAX_LOGPROBS
from vllm_spec.utils import is_int


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
    logprobs_mode: str = "raw_logprobs"   # what logprobs hold: see LOGPROBS_MODES
    # The model's config as read (config.json, or what a .gguf file's metadata says): hf_config's source.
    hf_dict: dict[str, Any] = field(default_factory=dict, repr=False)
    runner_type: str = "generate"   # (vLLM's: the only runner here)

    @classmethod
    def create(cls, model: str, tokenizer: str | None, dtype: str | torch.dtype, device: str,
               max_model_len: int | None, load_format: str, seed: int | None, generation_config: str = "auto",
               override_generation_config: dict | None = None,
               hf_overrides: dict | Callable | None = None) -> "ModelConfig":
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
        hf_cfg = _overridden(hf_cfg, hf_overrides)
        arch = ArchConfig.from_hf_dict(hf_cfg)
        dev = resolve_device(device)
        limit, bound = arch.max_position_embeddings, arch.key("max_position_embeddings")
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
        return _transformers_config(self.hf_dict)

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


def _transformers_config(hf_dict: dict[str, Any]):
    """The transformers config of a config.json's dict (no hub, no remote code): its family's, else (a model_type
    transformers does not know, or values its typed fields refuse, such as an int for a float) the base class."""
    from transformers import AutoConfig, PretrainedConfig

    cfg = {k: v for k, v in hf_dict.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(hf_dict.get("model_type", ""), **cfg)
    except Exception:   # (ValueError, TypeError, huggingface_hub's StrictDataclassError: no common base)
        return PretrainedConfig(**hf_dict)


def _overridden(hf_dict: dict[str, Any], overrides: dict | Callable | None) -> dict[str, Any]:
    """vLLM's hf_overrides: a dict's keys replace the config's (values whole, nested dicts too), or a callable
    takes the transformers config and returns it changed."""
    if overrides is None:
        return hf_dict
    if isinstance(overrides, dict):
        bad = [k for k in overrides if not isinstance(k, str)]
        if bad:
            raise ValueError(f"hf_overrides keys must be config.json keys (strings), got {bad!r}.")
        return {**hf_dict, **overrides}
    if not callable(overrides):
        raise ValueError("hf_overrides must be a dict of config.json keys and values, or a callable taking and "
                         f"returning the model's transformers config, got {type(overrides).__name__}.")
    from transformers import PretrainedConfig

    config = _transformers_config(hf_dict)
    before = config.to_dict()
    config = overrides(config)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"hf_overrides (a callable) must return the transformers config it was given (a "
                         f"PretrainedConfig), got {type(config).__name__}.")
    # Only what the callable changed: the rest of to_dict() holds transformers' class defaults (e.g. an
    # eos_token_id the checkpoint does not name), which would change what the model is.
    after = config.to_dict()
    return {**hf_dict, **{k: v for k, v in after.items() if k not in before or before[k] != v}}
