"""Tokenizer loading: from the tokenizer path, the HF model folder, or the GGUF file itself."""

from __future__ import annotations

from vllm_spec.config import ModelConfig


def get_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    if cfg.tokenizer is None and cfg.source == "gguf":
        from vllm_spec.model.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(cfg.path)
    folder = str(cfg.path if cfg.tokenizer is None else cfg.tokenizer)
    try:
        # Local files only: a path that is no tokenizer folder must not become a model hub request.
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"no tokenizer found in {folder} ({e}); pass tokenizer=PATH, or skip_tokenizer_init=True "
            "and give prompts as token ids."
        ) from e
