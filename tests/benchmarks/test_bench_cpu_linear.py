"""benchmarks/bench_cpu_linear.py, tiny: every method, shape and row count is timed and written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_cpu_linear as bcl  # noqa: E402

from vllm_spec.model import cpu_linear  # noqa: E402


@pytest.mark.skipif(not cpu_linear.available(), reason="no AVX2 CPU kernel here")
def test_bench_times_every_case(tmp_path, capsys):
    out = tmp_path / "r.json"
    rows = bcl.main(["--rows", "1", "3", "--threads", "1", "--layers", "2", "--repeats", "1", "--out", str(out)])
    methods = {r["method"] for r in rows}
    assert {"kernel", "plain"} <= methods
    assert len(rows) == len(bcl.SHAPES) * 2 * len(methods)
    assert all(r["ms"] > 0 and r["gb_s"] > 0 for r in rows)
    assert all(r["vs_1_row"] == 1.0 for r in rows if r["rows"] == 1)
    assert len(json.loads(out.read_text())["rows"]) == len(rows)
    assert "GB/s" in capsys.readouterr().out
