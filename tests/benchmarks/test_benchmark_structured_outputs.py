"""benchmarks/benchmark_structured_outputs.py on a tiny random model: every system runs under both
constraints, and speculation keeps plain decoding's ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_structured_outputs as bso  # noqa: E402


def test_benchmark_runs_and_reports(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r.json"
    rows = bso.main(["--model", str(tiny_llama), "--draft", str(tiny_llama), "--k", "2", "--requests", "3",
                     "--batch", "2", "--max-tokens", "8", "--policy", "fixed", "--device", "cpu", "--out", str(out)])
    assert [(r.system, r.constraint) for r in rows] == [(s, c) for c in ("none", "json_schema")
                                                        for s in ("plain", "draft", "ngram")]
    for r in rows:
        assert r.requests == 3 and r.tokens_per_s > 0
        assert r.identical_to_plain is (None if r.system == "plain" else True)
    # The draft is the target itself: every draft is accepted, without a grammar (under one, drafts the
    # grammar refuses are rejected).
    assert next(r for r in rows if r.system == "draft" and r.constraint == "none").acceptance_rate == 1.0
    assert len(json.loads(out.read_text())["rows"]) == 6
    assert "speedup" in capsys.readouterr().out
