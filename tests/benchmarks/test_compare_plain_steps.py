"""Smoke test of the interleaved plain-steps benchmark on tiny CPU models."""

from __future__ import annotations

import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_compare_plain_steps_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import compare_plain_steps as bench

    out = tmp_path / "steps.json"
    bench.main(["--tiny", "--batch-sizes", "2", "3", "--rounds", "2", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {f"{s}/{b}" for s in bench.SYSTEMS for b in (2, 3)}
    assert all(len(rs) == 2 and all(r["tokens_per_s"] > 0 for r in rs) for rs in runs.values())
    table = capsys.readouterr().out
    assert all(system in table for system in bench.SYSTEMS)
