"""benchmarks/benchmark_prefix_caching.py on a tiny random model: the cache is hit and outputs are kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_prefix_caching as bpc  # noqa: E402


def test_benchmark_runs_and_reports(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r.json"
    rows = bpc.main(["--model", str(tiny_llama), "--draft", str(tiny_llama), "--k", "2", "--prefix-tokens", "40",
                     "--requests", "5", "--batch", "2", "--max-tokens", "4", "--device", "cpu", "--out", str(out)])
    assert [(r.system, r.caching) for r in rows] == [("plain", False), ("plain", True),
                                                      ("speculative", False), ("speculative", True)]
    for r in rows:
        # 4 requests after the first: each finds the 40-token prefix's 2 full blocks of 16.
        assert r.cached_tokens == (4 * 32 if r.caching else 0)
        assert r.identical_to_uncached is (True if r.caching else None)
    assert len(json.loads(out.read_text())["rows"]) == 4
    assert "TTFT ms" in capsys.readouterr().out
