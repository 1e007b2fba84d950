"""Tokenizer loading: from the tokenizer path, the HF model folder, or the GGUF file itself."""

from __future__ import annotations

from vllm_spec.config import ModelConfig


def get_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    if cfg.tokenizer is not None:
        return AutoTokenizer.from_pretrained(cfg.tokenizer)
    if cfg.source == "gguf":
        from vllm_spec.model.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(cfg.path)
    try:
        return AutoTokenizer.from_pretrained(str(cfg.path))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"no tokenizer found in {cfg.path} ({e}); pass tokenizer=PATH, or skip_tokenizer_init=True "
            "and give prompts as token ids."
        ) from e
