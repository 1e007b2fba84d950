"""The model's generation_config.json: its end-of-sequence ids and, as vLLM's
`generation_config="auto"`, the sampling defaults for fields a request leaves unset."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
# The sampling fields vLLM takes from a generation config, with transformers' GenerationConfig defaults:
# a field at its default is not the model's choice (GenerationConfig.to_diff_dict drops it).
_SAMPLING_FIELDS: dict[str, Any] = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                                    "min_p": None, "max_new_tokens": None}
logger = logging.getLogger(__name__)


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The folder's generation_config.json ({} without one)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return config


def model_eos_token_ids(model_config, tokenizer) -> tuple[set[int], int | None]:
    """The ids that end a request (the model's config, its generation config, the tokenizer's) and the
    primary one (the tokenizer's, else the config's first)."""
    ids = set(model_config.arch.eos_token_ids)
    if model_config.source == "hf":
        eos = read_generation_config(model_config.path).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    primary = next(iter(model_config.arch.eos_token_ids), None)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        primary = tokenizer.eos_token_id
        ids.add(primary)
    return ids, primary


def sampling_defaults(generation_config: str, override: dict | None, model_folder: Path | None) -> dict[str, Any]:
    """{SamplingParams field: value} that requests leaving the field unset take, checked.

    generation_config: "auto" (the model folder's file; model_folder None: a GGUF or dummy model,
    which has none), "vllm" (none: vLLM's own defaults) or a folder holding a generation_config.json.
    override: fields over the file's (vLLM's override_generation_config).
    """
    from vllm_spec.sampling_params import SamplingParams

    if isinstance(generation_config, os.PathLike):
        generation_config = os.fspath(generation_config)
    if not isinstance(generation_config, str):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder with a {FILE}, "
                         f"got {generation_config!r}.")
    if override is not None and not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a dict (JSON object), got {override!r}.")
    if generation_config == "vllm":
        folder = None
    elif generation_config == "auto":
        folder = model_folder
    elif (Path(generation_config) / FILE).is_file():
        folder = Path(generation_config)
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder with a {FILE}, "
                         f"got {generation_config!r} (no {FILE} there).")
    config = read_generation_config(folder) if folder is not None else {}
    found = {name: config[name] for name, default in _SAMPLING_FIELDS.items()
             if config.get(name) is not None and config[name] != default}
    ignored = sorted(set(override or {}) - set(_SAMPLING_FIELDS))
    if ignored:   # as vLLM: a generation config's other fields set no sampling default
        logger.warning("override_generation_config: %s set no sampling default (those that do: %s).",
                       ignored, sorted(_SAMPLING_FIELDS))
    found.update({k: v for k, v in (override or {}).items() if k in _SAMPLING_FIELDS})
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    try:
        SamplingParams(**found)
    except (TypeError, ValueError) as e:
        where = "override_generation_config" if override else str(folder / FILE)
        raise ValueError(f"sampling defaults from {where}: {e}") from e
    return found
