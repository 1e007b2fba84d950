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
