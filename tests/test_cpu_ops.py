"""The CPU extension's build folder (cpu_ops.build_name)."""

from __future__ import annotations

import shutil

from vllm_spec import cpu_ops


def test_one_build_folder_per_sources_and_their_place(tmp_path):
    """Two checkouts of one version build apart: sharing a folder, each load rebuilt what the other built
    (ninja's build file names the sources' paths)."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(cpu_ops.SOURCE_DIR, a)
    shutil.copytree(cpu_ops.SOURCE_DIR, b)
    assert cpu_ops.build_name(a) == cpu_ops.build_name(a)
    assert cpu_ops.build_name(a) != cpu_ops.build_name(b)
    before = cpu_ops.build_name(a)
    (a / "module.cpp").write_text((a / "module.cpp").read_text() + "\n// edited\n")
    assert cpu_ops.build_name(a) != before


def test_avx512_and_vnni_join_the_flags_where_the_cpu_has_them(monkeypatch):
    """AVX-512F and VL are built in where the CPU has both (unless switched off), VNNI with them where the CPU
    has it, and a build with them is a build of its own."""
    monkeypatch.delenv(cpu_ops.AVX512_SWITCH, raising=False)
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512vl"}))
    with_avx512 = cpu_ops.build_name(cpu_ops.SOURCE_DIR)
    assert cpu_ops.build_flags() == cpu_ops.BASE_FLAGS + ["-mavx512f", "-mavx512vl"]
    monkeypatch.setenv(cpu_ops.AVX512_SWITCH, "0")
    assert cpu_ops.build_flags() == cpu_ops.BASE_FLAGS
    assert cpu_ops.build_name(cpu_ops.SOURCE_DIR) != with_avx512
    monkeypatch.delenv(cpu_ops.AVX512_SWITCH)
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))   # no VL
    assert cpu_ops.build_flags() == cpu_ops.BASE_FLAGS
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512vl", "avx512_vnni"}))
    assert cpu_ops.build_flags() == cpu_ops.BASE_FLAGS + ["-mavx512f", "-mavx512vl", "-mavx512vnni"]
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512_vnni"}))   # VNNI alone: AVX2
    assert cpu_ops.build_flags() == cpu_ops.BASE_FLAGS
